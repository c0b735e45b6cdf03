//! Why a request waits (docs/protocol.md §6.1, `waiting`), end to end: each cause
//! injected into a real launcher with real agents (a tenant at its `max-slots`, a
//! provider out of capacity, a slow boot, a provider's create limits, a request of a
//! better priority) is named in the request's record, and the times its causes held it
//! add up to its wait.

use slotpool_protocol::auth::Role;
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::model::{NodeRequest, RequestState, WaitCause, Waiting};
use slotpool_protocol::RequestId;
use slotpool_tests::exec_provider::{exec_config, exec_config_with, switch_on, KillUnder};
use slotpool_tests::{label, wait_for_some, Pool};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// The most of a wait no cause accounts for: before the first cause is written (a wait
/// is written once it lasts 250 ms) and the write's own time.
const UNACCOUNTED_MS: u64 = 1_500;

async fn submit(client: &Client, labels: &[&str], priority: Option<i32>) -> RequestId {
    let mut sub = submission(labels.iter().map(|l| l.to_string()).collect(), "causes");
    sub.priority = priority;
    client.submit(&sub).await.expect("submit")
}

async fn record(client: &Client, id: &RequestId) -> NodeRequest {
    client
        .request(id)
        .await
        .expect("status")
        .expect("the request exists")
}

/// Waits until request `id` says it waits for `cause`.
async fn waits_for(client: &Client, id: &RequestId, cause: WaitCause) -> Waiting {
    wait_for_some(
        &format!("{id} to wait for {}", cause.name()),
        WAIT,
        || async {
            record(client, id)
                .await
                .waiting
                .filter(|w| w.cause == cause)
        },
    )
    .await
}

async fn fulfilled(client: &Client, id: &RequestId) -> NodeRequest {
    let r = tokio::time::timeout(WAIT, client.wait(id, |_| {}))
        .await
        .unwrap_or_else(|_| panic!("request {id} not final within {WAIT:?}"))
        .expect("wait");
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    r
}

/// The causes of fulfilled request `r` with their milliseconds, checked to add up to
/// its wait (submission to fulfilment) but for [`UNACCOUNTED_MS`].
fn adds_up(r: &NodeRequest) -> Vec<(WaitCause, u64)> {
    let end = r.fulfilled_at.expect("fulfilled");
    let waiting = r.waiting.as_ref().expect("it waited, and says why");
    let causes = waiting.breakdown(end);
    let sum: u64 = causes.iter().map(|(_, ms)| ms).sum();
    let wait = end - r.created_at;
    println!(
        "{}: waited {wait} ms: {} (sum {sum} ms)",
        r.id,
        waiting.summary(end)
    );
    assert!(
        sum <= wait && wait - sum <= UNACCOUNTED_MS,
        "the causes ({causes:?}, {sum} ms) against the wait ({wait} ms)"
    );
    causes
}

fn held(causes: &[(WaitCause, u64)], cause: WaitCause) -> u64 {
    causes
        .iter()
        .find(|(c, _)| *c == cause)
        .map_or(0, |(_, ms)| *ms)
}

/// A pool of the test exec provider, its machines killed when the test ends whatever
/// happens (declared after the pool, so dropped first).
async fn exec_pool(
    config: impl FnOnce(&std::path::Path) -> String,
) -> (Pool, KillUnder, std::path::PathBuf) {
    let pool = Pool::start_configured(config, 1, &[]).await;
    let state = pool.work_dir();
    (pool, KillUnder(state.clone()), state)
}

/// The provider is out of capacity, then capacity comes back on a machine that boots
/// slowly: `out_of_capacity`, then `booting`, each for about as long as it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_capacity_then_a_slow_boot() {
    let (pool, _machines, state) = exec_pool(|state| {
        switch_on(state, "out-of-capacity", "");
        exec_config(state, 1)
    })
    .await;
    let client = &pool.client;
    let id = submit(client, &["small"], None).await;
    waits_for(client, &id, WaitCause::OutOfCapacity).await;
    let oc_seen = std::time::Instant::now();
    switch_on(&state, "slow-boot", "3");
    std::fs::remove_file(state.join("out-of-capacity")).unwrap();
    let before_boot = oc_seen.elapsed();
    waits_for(client, &id, WaitCause::Booting).await;
    let r = fulfilled(client, &id).await;
    let causes = adds_up(&r);
    assert!(
        held(&causes, WaitCause::OutOfCapacity) >= before_boot.as_millis() as u64,
        "{causes:?}"
    );
    assert!(
        held(&causes, WaitCause::Booting) >= 2_500,
        "the agent started 3 s late: {causes:?}"
    );
}

/// One launch per 10 s (`max-creates-per-second: 0.1`): the second backing node waits
/// for its turn, and the request it is for says `rate_limited`, then `booting`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_held_by_the_providers_create_limits() {
    let (pool, _machines, _state) =
        exec_pool(|state| exec_config_with(state, 1, "max-creates-per-second: 0.1")).await;
    let client = &pool.client;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(submit(client, &["small"], None).await);
    }
    // Two slots per backing node: the first two, in the queue's order, take the first
    // node; the third waits for the second, launched 10 s after the first.
    let third = ids[2].clone();
    waits_for(client, &third, WaitCause::RateLimited).await;
    let r = fulfilled(client, &third).await;
    let causes = adds_up(&r);
    assert!(
        held(&causes, WaitCause::RateLimited) >= 3_000,
        "the second launch waits most of 10 s: {causes:?}"
    );
    let status = record(client, &third).await;
    assert!(status.waiting.is_some(), "kept once it ended: {status:?}");
}

/// Two slots, both held; a request at a worse priority waits, then one at a better
/// priority. One slot comes back: the better one takes it though it came later, and
/// the worse one goes on waiting for the pools at `max-servers` until the next slot
/// comes back. (`behind`, free slots that requests served first take, lasts only as
/// long as their claim: the planner's tests name it, `request::plan`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_better_priority_served_first() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let client = &pool.client;
    let first = submit(client, &["small"], None).await;
    let second = submit(client, &["small"], None).await;
    let first = fulfilled(client, &first).await;
    let second = fulfilled(client, &second).await;
    let worse = submit(client, &["small"], Some(500)).await;
    waits_for(client, &worse, WaitCause::PoolsFull).await;
    let better = submit(client, &["small"], Some(50)).await;
    waits_for(client, &better, WaitCause::PoolsFull).await;

    client.release(first.nodes).await.expect("release");
    let better = fulfilled(client, &better).await;
    assert_eq!(
        record(client, &worse).await.state,
        RequestState::Requested,
        "the better priority is served first"
    );
    client.release(second.nodes).await.expect("release");
    let worse = fulfilled(client, &worse).await;
    assert!(worse.fulfilled_at > better.fulfilled_at);
    for r in [&better, &worse] {
        let causes = adds_up(r);
        assert_eq!(causes[0].0, WaitCause::PoolsFull, "{causes:?}");
    }
}

/// A team may hold one slot: its second request waits `tenant_limit` while slots are
/// free, and is served once the first is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_max_slots() {
    let labels =
        label("small", 4, 600, &[]) + "tenants:\n  - {name: a, clients: [team-a], max-slots: 1}\n";
    let pool = Pool::start(1, 5, &labels, 1).await;
    let a = Client::connect(&pool.nats.options_as(Role::Client, "team-a"))
        .await
        .expect("team a connects");
    let first = submit(&a, &["small"], None).await;
    let first = fulfilled(&a, &first).await;
    let second = submit(&a, &["small"], None).await;
    waits_for(&a, &second, WaitCause::TenantLimit).await;
    // The limit holds it for a while: that while is what the record must account for.
    tokio::time::sleep(Duration::from_secs(1)).await;
    a.release(first.nodes).await.expect("release");
    let r = fulfilled(&a, &second).await;
    let causes = adds_up(&r);
    assert_eq!(causes[0].0, WaitCause::TenantLimit, "{causes:?}");
    assert!(held(&causes, WaitCause::TenantLimit) >= 1_000, "{causes:?}");
}
