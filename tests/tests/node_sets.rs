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

/// A node set as big as the pool, at a worse priority than the jobs running: before,
/// its worker could never complete it, was woken again at once after every look, and
/// spun on a core with the world's lock, so that no launcher served anything (not even
/// a cancel). Now the jobs go on being served, the set waits without a cost, and the
/// API answers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_as_big_as_the_pool_at_a_worse_priority_stops_nothing() {
    use slotpool_protocol::client::submission;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    let pool = Arc::new(Pool::start(3, 5, &label("small", 4, 60, &[]), 1).await);
    // Three backing nodes up: twelve jobs at once, given back but for one, held all
    // along, so that the set can never complete while the others come and go.
    let first: Vec<_> = futures::future::join_all((0..12).map(|_| pool.submit(&["small"]))).await;
    let mut held = None;
    for id in &first {
        let r = pool.fulfilled(id).await;
        match held {
            None => held = Some(r),
            Some(_) => {
                pool.release_and_wait(&r.nodes).await;
            }
        }
    }

    let stop = Instant::now() + Duration::from_secs(8);
    let served = Arc::new(AtomicU32::new(0));
    let jobs: Vec<_> = (0..6)
        .map(|_| {
            let (pool, served) = (pool.clone(), served.clone());
            tokio::spawn(async move {
                let mut slowest = Duration::ZERO;
                while Instant::now() < stop {
                    let mut sub = submission(vec!["small".into()], "job");
                    sub.priority = Some(100);
                    let asked = Instant::now();
                    let id = pool.client.submit(&sub).await.expect("submit");
                    slowest = slowest.max(asked.elapsed());
                    let r = pool.wait_final(&id, Duration::from_secs(10)).await;
                    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
                    let asked = Instant::now();
                    pool.release_and_wait(&r.nodes).await;
                    slowest = slowest.max(asked.elapsed());
                    served.fetch_add(1, Ordering::Relaxed);
                }
                slowest
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut set = submission(vec!["small".into(); 12], "whole pool");
    set.priority = Some(500);
    let set = pool.client.submit(&set).await.expect("submit the set");
    let before = served.load(Ordering::Relaxed);
    let mut slowest = Duration::ZERO;
    for job in jobs {
        match job.await {
            Ok(took) => slowest = slowest.max(took),
            Err(err) => panic!("a job failed: {err}\n{}", pool.logs()),
        }
    }
    let after_set = served.load(Ordering::Relaxed) - before;
    let asked = Instant::now();
    let canceled = pool.client.cancel(set.clone()).await.expect("cancel");
    let cancel_took = asked.elapsed();
    eprintln!(
        "jobs served after the set came: {after_set}; slowest submit or release {slowest:?}; cancel {cancel_took:?}"
    );
    assert!(
        after_set >= 12,
        "the jobs were served {after_set} times in 7.5 s after the set came\n{}",
        pool.logs()
    );
    assert_eq!(canceled.state, RequestState::Canceled, "{canceled:?}");
    let r = pool.wait_final(&set, Duration::from_secs(10)).await;
    assert_eq!(r.state, RequestState::Canceled, "{r:?}");
    pool.release_and_wait(&held.expect("a job held").nodes)
        .await;
}
