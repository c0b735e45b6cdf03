//! Figures, not assertions: how long a real agent with user isolation takes to prepare and
//! release a slot (NATS round trip included), and its resident memory when idle with 8
//! prepared slots. Ignored by default; run as root with
//!
//! ```text
//! cargo build --workspace --bins
//! cargo test -p slotpool-tests --test slot_timing -- --ignored --nocapture
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
    let backing = BackingId::parse("bn-bench").unwrap();
    let mut cmd = Command::new(bin_path("slotpool-agent"));
    cmd.args([
        "--nats",
        &nats.url(),
        "--backing-id",
        backing.as_str(),
        "--slots",
    ])
    .arg(SLOTS.to_string())
    .arg("--work-dir")
    .arg(work.path())
    .args(env.agent_args())
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
    };
    let (mut prepare, mut release) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let node_id = NodeId::for_slot(&backing, 0);
        let t = Instant::now();
        let _: SlotPrepared = bus
            .call(
                &subject,
                &AgentCommand::PrepareSlot {
                    slot: 0,
                    node_id: node_id.clone(),
                    ssh_public_key: Some("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB bench".into()),
                    limits,
                },
                TIMEOUT,
            )
            .await
            .unwrap();
        prepare.push(t.elapsed());
        let t = Instant::now();
        let _: serde_json::Value = bus
            .call(
                &subject,
                &AgentCommand::ReleaseSlot { slot: 0, node_id },
                TIMEOUT,
            )
            .await
            .unwrap();
        release.push(t.elapsed());
    }
    prepare.sort();
    release.sort();
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
    // Idle: a few heartbeats and placement sweeps with 8 slots prepared.
    tokio::time::sleep(Duration::from_secs(5)).await;
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
    println!(
        "prepare_slot over {ROUNDS}: median {:?}, p90 {:?}, max {:?}",
        percentile(&prepare, 0.5),
        percentile(&prepare, 0.9),
        prepare[prepare.len() - 1]
    );
    println!(
        "release_slot over {ROUNDS}: median {:?}, p90 {:?}, max {:?}",
        percentile(&release, 0.5),
        percentile(&release, 0.9),
        release[release.len() - 1]
    );
    println!("agent VmRSS idle: {idle_empty} KiB with no slot, {idle_eight} KiB with {SLOTS} slots prepared");
}
