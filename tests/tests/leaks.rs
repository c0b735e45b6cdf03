//! The leak sweep end to end: an agent the local provider runs but no backing record
//! owns is deleted by the launcher, and the deletion is in the event log with reason
//! `leak`, while the backing node serving a request is left alone.

use slotpool_launcher::provider::local::LocalProvider;
use slotpool_launcher::provider::{LaunchSpec, Provider};
use slotpool_protocol::auth::{Credentials, Role};
use slotpool_protocol::model::{BackingState, RequestState, EVENT_REASON_LEAK};
use slotpool_protocol::BackingId;
use slotpool_tests::{bin_path, label, wait_for, Pool, AGENT_ARGS};
use std::time::Duration;

const SOON: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_no_backing_record_owns_is_deleted_as_a_leak() {
    // Provider keys may follow its pools: the sweep runs every second with a 2 s grace.
    let labels = format!(
        "{}    leak-sweep-interval: 1\n    leak-grace: 2\n",
        label("tiny", 2, 600, &[])
    );
    let pool = Pool::start(2, 3, &labels, 1).await;
    let id = pool.submit(&["tiny"]).await;
    let request = pool.wait_final(&id, SOON).await;
    assert_eq!(request.state, RequestState::Fulfilled, "{request:?}");
    let legit = pool.backing_in(&[BackingState::Ready]).await;
    assert_eq!(legit.len(), 1, "{legit:?}");
    let legit = legit[0].clone();

    // An agent of the same provider and work dir that no backing record owns, as a launch
    // interrupted before its record was written leaves behind.
    let local = LocalProvider::new(
        "local",
        bin_path("slotpool-agent"),
        AGENT_ARGS.iter().map(|a| a.to_string()).collect(),
        pool.work_dir(),
    );
    let leaked = BackingId::parse("bn-leaked-by-an-interrupted-launch").unwrap();
    let creds = std::fs::read_to_string(pool.nats.creds(Role::Agent, leaked.as_str())).unwrap();
    local
        .launch(&LaunchSpec {
            backing_id: leaked.clone(),
            secret: "not-known-to-any-launcher".into(),
            provider: "local".into(),
            pool: "main".into(),
            backing_label: "vm".into(),
            slots: 1,
            nats_url: pool.nats.url(),
            credentials: Some(Credentials::from_text(creds)),
            timeout: SOON,
            create_queue: None,
        })
        .await
        .expect("launching the leaked agent");
    let listed = |l: &[slotpool_launcher::provider::ListedInstance], id: &BackingId| {
        l.iter().any(|l| l.backing_id.as_ref() == Some(id))
    };
    assert!(listed(&local.list().await.unwrap(), &leaked));

    wait_for("the leaked agent deleted", SOON, || async {
        !listed(&local.list().await.unwrap(), &leaked)
    })
    .await;
    wait_for("the deletion in the event log", SOON, || async {
        pool.client.list_events().await.unwrap().iter().any(|e| {
            e.reason.as_deref() == Some(EVENT_REASON_LEAK)
                && e.backing_id.as_ref() == Some(&leaked)
                && e.message.contains("no backing record has id")
        })
    })
    .await;
    assert!(
        !pool.agent_dir(leaked.as_str()).exists(),
        "its directory removed"
    );

    // The backing node serving the request is untouched, and no other leak was found.
    assert!(
        listed(&local.list().await.unwrap(), &legit.id),
        "legit agent runs"
    );
    let now = pool.backing_in(&[BackingState::Ready]).await;
    assert_eq!(now.len(), 1, "{now:?}");
    assert_eq!(now[0].id, legit.id);
    assert_eq!(now[0].instance, legit.instance);
    let leaks: Vec<_> = pool
        .client
        .list_events()
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.reason.is_some())
        .collect();
    assert_eq!(leaks.len(), 1, "{leaks:#?}");
    let r = pool.fulfilled(&id).await;
    assert_eq!(r.state, RequestState::Fulfilled);
}
