//! A label served by several backing sizes, against a real nats-server, a real launcher
//! and local agents: the planner launches the size that covers what waits at the lowest
//! price, and slots are taken from the smallest node first.

use slotpool_protocol::model::BackingNode;
use slotpool_tests::Pool;
use std::collections::BTreeMap;

/// `sized`: a 1-slot node at 0.10 an hour or a 4-slot one at 0.30.
const SIZED: &str = "          - name: sized
            grace-time: 30
            sizes:
              - {backing-label: vm-1, max-parallel-jobs: 1, cost-per-hour: 0.10}
              - {backing-label: vm-4, max-parallel-jobs: 4, cost-per-hour: 0.30}
";

/// Backing labels and slots of the backing nodes of `sized`, by backing id.
async fn sizes(pool: &Pool) -> BTreeMap<String, (String, u32)> {
    pool.backing()
        .await
        .into_iter()
        .filter(|b: &BackingNode| b.label == "sized")
        .map(|b| (b.id.to_string(), (b.backing_label, b.slots)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_small_size_for_one_request_the_big_one_for_a_burst_and_claims_on_the_small() {
    let pool = Pool::start(8, 5, SIZED, 1).await;

    // One request: one 1-slot node (0.10), not a 4-slot one (0.30).
    let one = pool.fulfilled(&pool.submit(&["sized"]).await).await;
    let first = pool.node(&one.nodes[0]).await.backing_id;
    let launched = sizes(&pool).await;
    assert_eq!(
        launched.values().collect::<Vec<_>>(),
        [&("vm-1".to_string(), 1)],
        "one waiting request: {launched:?}"
    );

    // Holding it, a burst of four at once (a node set): one 4-slot node (0.30), not four
    // 1-slot ones (0.40); all four nodes on it.
    let burst = pool
        .fulfilled(&pool.submit(&["sized", "sized", "sized", "sized"]).await)
        .await;
    let launched = sizes(&pool).await;
    assert_eq!(launched.len(), 2, "{launched:?}");
    let big = launched
        .iter()
        .find(|(id, _)| **id != first.to_string())
        .expect("a second backing node");
    assert_eq!(
        big.1,
        &("vm-4".to_string(), 4),
        "a burst of four: {launched:?}"
    );
    for node in &burst.nodes {
        assert_eq!(pool.node(node).await.backing_id.to_string(), *big.0);
    }

    // Packing: with the small node empty and the big one at 3 of 4, the next request
    // takes the small node, so the big one is the one that drains.
    pool.release_and_wait(&one.nodes).await;
    pool.release_and_wait(&burst.nodes[..1]).await;
    let next = pool.fulfilled(&pool.submit(&["sized"]).await).await;
    assert_eq!(
        pool.node(&next.nodes[0]).await.backing_id,
        first,
        "a slot on the smallest node first, not on the fuller big one"
    );
    assert_eq!(sizes(&pool).await.len(), 2, "nothing launched for it");
}
