//! Every call gets an answer, and soon: a subject or bucket the caller's role may not use
//! is refused with "not permitted" as soon as the server says so (not a time-out), an
//! operation the API does not have is answered `unknown_operation` (not "no
//! responders", which means no launcher runs), and an operator's `slotpool list` is as
//! quick as a launcher's.

use bytes::Bytes;
use slotpool_protocol::api::{ErrorCode, Reply};
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_protocol::connect::BusError;
use slotpool_protocol::store::KvError;
use slotpool_tests::{bin_path, label, Pool};
use std::time::{Duration, Instant};

/// How long a refusal may take to reach the caller: well below the 5 s a JetStream
/// call waits and the 10 s an API call waits, which a refusal used to wait out.
const REFUSED_WITHIN: Duration = Duration::from_secs(2);

/// How long a list may take (a list that waited for a refused consumer deletion took
/// 5 s per bucket).
const LISTED_WITHIN: Duration = Duration::from_secs(2);

async fn client_as(pool: &Pool, role: Role, name: &str) -> Client {
    Client::connect(&pool.nats.options_as(role, name))
        .await
        .unwrap_or_else(|err| panic!("connecting as {role} {name}: {err}"))
}

/// Runs `slotpool <args>` as `role` `name` and returns how long it took and its output.
async fn slotpool_as(
    pool: &Pool,
    role: Role,
    name: &str,
    args: &[&str],
) -> (Duration, std::process::Output) {
    let mut all = pool.nats.args_as(role, name);
    all.extend(args.iter().map(|a| a.to_string()));
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let out = std::process::Command::new(bin_path("slotpool"))
            .args(all)
            .env("SLOTPOOL_LOG", "warn")
            .output()
            .expect("running slotpool");
        (started.elapsed(), out)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_subject_is_named_at_once_and_an_unknown_operation_is_answered() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let ci = client_as(&pool, Role::Client, "ci").await;

    // A bucket read a client may not make.
    let started = Instant::now();
    let read = ci.list_backing().await;
    let took = started.elapsed();
    match read {
        Err(BusError::Kv(KvError::NotPermitted {
            ref user,
            ref bucket,
            ref subject,
            ..
        })) => {
            assert_eq!(user, "client ci");
            assert_eq!(bucket, "slotpool_backing");
            assert!(subject.contains("KV_slotpool_backing"), "{subject}");
        }
        other => panic!("a client's read of the backing nodes: {other:?}"),
    }
    let text = read.unwrap_err().to_string();
    assert!(
        text.starts_with("not permitted: client ci may not read"),
        "{text}"
    );
    assert!(took < REFUSED_WITHIN, "the refusal took {took:?}");
    let started = Instant::now();
    let get = ci.bus().requests.get::<serde_json::Value>("req-x").await;
    assert!(
        matches!(get, Err(KvError::NotPermitted { .. })),
        "a client's KV get: {get:?}"
    );
    assert!(started.elapsed() < REFUSED_WITHIN);

    // A subject of another client's API.
    let started = Instant::now();
    let other = ci
        .bus()
        .call_raw(
            "slotpool.api.v2.mallory.status",
            Bytes::from_static(b"{}"),
            Duration::from_secs(10),
        )
        .await;
    match other {
        Err(BusError::NotPermitted { user, subject }) => {
            assert_eq!(user, "client ci");
            assert_eq!(subject, "slotpool.api.v2.mallory.status");
        }
        other => panic!("a publish on another client's subject: {other:?}"),
    }
    assert!(started.elapsed() < REFUSED_WITHIN);

    // The command line says so too, and fails at once.
    let (took, out) = slotpool_as(&pool, Role::Client, "ci", &["list", "backing"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a client listed the backing nodes");
    assert!(
        stderr.contains("not permitted: client ci may not read slotpool_backing"),
        "{stderr}"
    );
    assert!(
        took < REFUSED_WITHIN * 2,
        "`slotpool list backing` took {took:?}"
    );

    // An operation the API does not have, for a client and for an operator.
    for (bus, subject) in [
        (
            ci.bus().clone(),
            "slotpool.api.v2.ci.frobnicate".to_string(),
        ),
        (
            client_as(&pool, Role::Operator, "alice")
                .await
                .bus()
                .clone(),
            "slotpool.admin.v2.alice.frobnicate".to_string(),
        ),
    ] {
        let reply = bus
            .call_raw(&subject, Bytes::from_static(b"{}"), Duration::from_secs(10))
            .await
            .unwrap_or_else(|err| panic!("{subject}: {err}"));
        let reply: Reply<serde_json::Value> = serde_json::from_slice(&reply).unwrap();
        let err = reply.into_result().expect_err("an unknown operation");
        assert_eq!(err.code, ErrorCode::UnknownOperation, "{err:?}");
        assert!(err.message.contains("frobnicate"), "{err:?}");
    }
    // What the client may do still works.
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "refusals");
    let id = ci.submit(&sub).await.expect("a client's own submit");
    ci.wait(&id, |_| {}).await.expect("followed to its end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_list_is_as_quick_as_a_launchers() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "refusals");
    let id = pool.client.submit(&sub).await.unwrap();
    pool.client.wait(&id, |_| {}).await.unwrap();
    let mut took = Vec::new();
    for (role, name) in [(Role::Launcher, "launcher"), (Role::Operator, "alice")] {
        for what in [&["list", "backing"][..], &["list", "requests"][..]] {
            let (t, out) = slotpool_as(&pool, role, name, what).await;
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{role} {what:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!stdout.trim().is_empty(), "{role} {what:?} listed nothing");
            took.push(format!(
                "{role} {}: {:.3} s",
                what.join(" "),
                t.as_secs_f64()
            ));
            assert!(
                t < LISTED_WITHIN,
                "{role} `slotpool {}` took {t:?}",
                what.join(" ")
            );
        }
    }
    eprintln!("list times: {}", took.join(", "));
}
