//! A bus outage longer than the agents' heartbeat TTL: the nats-server is stopped and
//! started again on the same port and store while launcher and agents keep running. A
//! live backing node must survive it; one whose agent died meanwhile must still be found.

use slotpool_protocol::model::{BackingNode, BackingState};
use slotpool_protocol::BackingId;
use slotpool_tests::{label, wait_for, Pool};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);
/// Longer than the test agents' heartbeat TTL (2 s): every heartbeat expires meanwhile.
const OUTAGE: Duration = Duration::from_secs(5);
/// How long a live node is watched after the outage: past the launcher's grace for a
/// heartbeat missing after a reconnect (the agents' TTL plus a 10 s margin).
const WATCH_AFTER: Duration = Duration::from_secs(15);
/// How long after the server an agent comes back (its reconnect can lag the launcher's).
const AGENT_LATE: Duration = Duration::from_secs(2);

async fn backing_of(pool: &Pool, id: &BackingId) -> BackingNode {
    pool.backing()
        .await
        .into_iter()
        .find(|b| &b.id == id)
        .unwrap_or_else(|| panic!("backing node {id} has no record"))
}

/// Fails if `id` becomes failed within `period`.
async fn assert_never_failed(pool: &Pool, id: &BackingId, period: Duration) {
    let until = tokio::time::Instant::now() + period;
    while tokio::time::Instant::now() < until {
        let b = backing_of(pool, id).await;
        assert_ne!(
            b.state,
            BackingState::Failed,
            "the live backing node {id} was failed: {:?}",
            b.failure
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Stops the pool's nats-server for [`OUTAGE`], running `meanwhile` while it is down, and
/// starts it again on the same port and store.
async fn outage(pool: &mut Pool, meanwhile: impl FnOnce(&Pool)) {
    pool.nats.stop().await;
    meanwhile(pool);
    // The outage itself is what is tested: its length is the point, not a wait.
    tokio::time::sleep(OUTAGE).await;
    pool.nats.resume().await;
    // The launcher subscribes to the API again once it is back.
    pool.wait_served().await;
}

fn agent_pid(pool: &Pool, id: &BackingId) -> i32 {
    std::fs::read_to_string(pool.agent_dir(id.as_str()).join("agent.pid"))
        .expect("agent pid file")
        .trim()
        .parse()
        .expect("a pid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_outage_longer_than_the_heartbeat_ttl_fails_no_live_backing_node() {
    // One seat: a second request can only be served by the same backing node.
    let mut pool = Pool::start(1, 5, &label("small", 4, 60, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let node = pool.node(&first.nodes[0]).await;

    // The agent is stopped through the outage and goes on a little after the server is
    // back: the launcher reloads its mirror before the agent writes a heartbeat again.
    let pid = agent_pid(&pool, &node.backing_id);
    outage(&mut pool, |_| {
        // SAFETY: the agent was started by this test's launcher.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
    })
    .await;
    tokio::time::sleep(AGENT_LATE).await;
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };

    let second = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let second_node = pool.node(&second.nodes[0]).await;
    assert_eq!(
        second_node.backing_id, node.backing_id,
        "the second request was served by another backing node"
    );
    assert_never_failed(&pool, &node.backing_id, WATCH_AFTER).await;
    let b = backing_of(&pool, &node.backing_id).await;
    assert_eq!(b.state, BackingState::Ready, "{b:?}");
    let held = pool.node(&node.id).await;
    assert_eq!(held.request_id, first.id, "the first node changed hands");
    assert!(held.failure.is_none(), "{held:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_died_during_a_bus_outage_is_found_after_it() {
    // One slot per backing node: two requests, two backing nodes.
    let mut pool = Pool::start(2, 5, &label("small", 1, 60, &[]), 1).await;
    let a = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let b = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let dead = pool.node(&a.nodes[0]).await.backing_id;
    let live = pool.node(&b.nodes[0]).await.backing_id;
    assert_ne!(dead, live);

    let pid = agent_pid(&pool, &dead);
    outage(&mut pool, |_| {
        // SAFETY: the agent was started by this test's launcher.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    })
    .await;

    wait_for("the dead agent's backing node failed", LONG, || async {
        backing_of(&pool, &dead).await.state == BackingState::Failed
    })
    .await;
    let failed = backing_of(&pool, &dead).await;
    let reason = failed.failure.unwrap_or_default();
    assert!(reason.contains("while connected"), "{reason}");
    assert_never_failed(&pool, &live, WATCH_AFTER).await;
    assert!(pool.node(&b.nodes[0]).await.failure.is_none());
}
