//! Recoveries driven by events and timers, not by the launcher's periodic resync
//! (`RESYNC_INTERVAL`, 15 s): each is awaited with a deadline well below it.

use futures::StreamExt;
use slotpool_protocol::layout::slot_key;
use slotpool_protocol::model::{Lease, Node, NodeRequest, NodeState, RequestState};
use slotpool_protocol::store::Change;
use slotpool_protocol::store::KvError;
use slotpool_protocol::time::now_ms;
use slotpool_tests::{label, Pool};
use std::time::Duration;

/// Far below the resync interval: what a recovery driven by events may take here.
const PROMPT: Duration = Duration::from_secs(6);

/// Reads `changes` until `wanted` says yes; panics naming `what` after [`PROMPT`].
async fn wait_change<S>(changes: &mut S, what: &str, mut wanted: impl FnMut(&Change) -> bool)
where
    S: futures::Stream<Item = Result<Change, KvError>> + Unpin,
{
    let found = tokio::time::timeout(PROMPT, async {
        while let Some(change) = changes.next().await {
            if wanted(&change.expect("watching KV")) {
                return;
            }
        }
        panic!("the watch ended while waiting for {what}");
    })
    .await;
    if found.is_err() {
        panic!("timed out after {PROMPT:?} waiting for {what}");
    }
}

/// A slot marked releasing by a launcher that then died (its release never finished) is
/// freed by the launcher that sees it, about a second later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_left_behind_is_finished_within_seconds() {
    let pool = Pool::start(1, 5, &label("small", 2, 60, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (backing, slot) = r.nodes[0].slot().unwrap();
    let key = slot_key(&backing, slot);
    let slots = &pool.client.bus().slots;
    let mut changes = Box::pin(slots.watch_keys(&key).await.unwrap());
    let node = slots.get::<Node>(&key).await.unwrap().unwrap();
    let mut releasing = node.value.clone();
    releasing.state = NodeState::Releasing;
    releasing.released_at = Some(now_ms());
    slots
        .update(&key, &releasing, node.revision, None)
        .await
        .unwrap();
    wait_change(&mut changes, "the slot left releasing to be freed", |c| {
        matches!(c, Change::Removed { .. })
    })
    .await;
}

/// A launcher whose liveness lease was lost (here: deleted, as if it had expired) takes
/// it back and at once drives its waiting requests again: one is served as soon as a slot
/// frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_that_takes_its_liveness_back_drives_its_requests_at_once() {
    let pool = Pool::start(1, 3, &label("small", 1, 60, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let waiting = pool.submit(&["small"]).await;

    let leases = &pool.client.bus().leases;
    let mut lease_changes = Box::pin(leases.watch_keys("launcher.*").await.unwrap());
    let mut key = String::new();
    wait_change(
        &mut lease_changes,
        "the launcher's liveness lease",
        |c| match c {
            Change::Put { key: k, .. } => {
                key = k.clone();
                true
            }
            _ => false,
        },
    )
    .await;
    let lease = leases.get::<Lease>(&key).await.unwrap().unwrap();
    leases.delete(&key, lease.revision).await.unwrap();
    // Taken again (a new record under the same key).
    wait_change(&mut lease_changes, "the liveness lease taken again", |c| {
        matches!(c, Change::Put { key: k, revision, .. } if *k == key && *revision > lease.revision)
    })
    .await;
    let mut requests = pool
        .client
        .bus()
        .requests
        .watch_keys(waiting.as_str())
        .await
        .unwrap()
        .boxed();
    pool.client.release(first.nodes.clone()).await.unwrap();
    wait_change(&mut requests, "the waiting request served", |c| match c {
        Change::Put {
            key,
            revision,
            value,
        } => Change::decode::<NodeRequest>("slotpool_requests", key, *revision, value)
            .is_ok_and(|r| r.value.state == RequestState::Fulfilled),
        _ => false,
    })
    .await;
}
