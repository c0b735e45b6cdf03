//! Node leases for requestors: a request kept alive by its client holds its nodes, one
//! whose client stops renewing (it died) has them reclaimed with the reason, and a
//! label's `max-hold-time` reclaims a node whatever the client does.

use slotpool_protocol::api::{ErrorCode, MIN_KEEP_ALIVE_SECS};
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::submission;
use slotpool_protocol::connect::BusError;
use slotpool_protocol::model::{NodeRequest, RequestState};
use slotpool_protocol::RequestId;
use slotpool_tests::{bin_path, label, wait_for, wait_for_some, ChildGuard, Pool};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

async fn submit_kept_alive(pool: &Pool, labels: &[&str], secs: u64) -> RequestId {
    let mut sub = submission(labels.iter().map(|l| l.to_string()).collect(), "test");
    sub.keep_alive_secs = Some(secs);
    pool.client.submit(&sub).await.expect("submit")
}

/// Waits until request `id` is reclaimed, and returns it.
async fn reclaimed(pool: &Pool, id: &RequestId) -> NodeRequest {
    wait_for_some(format!("request {id} reclaimed"), LONG, || async {
        pool.client
            .request(id)
            .await
            .ok()
            .flatten()
            .filter(|r| r.state == RequestState::Reclaimed)
    })
    .await
}

/// The slot is free again: no node is held, and a new request gets one at once.
async fn assert_slot_free_again(pool: &Pool) {
    wait_for("every node released", LONG, || async {
        pool.nodes().await.is_empty()
    })
    .await;
    pool.fulfilled(&pool.submit(&["small"]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_request_holds_its_nodes_past_several_keep_alive_periods() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &[]), 1).await;
    let mut sub = submission(vec!["small".into()], "test");
    sub.keep_alive_secs = Some(MIN_KEEP_ALIVE_SECS - 1);
    match pool.client.submit(&sub).await {
        Err(BusError::Api(e)) if e.code == ErrorCode::BadRequest => {
            assert!(e.message.contains("keep_alive_secs must be"), "{e:?}")
        }
        other => panic!("a keep-alive below the minimum accepted: {other:?}"),
    }

    let id = submit_kept_alive(&pool, &["small"], 2).await;
    let held = pool.fulfilled(&id).await;
    // Renewed every 300 ms for four periods of 2 s.
    let until = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < until {
        let kept = pool.client.keep_alive(&id).await.unwrap_or_else(|err| {
            panic!("renewal refused: {err}\n{}", pool.logs());
        });
        assert_eq!(kept.state, RequestState::Fulfilled);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let r = pool.client.request(&id).await.unwrap().unwrap();
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}\n{}", pool.logs());
    assert_eq!(pool.node(&held.nodes[0]).await.id, held.nodes[0]);

    // Released by its client: the keep-alive is over.
    pool.release_and_wait(&held.nodes).await;
    let err = wait_for_some("keepalive refused", LONG, || async {
        match pool.client.keep_alive(&id).await {
            Err(BusError::Api(e)) => Some(e),
            _ => None,
        }
    })
    .await;
    assert_eq!(err.code, ErrorCode::Ended, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_not_renewed_has_its_nodes_reclaimed_with_the_reason() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &[]), 1).await;
    let id = submit_kept_alive(&pool, &["small"], 2).await;
    pool.fulfilled(&id).await;
    // Its client "died": no renewal.
    let r = reclaimed(&pool, &id).await;
    assert_eq!(
        r.failure.as_deref(),
        Some("keep-alive lapsed: not renewed within 2s"),
        "{r:?}"
    );
    assert_eq!(
        r.status,
        "reclaimed: keep-alive lapsed: not renewed within 2s"
    );
    match pool.client.keep_alive(&id).await {
        Err(BusError::Api(e)) if e.code == ErrorCode::Ended => {
            assert!(e.message.contains("keep-alive lapsed"), "{e:?}")
        }
        other => panic!("a late renewal of a reclaimed request: {other:?}"),
    }
    assert_slot_free_again(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_labels_max_hold_time_reclaims_a_held_node() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &["max-hold-time: 2"]), 1).await;
    let id = pool.submit(&["small"]).await;
    let held = pool.fulfilled(&id).await;
    assert!(held.hold_until.is_some(), "{held:?}");
    let r = reclaimed(&pool, &id).await;
    assert_eq!(
        r.failure.as_deref(),
        Some("max-hold-time reached: held 2s since fulfilled"),
        "{r:?}"
    );
    assert_slot_free_again(&pool).await;
}

/// The state of the one request of client `ci`, read from KV.
async fn state_of_ci_request(pool: &Pool) -> Option<NodeRequest> {
    pool.client
        .list_requests()
        .await
        .ok()?
        .into_iter()
        .find(|r| r.client.as_ref().is_some_and(|c| c.as_str() == "ci"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_keeps_its_nodes_while_it_runs_and_they_are_reclaimed_once_it_is_killed() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &[]), 1).await;
    let mut cmd = std::process::Command::new(bin_path("slotpool"));
    cmd.args(pool.nats.args_as(Role::Client, "ci"))
        .args(["request", "--label", "small", "--keep-alive", "2"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut cli = ChildGuard::spawn("slotpool request --keep-alive", cmd).unwrap();
    let held = wait_for_some("the CLI's request fulfilled", LONG, || async {
        state_of_ci_request(&pool)
            .await
            .filter(|r| r.state == RequestState::Fulfilled)
    })
    .await;
    // Three periods later it still holds its node.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let r = state_of_ci_request(&pool).await.unwrap();
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}\n{}", pool.logs());
    assert!(cli.try_wait().is_none(), "the CLI exited");
    assert_eq!(pool.node(&held.nodes[0]).await.id, held.nodes[0]);

    cli.kill();
    let r = wait_for_some("the killed CLI's request reclaimed", LONG, || async {
        state_of_ci_request(&pool)
            .await
            .filter(|r| r.state == RequestState::Reclaimed)
    })
    .await;
    assert_eq!(
        r.failure.as_deref(),
        Some("keep-alive lapsed: not renewed within 2s")
    );
    assert_slot_free_again(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_request_whose_launcher_died_is_reclaimed_by_another() {
    let mut pool = Pool::start(1, 2, &label("small", 1, 30, &[]), 1).await;
    let id = submit_kept_alive(&pool, &["small"], 2).await;
    let held = pool.fulfilled(&id).await;
    pool.kill_launcher(0);
    pool.spawn_launcher();
    let r = reclaimed(&pool, &id).await;
    assert_eq!(
        r.failure.as_deref(),
        Some("keep-alive lapsed: not renewed within 2s"),
        "{r:?}"
    );
    assert_ne!(
        r.owner, held.owner,
        "reclaimed by the launcher that took it over"
    );
    assert_slot_free_again(&pool).await;
}
