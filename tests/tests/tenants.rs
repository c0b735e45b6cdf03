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

/// One team's job: submits, waits for its node, holds it for `hold`, releases it.
/// Returns how long it waited for its node.
async fn job(client: Client, requestor: String, hold: Duration) -> Duration {
    let started = tokio::time::Instant::now();
    let r = client
        .submit_and_wait(&submission(vec!["small".into()], requestor))
        .await
        .expect("submit and wait");
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    let waited = started.elapsed();
    tokio::time::sleep(hold).await;
    client.release(r.nodes).await.expect("release");
    waited
}

fn p95(mut waits: Vec<Duration>) -> Duration {
    waits.sort();
    let rank = ((waits.len() as f64 * 0.95).ceil() as usize).clamp(1, waits.len());
    waits[rank - 1]
}

/// How long a quiet team's job may wait while another team floods: a few slot turns
/// (a job holds its node 1 s), far below the flood's backlog.
const QUIET_BOUND: Duration = Duration::from_secs(5);

/// Two launchers, eight slots, three teams of equal weight. Team a floods 160 jobs at
/// once (a backlog of about 20 s of the pool); teams b and c each start a job every
/// 500 ms for 10 s. Each team's p95 wait is printed; b's and c's stay within
/// [`QUIET_BOUND`] (first come, first served, they would wait behind the whole flood).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_teams_wait_little_while_another_floods_two_launchers() {
    let labels = label("small", 4, 600, &["min-ready: 8"])
        + "tenants:\n  - {name: a, clients: [team-a]}\n  - {name: b, clients: [team-b]}\n  \
           - {name: c, clients: [team-c]}\n";
    let pool = Pool::start(2, 5, &labels, 2).await;
    let (a, b, c) = (
        team(&pool, "team-a").await,
        team(&pool, "team-b").await,
        team(&pool, "team-c").await,
    );
    let hold = Duration::from_secs(1);
    // The eight slots ready first, so the figures are the queue's, not the boot's.
    wait_for_some("eight free slots", WAIT, || async {
        let free = pool
            .backing()
            .await
            .iter()
            .filter(|b| b.state == slotpool_protocol::model::BackingState::Ready)
            .map(|b| b.slots)
            .sum::<u32>();
        (free >= 8).then_some(())
    })
    .await;

    let flood: Vec<_> = (0..160)
        .map(|n| tokio::spawn(job(a.clone(), format!("a-{n}"), hold)))
        .collect();
    let mut quiet = Vec::new();
    for n in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        quiet.push(("b", tokio::spawn(job(b.clone(), format!("b-{n}"), hold))));
        quiet.push(("c", tokio::spawn(job(c.clone(), format!("c-{n}"), hold))));
    }
    let (mut wb, mut wc) = (Vec::new(), Vec::new());
    for (team, handle) in quiet {
        let waited = handle.await.expect("a quiet job");
        if team == "b" {
            wb.push(waited);
        } else {
            wc.push(waited);
        }
    }
    let mut wa = Vec::new();
    for handle in flood {
        wa.push(handle.await.expect("a flood job"));
    }
    let (pa, pb, pc) = (p95(wa), p95(wb), p95(wc));
    eprintln!(
        "p95 wait over two launchers: flooding team a {:.2} s (160 jobs), quiet teams b \
         {:.2} s and c {:.2} s (20 jobs each)",
        pa.as_secs_f64(),
        pb.as_secs_f64(),
        pc.as_secs_f64()
    );
    assert!(
        pb <= QUIET_BOUND && pc <= QUIET_BOUND,
        "quiet teams waited {pb:?} and {pc:?} (bound {QUIET_BOUND:?}); the flood {pa:?}"
    );
}
