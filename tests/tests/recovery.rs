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

/// A release whose agent call arrives late (after another launcher finished the same
/// release and the slot was claimed and prepared for a new node) finds the agent holding
/// the new node. Its claim stands, and a client may hold it by now: the late release
/// leaves it alone. It used to release it at the agent as "held for a node without a
/// claim", trusting that the key still named the node being released: in a cluster run
/// with leader kills, that wiped a node under the client holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_leaves_alone_the_node_the_slot_was_claimed_for_since() {
    use slotpool_protocol::api::{AgentCommand, SlotLimits, SlotPrepared, SlotReleased};
    use slotpool_protocol::layout::subjects;
    use slotpool_protocol::model::AgentHeartbeat;
    use slotpool_protocol::{NodeId, RequestId};
    let pool = Pool::start(1, 5, &label("small", 1, 600, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let old = pool.node(&first.nodes[0]).await;
    let key = slot_key(&old.backing_id, old.slot);
    let agent = subjects::agent(&old.backing_id);

    // Another launcher finishes the release of the old node at the agent, and the slot
    // is prepared for a new node...
    let other = pool.nats.bus().await;
    let wiped: SlotReleased = other
        .call(
            &agent,
            &AgentCommand::ReleaseSlot {
                slot: old.slot,
                node_id: old.id.clone(),
            },
            PROMPT,
        )
        .await
        .expect("the agent releases the old node");
    assert_eq!(wiped.held_by, None);
    let new = NodeId::for_slot(&old.backing_id, old.slot);
    let _: SlotPrepared = other
        .call(
            &agent,
            &AgentCommand::PrepareSlot {
                slot: old.slot,
                node_id: new.clone(),
                ssh_public_key: None,
                limits: SlotLimits::default(),
            },
            PROMPT,
        )
        .await
        .expect("the agent prepares the new node");

    // ...while the launcher's call releasing the old node is held up on its way (the
    // agent frozen here; a reply lost with a server holds it up until its resend).
    let pid: i32 =
        std::fs::read_to_string(pool.agent_dir(old.backing_id.as_str()).join("agent.pid"))
            .expect("the agent's pid file")
            .trim()
            .parse()
            .unwrap();
    let frozen = Frozen::stop(pid);
    let answer = pool
        .client
        .release(first.nodes.clone())
        .await
        .expect("the release is answered once the node is marked");
    assert_eq!(answer.released, first.nodes);
    // The other launcher deletes the key and claims the slot for the new node.
    let marked = other
        .slots
        .get::<Node>(&key)
        .await
        .expect("reading the slot")
        .expect("the old node marked releasing");
    assert_eq!(
        (&marked.value.id, marked.value.state),
        (&old.id, NodeState::Releasing)
    );
    other
        .slots
        .delete(&key, marked.revision)
        .await
        .expect("deleting the old node's key");
    let mut claim = marked.value.clone();
    claim.id = new.clone();
    claim.request_id = RequestId::generate();
    claim.state = NodeState::Ready;
    claim.released_at = None;
    other
        .slots
        .create(&key, &claim, None)
        .await
        .expect("claiming the slot for the new node");
    drop(frozen);

    // The launcher's release ends: the first request's nodes are all released.
    wait_for_some(
        "the launcher to finish the old node's release",
        PROMPT,
        || async {
            pool.client
                .request(&first.id)
                .await
                .ok()
                .flatten()
                .filter(|r| r.nodes_released_at.is_some())
        },
    )
    .await;
    let after = now_ms();
    let heartbeat = wait_for_some("a heartbeat of the agent since", PROMPT, || async {
        other
            .agents
            .list::<AgentHeartbeat>()
            .await
            .ok()?
            .into_iter()
            .filter_map(|h| h.ok().map(|h| h.value))
            .find(|h| h.backing_id == old.backing_id && h.sent_at > after + 100)
    })
    .await;
    let held: Vec<(u32, NodeId)> = heartbeat
        .slots
        .iter()
        .map(|s| (s.slot, s.node_id.clone()))
        .collect();
    assert_eq!(
        held,
        vec![(old.slot, new)],
        "the slot's new node was taken from it by a late release of the old one"
    );
    assert!(
        pool.logs()
            .contains("this release was finished elsewhere; the holder is left alone"),
        "the launcher says why it left the holder alone"
    );
}

/// A process stopped (`SIGSTOP`) until dropped, even when the test fails.
struct Frozen(i32);

impl Frozen {
    fn stop(pid: i32) -> Frozen {
        // SAFETY: kill(2) of the pool's own agent; touches no memory.
        let stopped = unsafe { libc::kill(pid, libc::SIGSTOP) };
        assert_eq!(stopped, 0, "stopping {pid}");
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: as in `Frozen::stop`.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
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
