//! Teams sharing one pool (docs/configuration.md, `tenants[]`), against a real launcher,
//! real agents and an authenticated nats-server, each team submitting under its own
//! bus identity: a quieter team's request is served before a busier team's backlog, a
//! team at its `max-slots` waits and says so, and a submit over a hard limit is refused
//! with the limit.

use slotpool_protocol::api::{ApiError, ErrorCode};
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::submission;
use slotpool_protocol::client::Client;
use slotpool_protocol::connect::BusError;
use slotpool_protocol::model::{NodeRequest, RequestState, WaitCause};
use slotpool_protocol::RequestId;
use slotpool_tests::{label, wait_for_some, Pool};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

async fn team(pool: &Pool, name: &str) -> Client {
    Client::connect(&pool.nats.options_as(Role::Client, name))
        .await
        .expect("a team's client connects")
}

async fn submit(client: &Client, requestor: &str) -> Result<RequestId, BusError> {
    client
        .submit(&submission(vec!["small".into()], requestor))
        .await
}

async fn record(client: &Client, id: &RequestId) -> NodeRequest {
    client
        .request(id)
        .await
        .expect("status")
        .expect("the request exists")
}

async fn fulfilled(client: &Client, id: &RequestId) -> NodeRequest {
    let r = tokio::time::timeout(WAIT, client.wait(id, |_| {}))
        .await
        .unwrap_or_else(|_| panic!("request {id} not final within {WAIT:?}"))
        .expect("wait");
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    r
}

/// Two slots; team a fills them and queues eight more; team b asks for one after. When
/// one of a's nodes is given back, b's request takes the slot: b holds none, so it is
/// furthest below its share, though a's backlog came first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quieter_team_is_served_before_a_busier_teams_backlog() {
    let labels = label("small", 2, 600, &[])
        + "tenants:\n  - {name: a, clients: [team-a]}\n  - {name: b, clients: [team-b]}\n";
    let pool = Pool::start(1, 5, &labels, 1).await;
    let (a, b) = (team(&pool, "team-a").await, team(&pool, "team-b").await);

    let mut a_requests = Vec::new();
    for n in 0..10 {
        a_requests.push(submit(&a, &format!("a-{n}")).await.expect("submit"));
    }
    let first = fulfilled(&a, &a_requests[0]).await;
    fulfilled(&a, &a_requests[1]).await;
    let b_request = submit(&b, "b-0").await.expect("submit");
    // b's request is in the queue (and says why it waits) before a slot comes back.
    let why = wait_for_some("b's request says why it waits", WAIT, || async {
        record(&b, &b_request).await.waiting
    })
    .await;
    assert_eq!(why.cause, WaitCause::PoolsFull, "{why:?}");

    a.release(first.nodes.clone()).await.expect("release");
    let served = fulfilled(&b, &b_request).await;
    for id in &a_requests[2..] {
        let r = record(&a, id).await;
        assert_eq!(
            r.state,
            RequestState::Requested,
            "a's backlog waits while b is served: {r:?}"
        );
    }
    let waited = served
        .waiting
        .expect("b waited, and its record says for what");
    assert!(
        waited.held(WaitCause::PoolsFull, served.fulfilled_at.unwrap()) > 0,
        "{waited:?}"
    );
}

/// Team a may hold one slot and have two requests open: its second request waits with
/// cause `tenant_limit` while slots are free, another team is served meanwhile, and a
/// third submit is refused with `over_limit`, naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_at_its_limits_waits_or_is_refused_and_says_which_limit() {
    let labels = label("small", 4, 600, &[])
        + "tenants:\n  - {name: a, clients: [team-a], max-slots: 1, max-waiting: 2}\n";
    let pool = Pool::start(1, 5, &labels, 1).await;
    let (a, other) = (team(&pool, "team-a").await, team(&pool, "team-z").await);

    let first = submit(&a, "a-0").await.expect("submit");
    fulfilled(&a, &first).await;
    let second = submit(&a, "a-1").await.expect("submit");
    let third = submit(&a, "a-2").await.expect("submit");
    let why = wait_for_some("a's second request says why it waits", WAIT, || async {
        record(&a, &second).await.waiting
    })
    .await;
    assert_eq!(why.cause, WaitCause::TenantLimit, "{why:?}");
    let status = record(&a, &second).await.status;
    assert!(status.contains("max-slots of 1"), "{status}");

    let refused = submit(&a, "a-3").await.expect_err("over max-waiting");
    match refused {
        BusError::Api(ApiError {
            code: ErrorCode::OverLimit,
            message,
        }) => assert!(message.contains("max-waiting"), "{message}"),
        other => panic!("expected over_limit, got {other:?}"),
    }

    let z = submit(&other, "z-0").await.expect("another team submits");
    fulfilled(&other, &z).await;
    assert_eq!(record(&a, &second).await.state, RequestState::Requested);
    assert_eq!(record(&a, &third).await.state, RequestState::Requested);
}
