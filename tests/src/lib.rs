//! Test fixtures for slotpool's end-to-end tests.
//!
//! - [`NatsServer`]: a real `nats-server` with JetStream on a free port and a temp store,
//!   one per test, killed on drop (and when the test process dies, via `PR_SET_PDEATHSIG`).
//! - [`ChildGuard`]: a spawned process (an agent, a launcher) killed with its process
//!   group on drop.
//! - [`bin_path`]: the workspace's binaries, built by `cargo build --workspace --bins`.
//! - [`wait_for`], [`wait_for_some`], [`next_within`]: condition waits with a deadline, so
//!   tests never sleep to synchronise.
//! - [`metrics`]: a launcher's `--http` listener read back, `/metrics` parsed.
//! - [`prometheus::Prometheus`]: a real Prometheus scraping given targets.
//! - [`Moto`]: moto's EC2 API server on a free port, one per test, and
//!   [`ec2_proxy::Ec2Proxy`] in front of it, losing answers and answering with EC2's
//!   errors, for the EC2 provider's tests; [`imds::FakeImds`], an instance's metadata
//!   service as far as the spot interruption notice goes.
//! - [`NatsCluster`]: a JetStream cluster of servers on loopback, for replicated buckets.
//! - [`chaos`]: a request load that rides out failures, and the checks made after it.
//! - [`mix`]: a randomized mix of node sets, priorities, cancels and releases from
//!   several clients, and the progress check made once it stops.
//! - [`Tmux`]: a terminal of its own, for the console and the demo on a terminal.
//! - [`SlotAgent`]: one agent with user isolation, driven directly over NATS.
//! - [`IsolationEnv`], [`Sshd`], [`ClientKey`]: unique user/cgroup names per test with a
//!   guard that removes them, a private sshd on a loopback port, an ssh client key.
//!
//! Tests built on these are parallel-safe: nothing here uses a fixed port, a fixed path or
//! shared state other than the path of the nats-server binary.
//!
//! The nats-server binary comes from `$SLOTPOOL_NATS_SERVER`, or else from
//! `scripts/nats-server.sh`, which provisions one (>= 2.11) under `.tools/`. When neither
//! works the tests fail with the script's message; they never skip.

mod agent;
pub mod chaos;
pub mod ec2_proxy;
pub mod exec_provider;
pub mod imds;
mod isolation;
pub mod metrics;
pub mod mix;
mod moto;
mod nats;
mod pool;
mod process;
pub mod prometheus;
mod tmux;
mod wait;

pub use agent::{
    claim_slot, exists, login_env, login_env_with, login_of, uid_of, SlotAgent, AGENT_CALL_TIMEOUT,
};
pub use isolation::{
    in_namespace, require_root, set_mode, shipped_sshd_drop_in, slot_match_block,
    slot_visible_tempdir, unmount_all_under, ClientKey, IsolationEnv, PrivateMounts,
    SlotNetworksForTest, Sshd, UnmountOnDrop, SLOT_VISIBLE_ROOT, SSHD,
};
pub use moto::{moto_server_binary, Moto, MOTO_START_TIMEOUT};
pub use nats::{nats_server_binary, NatsCluster, NatsServer, NATS_START_TIMEOUT};
pub use pool::{
    config_yaml, config_yaml_with, kill_agents, label, spawn_serve, wait_served, AgentsGuard, Pool,
    AGENT_ARGS,
};
pub use process::{bin_path, workspace_root, ChildGuard};
pub use tmux::Tmux;
pub use wait::{next_within, wait_for, wait_for_some, POLL_INTERVAL};
