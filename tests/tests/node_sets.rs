//! Node sets claim all or nothing: a set that cannot complete holds no slot a smaller
//! request could use.

use slotpool_protocol::model::RequestState;
use slotpool_tests::{label, wait_for_some, Pool};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_single_node_is_served_while_a_set_waits_for_a_busy_label() {
    // Two backing nodes at most: one of `a`, one of `b`, one slot each.
    let labels = format!("{}{}", label("a", 1, 60, &[]), label("b", 1, 60, &[]));
    let pool = Pool::start(2, 5, &labels, 1).await;
    let busy_b = pool.fulfilled(&pool.submit(&["b"]).await).await;
    let warm_a = pool.fulfilled(&pool.submit(&["a"]).await).await;
    pool.release_and_wait(&warm_a.nodes).await;

    // The set gets no `b`, so it waits, and must leave the free `a` alone.
    let set = pool.submit(&["a", "b"]).await;
    wait_for_some("the set waits for b", LONG, || async {
        pool.client
            .request(&set)
            .await
            .ok()
            .flatten()
            .filter(|r| r.status.starts_with("waiting for a free slot of b"))
    })
    .await;
    let single = pool.submit(&["a"]).await;
    let served = pool.wait_final(&single, Duration::from_secs(20)).await;
    assert_eq!(
        served.state,
        RequestState::Fulfilled,
        "the later single-node request was not served while the set waits: {served:?}\n{}",
        pool.logs()
    );
    let r = pool.client.request(&set).await.unwrap().unwrap();
    assert_eq!(r.state, RequestState::Requested, "{r:?}");

    // Once both are given back, the set gets both at once.
    pool.release_and_wait(&busy_b.nodes).await;
    pool.release_and_wait(&served.nodes).await;
    let done = pool.fulfilled(&set).await;
    assert_eq!(done.nodes.len(), 2);
}
