//! The launcher agrees with its simulator: a short trace (`examples/traces/short.csv`,
//! 31 jobs of a few seconds over 75 s) replayed through a real launcher, a real
//! nats-server and local agents, and through `slotpool simulate` on the same
//! configuration with the boot time measured in the real run, gives the same backing
//! nodes launched and released and the same efficiency, within the tolerances below.

use futures::StreamExt;
use slotpool_protocol::model::BackingNode;
use slotpool_protocol::store::Change;
use slotpool_simulate::trace::{self, Job};
use slotpool_tests::{bin_path, label, wait_for, Pool};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Slots per backing node and grace-time (seconds) of the one label, on both sides.
const SLOTS: u32 = 2;
const GRACE_SECS: u32 = 3;
const MAX_SERVERS: u32 = 12;

/// Tolerances. Both sides decide with the same code, but the real run's times are not
/// the trace's: a submit, a claim, a release and an agent's wipe each take some
/// milliseconds on a loaded machine, and each boot is its own (the simulator draws boots
/// from the measured range, not the same boot for the same node). A job that ends near
/// another's arrival, or a node whose grace-time ends near one, can go either way, and
/// each such turn moves one launch and one release, and the efficiency by about 0.02
/// (a 2-slot node paid for a boot, a short job and a grace-time, against some 250 paid
/// slot-seconds). The trace keeps its decisions a second or more from those edges, so
/// the two sides should agree within one or two such turns: 2 launches and releases,
/// efficiency 0.05. The margin is not wider, so that the test still fails for a policy
/// that differs: the simulator with the grace-time doubled launches 5 fewer backing nodes
/// on this trace and is 0.09 less efficient.
const LAUNCH_TOLERANCE: u32 = 2;
const EFFICIENCY_TOLERANCE: f64 = 0.05;

/// One side's figures.
#[derive(Debug)]
struct Figures {
    launched: u32,
    released: u32,
    paid_slot_secs: f64,
    busy_slot_secs: f64,
    efficiency: f64,
    wait_p50_secs: f64,
    wait_max_secs: f64,
}

/// What the watch of the backing bucket saw of one backing node.
#[derive(Debug, Default)]
struct Seen {
    slots: u32,
    /// The launch attempt that booted (the last one seen).
    launched_at: Option<u64>,
    ready_at: Option<u64>,
    /// When the server deleted its record.
    deleted_at: Option<u64>,
}

/// Every backing node seen, by backing id (a seat's key is used again by the next node
/// launched into it).
type Ledger = Arc<Mutex<BTreeMap<String, Seen>>>;

/// Every backing node written to the bucket, with its launch, ready and delete times.
async fn watch_backing(pool: &Pool) -> Ledger {
    let seen: Ledger = Arc::default();
    let bus = pool.client.bus().clone();
    let into = seen.clone();
    let mut changes = Box::pin(bus.backing.watch_timed().await.expect("watch backing"));
    tokio::spawn(async move {
        // Seat key -> the backing id in it.
        let mut seats: BTreeMap<String, String> = BTreeMap::new();
        while let Some(Ok(timed)) = changes.next().await {
            let mut seen = into.lock().unwrap();
            match timed.change {
                Change::Put { key, value, .. } => {
                    let Ok(b) = serde_json::from_slice::<BackingNode>(&value) else {
                        continue;
                    };
                    let s = seen.entry(b.id.to_string()).or_default();
                    s.slots = b.slots;
                    s.launched_at = b.launched_at.or(s.launched_at);
                    s.ready_at = b.ready_at.or(s.ready_at);
                    seats.insert(key, b.id.to_string());
                }
                Change::Removed { key, .. } => {
                    if let Some(s) = seats.remove(&key).and_then(|id| seen.get_mut(&id)) {
                        s.deleted_at = timed.written_at;
                    }
                }
                Change::Synced => {}
            }
        }
    });
    seen
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Plays `job` against the pool: submits at its arrival, holds its nodes for its
/// duration, releases them. Returns its wait and busy slot-seconds.
async fn play(pool: &Pool, start: Instant, job: &Job) -> (f64, f64) {
    tokio::time::sleep_until(start + Duration::from_millis(job.arrival_ms)).await;
    let labels: Vec<&str> = job.labels.iter().map(String::as_str).collect();
    let id = pool.submit(&labels).await;
    let r = pool.fulfilled(&id).await;
    let held = Instant::now();
    let wait = r.updated_at.saturating_sub(r.created_at) as f64 / 1000.0;
    tokio::time::sleep(Duration::from_millis(job.duration_ms)).await;
    pool.client.release(r.nodes.clone()).await.expect("release");
    (wait, held.elapsed().as_secs_f64() * r.nodes.len() as f64)
}

fn simulate(trace: &std::path::Path, config: &std::path::Path, boot: f64, jitter: f64) -> Figures {
    let out = std::process::Command::new(bin_path("slotpool"))
        .arg("simulate")
        .arg(trace)
        .arg("--config")
        .arg(config)
        .args(["--boot-secs", &format!("{boot:.3}")])
        .args(["--boot-jitter-secs", &format!("{jitter:.3}")])
        .args(["--output", "json"])
        .output()
        .expect("running slotpool simulate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!(r["unserved"], 0, "{r}");
    Figures {
        launched: f("backing_nodes_launched") as u32,
        released: f("backing_nodes_released") as u32,
        paid_slot_secs: f("paid_slot_hours") * 3600.0,
        busy_slot_secs: f("busy_slot_hours") * 3600.0,
        efficiency: f("efficiency"),
        wait_p50_secs: f("wait_p50_secs"),
        wait_max_secs: f("wait_max_secs"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_launcher_agrees_with_its_simulator_on_a_short_trace() {
    let trace_path = slotpool_tests::workspace_root().join("examples/traces/short.csv");
    let jobs = trace::load(&trace_path).expect("the shipped trace");
    let labels = label("small", SLOTS, GRACE_SECS, &[]);
    let pool = Pool::start(MAX_SERVERS, 5, &labels, 1).await;
    let seen = watch_backing(&pool).await;

    // The real run.
    let start = Instant::now();
    let played = futures::future::join_all(jobs.iter().map(|j| play(&pool, start, j))).await;
    wait_for(
        "every backing node released after the last job",
        Duration::from_secs(30),
        || async {
            let s = seen.lock().unwrap();
            !s.is_empty() && s.values().all(|b| b.deleted_at.is_some())
        },
    )
    .await;
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let launched: Vec<&Seen> = seen.values().filter(|b| b.launched_at.is_some()).collect();
    let boots: Vec<f64> = launched
        .iter()
        .filter_map(|b| Some(b.ready_at? as f64 - b.launched_at? as f64))
        .map(|ms| ms / 1000.0)
        .collect();
    assert!(!boots.is_empty(), "no backing node became ready: {seen:?}");
    let paid_slot_secs: f64 = launched
        .iter()
        .map(|b| {
            let (from, to) = (b.launched_at.unwrap(), b.deleted_at.unwrap());
            to.saturating_sub(from) as f64 / 1000.0 * b.slots as f64
        })
        .sum();
    let busy_slot_secs: f64 = played.iter().map(|p| p.1).sum();
    let mut waits: Vec<f64> = played.iter().map(|p| p.0).collect();
    waits.sort_by(f64::total_cmp);
    let real = Figures {
        launched: launched.len() as u32,
        released: launched.iter().filter(|b| b.deleted_at.is_some()).count() as u32,
        paid_slot_secs,
        busy_slot_secs,
        efficiency: busy_slot_secs / paid_slot_secs,
        wait_p50_secs: quantile(&waits, 0.5),
        wait_max_secs: *waits.last().unwrap(),
    };

    // The simulator, on the same trace and configuration, the provider booting in the
    // measured times: uniform over their range, as `--boot-jitter-secs` draws.
    let (lo, hi) = boots
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), b| (lo.min(*b), hi.max(*b)));
    let (boot, jitter) = ((lo + hi) / 2.0, (hi - lo) / 2.0);
    let sim = simulate(&trace_path, pool.config_path(), boot, jitter);

    let table = format!(
        "{} jobs; boot measured {lo:.2}–{hi:.2} s, simulated as {boot:.2} ± {jitter:.2} s\n\
         {:<26}{:>12}{:>12}\n\
         {:<26}{:>12}{:>12}\n\
         {:<26}{:>12}{:>12}\n\
         {:<26}{:>12.1}{:>12.1}\n\
         {:<26}{:>12.1}{:>12.1}\n\
         {:<26}{:>12.3}{:>12.3}\n\
         {:<26}{:>12.2}{:>12.2}\n\
         {:<26}{:>12.2}{:>12.2}",
        jobs.len(),
        "",
        "real",
        "simulated",
        "backing nodes launched",
        real.launched,
        sim.launched,
        "backing nodes released",
        real.released,
        sim.released,
        "paid slot-seconds",
        real.paid_slot_secs,
        sim.paid_slot_secs,
        "busy slot-seconds",
        real.busy_slot_secs,
        sim.busy_slot_secs,
        "efficiency",
        real.efficiency,
        sim.efficiency,
        "wait p50 (s)",
        real.wait_p50_secs,
        sim.wait_p50_secs,
        "wait max (s)",
        real.wait_max_secs,
        sim.wait_max_secs,
    );
    println!("{table}");

    for (what, r, s) in [
        ("launched", real.launched, sim.launched),
        ("released", real.released, sim.released),
    ] {
        assert!(
            r.abs_diff(s) <= LAUNCH_TOLERANCE,
            "backing nodes {what}: real {r}, simulated {s}, more than {LAUNCH_TOLERANCE} apart\n{table}"
        );
    }
    assert!(
        (real.efficiency - sim.efficiency).abs() <= EFFICIENCY_TOLERANCE,
        "efficiency: real {:.3}, simulated {:.3}, more than {EFFICIENCY_TOLERANCE} apart\n{table}",
        real.efficiency,
        sim.efficiency
    );
}
