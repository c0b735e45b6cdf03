//! slotpool's shared language: wire types, the KV layout, subject names and a typed client.
//!
//! Only this crate knows how slotpool state is stored in NATS JetStream. The other crates
//! see typed records (`NodeRequest`, `Node`, `BackingNode`, `AgentHeartbeat`), typed keys
//! and a [`store::Store`] whose errors are our own ([`store::KvError`]), never async-nats types.

#![forbid(unsafe_code)]

pub mod account_push;
pub mod api;
pub mod auth;
pub mod bearer;
pub mod client;
pub mod connect;
pub mod exec;
pub mod ids;
pub mod layout;
pub mod listener;
pub mod logging;
pub mod model;
pub mod provider;
pub mod refusals;
pub mod ssh_key;
pub mod store;
pub mod text;
pub mod time;

pub use ids::{BackingId, EventId, LauncherId, NodeId, RequestId, UserName};

/// Version of the wire format. Every record and message carries it as `"v"`.
pub const PROTOCOL_VERSION: u32 = 1;

/// The oldest nats-server slotpool works with: per-key TTL (leases, heartbeats) needs 2.11.
pub const MIN_NATS_SERVER: (u64, u64, u64) = (2, 11, 0);

/// Largest JSON message a launcher accepts on its API subjects.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
