//! Recoveries driven by events and timers, not by the launcher's periodic resync
//! (`RESYNC_INTERVAL`, 15 s): each is awaited with a deadline well below it.

use futures::StreamExt;
use slotpool_launcher::backing::lifecycle::FAILED_SEAT_COOLDOWN;
use slotpool_protocol::layout::slot_key;
use slotpool_protocol::model::BackingState;
use slotpool_protocol::model::{Lease, Node, NodeRequest, NodeState, RequestState};
use slotpool_protocol::store::Change;
use slotpool_protocol::store::KvError;
use slotpool_protocol::time::now_ms;
use slotpool_tests::{label, wait_for_some, Pool};
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

/// Whether a change of a request's record makes it fulfilled.
fn is_fulfilled(c: &Change) -> bool {
    match c {
        Change::Put {
            key,
            revision,
            value,
        } => Change::decode::<NodeRequest>("slotpool_requests", key, *revision, value)
            .is_ok_and(|r| r.value.state == RequestState::Fulfilled),
        _ => false,
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
    let mut requests = pool.request_changes(&waiting).await;
    pool.client.release(first.nodes.clone()).await.unwrap();
    wait_change(&mut requests, "the waiting request served", is_fulfilled).await;
}

/// A request waiting for a backing node whose only seat holds a failed one is served as
/// soon as the seat's rest ends (a timer), not at the next resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_seat_is_launched_into_again_when_its_rest_ends() {
    let pool = Pool::start(1, 5, &label("small", 1, 60, &[]), 1).await;
    let started = tokio::time::Instant::now();
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let dead = pool.node(&first.nodes[0]).await.backing_id;
    let waiting = pool.submit(&["small"]).await;
    let mut requests = pool.request_changes(&waiting).await;
    let pid: i32 = std::fs::read_to_string(pool.agent_dir(dead.as_str()).join("agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The launcher's resync runs as it starts and every 15 s after: the agent dies 8 s in,
    // so that the seat's rest (10 s after the failure, found within the 2 s heartbeat
    // TTL) ends half-way between two resyncs and only a timer serves the request in time.
    tokio::time::sleep_until(started + Duration::from_secs(8)).await;
    // SAFETY: the agent was started by this test's launcher.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let failed_at = wait_for_some(
        "the dead agent's backing node failed and cleaned up",
        Duration::from_secs(60),
        || async {
            pool.backing()
                .await
                .into_iter()
                .find(|b| b.id == dead && b.state == BackingState::Failed && b.instance.is_none())
                .map(|b| b.updated_at)
        },
    )
    .await;
    let rest_left = Duration::from_millis(
        (failed_at + FAILED_SEAT_COOLDOWN.as_millis() as u64).saturating_sub(now_ms()),
    );
    // What the timer does is start a launch; how long the new agent takes to boot is
    // the host's business (a loaded test machine takes seconds), so the deadline is on
    // the launch and the request only has to be served in the end.
    let launched = tokio::time::timeout(rest_left + Duration::from_secs(4), async {
        loop {
            let relaunched = pool.backing().await.into_iter().any(|b| {
                b.updated_at > failed_at
                    && matches!(
                        b.state,
                        BackingState::Requested | BackingState::Launching | BackingState::Ready
                    )
            });
            if relaunched {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        launched.is_ok(),
        "no launch into the seat within 4 s of its rest ending ({rest_left:?} after the failure was cleaned up)"
    );
    let served = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(change) = requests.next().await {
            if let Change::Put {
                key,
                revision,
                value,
            } = change.expect("watching the request")
            {
                let r = Change::decode::<NodeRequest>("slotpool_requests", &key, revision, &value)
                    .unwrap();
                if r.value.state == RequestState::Fulfilled {
                    return;
                }
            }
        }
    })
    .await;
    assert!(
        served.is_ok(),
        "the waiting request was not served on the relaunched seat"
    );
}

/// An agent that holds a slot for a node with no claim (a prepare that reached it after
/// its node was released, say) would refuse every later prepare of that slot, and the
/// launcher would claim and give it back for ever. The release of the refused claim
/// names the stale holder, and the launcher releases it at the agent too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_the_agent_holds_for_a_node_without_a_claim_is_freed_and_served() {
    use slotpool_protocol::api::{AgentCommand, SlotLimits, SlotPrepared};
    use slotpool_protocol::layout::subjects;
    let pool = Pool::start(1, 5, &label("small", 1, 600, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let backing = pool.backing().await.pop().expect("one backing node");
    pool.release_and_wait(&first.nodes).await;

    // The agent is told, as a launcher would, to prepare its only slot for a node that
    // no slot key names.
    let launcher = pool.nats.bus().await;
    let stale = AgentCommand::PrepareSlot {
        slot: 0,
        node_id: slotpool_protocol::NodeId::generate(),
        ssh_public_key: None,
        limits: SlotLimits::default(),
    };
    let _: SlotPrepared = launcher
        .call(&subjects::agent(&backing.id), &stale, PROMPT)
        .await
        .expect("the agent prepares the slot");

    let second = pool.submit(&["small"]).await;
    let r = pool.wait_final(&second, Duration::from_secs(30)).await;
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    assert_eq!(
        pool.backing().await.len(),
        1,
        "served on the same backing node"
    );
}

/// A node of a fulfilled request whose backing node fails (its agent killed) leaves
/// the request fulfilled, with its nodes still the request's until released, but a
/// client following the request by `status` is told: `nodes_failed` names the node and
/// the status line says why. It used to read "fulfilled: 1 node(s) ready" for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fulfilled_request_says_when_its_node_fails() {
    let pool = Pool::start(2, 5, &label("small", 2, 60, &[]), 1).await;
    let id = pool.submit(&["small"]).await;
    let r = pool.fulfilled(&id).await;
    let node = pool.node(&r.nodes[0]).await;
    let pid: i32 =
        std::fs::read_to_string(pool.agent_dir(node.backing_id.as_str()).join("agent.pid"))
            .expect("the agent's pid file")
            .trim()
            .parse()
            .unwrap();
    // SAFETY: kill(2) of the pool's own agent; touches no memory.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // The heartbeat's TTL (2 s) and the launcher's judgment: well within 20 s.
    let told = wait_for_some(
        "the request to say its node failed",
        Duration::from_secs(20),
        || async {
            pool.client
                .request(&id)
                .await
                .ok()
                .flatten()
                .filter(|r| !r.nodes_failed.is_empty())
        },
    )
    .await;
    assert_eq!(told.state, RequestState::Fulfilled, "{told:?}");
    assert_eq!(told.nodes, r.nodes, "{told:?}");
    assert_eq!(told.nodes_failed, r.nodes, "{told:?}");
    assert!(
        told.status
            .starts_with("fulfilled: 1 node(s), 1 failed: node ")
            && told.status.contains(node.backing_id.as_str()),
        "{}",
        told.status
    );
    // The node is still the client's to release.
    let released = pool.release_and_wait(&r.nodes).await;
    assert_eq!(released.released, r.nodes);
}
