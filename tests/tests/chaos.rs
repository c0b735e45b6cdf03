//! A pool under a request load while its parts die: launchers killed and restarted, an
//! agent killed, the nats-server killed and restarted after longer than an agent's
//! heartbeat TTL. Seeded: the seed is printed and `SLOTPOOL_CHAOS_SEED` repeats a run.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slotpool_protocol::model::Event;
use slotpool_tests::chaos::{self, Load};
use slotpool_tests::{label, wait_for, Pool};
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

/// Rounds of disruptions; each has a launcher crash, an agent kill and a bus outage.
const ROUNDS: usize = 3;

/// How long the load may take to get going again after a disruption.
const RECOVERY: Duration = Duration::from_secs(60);

/// Fulfilments to see after each disruption before the next.
const FULFILMENTS_PER_STEP: usize = 5;

/// The agents' heartbeat TTL in the test pool (`--heartbeat-ttl-secs` of `AGENT_ARGS`).
const HEARTBEAT_TTL: Duration = Duration::from_secs(2);

/// How long the leftovers of a disruption (a failed node's deletion, an idle node's
/// release) may take to settle at the end.
const SETTLE: Duration = Duration::from_secs(45);

async fn wait_fulfilments(load: &Load, what: &str) {
    let target = load.fulfilments() + FULFILMENTS_PER_STEP;
    wait_for(
        format!("{FULFILMENTS_PER_STEP} more fulfilments {what}"),
        RECOVERY,
        || async { load.fulfilments() >= target },
    )
    .await;
}

fn millis(rng: &mut StdRng, from: u64, to: u64) -> Duration {
    Duration::from_millis(rng.random_range(from..to))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launchers_an_agent_and_the_bus_die_under_load_and_every_request_ends_once() {
    let seed = chaos::seed();
    eprintln!("seed {seed} (set SLOTPOOL_CHAOS_SEED to repeat)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pool = Pool::start(4, 3, &label("small", 3, 2, &[]), 2).await;
    let load = Load::start(
        &pool.client,
        6,
        &["small"],
        Duration::from_millis(400),
        seed,
    );
    let started = Instant::now();
    // What each disruption was and when it ended, to measure the stall after it.
    let mut recoveries: Vec<(&str, Instant)> = Vec::new();
    let mut killed_agents = HashSet::new();
    wait_fulfilments(&load, "before the first disruption").await;

    for round in 1..=ROUNDS {
        // Both launchers crash and come back, one after the other.
        for _ in 0..2 {
            let n = rng.random_range(0..2);
            pool.kill_launcher(n);
            tokio::time::sleep(millis(&mut rng, 200, 2000)).await;
            pool.restart_launcher(n);
            eprintln!("round {round}: launcher {n} killed and restarted");
            recoveries.push(("launcher", Instant::now()));
            wait_fulfilments(&load, "after a launcher's restart").await;
        }

        // An agent dies.
        let agents = chaos::running_agents(&pool.work_dir());
        if !agents.is_empty() {
            let pick = rng.random_range(0..agents.len());
            let (id, pid) = agents.into_iter().nth(pick).expect("an agent");
            // SAFETY: a plain signal to an agent this test's pool started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            eprintln!("round {round}: agent {id} killed");
            killed_agents.insert(id);
            recoveries.push(("agent", Instant::now()));
            wait_fulfilments(&load, "after an agent's death").await;
        }

        // The bus goes away for longer than a heartbeat lives.
        pool.nats.crash();
        tokio::time::sleep(HEARTBEAT_TTL + millis(&mut rng, 1000, 2500)).await;
        pool.nats.resume().await;
        eprintln!("round {round}: nats-server killed and restarted");
        recoveries.push(("bus", Instant::now()));
        wait_fulfilments(&load, "after the bus came back").await;
    }
    let ended = Instant::now();
    let ledger = load.finish().await;

    let last = pool.client.list_requests().await.expect("list requests");
    let verdict = ledger.verdict(&last);

    // Every agent is owned by a backing record or gone, once the pool has settled.
    let settle_deadline = Instant::now() + SETTLE;
    let leaked = loop {
        let leaked = chaos::leaked_agents(&pool.work_dir(), &pool.backing().await);
        if leaked.is_empty() || Instant::now() >= settle_deadline {
            break leaked;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    let bus = pool.nats.bus().await;
    let events: Vec<Event> = bus
        .events
        .list::<Event>()
        .await
        .expect("list events")
        .into_iter()
        .filter_map(|e| e.ok().map(|e| e.value))
        .collect();
    let live_failed = chaos::live_failures(&events, &killed_agents);

    let stalls: Vec<Duration> = recoveries
        .iter()
        .filter_map(|(_, at)| ledger.stall_after(*at))
        .collect();
    for kind in ["launcher", "agent", "bus"] {
        let of_kind: Vec<String> = recoveries
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, at)| {
                ledger
                    .stall_after(*at)
                    .map_or("none".into(), |d| format!("{:.2}", d.as_secs_f64()))
            })
            .collect();
        eprintln!(
            "stalls after each {kind} disruption (s): {}",
            of_kind.join(" ")
        );
    }
    let secs =
        |d: Option<Duration>| d.map_or("none".into(), |d| format!("{:.2} s", d.as_secs_f64()));
    eprintln!(
        "chaos: rounds {ROUNDS}, requests {}, fulfilled {}, violations {}, leaked agents {}, \
         live nodes failed {}; stall after a disruption p50 {} max {}; longest gap with no \
         fulfilment {:.2} s",
        verdict.requests,
        verdict.fulfilled,
        verdict.violations.len(),
        leaked.len(),
        live_failed.len(),
        secs(chaos::median(&stalls)),
        secs(stalls.iter().max().copied()),
        ledger.longest_gap(started, ended).as_secs_f64()
    );
    let mut failures = Vec::new();
    if !verdict.violations.is_empty() {
        failures.push(format!(
            "requests lost, ended twice or double-booked: {:#?}",
            verdict.violations
        ));
    }
    if !leaked.is_empty() {
        failures.push(format!(
            "agents running with no backing record after {SETTLE:?}: {leaked:?}"
        ));
    }
    if !live_failed.is_empty() {
        failures.push(format!("live backing nodes failed: {live_failed:#?}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
