//! slotpool on a three-server JetStream cluster with replicated buckets (R3): a launcher
//! connected to all three servers keeps serving while servers die.

use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::model::Event;
use slotpool_protocol::store::Placement;
use slotpool_tests::chaos::{self, Load};
use slotpool_tests::{
    config_yaml_with, label, spawn_serve, wait_for, wait_for_some, wait_served, AgentsGuard,
    NatsCluster, NatsServer,
};
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

/// How long the load may take to get going again after a server dies.
const RECOVERY: Duration = Duration::from_secs(60);

/// Fulfilments to see between two steps, so each step happens under load.
const FULFILMENTS_PER_STEP: usize = 8;

/// The test's temp dir (config, launcher log, agents). When the test fails it prints
/// the tail of the launcher's log, and keeps the dir when `SLOTPOOL_KEEP_FAILED` is set.
struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    fn path(&self) -> &std::path::Path {
        self.0.as_ref().expect("the dir").path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text =
                std::fs::read_to_string(self.path().join("launcher.log")).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(100)..];
            eprintln!("--- launcher log (last lines)\n{}", tail.join("\n"));
            if std::env::var_os("SLOTPOOL_KEEP_FAILED").is_some() {
                let kept = self.0.take().expect("the dir").keep();
                eprintln!("test files kept in {}", kept.display());
            }
        }
    }
}

async fn wait_fulfilments(load: &Load, more: usize, what: &str) {
    let target = load.fulfilments() + more;
    wait_for(
        format!("{more} more fulfilments {what}"),
        RECOVERY,
        || async { load.fulfilments() >= target },
    )
    .await;
}

/// The placement of the slots and requests buckets once both have `replicas` current
/// copies and a leader.
async fn settled(bus: &Bus, replicas: usize) -> Placement {
    wait_for_some(
        format!("the buckets to have a leader and {replicas} current copies"),
        RECOVERY,
        || async {
            let slots = bus.slots.placement().await.ok()??;
            let requests = bus.requests.placement().await.ok()??;
            let whole = |p: &Placement| p.leader.is_some() && p.current.len() == replicas;
            (whole(&slots) && whole(&requests)).then_some(slots)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_loses_a_bucket_leader_and_the_launchers_server_and_keeps_every_request() {
    let seed = chaos::seed();
    eprintln!("seed {seed} (set SLOTPOOL_CHAOS_SEED to repeat)");
    let mut cluster = NatsCluster::start(3).await;
    let dir = TestDir(Some(tempfile::tempdir().expect("temp dir")));
    let work_dir = dir.path().join("agents");
    let _agents = AgentsGuard(work_dir.clone());
    let config = dir.path().join("pool.yaml");
    // The agents' heartbeats keep the shipped TTL (6 s), longer than an election on a
    // loaded 2-core machine (4.5 s). A launcher no longer fails a node for a heartbeat
    // lost while the heartbeats bucket elected its leader (launcher/src/heartbeat_clock.rs,
    // docs/protocol.md), but with a 2 s TTL and that bucket's leader killed too, this
    // test met a release refused during the slots bucket's election in 4 runs of 13.
    let agent_args = [
        "--heartbeat-interval-ms",
        "300",
        "--heartbeat-ttl-secs",
        "6",
        "--isolation",
        "none",
    ];
    let yaml = config_yaml_with(&work_dir, 3, 3, &label("small", 4, 30, &[]), &agent_args)
        .replacen("launcher:\n", "launcher:\n  kv-replicas: 3\n", 1);
    std::fs::write(&config, yaml).expect("writing config");
    let log = dir.path().join("launcher.log");
    let launcher = spawn_serve("launcher", &cluster.serve_args(&config), &log);

    let bus = cluster.bus().await;
    let client = Client::connect(&cluster.options_as(Role::Client, "client"))
        .await
        .expect("client connects");
    wait_served(&client).await;
    let placement = settled(&bus, 3).await;
    eprintln!("slots bucket: {placement:?}");

    let load = Load::start(&client, 4, &["small"], Duration::from_millis(300), seed);
    let started = Instant::now();
    wait_fulfilments(&load, FULFILMENTS_PER_STEP, "before any server dies").await;

    // 1. The slots bucket's leader dies: its buckets elect new leaders.
    let leader = placement.leader.expect("a leader");
    let killed_leader = Instant::now();
    cluster.crash(&leader);
    eprintln!("killed {leader}, the slots bucket's leader");
    wait_fulfilments(&load, FULFILMENTS_PER_STEP, "after the leader died").await;
    cluster.resume(&leader).await;
    settled(&bus, 3).await;

    // 2. The server the launcher is connected to dies: it reconnects to another.
    let server = wait_for_some("the launcher's server", RECOVERY, || async {
        cluster.server_of(launcher.id())
    })
    .await;
    let killed_server = Instant::now();
    cluster.crash(&server);
    eprintln!("killed {server}, the launcher's server");
    wait_fulfilments(
        &load,
        FULFILMENTS_PER_STEP,
        "after the launcher's server died",
    )
    .await;
    let ended = Instant::now();
    let ledger = load.finish().await;

    // Reads too wait while a bucket elects a leader. A client may not read KV: list as
    // the launcher.
    let operator = Client::from_bus(bus.clone());
    let last = wait_for_some("the requests listed", RECOVERY, || async {
        operator.list_requests().await.ok()
    })
    .await;
    let verdict = ledger.verdict(&last);
    let events: Vec<Event> = wait_for_some("the events listed", RECOVERY, || async {
        bus.events.list::<Event>().await.ok()
    })
    .await
    .into_iter()
    .filter_map(|e| e.ok().map(|e| e.value))
    .collect();
    let live_failed = chaos::live_failures(&events, &HashSet::new());
    let stall = |at| {
        ledger.stall_after(at).map_or("none".into(), |d: Duration| {
            format!("{:.2} s", d.as_secs_f64())
        })
    };
    eprintln!(
        "cluster: {} requests, {} fulfilled, violations {}, live nodes failed {}; \
         stall after the leader's death {}, after the launcher's server's death {}, \
         longest gap with no fulfilment {:.2} s",
        verdict.requests,
        verdict.fulfilled,
        verdict.violations.len(),
        live_failed.len(),
        stall(killed_leader),
        stall(killed_server),
        ledger.longest_gap(started, ended).as_secs_f64()
    );
    assert!(
        verdict.violations.is_empty(),
        "requests lost or double-booked: {:#?}",
        verdict.violations
    );
    assert!(
        live_failed.is_empty(),
        "live backing nodes failed: {live_failed:#?}"
    );
    drop(launcher);
}

/// The longest a request or a release in flight at the death of the server leading the
/// buckets may wait past the servers' own election of other leaders (which nats-server
/// starts 4–9 s after it last heard the dead one). The election's end is seen when each
/// bucket's stream info names a leader again, asked with [`PROBE`] as deadline.
const BEYOND_ELECTION: Duration = Duration::from_secs(2);

/// How long one look at a bucket's leader may take while the servers elect one.
const PROBE: Duration = Duration::from_millis(300);

/// Leader kills in one run of the stall test: `$SLOTPOOL_CLUSTER_KILLS`, or 2.
fn leader_kills() -> usize {
    std::env::var("SLOTPOOL_CLUSTER_KILLS")
        .ok()
        .map(|v| v.trim().parse().expect("SLOTPOOL_CLUSTER_KILLS: a number"))
        .unwrap_or(2)
}

fn seconds(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

// Client calls are sent again after 1 s, 2 s, 4 s (`client::API_RESEND`), so a call lost
// with the dead server does not wait out the 10 s time-out; a request worker, a release
// and a KV watch go on as soon as the buckets take writes again after the election, and
// the watches reload then (a watch's consumer may have died with the old leader). On
// demand: on a loaded machine an election once took 14.7 s, past the 10 s a write waits
// for a leader, and the launcher answered a release `internal`.
#[ignore = "an election longer than a write's patience makes the launcher answer internal"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_leaders_death_stalls_no_request_in_flight_past_the_election() {
    let seed = chaos::seed();
    eprintln!("seed {seed} (set SLOTPOOL_CHAOS_SEED to repeat)");
    let kills = leader_kills();
    let mut cluster = NatsCluster::start(3).await;
    let dir = TestDir(Some(tempfile::tempdir().expect("temp dir")));
    let work_dir = dir.path().join("agents");
    let _agents = AgentsGuard(work_dir.clone());
    let config = dir.path().join("pool.yaml");
    let agent_args = [
        "--heartbeat-interval-ms",
        "300",
        "--heartbeat-ttl-secs",
        "6",
        "--isolation",
        "none",
    ];
    // 20 clients on 5 × 4 slots: a request waits for the bus, never for a free slot.
    let yaml = config_yaml_with(&work_dir, 5, 3, &label("small", 4, 30, &[]), &agent_args)
        .replacen("launcher:\n", "launcher:\n  kv-replicas: 3\n", 1);
    std::fs::write(&config, yaml).expect("writing config");
    let log = dir.path().join("launcher.log");
    let launcher = spawn_serve("launcher", &cluster.serve_args(&config), &log);

    let bus = cluster.bus().await;
    let client = Client::connect(&cluster.options_as(Role::Client, "client"))
        .await
        .expect("client connects");
    wait_served(&client).await;
    let mut placement = settled(&bus, 3).await;
    let load = Load::start(&client, 20, &["small"], Duration::from_millis(200), seed);
    wait_fulfilments(&load, 40, "before any server dies").await;

    let mut all = Vec::new();
    // The longest a wait went on past the end of its kill's election.
    let mut beyond = Duration::ZERO;
    for kill in 1..=kills {
        let leader = placement.leader.clone().expect("a leader");
        let at = Instant::now();
        cluster.crash(&leader);
        // The servers' own election: until each bucket a request's path writes names a
        // leader other than the dead server.
        let mut elected = at;
        for store in [
            &bus.requests,
            &bus.slots,
            &bus.leases,
            &bus.agents,
            &bus.backing,
        ] {
            elected = elected.max(
                wait_for_some(
                    format!("{} to elect a leader after kill {kill}", store.bucket()),
                    RECOVERY,
                    || async {
                        // Its own short deadline: the election's end is seen when it comes,
                        // not after the client library's time-out.
                        let p = tokio::time::timeout(PROBE, store.placement())
                            .await
                            .ok()?
                            .ok()??;
                        p.leader.filter(|l| *l != leader).map(|_| Instant::now())
                    },
                )
                .await,
            );
        }
        let election = elected - at;
        wait_for(
            format!("every wait in flight at kill {kill} answered"),
            RECOVERY,
            || async { load.ledger().answered_across(at) },
        )
        .await;
        let mut waits = load.ledger().stalls_across(at, Instant::now());
        waits.sort();
        let stalls: Vec<Duration> = waits.iter().map(|(d, _)| *d).collect();
        let longest = stalls.last().copied().unwrap_or_default();
        eprintln!(
            "kill {kill} of {leader} (the slots bucket's leader): election {}, {} waits in \
             flight, stall p50 {}, max {}{}",
            seconds(election),
            stalls.len(),
            seconds(chaos::median(&stalls).unwrap_or_default()),
            seconds(longest),
            waits
                .last()
                .map_or(String::new(), |(_, what)| format!(" ({what})")),
        );
        beyond = beyond.max(longest.saturating_sub(election));
        all.extend(stalls);
        cluster.resume(&leader).await;
        placement = settled(&bus, 3).await;
        wait_fulfilments(&load, 20, "after the killed server came back").await;
    }
    let ledger = load.finish().await;
    let operator = Client::from_bus(bus.clone());
    let last = wait_for_some("the requests listed", RECOVERY, || async {
        operator.list_requests().await.ok()
    })
    .await;
    let verdict = ledger.verdict(&last);
    all.sort();
    let max = all.last().copied().unwrap_or_default();
    eprintln!(
        "leader kills: {kills}, {} requests, {} fulfilled, {} waits in flight at a kill: \
         stall p50 {}, max {}; longest past its election {} (bound {})",
        verdict.requests,
        verdict.fulfilled,
        all.len(),
        seconds(chaos::median(&all).unwrap_or_default()),
        seconds(max),
        seconds(beyond),
        seconds(BEYOND_ELECTION),
    );
    assert!(
        verdict.violations.is_empty(),
        "requests lost or double-booked: {:#?}",
        verdict.violations
    );
    assert!(!all.is_empty(), "no wait was in flight at any kill");
    assert!(
        beyond <= BEYOND_ELECTION,
        "a wait in flight went on {} past its kill's election (bound {})",
        seconds(beyond),
        seconds(BEYOND_ELECTION)
    );
    drop(launcher);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_set_to_other_replicas_than_the_buckets_refuses_to_start() {
    let nats = NatsServer::start().await;
    // The test server's buckets exist with one replica: a launcher set to three says so.
    let err = Bus::connect_replicated(&nats.options(), 3)
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(
            err,
            BusError::Replicas {
                found: 1,
                wanted: 3,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("has 1 replica(s), but this launcher is set to 3"),
        "{text}"
    );
}

/// A launcher started while the cluster has no majority (two of three servers down, or
/// rejoining) waits for JetStream to answer instead of exiting with "JetStream is not
/// enabled", and opens its buckets once a majority is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_started_while_the_cluster_has_no_majority_waits_for_it() {
    let mut cluster = NatsCluster::start(3).await;
    let names = cluster.names();
    // The buckets exist with three copies; now only one server is left.
    drop(cluster.bus().await);
    cluster.crash(&names[1]);
    cluster.crash(&names[2]);
    let options = cluster.options();
    let started = Instant::now();
    let launcher = tokio::spawn(async move { Bus::connect_replicated(&options, 3).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !launcher.is_finished(),
        "the launcher's connect ended without a majority: {:?}",
        launcher.await.expect("joined").err()
    );
    cluster.resume(&names[1]).await;
    let bus = tokio::time::timeout(RECOVERY, launcher)
        .await
        .expect("the launcher's connect ended")
        .expect("joined")
        .unwrap_or_else(|err| panic!("the launcher gave up: {err}\n{}", cluster.logs()));
    println!(
        "the launcher opened its buckets {:.1} s after it started, a majority back after 3 s",
        started.elapsed().as_secs_f64()
    );
    bus.events
        .put("probe", &serde_json::json!({"probe": true}), None)
        .await
        .expect("a write once a majority is back");
}
