//! `max-uses`: a backing node retired after handing out N slots, against a real
//! nats-server, a real launcher and local agents.

use slotpool_protocol::model::BackingState;
use slotpool_tests::{label, wait_for, Pool};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backing_node_is_retired_after_max_uses_jobs_and_the_next_job_gets_another() {
    // 4 slots and a long grace-time: without max-uses every job here would share one node.
    let pool = Pool::start(4, 5, &label("small", 4, 60, &["max-uses: 2"]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let node_a = pool.node(&first.nodes[0]).await.backing_id;
    pool.release_and_wait(&first.nodes).await;
    let second = pool.fulfilled(&pool.submit(&["small"]).await).await;
    assert_eq!(pool.node(&second.nodes[0]).await.backing_id, node_a);
    let a = pool
        .backing()
        .await
        .into_iter()
        .find(|b| b.id == node_a)
        .expect("node a");
    assert_eq!(a.uses, 2, "each claim counted in the backing record");
    wait_for("node a retired at max-uses", LONG, || async {
        pool.backing()
            .await
            .iter()
            .any(|b| b.id == node_a && b.state == BackingState::Retiring)
    })
    .await;
    // Its third job goes to another node, and it is released once empty, long before
    // its grace-time.
    let third = pool.fulfilled(&pool.submit(&["small"]).await).await;
    assert_ne!(
        pool.node(&third.nodes[0]).await.backing_id,
        node_a,
        "a backing node handed out a third slot with max-uses 2"
    );
    pool.release_and_wait(&second.nodes).await;
    wait_for("node a released once empty", LONG, || async {
        !pool.backing().await.iter().any(|b| b.id == node_a)
    })
    .await;
}
