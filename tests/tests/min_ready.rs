//! `min-ready`: free slots kept warm with no request waiting, against a real nats-server,
//! a real launcher and local agents.

use futures::StreamExt;
use slotpool_protocol::model::{BackingNode, BackingState};
use slotpool_protocol::store::Change;
use slotpool_protocol::time::now_ms;
use slotpool_protocol::BackingId;
use slotpool_tests::{label, wait_for, Pool};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(30);
/// Longer than the labels' grace-time (1 s), with room for a release to show.
const PAST_GRACE: Duration = Duration::from_secs(4);
/// The lease TTL of the pools started here.
const LEASE_TTL: Duration = Duration::from_secs(5);
/// What a step driven by a timer may take to show here: far below the resync (15 s).
const PROMPT: Duration = Duration::from_secs(4);

/// Every backing id of `label` ever written to the backing bucket, as a watch sees them.
fn launched(pool: &Pool, label: &'static str) -> Arc<Mutex<HashSet<BackingId>>> {
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let bus = pool.client.bus().clone();
    let into = seen.clone();
    tokio::spawn(async move {
        let mut changes = Box::pin(bus.backing.watch().await.expect("watch backing"));
        while let Some(Ok(change)) = changes.next().await {
            if let Change::Put { value, .. } = change {
                if let Ok(b) = serde_json::from_slice::<BackingNode>(&value) {
                    if b.label == label {
                        into.lock().unwrap().insert(b.id);
                    }
                }
            }
        }
    });
    seen
}

async fn ready(pool: &Pool, label: &str) -> Vec<BackingNode> {
    pool.backing_in(&[BackingState::Ready])
        .await
        .into_iter()
        .filter(|b| b.label == label)
        .collect()
}

/// Free slots of `label`: slots of its ready backing nodes not held by a node.
async fn free(pool: &Pool, label: &str) -> usize {
    let nodes = ready(pool, label).await;
    let held = pool.nodes().await;
    nodes
        .iter()
        .map(|b| b.slots as usize - held.iter().filter(|n| n.backing_id == b.id).count())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_ready_keeps_slots_warm_without_launching_and_releasing_in_a_loop() {
    let labels = label("warm", 2, 1, &["min-ready: 2"]) + &label("cold", 2, 1, &["min-ready: 0"]);
    let pool = Pool::start(4, 5, &labels, 1).await;
    let seen = launched(&pool, "warm");

    // No request: one backing node of 2 slots is launched for min-ready 2, none for 0.
    wait_for("a warm backing node ready", LONG, || async {
        ready(&pool, "warm").await.len() == 1
    })
    .await;
    let first = ready(&pool, "warm").await.remove(0);
    // Kept past its grace-time, and not replaced by another.
    tokio::time::sleep(PAST_GRACE).await;
    let now = ready(&pool, "warm").await;
    assert_eq!(
        now.iter().map(|b| &b.id).collect::<Vec<_>>(),
        vec![&first.id],
        "the warm node was released (or another launched) past its grace-time"
    );
    assert_eq!(seen.lock().unwrap().len(), 1, "launched more than once");
    assert!(
        pool.backing().await.iter().all(|b| b.label != "cold"),
        "a label with min-ready 0 got a backing node with no request"
    );

    // A request takes a warm slot at once, leaving one free: another node comes.
    let r = pool.fulfilled(&pool.submit(&["warm"]).await).await;
    assert_eq!(pool.node(&r.nodes[0]).await.backing_id, first.id);
    wait_for("free slots back to min-ready", LONG, || async {
        free(&pool, "warm").await >= 2
    })
    .await;
    assert_eq!(ready(&pool, "warm").await.len(), 2);

    // Given back, the two empty nodes have 4 free: one goes after its grace-time, the
    // other stays, and nothing is launched again.
    pool.release_and_wait(&r.nodes).await;
    wait_for("one of the two empty nodes released", LONG, || async {
        pool.backing()
            .await
            .iter()
            .filter(|b| b.label == "warm")
            .count()
            == 1
    })
    .await;
    tokio::time::sleep(PAST_GRACE).await;
    assert_eq!(
        ready(&pool, "warm").await.len(),
        1,
        "the last warm node went"
    );
    assert_eq!(free(&pool, "warm").await, 2);
    assert_eq!(
        seen.lock().unwrap().len(),
        2,
        "launched and released in a loop: {:?}",
        seen.lock().unwrap()
    );
    assert!(pool.backing().await.iter().all(|b| b.label != "cold"));
}

/// `warm-window`: a label with no `min-ready` keeps ready the slots its recent requests
/// predict, counted from the request records in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_window_keeps_slots_ready_for_the_recent_arrival_rate() {
    // Window and lead alike: the mean is the arrivals of the window, one here, whose
    // 0.9 quantile is 2 free slots.
    let labels = label("warm", 2, 1, &["warm-window: 600", "warm-lead: 600"]);
    let pool = Pool::start(4, 5, &labels, 1).await;
    tokio::time::sleep(PAST_GRACE).await;
    assert!(
        pool.backing().await.iter().all(|b| b.label != "warm"),
        "no arrival yet: nothing kept ready"
    );
    let r = pool.fulfilled(&pool.submit(&["warm"]).await).await;
    wait_for("two free slots beyond the one held", LONG, || async {
        free(&pool, "warm").await >= 2
    })
    .await;
    assert_eq!(ready(&pool, "warm").await.len(), 2);
    pool.release_and_wait(&r.nodes).await;
}

/// `warm-window` counts every request that arrived in the window, finished or not: a
/// launcher's mirror drops a finished request at once, yet its arrival still predicts the
/// next. A launcher started afresh counts the finished request records it finds in the
/// store, so it keeps the slots ready too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_window_counts_finished_requests_also_after_a_launcher_restart() {
    let labels = label("warm", 2, 1, &["warm-window: 600", "warm-lead: 600"]);
    let mut pool = Pool::start(4, 5, &labels, 1).await;
    let r = pool.fulfilled(&pool.submit(&["warm"]).await).await;
    pool.release_and_wait(&r.nodes).await;
    wait_for("two free slots after the release", LONG, || async {
        free(&pool, "warm").await >= 2
    })
    .await;
    // A new launcher looks at every backing node afresh; the request it finds is over.
    pool.kill_launcher(0);
    pool.restart_launcher(0);
    pool.wait_served().await;
    // Past the killed launcher's leases (5 s) and the grace-time after them.
    tokio::time::sleep(LEASE_TTL + PAST_GRACE).await;
    assert!(
        free(&pool, "warm").await >= 2,
        "the warm slots went once the request that predicted them had finished: {:?}",
        pool.backing().await
    );
}

/// A node kept only for the arrivals of a `warm-window` is released once they have
/// left the window, with nothing else happening: a timer looks at it again then, well
/// before the launcher's periodic resync (15 s) would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_kept_for_the_warm_window_goes_once_its_arrivals_leave_it() {
    // A window longer than the launches and releases that follow the request take, so
    // that nothing else is left to look at the kept node when the arrival leaves it,
    // and ending between two resyncs (at 15 s and 30 s after the launcher started).
    const WINDOW: Duration = Duration::from_secs(20);
    let labels = label("warm", 2, 1, &["warm-window: 20", "warm-lead: 20"]);
    let pool = Pool::start(4, 5, &labels, 1).await;
    let r = pool.fulfilled(&pool.submit(&["warm"]).await).await;
    pool.release_and_wait(&r.nodes).await;
    // The arrival leaves the window at created_at + WINDOW; grace-time (1 s) has long
    // passed by then. A few seconds more for the release to show.
    let due = r.created_at + WINDOW.as_millis() as u64;
    let deadline = Duration::from_millis(due.saturating_sub(now_ms())) + PROMPT;
    wait_for(
        "the warm node released once its arrival left the window",
        deadline,
        || async { pool.backing().await.iter().all(|b| b.label != "warm") },
    )
    .await;
}

/// With a grace-time of 0, a backing node launched for a waiting request serves it: it is
/// not released between becoming ready and the request's claim (which would have the
/// request launch another, and so on), whichever launcher drives the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grace_time_zero_serves_the_requests_a_node_was_launched_for() {
    let labels = label("zero", 1, 0, &[]);
    // Two launchers: the one driving a backing node sees another's claim only once its
    // write comes back through the watch.
    let pool = Pool::start(4, 5, &labels, 2).await;
    let seen = launched(&pool, "zero");
    const REQUESTS: usize = 4;
    for round in 0..REQUESTS {
        // Two at once: two nodes of one slot are launched, one for each.
        let ids = [pool.submit(&["zero"]).await, pool.submit(&["zero"]).await];
        let mut nodes = Vec::new();
        for id in &ids {
            nodes.extend(pool.fulfilled(id).await.nodes);
        }
        pool.release_and_wait(&nodes).await;
        wait_for("every node released", LONG, || async {
            pool.backing().await.iter().all(|b| b.label != "zero")
        })
        .await;
        assert_eq!(
            seen.lock().unwrap().len(),
            2 * (round + 1),
            "round {round}: backing nodes were launched that served no request"
        );
    }
}
