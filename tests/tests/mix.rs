//! Randomized request mixes against two real launchers on a real nats-server, with real
//! agents: node sets of one to three labels over three pools, counts up to a label's
//! capacity, priorities 0-1000, cancels and releases, from eight clients under two
//! bus identities; once with a pool per label, once with two labels sharing a pool's
//! seats. Seeded: the seed is printed and `SLOTPOOL_MIX_SEED` repeats a run;
//! `SLOTPOOL_MIX_SECS` sets how long the load runs (default 15 s; a long run on
//! demand).
//!
//! Checked: every API call is answered within 1 s (a held status call within 1 s of
//! the end of its wait); once the load stops, no request that the free slots could
//! serve in the queue's order is left waiting after [`PROGRESS_BOUND`] (the reference
//! rule, `launcher/src/request/reference.rs`); every request then ends once the nodes
//! are given back; no request ended twice, none is lost, no slot was held by two
//! requests at once; no request worker spun. Each launcher's CPU time over the run is printed.

use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_tests::mix::{self, Mix, MixSpec};
use slotpool_tests::{Pool, AGENT_ARGS};
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

/// How long any API call may take to be answered.
const ANSWER_BOUND: Duration = Duration::from_secs(1);

/// How long, once the load stops, a request the free slots can serve may stay waiting.
const PROGRESS_BOUND: Duration = Duration::from_secs(10);

/// How long the requests left when the load stops may take to end, each released as it
/// is served.
const DRAIN_BOUND: Duration = Duration::from_secs(60);

/// What a launcher logs when a request worker takes its steps without waiting
/// (`launcher/src/request/worker.rs`): a request needs a handful, so any is a fault.
const SPIN_WARNING: &str = "request worker took its steps without waiting";

/// Three pools of one local provider, one label each: `main` (3 backing nodes of 4
/// slots) serves `small`, `mid` (2 of 2) `medium`, `big` (2 of 1) `large`; an idle node
/// gives its seat back after a grace-time of 2 s.
///
/// With `shared_seats`, `small` and `medium` share the three seats of `main`: a node
/// launched or kept idle for one is a seat the other may need, and the seats must go to
/// the queue in its order (were an idle node kept while any request of its label waits,
/// two labels' nodes could each hold the seats the other's sets need, for good).
fn pool_file(work_dir: &Path, shared_seats: bool) -> String {
    let agent_args = serde_json::to_string(&AGENT_ARGS).expect("args serialize");
    let pools = if shared_seats {
        "      - name: main
        max-servers: 3
        boot-timeout: 20
        labels:
          - {name: small, backing-label: vm, max-parallel-jobs: 4, grace-time: 2}
          - {name: medium, backing-label: vm, max-parallel-jobs: 2, grace-time: 2}
      - name: big
        max-servers: 2
        boot-timeout: 20
        labels:
          - {name: large, backing-label: vm-big, max-parallel-jobs: 1, grace-time: 2}
"
    } else {
        "      - name: main
        max-servers: 3
        boot-timeout: 20
        labels:
          - {name: small, backing-label: vm, max-parallel-jobs: 4, grace-time: 2}
      - name: mid
        max-servers: 2
        boot-timeout: 20
        labels:
          - {name: medium, backing-label: vm, max-parallel-jobs: 2, grace-time: 2}
      - name: big
        max-servers: 2
        boot-timeout: 20
        labels:
          - {name: large, backing-label: vm-big, max-parallel-jobs: 1, grace-time: 2}
"
    };
    format!(
        "launcher:
  lease-ttl: 5
providers:
  - name: local
    driver: local
    local:
      work-dir: {}
      agent-args: {agent_args}
    pools:
{pools}",
        work_dir.display()
    )
}

fn load_secs() -> u64 {
    std::env::var("SLOTPOOL_MIX_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_mix_is_answered_served_in_order_and_booked_once() {
    run_mix(false).await;
}

/// The same with `small` and `medium` sharing the seats of one pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_sharing_seats_serve_any_mix_and_hold_no_seat_for_good() {
    run_mix(true).await;
}

async fn run_mix(shared_seats: bool) {
    let seed = mix::seed();
    eprintln!("seed {seed} (set SLOTPOOL_MIX_SEED to repeat)");
    let pool = Pool::start_configured(|dir| pool_file(dir, shared_seats), 2, &[]).await;
    let mut identities = Vec::new();
    for name in ["mix-a", "mix-b"] {
        identities.push(
            Client::connect(&pool.nats.options_as(Role::Client, name))
                .await
                .expect("a client connects"),
        );
    }
    let spec = MixSpec {
        labels: vec![
            ("small".into(), 12),
            ("medium".into(), if shared_seats { 6 } else { 4 }),
            ("large".into(), 2),
        ],
        clients_per_identity: 4,
        patience: Duration::from_secs(4),
        max_hold: Duration::from_millis(400),
    };
    let pids = [pool.launcher_pid(0), pool.launcher_pid(1)];
    let cpu_before: Vec<Duration> = pids
        .iter()
        .map(|p| mix::cpu_time(*p).unwrap_or_default())
        .collect();
    let started = Instant::now();
    let mut load = Mix::start(&identities, &spec, seed);
    tokio::time::sleep(Duration::from_secs(load_secs())).await;
    let (waiting, holding) = load.quiesce().await;
    let tally = load.tally();
    let loaded = started.elapsed();

    // Once the load stops, the launchers serve whatever free slots can serve.
    let quiet = Instant::now();
    let mut stuck = None;
    while quiet.elapsed() < PROGRESS_BOUND {
        stuck = mix::progress(&pool.client).await.expect("reading KV");
        if stuck.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let settled = quiet.elapsed();
    let cpu: Vec<Duration> = pids
        .iter()
        .zip(&cpu_before)
        .map(|(p, before)| {
            mix::cpu_time(*p)
                .unwrap_or_default()
                .saturating_sub(*before)
        })
        .collect();

    // Then every request left ends, each released as it is served.
    let unended = load.drain(DRAIN_BOUND).await;
    let (calls, ledger) = load.finish();
    let last = pool.client.list_requests().await.expect("list requests");
    let verdict = ledger.verdict(&last);

    eprintln!(
        "mix: {:.1} s of load from {} clients under 2 identities: {} submitted ({} refused \
         as never holdable), {} fulfilled, {} canceled, {} failed; at the stop {waiting} \
         waiting and {holding} holding, settled in {:.2} s",
        loaded.as_secs_f64(),
        2 * spec.clients_per_identity,
        tally.submitted,
        tally.refused,
        tally.fulfilled,
        tally.canceled,
        tally.failed,
        settled.as_secs_f64()
    );
    eprintln!("mix: answers: {}", calls.summary());
    for (n, (pid, used)) in pids.iter().zip(&cpu).enumerate() {
        eprintln!(
            "mix: launcher {n} (pid {pid}) used {:.2} s of CPU in {:.1} s ({:.1} % of a core)",
            used.as_secs_f64(),
            (loaded + settled).as_secs_f64(),
            100.0 * used.as_secs_f64() / (loaded + settled).as_secs_f64()
        );
    }

    let mut failures = Vec::new();
    failures.extend(calls.later_than(ANSWER_BOUND));
    failures.extend(calls.unanswered.iter().cloned());
    if let Some(why) = stuck {
        failures.push(format!(
            "{PROGRESS_BOUND:?} after the load stopped, a request free slots could serve \
             still waits: {why}"
        ));
    }
    if !unended.is_empty() {
        failures.push(format!(
            "requests not ended {DRAIN_BOUND:?} after their nodes were given back: {unended:?}"
        ));
    }
    for n in 0..2 {
        let spins: Vec<String> = pool
            .launcher_log(n)
            .lines()
            .filter(|l| l.contains(SPIN_WARNING))
            .take(3)
            .map(String::from)
            .collect();
        if !spins.is_empty() {
            failures.push(format!(
                "launcher {n}'s request workers spun (took their steps without waiting): \
                 {spins:#?}"
            ));
        }
    }
    if !verdict.violations.is_empty() {
        failures.push(format!(
            "requests lost, ended twice or double-booked: {:#?}",
            verdict.violations
        ));
    }
    assert!(tally.fulfilled > 0, "nothing was served");
    assert!(failures.is_empty(), "seed {seed}:\n{}", failures.join("\n"));
}
