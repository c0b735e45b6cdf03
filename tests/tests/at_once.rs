//! A submit that waits for its outcome (`wait_ms`) and finds a free slot for every label
//! is served before its request is recorded: the request is created already fulfilled,
//! one write instead of two. Whatever stops that half-way leaves the request to its
//! worker. Against a real nats-server, launcher and local agents.

use futures::StreamExt;
use slotpool_protocol::api::SubmitRequest;
use slotpool_protocol::client::submission;
use slotpool_protocol::model::{NodeRequest, RequestState};
use slotpool_protocol::store::{Change, KvError};
use slotpool_protocol::RequestId;
use slotpool_tests::{label, Pool};
use std::time::Duration;

const SOON: Duration = Duration::from_secs(20);

/// A submission for `labels` under an id of the client's, and that id.
fn with_id(labels: &[&str], requestor: &str) -> (SubmitRequest, RequestId) {
    let mut sub = submission(labels.iter().map(|l| l.to_string()).collect(), requestor);
    let id = RequestId::generate();
    sub.id = Some(id.clone());
    (sub, id)
}

/// The next write of the request, decoded.
async fn next_write<S>(writes: &mut S, what: &str) -> NodeRequest
where
    S: futures::Stream<Item = Result<Change, KvError>> + Unpin,
{
    loop {
        let change = tokio::time::timeout(SOON, writes.next())
            .await
            .unwrap_or_else(|_| panic!("no write of the request within {SOON:?} ({what})"))
            .expect("the watch goes on")
            .expect("watching KV");
        if let Change::Put {
            key,
            revision,
            value,
        } = change
        {
            return Change::decode::<NodeRequest>("slotpool_requests", &key, revision, &value)
                .expect("a readable request")
                .value;
        }
    }
}

/// Starts a pool of one launcher and has it serve a first request, so that a backing
/// node with a free slot is up.
async fn warm_pool() -> Pool {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    pool.wait_served().await;
    let first = pool
        .client
        .submit_and_wait(&submission(vec!["small".into()], "warm-up"))
        .await
        .unwrap();
    assert_eq!(first.state, RequestState::Fulfilled, "{first:?}");
    pool
}

/// The pid of the agent of the backing node behind `pool`'s first ready node.
async fn agent_pid(pool: &Pool) -> i32 {
    let backing = pool.backing().await;
    let id = &backing.first().expect("a backing node").id;
    std::fs::read_to_string(pool.agent_dir(id.as_str()).join("agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// With free slots, the request's first write is already fulfilled, and its only other
/// write is the release mark: a create and two updates before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_submit_with_a_free_slot_is_recorded_once_already_fulfilled() {
    let pool = warm_pool().await;
    let (sub, id) = with_id(&["small"], "at-once");
    let mut writes = pool.request_changes(&id).await;
    let served = pool.client.submit_and_wait(&sub).await.unwrap();
    assert_eq!(served.state, RequestState::Fulfilled, "{served:?}");
    let first = next_write(&mut writes, "its creation").await;
    assert_eq!(
        first.state,
        RequestState::Fulfilled,
        "the request was first recorded {:?} ({})",
        first.state,
        first.status
    );
    assert_eq!(first.nodes, served.nodes);
    let node = pool.node(&served.nodes[0]).await;
    assert_eq!(node.request_id, id);
    pool.release_and_wait(&served.nodes).await;
    let second = next_write(&mut writes, "the release mark").await;
    assert!(
        second.nodes_released_at.is_some(),
        "a write between the creation and the release mark: {second:?}"
    );
}

/// An agent that does not answer in time (paused here) leaves the request to its
/// worker: it is recorded `requested`, and served once the agent answers, with one
/// node in one slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_submit_whose_agent_is_slow_is_served_by_the_requests_worker() {
    let pool = warm_pool().await;
    let pid = agent_pid(&pool).await;
    let (sub, id) = with_id(&["small"], "slow-agent");
    let mut writes = pool.request_changes(&id).await;
    // SAFETY: pausing the test's own child agent by its recorded pid.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let waiting = {
        let client = pool.client.clone();
        tokio::spawn(async move { client.submit_and_wait(&sub).await })
    };
    let first = next_write(&mut writes, "its creation").await;
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(first.state, RequestState::Requested, "{first:?}");
    let served = tokio::time::timeout(SOON, waiting)
        .await
        .expect("the waiting submit is answered")
        .unwrap()
        .expect("the request is served");
    assert_eq!(served.state, RequestState::Fulfilled, "{served:?}");
    assert_eq!(served.nodes.len(), 1);
    let held: Vec<_> = pool
        .nodes()
        .await
        .into_iter()
        .filter(|n| n.request_id == id)
        .collect();
    assert_eq!(held.len(), 1, "slots held for the request: {held:?}");
    assert_eq!(held[0].id, served.nodes[0]);
}

/// A submit sent again under the id of a request already served is answered with that
/// request, and one under a taken id with other labels, or from another client, is
/// refused; none of them leaves a slot claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_under_a_taken_id_gets_the_first_request_or_a_refusal_and_holds_nothing() {
    let pool = warm_pool().await;
    let (sub, id) = with_id(&["small"], "first");
    let first = pool.client.submit_and_wait(&sub).await.unwrap();
    assert_eq!(first.state, RequestState::Fulfilled, "{first:?}");
    let again = pool.client.submit_and_wait(&sub).await.unwrap();
    assert_eq!(again.nodes, first.nodes, "sent again: {again:?}");
    let mut other_labels = submission(vec!["small".into(), "small".into()], "first");
    other_labels.id = Some(id.clone());
    let refused = pool.client.submit_and_wait(&other_labels).await;
    assert!(
        refused.as_ref().is_err_and(|e| e
            .to_string()
            .contains("already used by a different request")),
        "{refused:?}"
    );
    let mallory = slotpool_protocol::client::Client::connect(
        &pool
            .nats
            .options_as(slotpool_protocol::auth::Role::Client, "mallory"),
    )
    .await
    .unwrap();
    let refused = mallory.submit_and_wait(&sub).await;
    assert!(
        refused.is_err(),
        "another client's submit under the id: {refused:?}"
    );
    slotpool_tests::wait_for(
        "only the first request's node held under its id",
        SOON,
        || async {
            let held: Vec<_> = pool
                .nodes()
                .await
                .into_iter()
                .filter(|n| n.request_id == id)
                .map(|n| n.id)
                .collect();
            held == first.nodes
        },
    )
    .await;
}
