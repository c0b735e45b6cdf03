//! Figures, not assertions: how long a real agent with user isolation takes to prepare and
//! release a slot (NATS round trip included), and its resident memory and CPU use when
//! idle with 8 prepared slots. Prepare is timed twice: on a warm slot (the agent warmed
//! it after the previous release, as happens when jobs do not follow each other within
//! milliseconds), and right after a release, when it waits for the warm-up. Ignored by
//! default; run as root with
//!
//! ```text
//! cargo build --workspace --bins
//! cargo test -p slotpool-tests --test slot_timing prepare_release -- --ignored --nocapture
//! ```
//!
//! or with `--release` on both commands for release-build figures. More agent flags
//! (space-separated) come from `SLOTPOOL_BENCH_AGENT_ARGS`, e.g. for quota'd
//! workspaces or without the per-slot network namespace (docs/slot-network.md):
//!
//! ```text
//! SLOTPOOL_BENCH_AGENT_ARGS="--slot-disk-quota-mb 1024" \
//!     cargo test -p slotpool-tests --test slot_timing prepare_release -- --ignored --nocapture
//! SLOTPOOL_BENCH_AGENT_ARGS="--slot-netns off" \
//!     cargo test -p slotpool-tests --test slot_timing prepare_release -- --ignored --nocapture
//! ```

use slotpool_protocol::api::{AgentCommand, SlotLimits, SlotPrepared};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::{BackingId, NodeId};
use slotpool_tests::{bin_path, wait_for, ChildGuard, IsolationEnv, NatsServer};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROUNDS: usize = 60;
const SLOTS: u32 = 8;
const TIMEOUT: Duration = Duration::from_secs(30);
/// How long the agent is watched idle for its CPU use.
const IDLE: Duration = Duration::from_secs(30);

/// The agent's CPU time so far (user + system), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces): utime is the 12th, stime the 13th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Whether the agent's state file for `slot` says the slot is warm (free, no node).
fn warm(work: &std::path::Path, slot: u32) -> bool {
    std::fs::read_to_string(work.join(format!("state/{slot}.json")))
        .is_ok_and(|s| s.contains("\"user\"") && !s.contains("node_id"))
}

fn summary(name: &str, times: &mut [Duration]) {
    times.sort();
    println!(
        "{name} over {}: median {:?}, p90 {:?}, max {:?}",
        times.len(),
        percentile(times, 0.5),
        percentile(times, 0.9),
        times[times.len() - 1]
    );
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run by hand as root"]
async fn prepare_release_times_and_idle_memory() {
    let env = IsolationEnv::new();
    let nats = NatsServer::start().await;
    let bus = nats.bus().await;
    let work = tempfile::tempdir().unwrap();
    // Quota'd workspaces (SLOTPOOL_BENCH_AGENT_ARGS) are mounts: gone with the agent.
    let _unmount = slotpool_tests::UnmountOnDrop(work.path().to_path_buf());
    let backing = BackingId::parse("bn-bench").unwrap();
    let mut cmd = Command::new(bin_path("slotpool-agent"));
    cmd.args(nats.args_as(slotpool_protocol::auth::Role::Agent, backing.as_str()))
        .args(["--backing-id", backing.as_str(), "--slots"])
        .arg(SLOTS.to_string())
        .arg("--work-dir")
        .arg(work.path())
        .args(env.agent_args())
        .args(
            std::env::var("SLOTPOOL_BENCH_AGENT_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .env("SLOTPOOL_AGENT_SECRET", "bench")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let mut agent = ChildGuard::spawn("agent", cmd).unwrap();
    wait_for("the agent's heartbeat", TIMEOUT, || async {
        matches!(
            bus.agents.get::<serde_json::Value>(backing.as_str()).await,
            Ok(Some(_))
        )
    })
    .await;
    let subject = subjects::agent(&backing);
    let limits = SlotLimits {
        cpu_millis: Some(1000),
        memory_bytes: Some(512 << 20),
        pids: Some(256),
        disk_bytes: None,
    };
    let prepare_cmd = |node_id: &NodeId| {
        AgentCommand::PrepareSlot {
        slot: 0,
        node_id: node_id.clone(),
        ssh_public_key: Some(
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGaKVw3eUGESvO1UcmfBj0MJKaPSCWfAXDprq+uHFDzc bench".into(),
        ),
        limits,
    }
    };
    let (mut warm_prepare, mut eager_prepare, mut release) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..2 * ROUNDS {
        let back_to_back = round >= ROUNDS;
        if !back_to_back {
            wait_for("slot 0 to be warm", TIMEOUT, || async {
                warm(work.path(), 0)
            })
            .await;
        }
        let node_id = NodeId::for_slot(&backing, 0);
        let t = Instant::now();
        let _: SlotPrepared = bus
            .call(&subject, &prepare_cmd(&node_id), TIMEOUT)
            .await
            .unwrap();
        if back_to_back {
            eager_prepare.push(t.elapsed());
        } else {
            warm_prepare.push(t.elapsed());
        }
        let t = Instant::now();
        let release_cmd = AgentCommand::ReleaseSlot { slot: 0, node_id };
        let _: serde_json::Value = bus.call(&subject, &release_cmd, TIMEOUT).await.unwrap();
        release.push(t.elapsed());
    }
    let idle_empty = rss_kb(agent.id());
    let mut held = Vec::new();
    for slot in 0..SLOTS {
        let node_id = NodeId::for_slot(&backing, slot);
        let _: SlotPrepared = bus
            .call(
                &subject,
                &AgentCommand::PrepareSlot {
                    slot,
                    node_id: node_id.clone(),
                    ssh_public_key: None,
                    limits,
                },
                TIMEOUT,
            )
            .await
            .unwrap();
        held.push(node_id);
    }
    // Idle: heartbeats and placement sweeps with 8 slots prepared.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ticks, t) = (cpu_ticks(agent.id()), Instant::now());
    tokio::time::sleep(IDLE).await;
    let idle_ticks = cpu_ticks(agent.id()) - ticks;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let idle_cpu = idle_ticks as f64 / hz / t.elapsed().as_secs_f64() * 100.0;
    let idle_eight = rss_kb(agent.id());
    for (slot, node_id) in held.into_iter().enumerate() {
        let _: serde_json::Value = bus
            .call(
                &subject,
                &AgentCommand::ReleaseSlot {
                    slot: slot as u32,
                    node_id,
                },
                TIMEOUT,
            )
            .await
            .unwrap();
    }
    agent.terminate(Duration::from_secs(10)).await;
    summary("prepare_slot of a warm slot", &mut warm_prepare);
    summary(
        "prepare_slot right after release (waits for the warm-up)",
        &mut eager_prepare,
    );
    summary("release_slot", &mut release);
    println!("agent VmRSS idle: {idle_empty} KiB with no slot, {idle_eight} KiB with {SLOTS} slots prepared");
    println!(
        "agent CPU idle with {SLOTS} slots prepared: {idle_cpu:.3} % ({idle_ticks} ticks in {:?})",
        t.elapsed()
    );
}

/// Figures, not assertions: the per-slot network namespace's own work (`--slot-netns
/// on`), without the agent around it: what a slot's first warm-up adds (make the
/// namespace, veth and table), what a later one costs (finding it kept) and what a
/// removal costs. Run as root with
///
/// ```text
/// cargo test -p slotpool-tests --test slot_timing netns -- --ignored --nocapture
/// ```
#[test]
#[ignore = "a benchmark: run by hand as root"]
fn slot_netns_create_and_remove_times() {
    let slot_networks = slotpool_tests::SlotNetworksForTest::new();
    let nets = &slot_networks.nets;
    let (mut create, mut kept, mut remove) = (Vec::new(), Vec::new(), Vec::new());
    let (mut create_cpu, mut kept_cpu, mut remove_cpu) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for _ in 0..ROUNDS {
        let (t, cpu) = (Instant::now(), cpu_used());
        nets.create(0).unwrap();
        create.push(t.elapsed());
        create_cpu += cpu_used() - cpu;
        let (t, cpu) = (Instant::now(), cpu_used());
        nets.create(0).unwrap();
        kept.push(t.elapsed());
        kept_cpu += cpu_used() - cpu;
        nets.open(0).expect("the namespace is there");
        let (t, cpu) = (Instant::now(), cpu_used());
        let problems = nets.remove(0);
        remove.push(t.elapsed());
        remove_cpu += cpu_used() - cpu;
        assert!(problems.is_empty(), "{problems:?}");
        assert!(nets.leftovers(0).is_empty(), "{:?}", nets.leftovers(0));
    }
    summary("slot network namespace: create", &mut create);
    summary("slot network namespace: warm-up finding it kept", &mut kept);
    summary("slot network namespace: remove", &mut remove);
    println!(
        "slot network namespace: CPU of this process, per create {:?}, per warm-up \
         finding it kept {:?}, per remove {:?} (the kernel's own work on namespaces not \
         counted)",
        create_cpu / ROUNDS as u32,
        kept_cpu / ROUNDS as u32,
        remove_cpu / ROUNDS as u32
    );
}

/// The CPU time (user and system) this process and its waited-for children used so far.
fn cpu_used() -> Duration {
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    [libc::RUSAGE_SELF, libc::RUSAGE_CHILDREN]
        .into_iter()
        .map(|who| {
            // SAFETY: rusage is plain data; getrusage fills it.
            let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: `usage` is valid for the call.
            assert_eq!(unsafe { libc::getrusage(who, &mut usage) }, 0);
            time(usage.ru_utime) + time(usage.ru_stime)
        })
        .sum()
}

/// Figures, not assertions: what `--slot-netns on` costs a job, measured in one run
/// against an agent without it, side by side (each with its own sshd; the two take
/// turns, first one then the other, so drift on a shared host falls on both). Each of
/// [`ROUNDS`] rounds, per agent: `prepare_slot` of a warm slot, an SSH login running
/// `true` (the ssh client's handshake included), `release_slot`, then `prepare_slot`
/// right after it (which waits for the warm-up making the next namespace) and its
/// release (no login in between). Run as root with
///
/// ```text
/// cargo build --workspace --bins
/// cargo test -p slotpool-tests --test slot_timing slot_netns_cost -- --ignored --nocapture
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run by hand as root"]
async fn slot_netns_cost_on_prepare_login_and_release() {
    use slotpool_tests::login_env_with;
    use std::collections::BTreeMap;
    let range = {
        use rand::Rng;
        format!(
            "10.{}.{}.0/24",
            rand::rng().random_range(100..250u8),
            rand::rng().random_range(0..=255u8)
        )
    };
    let envs = [IsolationEnv::new(), IsolationEnv::new()];
    let off = login_env_with(&envs[0], 1, &["--slot-netns", "off"]).await;
    let on = login_env_with(
        &envs[1],
        1,
        &["--slot-netns", "on", "--slot-netns-range", &range],
    )
    .await;
    let agents = [("off", &off), ("on", &on)];
    let mut times: BTreeMap<(&str, &str), Vec<Duration>> = BTreeMap::new();
    for round in 0..ROUNDS {
        for i in 0..2 {
            let (name, (sshd, key, agent)) = agents[(round + i) % 2];
            let node = format!("node-{round}");
            wait_for("slot 0 to be warm", TIMEOUT, || async { agent.warm(0) }).await;
            let t = Instant::now();
            let (user, _) = agent.prepare_login(0, &node, &key.public()).await;
            times
                .entry(("prepare, warm", name))
                .or_default()
                .push(t.elapsed());
            let t = Instant::now();
            let (ok, _, err) = key.ssh(sshd.port, &user, "true");
            times
                .entry(("login (ssh true)", name))
                .or_default()
                .push(t.elapsed());
            assert!(ok, "login with --slot-netns {name}: {err}");
            let t = Instant::now();
            agent.release(0, &node).await.unwrap();
            times
                .entry(("release after a login", name))
                .or_default()
                .push(t.elapsed());
            let node = format!("node-{round}-again");
            let t = Instant::now();
            agent.prepare(0, &node, None).await.unwrap();
            times
                .entry(("prepare right after release", name))
                .or_default()
                .push(t.elapsed());
            let t = Instant::now();
            agent.release(0, &node).await.unwrap();
            times
                .entry(("release without a login", name))
                .or_default()
                .push(t.elapsed());
            assert_eq!(agent.dirty(0), None, "{}", agent.log());
        }
    }
    for ((what, name), mut samples) in times {
        summary(&format!("{what}, --slot-netns {name}"), &mut samples);
    }
}
