//! The KV semantics slotpool's "no double booking" rests on, pinned against a real
//! nats-server: conditional create/update/delete, per-key TTL (also over tombstones),
//! watch ordering and listing.

use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::json;
use slotpool_protocol::connect::{check_server_version, Bus, BusError, NatsOptions};
use slotpool_protocol::store::{Change, KvError, Store};
use slotpool_tests::{next_within, wait_for, NatsServer};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;

/// Generous bound for one watch event on a loaded 2-core machine.
const EVENT: Duration = Duration::from_secs(10);
/// The shortest per-key TTL the server accepts.
const TTL: Duration = Duration::from_secs(1);
/// Expiry takes TTL plus up to ~0.25 s; leave room for a loaded machine.
const EXPIRY: Duration = Duration::from_secs(15);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Rec {
    n: u32,
}

async fn next_change<S>(watch: &mut S, what: &str) -> Change
where
    S: Stream<Item = Result<Change, KvError>> + Unpin,
{
    next_within(watch, EVENT, what)
        .await
        .unwrap_or_else(|err| panic!("watch failed while waiting for {what}: {err}"))
}

fn assert_conflict<T: std::fmt::Debug>(result: Result<T, KvError>, what: &str) {
    match result {
        Err(err) if err.is_conflict() => {}
        other => panic!("{what}: expected a conflict, got {other:?}"),
    }
}

/// Watches `key` and waits for its removal, after checking the watch starts at `revision`.
async fn expect_expiry(store: &Store, key: &str, revision: u64) {
    let mut watch = Box::pin(store.watch_keys(key).await.unwrap());
    match next_change(&mut watch, "the current value").await {
        Change::Put {
            key: k,
            revision: r,
            ..
        } => {
            assert_eq!((k.as_str(), r), (key, revision));
        }
        // It may already have expired on a slow machine.
        Change::Removed { key: k, .. } => {
            assert_eq!(k, key);
            return;
        }
        other => panic!("expected the current value of {key}, got {other:?}"),
    }
    assert!(matches!(
        next_change(&mut watch, "synced").await,
        Change::Synced
    ));
    let change = next_within(&mut watch, EXPIRY, format!("{key} to expire"))
        .await
        .unwrap();
    match change {
        Change::Removed {
            key: k,
            revision: r,
        } => {
            assert_eq!(k, key);
            assert!(r > revision, "expiry marker revision {r} <= {revision}");
        }
        other => panic!("expected {key} to be removed by its TTL, got {other:?}"),
    }
}

#[tokio::test]
async fn create_succeeds_once_then_conflicts() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let rev = create_slot(&bus, 1).await;
    assert!(rev > 0);
    assert_conflict(
        bus.slots.create("bn-a.0", &Rec { n: 2 }, None).await,
        "second create",
    );
    let got = bus.slots.get::<Rec>("bn-a.0").await.unwrap().unwrap();
    assert_eq!((got.revision, got.value), (rev, Rec { n: 1 }));
    assert_eq!(bus.slots.get::<Rec>("bn-a.1").await.unwrap(), None);
}

#[tokio::test]
async fn create_works_again_after_delete() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let rev = create_slot(&bus, 1).await;
    bus.slots.delete("bn-a.0", rev).await.unwrap();
    assert_eq!(bus.slots.get::<Rec>("bn-a.0").await.unwrap(), None);
    let rev2 = create_slot(&bus, 2).await;
    assert!(rev2 > rev);
    assert_conflict(
        bus.slots.create("bn-a.0", &Rec { n: 3 }, None).await,
        "create over a live value that replaced a tombstone",
    );
    let got = bus.slots.get::<Rec>("bn-a.0").await.unwrap().unwrap();
    assert_eq!((got.revision, got.value), (rev2, Rec { n: 2 }));
}

/// async-nats' own `create_with_ttl` silently drops the TTL over a tombstone; ours must not,
/// or a re-acquired lease would never expire.
#[tokio::test]
async fn create_over_a_tombstone_keeps_the_ttl() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let key = "request.req-1";
    let rev = bus.leases.create(key, &Rec { n: 1 }, None).await.unwrap();
    bus.leases.delete(key, rev).await.unwrap();
    let rev2 = take_lease(&bus, key, 2).await;
    expect_expiry(&bus.leases, key, rev2).await;
    assert_eq!(bus.leases.get::<Rec>(key).await.unwrap(), None);
}

/// A key removed by its TTL leaves an expiry marker; creating over it must work (a lease is
/// re-acquired after its holder died) and must keep the new TTL too.
#[tokio::test]
async fn ttl_expiry_is_a_removal_and_the_key_can_be_created_again() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let key = "backing.local.small.0";
    let rev = take_lease(&bus, key, 1).await;
    expect_expiry(&bus.leases, key, rev).await;
    assert_eq!(bus.leases.get::<Rec>(key).await.unwrap(), None);

    let rev2 = take_lease(&bus, key, 2).await;
    assert!(rev2 > rev);
    assert_conflict(
        bus.leases.create(key, &Rec { n: 3 }, Some(TTL)).await,
        "create over a live re-acquired lease",
    );
    expect_expiry(&bus.leases, key, rev2).await;
}

/// A read from the bucket's leader sees what a direct get sees on one server: the last
/// value with its revision, and nothing for a key never written, deleted or expired
/// (a tombstone or an expiry marker is no value).
#[tokio::test]
async fn a_read_from_the_leader_sees_values_and_no_markers() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let leases = &bus.leases;
    assert_eq!(
        leases
            .get_from_leader::<Rec>("launcher.none")
            .await
            .unwrap(),
        None
    );

    let rev = leases
        .create("launcher.a", &Rec { n: 1 }, None)
        .await
        .unwrap();
    let rev2 = leases
        .update("launcher.a", &Rec { n: 2 }, rev, None)
        .await
        .unwrap();
    let read = leases
        .get_from_leader::<Rec>("launcher.a")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((read.revision, read.value), (rev2, Rec { n: 2 }));
    assert_eq!(
        leases
            .get::<Rec>("launcher.a")
            .await
            .unwrap()
            .unwrap()
            .revision,
        rev2
    );

    leases.delete("launcher.a", rev2).await.unwrap();
    assert_eq!(
        leases.get_from_leader::<Rec>("launcher.a").await.unwrap(),
        None
    );

    let rev = take_lease(&bus, "launcher.b", 3).await;
    expect_expiry(leases, "launcher.b", rev).await;
    assert_eq!(
        leases.get_from_leader::<Rec>("launcher.b").await.unwrap(),
        None
    );
}

/// Renewing a lease is an `update` with a TTL: the key must still expire afterwards.
#[tokio::test]
async fn update_with_ttl_keeps_the_key_expiring() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let key = "request.req-2";
    let rev = take_lease(&bus, key, 1).await;
    let rev2 = bus
        .leases
        .update(key, &Rec { n: 2 }, rev, Some(TTL))
        .await
        .unwrap();
    assert!(rev2 > rev);
    expect_expiry(&bus.leases, key, rev2).await;
}

/// Creates the slot key `bn-a.0`; returns its revision.
async fn create_slot(bus: &Bus, n: u32) -> u64 {
    bus.slots.create("bn-a.0", &Rec { n }, None).await.unwrap()
}

/// Creates the lease `key` (with the test TTL); returns its revision.
async fn take_lease(bus: &Bus, key: &str, n: u32) -> u64 {
    bus.leases.create(key, &Rec { n }, Some(TTL)).await.unwrap()
}

/// Creates `key` in the slots bucket and updates it once; returns both revisions.
async fn written_twice(bus: &Bus, key: &str) -> (u64, u64) {
    let rev1 = bus.slots.create(key, &Rec { n: 1 }, None).await.unwrap();
    let rev2 = bus
        .slots
        .update(key, &Rec { n: 2 }, rev1, None)
        .await
        .unwrap();
    (rev1, rev2)
}

#[tokio::test]
async fn update_with_a_stale_revision_conflicts() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let (rev1, rev2) = written_twice(&bus, "bn-a.0").await;
    assert!(rev2 > rev1);
    assert_conflict(
        bus.slots.update("bn-a.0", &Rec { n: 3 }, rev1, None).await,
        "update at a stale revision",
    );
    assert_conflict(
        bus.slots
            .update("bn-a.0", &Rec { n: 3 }, rev2 + 100, None)
            .await,
        "update at a future revision",
    );
    let got = bus.slots.get::<Rec>("bn-a.0").await.unwrap().unwrap();
    assert_eq!((got.revision, got.value), (rev2, Rec { n: 2 }));
    bus.slots
        .update("bn-a.0", &Rec { n: 4 }, rev2, None)
        .await
        .unwrap();
}

#[tokio::test]
async fn delete_with_a_stale_revision_conflicts() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let (rev1, rev2) = written_twice(&bus, "bn-a.0").await;
    assert_conflict(
        bus.slots.delete("bn-a.0", rev1).await,
        "delete at a stale revision",
    );
    assert!(bus.slots.get::<Rec>("bn-a.0").await.unwrap().is_some());
    bus.slots.delete("bn-a.0", rev2).await.unwrap();
    assert_eq!(bus.slots.get::<Rec>("bn-a.0").await.unwrap(), None);
}

/// Races `tasks` creates of `key`, each task on its own connection (as separate launchers
/// would be), and checks that exactly one wins and every loser sees a conflict.
async fn race_creates(
    server: &NatsServer,
    key: &str,
    ttl: Option<Duration>,
    pick: fn(&Bus) -> &Store,
) {
    const TASKS: u32 = 32;
    let barrier = Arc::new(Barrier::new(TASKS as usize));
    let mut handles = Vec::new();
    for n in 0..TASKS {
        let bus = server.bus().await;
        let barrier = barrier.clone();
        let key = key.to_string();
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            (n, pick(&bus).create(&key, &Rec { n }, ttl).await)
        }));
    }
    let mut winners = Vec::new();
    for handle in handles {
        match handle.await.unwrap() {
            (n, Ok(rev)) => winners.push((n, rev)),
            (_, Err(err)) if err.is_conflict() => {}
            (n, Err(err)) => panic!("task {n}: expected success or conflict, got {err}"),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "winners of the race for {key}: {winners:?}"
    );
    let (n, rev) = winners[0];
    let bus = server.bus().await;
    let got = pick(&bus).get::<Rec>(key).await.unwrap().unwrap();
    assert_eq!((got.revision, got.value), (rev, Rec { n }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_have_exactly_one_winner() {
    let server = NatsServer::start().await;
    race_creates(&server, "bn-a.0", None, |bus| &bus.slots).await;
}

/// Creating over a tombstone takes two steps (read the tombstone's revision, then write at
/// it); the race must still have exactly one winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_over_a_tombstone_have_exactly_one_winner() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let rev = create_slot(&bus, 99).await;
    bus.slots.delete("bn-a.0", rev).await.unwrap();
    race_creates(&server, "bn-a.0", None, |bus| &bus.slots).await;

    let rev = bus
        .leases
        .create("request.req-1", &Rec { n: 99 }, None)
        .await
        .unwrap();
    bus.leases.delete("request.req-1", rev).await.unwrap();
    race_creates(
        &server,
        "request.req-1",
        Some(Duration::from_secs(60)),
        |bus| &bus.leases,
    )
    .await;
}

#[tokio::test]
async fn watch_on_an_empty_bucket_is_synced_at_once() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let mut watch = Box::pin(bus.backing.watch().await.unwrap());
    assert!(matches!(
        next_change(&mut watch, "synced").await,
        Change::Synced
    ));
    bus.backing
        .create("local.small.0", &Rec { n: 1 }, None)
        .await
        .unwrap();
    match next_change(&mut watch, "the first live value").await {
        Change::Put { key, value, .. } => {
            assert_eq!(key, "local.small.0");
            assert_eq!(serde_json::from_slice::<Rec>(&value).unwrap(), Rec { n: 1 });
        }
        other => panic!("expected a put, got {other:?}"),
    }
}

/// Current values (and possibly removals of keys deleted earlier), then `Synced`, then live
/// changes in order.
#[tokio::test]
async fn watch_delivers_current_values_then_synced_then_changes() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let store = &bus.slots;
    let rev_a = store.create("bn-a.0", &Rec { n: 1 }, None).await.unwrap();
    let rev_b = store.create("bn-a.1", &Rec { n: 2 }, None).await.unwrap();
    let rev_x = store.create("bn-x.0", &Rec { n: 3 }, None).await.unwrap();
    store.delete("bn-x.0", rev_x).await.unwrap();

    let mut watch = Box::pin(store.watch().await.unwrap());
    let mut current = BTreeSet::new();
    loop {
        match next_change(&mut watch, "the current values").await {
            Change::Put {
                key,
                revision,
                value,
            } => {
                let rec: Rec = serde_json::from_slice(&value).unwrap();
                current.insert((key, revision, rec.n));
            }
            Change::Removed { key, .. } => assert_eq!(key, "bn-x.0", "only bn-x.0 was deleted"),
            Change::Synced => break,
        }
    }
    let expected = BTreeSet::from([
        ("bn-a.0".to_string(), rev_a, 1),
        ("bn-a.1".to_string(), rev_b, 2),
    ]);
    assert_eq!(current, expected);

    let rev_c = store.create("bn-a.2", &Rec { n: 4 }, None).await.unwrap();
    let rev_a2 = store
        .update("bn-a.0", &Rec { n: 5 }, rev_a, None)
        .await
        .unwrap();
    store.delete("bn-a.1", rev_b).await.unwrap();
    let mut live = Vec::new();
    for what in ["the create", "the update", "the delete"] {
        live.push(match next_change(&mut watch, what).await {
            Change::Put {
                key,
                revision,
                value,
            } => {
                let rec: Rec = serde_json::from_slice(&value).unwrap();
                (key, revision, Some(rec.n))
            }
            Change::Removed { key, revision } => (key, revision, None),
            Change::Synced => panic!("a second synced while waiting for {what}"),
        });
    }
    assert_eq!(live[0], ("bn-a.2".to_string(), rev_c, Some(4)));
    assert_eq!(live[1], ("bn-a.0".to_string(), rev_a2, Some(5)));
    assert_eq!(live[2].0, "bn-a.1");
    assert_eq!(live[2].2, None);
    assert!(live[2].1 > rev_a2);
}

#[tokio::test]
async fn watch_keys_sees_only_matching_keys() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    bus.slots
        .create("bn-a.0", &Rec { n: 1 }, None)
        .await
        .unwrap();
    bus.slots
        .create("bn-b.0", &Rec { n: 2 }, None)
        .await
        .unwrap();
    let mut watch = Box::pin(bus.slots.watch_keys("bn-b.*").await.unwrap());
    match next_change(&mut watch, "bn-b.0").await {
        Change::Put { key, .. } => assert_eq!(key, "bn-b.0"),
        other => panic!("expected bn-b.0, got {other:?}"),
    }
    assert!(matches!(
        next_change(&mut watch, "synced").await,
        Change::Synced
    ));
    bus.slots
        .create("bn-a.1", &Rec { n: 3 }, None)
        .await
        .unwrap();
    bus.slots
        .create("bn-b.1", &Rec { n: 4 }, None)
        .await
        .unwrap();
    match next_change(&mut watch, "bn-b.1").await {
        Change::Put { key, .. } => assert_eq!(key, "bn-b.1"),
        other => panic!("expected bn-b.1 (bn-a.1 is filtered out), got {other:?}"),
    }
}

#[tokio::test]
async fn list_returns_live_values_and_bad_records_in_place() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    assert!(bus.slots.list::<Rec>().await.unwrap().is_empty());

    bus.slots
        .create("bn-a.0", &Rec { n: 1 }, None)
        .await
        .unwrap();
    let rev = bus
        .slots
        .create("bn-a.1", &Rec { n: 2 }, None)
        .await
        .unwrap();
    bus.slots
        .create("bn-a.2", &Rec { n: 3 }, None)
        .await
        .unwrap();
    bus.slots.delete("bn-a.1", rev).await.unwrap();
    bus.slots
        .create("bn-a.3", &json!("not a record"), None)
        .await
        .unwrap();

    let listed = bus.slots.list::<Rec>().await.unwrap();
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for item in listed {
        match item {
            Ok(v) => good.push((v.key, v.value.n)),
            Err(KvError::Decode { key, .. }) => bad.push(key),
            Err(err) => panic!("unexpected error in list: {err}"),
        }
    }
    good.sort();
    assert_eq!(good, [("bn-a.0".to_string(), 1), ("bn-a.2".to_string(), 3)]);
    assert_eq!(bad, ["bn-a.3"]);
}

#[tokio::test]
async fn old_servers_are_rejected() {
    let err = check_server_version("2.9.10").unwrap_err();
    assert!(
        matches!(err, BusError::ServerTooOld { ref found, needed: (2, 11, 0) } if found == "2.9.10"),
        "{err:?}"
    );
    assert!(check_server_version("2.10.99").is_err());
    assert!(check_server_version("2.11.0").is_ok());
}

#[tokio::test]
async fn connect_to_a_closed_port_fails_quickly_and_clearly() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("nats://127.0.0.1:{port}");
    let opts = NatsOptions {
        url: url.clone(),
        ..Default::default()
    };
    let start = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), Bus::connect(&opts))
        .await
        .expect("Bus::connect to a closed port hung");
    match result {
        Err(BusError::Connect { url: u, message }) => {
            assert_eq!(u, url);
            assert!(!message.is_empty());
        }
        Err(other) => panic!("expected BusError::Connect, got {other}"),
        Ok(_) => panic!("connected to a closed port {port}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "connect took {:?} to fail",
        start.elapsed()
    );
}

/// Keys `bn-a.0` to `bn-a.<KEYS - 1>` of the slots bucket, rewritten one after another
/// until the returned flag is set; the task returns how many writes it made.
async fn rewrite_keys_until_stopped(
    bus: &Bus,
) -> (
    Arc<std::sync::atomic::AtomicBool>,
    tokio::task::JoinHandle<u64>,
) {
    let mut revisions = Vec::new();
    for n in 0..KEYS {
        let key = format!("bn-a.{n}");
        revisions.push(bus.slots.create(&key, &Rec { n }, None).await.unwrap());
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (bus, stop) = (bus.clone(), stop.clone());
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let n = (round % u64::from(KEYS)) as u32;
                let key = format!("bn-a.{n}");
                let rev = revisions[n as usize];
                revisions[n as usize] =
                    bus.slots.update(&key, &Rec { n }, rev, None).await.unwrap();
                round += 1;
            }
            round
        })
    };
    (stop, writer)
}

/// How many keys [`rewrite_keys_until_stopped`] rewrites.
const KEYS: u32 = 40;

/// A listing taken while every key is being rewritten still has every key: a key whose
/// value the listing was about to deliver, and which was replaced meanwhile, is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_has_every_key_while_the_keys_are_rewritten() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let (stop, writer) = rewrite_keys_until_stopped(&bus).await;
    for attempt in 0..150 {
        let listed = bus.slots.list::<Rec>().await.unwrap();
        let keys: BTreeSet<String> = listed.into_iter().map(|r| r.unwrap().key).collect();
        assert_eq!(
            keys.len(),
            KEYS as usize,
            "listing {attempt} missed a key: {keys:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(writer.await.unwrap() > 0);
}

/// The same for a watch: at its `Synced`, a whole-bucket watch has delivered every key,
/// so a mirror built from it (the launcher's, the console's) lacks none at that point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_has_every_key_at_its_sync_while_the_keys_are_rewritten() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    let (stop, writer) = rewrite_keys_until_stopped(&bus).await;
    for attempt in 0..150 {
        let mut watch = Box::pin(bus.slots.watch().await.unwrap());
        let mut keys = BTreeSet::new();
        loop {
            match next_change(&mut watch, "the initial values").await {
                Change::Put { key, .. } => {
                    keys.insert(key);
                }
                Change::Removed { key, .. } => {
                    keys.remove(&key);
                }
                Change::Synced => break,
            }
        }
        assert_eq!(
            keys.len(),
            KEYS as usize,
            "watch {attempt} synced without a key: {keys:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(writer.await.unwrap() > 0);
}

/// A listing of a bucket whose last write is gone (a key expired, and then its expiry
/// marker) ends with what is there, without waiting for that write: the watch under it
/// reads on past the server's end-of-initial-values marker to the bucket's last
/// revision, and must see that nothing more will come.
#[tokio::test]
async fn a_listing_whose_last_write_expired_has_the_keys_left() {
    let server = NatsServer::start().await;
    let bus = server.bus().await;
    bus.leases
        .create("launcher.kept", &Rec { n: 7 }, None)
        .await
        .unwrap();
    let rev = take_lease(&bus, "request.req-1", 1).await;
    expect_expiry(&bus.leases, "request.req-1", rev).await;
    // The expiry marker has a TTL of its own.
    wait_for("the expiry marker to expire", EXPIRY, || async {
        !bus.leases.has_entry("request.req-1").await.unwrap()
    })
    .await;
    // A listing that waited for the gone write would fail ("did not reach revision").
    let listed: Vec<String> = bus
        .leases
        .list::<Rec>()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().key)
        .collect();
    assert_eq!(listed, ["launcher.kept"]);
}

/// How long a JetStream write waits for its acknowledgement (`Bus` sets it).
const JETSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_timed_out_but_landed_counts_as_done() {
    let mut nats = NatsServer::start().await;
    let bus = nats.bus().await;
    let store = bus.requests.clone();
    let rev = store.create("late", &Rec { n: 1 }, None).await.unwrap();
    // The server freezes with the update on its way: the update times out, and only then
    // does the server take it, and the read that follows.
    nats.signal(libc::SIGSTOP);
    let write = tokio::spawn(async move { store.update("late", &Rec { n: 2 }, rev, None).await });
    tokio::time::sleep(JETSTREAM_TIMEOUT + Duration::from_millis(1500)).await;
    nats.signal(libc::SIGCONT);
    let written = write.await.expect("the update task");
    let now = bus.requests.get::<Rec>("late").await.unwrap().unwrap();
    assert_eq!(now.value, Rec { n: 2 }, "the update landed");
    assert!(
        matches!(written, Ok(r) if r == now.revision),
        "an update that landed after its timeout is reported as done at revision {}, \
         got {written:?}",
        now.revision
    );
}

/// The event log is a log: once full (64 MiB) it drops its oldest entries and goes on
/// taking new ones (`discard: old`, set by a launcher's connection), as docs/protocol.md
/// §6 says. A KV bucket is created refusing new writes when full instead, so without the
/// launcher's setting the writes past the limit fail here.
#[tokio::test]
async fn the_event_log_drops_its_oldest_entries_when_full() {
    let nats = NatsServer::start().await;
    let bus = Bus::connect_replicated(&nats.options(), 1)
        .await
        .expect("connecting as a launcher");
    assert!(
        bus.events.discards_old(),
        "the events bucket refuses new writes when full"
    );
    // 16 KiB values (the bucket's largest) past its 64 MiB.
    let spec = slotpool_protocol::layout::EVENTS;
    let value = json!({"pad": "x".repeat(spec.max_value_size as usize - 64)});
    let writes = (spec.max_bytes / i64::from(spec.max_value_size)) as usize + 200;
    for n in 0..writes {
        bus.events
            .put(&format!("evt-{n:06}"), &value, None)
            .await
            .unwrap_or_else(|err| panic!("write {n} of {writes} into the event log: {err}"));
    }
    assert!(
        bus.events.get_bytes("evt-000000").await.unwrap().is_none(),
        "the oldest entry is still there"
    );
    let last = format!("evt-{:06}", writes - 1);
    assert!(bus.events.get_bytes(&last).await.unwrap().is_some());
}
