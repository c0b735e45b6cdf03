//! Attacks on the bus, made as a hostile CI job would, against a real nats-server with
//! slotpool's shipped authorisation, a real launcher and real local agents. Each attack
//! must fail and leave the pool as it was; each test also checks that the same action
//! succeeds for the party allowed to do it, so a test cannot pass because nothing works.
//!
//! The attackers hold what a job could at best get: no credentials at all (a slot user
//! cannot read any: they are 0600 files of root, see the local provider), the credential
//! of another client, or that of another backing node's agent. The execute channel's
//! attacks (`mod exec`) run with agents in users mode, as jobs run: another client in my
//! slot, a job reaching for the bus to write into another's stream, a never-ending
//! output to a reader that stops, escape sequences for the caller's terminal, a process
//! hidden from its exec.

use bytes::Bytes;
use slotpool_protocol::api::{AgentCommand, ErrorCode, SlotLimits};
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_protocol::connect::{Bus, BusError, NatsOptions};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::{BackingState, IdleBehaviour, NodeState, OperatorAction};
use slotpool_tests::{label, wait_for, wait_for_some, Pool};
use std::time::Duration;

/// How long a request to a subject the server refuses is given before it counts as
/// unanswered.
const REFUSED: Duration = Duration::from_secs(2);
const SOON: Duration = Duration::from_secs(20);

async fn client_as(pool: &Pool, role: Role, name: &str) -> Client {
    Client::connect(&pool.nats.options_as(role, name))
        .await
        .unwrap_or_else(|err| panic!("connecting as {role} {name}: {err}"))
}

async fn bus_as(pool: &Pool, role: Role, name: &str) -> Bus {
    Bus::connect(&pool.nats.options_as(role, name))
        .await
        .unwrap_or_else(|err| panic!("connecting as {role} {name}: {err}"))
}

fn raw(msg: &impl serde::Serialize) -> Bytes {
    Bytes::from(serde_json::to_vec(msg).unwrap())
}

/// A connection without credentials is refused outright.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_connection_is_refused() {
    let pool = Pool::start(1, 5, &label("small", 2, 60, &[]), 1).await;
    let anonymous = NatsOptions {
        url: pool.nats.url(),
        name: "job".into(),
        ..Default::default()
    };
    let err = Bus::connect(&anonymous).await.err().expect("refused");
    let text = err.to_string().to_lowercase();
    assert!(text.contains("authorization"), "{err}");
    // A credential whose signature does not check out is refused too.
    let forged = pool.dir().join("forged.creds");
    let good = std::fs::read_to_string(pool.nats.creds(Role::Client, "ci")).unwrap();
    let jwt = slotpool_protocol::auth::jwt::jwt_of_creds(&good)
        .unwrap()
        .to_string();
    let mut parts: Vec<&str> = jwt.split('.').collect();
    let other = std::fs::read_to_string(pool.nats.creds(Role::Launcher, "launcher")).unwrap();
    let other_jwt = slotpool_protocol::auth::jwt::jwt_of_creds(&other)
        .unwrap()
        .to_string();
    let other_parts: Vec<&str> = other_jwt.split('.').collect();
    parts[1] = other_parts[1]; // a launcher's claims under a client's signature
    std::fs::write(&forged, good.replace(&jwt, &parts.join("."))).unwrap();
    let opts = NatsOptions {
        creds: Some(forged),
        ..anonymous
    };
    assert!(
        Bus::connect(&opts).await.is_err(),
        "a tampered JWT was accepted"
    );
}

/// Another backing node's agent cannot hear a neighbour's commands (so cannot answer a
/// prepare_slot with its own login) nor send it commands (a foreign release_slot), nor
/// read its slot keys, nor write its heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_cannot_hear_command_or_impersonate_another() {
    let pool = Pool::start(2, 5, &label("small", 2, 600, &[]), 1).await;
    let victim_client = client_as(&pool, Role::Client, "ci").await;
    let mut sub = slotpool_protocol::client::submission(vec!["small".into()], "victim");
    sub.ssh_public_key = None;
    let id = victim_client.submit(&sub).await.unwrap();
    let victim = victim_client.wait(&id, |_| {}).await.unwrap();
    assert_eq!(
        victim.state,
        slotpool_protocol::model::RequestState::Fulfilled
    );
    let node = pool.node(&victim.nodes[0]).await;
    let target = node.backing_id.clone();

    let attacker = bus_as(&pool, Role::Agent, "bn-attacker").await;
    // Listening on the victim's command subject: the server refuses the subscription,
    // so nothing sent there reaches the attacker.
    let mut eavesdrop = attacker
        .serve(&subjects::agent(&target), None)
        .await
        .expect("the client library subscribes locally");
    // Sending the victim's agent a release of the neighbour's slot.
    let release = AgentCommand::ReleaseSlot {
        slot: node.slot,
        node_id: node.id.clone(),
    };
    let sent = attacker
        .call_raw(&subjects::agent(&target), raw(&release), REFUSED)
        .await;
    assert!(
        sent.is_err(),
        "a foreign release_slot was answered: {sent:?}"
    );
    // Reading the victim's slot key (the node's login): refused; an agent reads only
    // its own backing node's slot keys.
    let key = slotpool_protocol::layout::slot_key(&target, node.slot);
    let read = attacker.slots.get::<serde_json::Value>(&key).await;
    assert!(read.is_err(), "an agent read another's slot key: {read:?}");
    // A forged heartbeat for the victim's backing node.
    let forged = serde_json::json!({"v": 1, "backing_id": target.as_str()});
    assert!(
        attacker
            .agents
            .put(target.as_str(), &forged, None)
            .await
            .is_err(),
        "a forged heartbeat was written"
    );
    // Meanwhile the launcher's own command to the real agent works, and the attacker
    // heard none of it.
    let launcher = pool.nats.bus().await;
    let prepare = AgentCommand::PrepareSlot {
        slot: 1 - node.slot,
        node_id: slotpool_protocol::NodeId::generate(),
        ssh_public_key: None,
        limits: SlotLimits::default(),
    };
    launcher
        .call_raw(&subjects::agent(&target), raw(&prepare), SOON)
        .await
        .expect("the launcher commands the real agent");
    use futures::StreamExt;
    let heard = tokio::time::timeout(Duration::from_millis(500), eavesdrop.next()).await;
    assert!(
        heard.is_err(),
        "the attacker heard a command of another agent"
    );
    // The victim's node is untouched.
    let after = pool.node(&node.id).await;
    assert_eq!(after.state, NodeState::Ready);
}

/// A client cannot give operators' orders, under its own name or an operator's; an
/// operator can, and the event log names the operator the server authenticated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_order_and_orders_are_recorded_under_the_real_operator() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let ci = client_as(&pool, Role::Client, "ci").await;
    let id = ci
        .submit(&slotpool_protocol::client::submission(
            vec!["small".into()],
            "x",
        ))
        .await
        .unwrap();
    ci.wait(&id, |_| {}).await.unwrap();
    let backing = pool.backing().await.pop().unwrap();

    for operator in ["ci", "alice"] {
        let order = slotpool_protocol::api::BackingOrder {
            v: 1,
            backing_id: backing.id.clone(),
            actor: "alice@ops1".into(),
            reason: Some("pwned".into()),
        };
        let subject = subjects::admin(
            &slotpool_protocol::UserName::parse(operator).unwrap(),
            OperatorAction::Kill,
        );
        let r = ci.bus().call_raw(&subject, raw(&order), REFUSED).await;
        assert!(
            r.is_err(),
            "a client's kill order on {subject} was answered: {r:?}"
        );
    }
    let b = pool.backing().await.pop().unwrap();
    assert_eq!(b.state, BackingState::Ready, "a client's order took effect");

    let alice = client_as(&pool, Role::Operator, "alice").await;
    // The message names another actor: the launcher records the bus user instead.
    let forged = slotpool_protocol::api::BackingOrder {
        v: 1,
        backing_id: backing.id.clone(),
        actor: "mallory@evil".into(),
        reason: Some("maintenance".into()),
    };
    let subject = subjects::admin(alice.name(), OperatorAction::Hold);
    let reply = alice
        .bus()
        .call_raw(&subject, raw(&forged), REFUSED * 5)
        .await
        .expect("an operator may hold");
    serde_json::from_slice::<slotpool_protocol::api::Reply<slotpool_protocol::api::OrderTaken>>(
        &reply,
    )
    .unwrap()
    .into_result()
    .expect("the hold is taken");
    // The launcher records the order off its reply's path: wait for it.
    let held = wait_for_some("the hold in the event log", SOON, || async {
        let events = alice.list_events().await.unwrap();
        events.into_iter().find(|e| e.message.contains("hold"))
    })
    .await;
    assert_eq!(held.actor, "alice", "{held:?}");
    assert!(!held.message.contains("mallory"), "{held:?}");
    let b = pool.backing().await.pop().unwrap();
    assert_eq!(b.idle, IdleBehaviour::Hold);
}

/// A client sees, releases and cancels only its own requests and nodes, and reads no
/// bucket; nobody but a launcher can delete a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_touches_only_its_own_requests_and_nobody_deletes_the_log() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let ci = client_as(&pool, Role::Client, "ci").await;
    let mut sub = slotpool_protocol::client::submission(vec!["small".into()], "victim");
    sub.ssh_public_key = Some(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl ci@victim"
            .into(),
    );
    let id = ci.submit(&sub).await.unwrap();
    let victim = ci.wait(&id, |_| {}).await.unwrap();

    let mallory = client_as(&pool, Role::Client, "mallory").await;
    // Its status: as if it did not exist.
    assert!(mallory.request(&id).await.unwrap().is_none());
    // Its record in KV: refused (no read permission on any bucket).
    let read = tokio::time::timeout(
        REFUSED * 2,
        mallory.bus().requests.get::<serde_json::Value>(id.as_str()),
    )
    .await;
    assert!(
        !matches!(read, Ok(Ok(Some(_)))),
        "a client read another's request from KV: {read:?}"
    );
    // Releasing and canceling it: refused with a clear error.
    match mallory.release(victim.nodes.clone()).await {
        Err(BusError::Api(e)) => {
            assert_eq!(e.code, ErrorCode::Forbidden, "{e:?}");
            assert!(e.message.contains("another client"), "{e:?}");
        }
        other => panic!("a client released another's node: {other:?}"),
    }
    match mallory.cancel(id.clone()).await {
        Err(BusError::Api(e)) => assert_eq!(e.code, ErrorCode::Forbidden, "{e:?}"),
        other => panic!("a client canceled another's request: {other:?}"),
    }
    assert_eq!(pool.node(&victim.nodes[0]).await.state, NodeState::Ready);

    // Deleting the event log's stream: refused for a client, an operator and an agent.
    for (role, name) in [
        (Role::Client, "mallory"),
        (Role::Operator, "alice"),
        (Role::Agent, "bn-attacker"),
    ] {
        let bus = bus_as(&pool, role, name).await;
        let r = bus
            .call_raw(
                "$JS.API.STREAM.DELETE.KV_slotpool_events",
                Bytes::new(),
                REFUSED,
            )
            .await;
        let deleted = r
            .as_ref()
            .is_ok_and(|b| String::from_utf8_lossy(b).contains("\"success\":true"));
        assert!(!deleted, "{role} {name} deleted the event log");
    }
    pool.nats
        .bus()
        .await
        .events
        .list::<serde_json::Value>()
        .await
        .expect("the event log is still there");

    // The owner may release its node.
    let released = ci.release(victim.nodes.clone()).await.unwrap();
    assert_eq!(released.released, victim.nodes);
    tokio::time::timeout(SOON, ci.wait_released(&victim.nodes))
        .await
        .expect("released in time")
        .unwrap();
}

/// A prepare reply that disagrees with the agent's heartbeat (another port or host key,
/// as a forged reply would have) is refused: the node is not handed out and the backing
/// node fails with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_reply_that_disagrees_with_the_heartbeat_fails_the_backing_node() {
    forged_prepare_reply(Submit::Queued).await;
}

/// The same attack on a submit that waits for its outcome, which a launcher serves
/// before it records the request when slots are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_prepare_reply_is_not_handed_out_to_a_waiting_submit() {
    forged_prepare_reply(Submit::Waiting).await;
}

/// How the victim's request is submitted.
#[derive(Clone, Copy, Debug)]
enum Submit {
    /// `submit`, answered with the id at once.
    Queued,
    /// `submit` with `wait_ms` (`Client::submit_and_wait`).
    Waiting,
}

async fn forged_prepare_reply(how: Submit) {
    let pool = Pool::start(2, 5, &label("small", 2, 600, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let node = pool.node(&first.nodes[0]).await;
    let target = node.backing_id.clone();
    // Stand in for the agent on its own subject with its own credential (what a forged
    // reply could only do with the agent's credential: the protection under test is
    // the launcher's check, not the permissions), answering with another login.
    let impostor = bus_as(&pool, Role::Agent, target.as_str()).await;
    let mut commands = impostor
        .serve(&subjects::agent(&target), None)
        .await
        .unwrap();
    let answering = tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(msg) = commands.next().await {
            let Some(reply) = msg.reply_to else { continue };
            let forged = serde_json::json!({"ok": {
                "workspace": "/tmp/attacker", "username": "attacker", "port": 2222,
                "host_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAttacker"]
            }});
            let _ = impostor
                .respond(
                    &reply,
                    &serde_json::from_value::<slotpool_protocol::api::Reply<serde_json::Value>>(
                        forged,
                    )
                    .unwrap(),
                )
                .await;
        }
    });
    // The real agent is paused, so the forged reply is the one the launcher gets (its
    // heartbeat, with the real login, stays in KV for its TTL); a forged reply must
    // never be handed out, and the backing node is failed.
    let pid: i32 = std::fs::read_to_string(pool.agent_dir(target.as_str()).join("agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: signalling the test's own child agent by its recorded pid.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let ci = client_as(&pool, Role::Client, "ci").await;
    let mut sub = slotpool_protocol::client::submission(vec!["small".into()], "victim");
    let id = slotpool_protocol::RequestId::generate();
    sub.id = Some(id.clone());
    let waiting = match how {
        Submit::Queued => {
            ci.submit(&sub).await.unwrap();
            None
        }
        Submit::Waiting => {
            let ci = ci.clone();
            Some(tokio::spawn(async move { ci.submit_and_wait(&sub).await }))
        }
    };
    wait_for(
        "the backing node to fail for the forged reply",
        SOON,
        || async {
            pool.backing().await.iter().any(|b| {
                b.id == target
                    && b.state == BackingState::Failed
                    && b.failure
                        .as_deref()
                        .is_some_and(|f| f.contains("prepare reply refused"))
            })
        },
    )
    .await;
    for n in pool.nodes().await {
        assert_ne!(
            n.login.port,
            Some(2222),
            "a forged login was handed out: {n:?}"
        );
        assert_ne!(n.workspace.as_deref(), Some("/tmp/attacker"), "{n:?}");
    }
    if let Some(r) = ci.request(&id).await.unwrap() {
        for n in &r.nodes {
            assert_ne!(pool.node(n).await.login.port, Some(2222));
        }
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    answering.abort();
    if let Some(waiting) = waiting {
        // The request is served elsewhere (the pool launches another backing node),
        // never with the forged login.
        let served = tokio::time::timeout(SOON, waiting)
            .await
            .expect("the waiting submit is answered")
            .unwrap()
            .expect("the request is served");
        for n in &served.nodes {
            assert_ne!(pool.node(n).await.backing_id, target, "{served:?}");
            assert_ne!(pool.node(n).await.login.port, Some(2222), "{served:?}");
        }
    }
}

/// `slotpool nats-setup` writes an installation nats-server accepts, with every secret
/// readable by its owner only.
#[test]
fn nats_setup_writes_a_configuration_the_server_accepts() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let install = dir.path().join("nats");
    let out = std::process::Command::new(slotpool_tests::bin_path("slotpool"))
        .args(["nats-setup", "--dir"])
        .arg(&install)
        .args([
            "--listen",
            "127.0.0.1:4333",
            "--operator",
            "alice",
            "--client",
            "ci",
        ])
        .args(["--static-agent", "build-01"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conf = install.join("nats-server.conf");
    let checked = std::process::Command::new(slotpool_tests::nats_server_binary())
        .arg("-c")
        .arg(&conf)
        .arg("-t")
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "nats-server -t refused the configuration: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let text = std::fs::read_to_string(&conf).unwrap();
    assert!(
        text.contains("type: full") && text.contains("tls {"),
        "{text}"
    );
    for secret in [
        "agent-signing.json",
        "creds/launcher-launcher.creds",
        "creds/operator-alice.creds",
        "creds/client-ci.creds",
        "creds/agent-build-01.creds",
        "tls/ca-key.pem",
        "tls/server-key.pem",
    ] {
        let mode = std::fs::metadata(install.join(secret))
            .unwrap_or_else(|e| panic!("{secret}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{secret} is readable by others: {mode:o}");
    }
    // A second run must not replace the installation (and with it every credential).
    let again = std::process::Command::new(slotpool_tests::bin_path("slotpool"))
        .args(["nats-setup", "--dir"])
        .arg(&install)
        .output()
        .unwrap();
    assert!(!again.status.success());
}

/// A client of API v1 gets a clear error naming the subjects to use, not silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_v1_client_is_told_to_use_v2() {
    let pool = Pool::start(1, 5, &label("small", 2, 60, &[]), 1).await;
    let ci = client_as(&pool, Role::Client, "ci").await;
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "old");
    let reply = ci
        .bus()
        .call_raw("slotpool.api.v1.submit", raw(&sub), SOON)
        .await
        .expect("a launcher answers v1");
    let v: serde_json::Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(v["error"]["code"], "unsupported_version", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("slotpool.api.v2."), "{message}");
}

/// What the server refuses is named in the error of the process it refused, not left
/// to look like a time-out: a client reading the backing nodes' bucket, which no client
/// may, is told it is not permitted and which subject the server refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_refusal_is_named_in_the_refused_clients_log() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let out = tokio::task::spawn_blocking({
        let args = pool.nats.args_as(Role::Client, "mallory");
        move || {
            std::process::Command::new(slotpool_tests::bin_path("slotpool"))
                .args(args)
                .args(["list", "backing"])
                .env("SLOTPOOL_LOG", "warn")
                .output()
                .expect("running slotpool")
        }
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a client listed the backing nodes");
    assert!(
        stderr.contains("not permitted: client mallory may not read slotpool_backing")
            && stderr
                .contains("the NATS server refused $JS.API.CONSUMER.CREATE.KV_slotpool_backing"),
        "the refusal is not in the client's error:\n{stderr}"
    );
}

/// Every revocation pushed makes the server apply a new account JWT, and for that moment
/// it answers the account's requests to create a consumer with "no responders". A list
/// or a watch started then (each creates one) is asked again (`store::asked_again`), not
/// failed: eight readers listing in a loop go on through 60 revocations without an error
/// (without the asking again, 4 to 14 of their ~9,000 lists failed in each of four runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_go_on_while_the_server_takes_revocations() {
    use slotpool_protocol::auth::BusUser;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    const REVOCATIONS: usize = 60;
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let alice = client_as(&pool, Role::Operator, "alice").await;
    let stop = Arc::new(AtomicBool::new(false));
    let lists = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let (client, stop, lists) = (pool.client.clone(), stop.clone(), lists.clone());
            tokio::spawn(async move {
                let mut failed = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Err(err) = client.list_backing().await {
                        failed.push(err.to_string());
                    }
                    lists.fetch_add(1, Ordering::Relaxed);
                }
                failed
            })
        })
        .collect();
    for i in 0..REVOCATIONS {
        let user = BusUser::new(Role::Client, &format!("gone-{i}")).unwrap();
        alice
            .revoke(&user, None)
            .await
            .expect("an operator revokes");
    }
    stop.store(true, Ordering::Relaxed);
    let mut failed = Vec::new();
    for r in readers {
        failed.extend(r.await.unwrap());
    }
    let lists = lists.load(Ordering::Relaxed);
    println!(
        "{lists} lists during {REVOCATIONS} revocations, {} failed",
        failed.len()
    );
    assert!(lists > 1_000, "the readers hardly ran: {lists} lists");
    assert!(failed.is_empty(), "lists failed: {failed:?}");
}

/// An operator revokes a client's credentials: the server closes the connection the
/// client holds and refuses it from then on, the launchers' HTTP API refuses its token,
/// other clients go on, and a credential minted afterwards lets the client back in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_credential_is_refused_and_its_open_connection_closed() {
    use slotpool_protocol::auth::{BusUser, Minter};
    let pool = Pool::start_serving_with(
        1,
        5,
        &label("small", 2, 600, &[]),
        1,
        &slotpool_tests::AGENT_ARGS,
        &["--http", "127.0.0.1:0"],
    )
    .await;
    let addr = pool.http_addr(0).await;
    let ci = client_as(&pool, Role::Client, "ci").await;
    let cd = client_as(&pool, Role::Client, "cd").await;
    let id = ci
        .submit(&slotpool_protocol::client::submission(
            vec!["small".into()],
            "x",
        ))
        .await
        .unwrap();
    ci.wait(&id, |_| {}).await.unwrap();
    let token = pool.nats.http_token(Role::Client, "ci");
    let (status, _) = slotpool_tests::metrics::get(addr, "/api/v1/requests", Some(&token)).await;
    assert_eq!(status, 200);

    let alice = client_as(&pool, Role::Operator, "alice").await;
    let user = BusUser::new(Role::Client, "ci").unwrap();
    let taken = alice
        .revoke(&user, Some("leaked".into()))
        .await
        .expect("an operator revokes");
    println!("revoked {user}: {taken:?}");

    // The connection ci holds is closed by the server and not let back in.
    wait_for("ci's open connection to be closed", SOON, || async {
        !ci.bus().is_connected()
    })
    .await;
    let again = Bus::connect(&pool.nats.options_as(Role::Client, "ci")).await;
    let refused = again
        .err()
        .expect("a revoked credential is refused")
        .to_string();
    println!("ci connecting again: {refused}");
    assert!(
        refused.to_lowercase().contains("authorization"),
        "{refused}"
    );
    let (status, body) = slotpool_tests::metrics::get(addr, "/api/v1/requests", Some(&token)).await;
    println!("ci's HTTP token: {status} {}", body.trim());
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("revoked"), "{body}");
    // Another client goes on.
    assert!(cd.bus().is_connected());
    cd.submit(&slotpool_protocol::client::submission(
        vec!["small".into()],
        "y",
    ))
    .await
    .expect("another client is untouched");
    // The event log says who revoked whom.
    let events = alice.list_events().await.unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.actor == "alice" && e.message.contains("revoke client ci")),
        "{events:?}"
    );

    // A credential issued after the revocation (JWT times are whole seconds) is valid.
    let at = taken.revoked_at;
    wait_for(
        "the clock to pass the revocation's second",
        SOON,
        || async {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                > at
        },
    )
    .await;
    let fresh = pool.dir().join("ci-again.creds");
    Minter::load(pool.nats.signing_key())
        .unwrap()
        .mint(&user, None)
        .unwrap()
        .write_private(&fresh)
        .unwrap();
    let opts = NatsOptions {
        creds: Some(fresh),
        ..pool.nats.options_as(Role::Client, "ci")
    };
    Bus::connect(&opts)
        .await
        .expect("a credential minted after the revocation connects");
}

/// When a launched backing node is deleted, its agent's credential is revoked at once:
/// a connection made with a copy of it (a leaked credential) is closed, and the copy is
/// refused from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_nodes_agent_credential_is_revoked_at_once() {
    let pool = Pool::start(1, 5, &label("small", 1, 1, &[]), 1).await;
    let request = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let backing = pool.backing().await.pop().expect("a backing node");
    let creds = pool.agent_dir(backing.id.as_str()).join("agent.creds");
    let leaked = pool.dir().join("leaked-agent.creds");
    std::fs::copy(&creds, &leaked).expect("copying the agent's credential");
    let opts = NatsOptions {
        creds: Some(leaked),
        ..pool.nats.options_as(Role::Agent, backing.id.as_str())
    };
    let thief = Bus::connect(&opts)
        .await
        .expect("the copy works while the node lives");
    pool.release_and_wait(&request.nodes).await;
    wait_for("the idle backing node to be deleted", SOON, || async {
        pool.backing().await.is_empty()
    })
    .await;
    wait_for("the copy's connection to be closed", SOON, || async {
        !thief.is_connected()
    })
    .await;
    let refused = Bus::connect(&opts)
        .await
        .err()
        .expect("the deleted node's credential is refused")
        .to_string();
    println!("the deleted node's agent credential: {refused}");
    assert!(
        refused.to_lowercase().contains("authorization"),
        "{refused}"
    );
}

// ---- the execute channel ------------------------------------------------------------

mod exec {
    use super::*;
    use futures::StreamExt;
    use slotpool_protocol::api::ApiError;
    use slotpool_protocol::exec::{output_of, ExecRequest, ExecStarted, IN_STDIN};
    use slotpool_protocol::layout::subjects::ApiOp;
    use slotpool_protocol::model::Node;
    use slotpool_protocol::{UserName, PROTOCOL_VERSION};
    use slotpool_tests::IsolationEnv;
    use std::process::{Command, Stdio};

    const WAIT: Duration = Duration::from_secs(60);

    async fn users_pool(env: &IsolationEnv, serve_extra: &[&str]) -> Pool {
        let args = env.agent_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Pool::start_serving_with(1, 5, &label("small", 2, 60, &[]), 1, &args, serve_extra).await
    }

    async fn held_node(client: &Client) -> Node {
        let done = client
            .submit_and_wait(&slotpool_protocol::client::submission(
                vec!["small".into()],
                "redteam",
            ))
            .await
            .expect("a node");
        client.nodes(&done.nodes).await.unwrap().remove(0)
    }

    fn request(node: &Node, inbox: &str, session: &str, argv: &[&str]) -> ExecRequest {
        ExecRequest {
            v: PROTOCOL_VERSION,
            node_id: node.id.clone(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: Default::default(),
            timeout_secs: Some(60),
            session: session.into(),
            inbox: inbox.into(),
            window: None,
        }
    }

    fn api_error(err: BusError) -> ApiError {
        match err {
            BusError::Api(err) => err,
            other => panic!("expected the API's refusal, got {other}"),
        }
    }

    /// Whether any process of the env's slot users is named `name`.
    fn running(env: &IsolationEnv, name: &str) -> bool {
        let users = env.users();
        !users.is_empty()
            && Command::new("pgrep")
                .args(["-u", &users.join(","), "-x", name])
                .stdout(Stdio::null())
                .status()
                .unwrap()
                .success()
    }

    fn server_log(pool: &Pool) -> String {
        std::fs::read_to_string(pool.nats.dir().join("nats-server.log")).unwrap_or_default()
    }

    /// Sends `stdin` to a started command as `client` and ends its input, then reads its
    /// output to the end, acknowledging as it goes: the subjects heard, stdout and
    /// stderr together, and the exit's payload.
    async fn feed_and_read(
        client: &Client,
        started: &ExecStarted,
        stdin: &[u8],
        output: &mut (impl futures::Stream<Item = slotpool_protocol::connect::Incoming> + Unpin),
    ) -> (Vec<String>, Vec<u8>, Bytes) {
        for chunk in [stdin, b""] {
            client
                .bus()
                .publish_raw(
                    format!("{}.{IN_STDIN}", started.input),
                    Bytes::copy_from_slice(chunk),
                )
                .await
                .unwrap();
        }
        let (mut subjects, mut bytes) = (Vec::new(), Vec::new());
        loop {
            let msg = tokio::time::timeout(WAIT, output.next())
                .await
                .expect("output in time")
                .expect("the subscription");
            subjects.push(msg.subject.clone());
            match msg.subject.rsplit('.').next().unwrap() {
                "stdout" | "stderr" => {
                    bytes.extend_from_slice(&msg.payload);
                    client
                        .bus()
                        .publish_raw(format!("{}.ack", started.input), "1000".into())
                        .await
                        .unwrap();
                }
                "exit" => return (subjects, bytes, msg.payload),
                _ => {}
            }
        }
    }

    /// Another client tries every way into ci's node: asking a launcher to run there,
    /// pointing the output at ci's inbox, listening to ci's output, feeding ci's
    /// command. The launcher refuses the first two; the bus the others. ci, meanwhile,
    /// runs and feeds its own command, which hears only ci.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_client_cannot_run_in_hear_or_feed_my_slot() {
        let env = IsolationEnv::new();
        let pool = users_pool(&env, &[]).await;
        let ci = client_as(&pool, Role::Client, "ci").await;
        let mallory = client_as(&pool, Role::Client, "mallory").await;
        let node = held_node(&ci).await;
        let ci_name = UserName::parse("ci").unwrap();
        let mallory_name = UserName::parse("mallory").unwrap();

        // Run in ci's node, output to mallory: the node is not mallory's.
        let err = mallory
            .bus()
            .call::<_, ExecStarted>(
                &subjects::api(&mallory_name, ApiOp::Exec),
                &request(&node, "_INBOX.client.mallory", "m1", &["id"]),
                SOON,
            )
            .await
            .expect_err("mallory may not run in ci's node");
        let err = api_error(err);
        assert_eq!(err.code, ErrorCode::Forbidden, "{err:?}");
        // Output to ci's inbox: refused before the node is even looked at.
        let err = mallory
            .bus()
            .call::<_, ExecStarted>(
                &subjects::api(&mallory_name, ApiOp::Exec),
                &request(&node, "_INBOX.client.ci", "m2", &["id"]),
                SOON,
            )
            .await
            .expect_err("mallory may not aim output at ci's inbox");
        assert_eq!(api_error(err).code, ErrorCode::BadRequest);
        // As ci, on ci's own API subject: the bus refuses the publish.
        let err = mallory
            .bus()
            .call::<_, ExecStarted>(
                &subjects::api(&ci_name, ApiOp::Exec),
                &request(&node, "_INBOX.client.mallory", "m3", &["id"]),
                REFUSED,
            )
            .await
            .expect_err("mallory may not speak as ci");
        assert!(!matches!(err, BusError::Api(_)), "{err}");

        // ci runs `cat` in its node; mallory listens to ci's exec inbox and its input.
        let mut heard = mallory
            .bus()
            .serve("_INBOX.client.ci.exec.>", None)
            .await
            .unwrap();
        let mut heard_input = mallory
            .bus()
            .serve("slotpool.exec.v2.ci.>", None)
            .await
            .unwrap();
        let session = "redteam1";
        let inbox = "_INBOX.client.ci";
        let mut output = ci
            .bus()
            .serve(
                &format!(
                    "{}.>",
                    output_of(&request(&node, inbox, session, &[])).unwrap()
                ),
                None,
            )
            .await
            .unwrap();
        let started: ExecStarted = ci
            .bus()
            .call(
                &subjects::api(&ci_name, ApiOp::Exec),
                &request(&node, inbox, session, &["cat"]),
                SOON,
            )
            .await
            .expect("ci runs in its own node");
        // Mallory feeds ci's command with the subject it cannot publish to...
        mallory
            .bus()
            .publish_raw(
                format!("{}.{IN_STDIN}", started.input),
                Bytes::from_static(b"from mallory\n"),
            )
            .await
            .unwrap();
        let _ = mallory.bus().flush().await;
        // ...then ci feeds it and ends its input.
        let (_, stdout, _) = feed_and_read(&ci, &started, b"from ci\n", &mut output).await;
        assert_eq!(String::from_utf8_lossy(&stdout), "from ci\n");
        // Mallory heard nothing of it, and the server says why.
        let nothing = tokio::time::timeout(REFUSED, async {
            tokio::select! {
                m = heard.next() => m.map(|m| m.subject),
                m = heard_input.next() => m.map(|m| m.subject),
            }
        })
        .await;
        assert!(
            matches!(nothing, Err(_) | Ok(None)),
            "mallory heard {nothing:?}"
        );
        let log = server_log(&pool);
        assert!(log.contains("Subscription Violation"), "{log}");
        assert!(log.contains("Publish Violation"), "{log}");
    }

    /// A compromised backing node holds its agent's credential. With it, it writes
    /// into a command running on another node, whose session name it has learnt: output
    /// and an exit on that session's output subject, as the session's own agent would.
    /// The bus refuses them (the agent's credential may publish only into sessions on
    /// its own node) and the session hears only its own agent: the command's real
    /// output and exit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_nodes_agent_cannot_write_into_my_session() {
        let env = IsolationEnv::new();
        let pool = users_pool(&env, &[]).await;
        let ci = client_as(&pool, Role::Client, "ci").await;
        let node = held_node(&ci).await;
        let attacker = bus_as(&pool, Role::Agent, "bn-attacker").await;
        let ci_name = UserName::parse("ci").unwrap();

        let (inbox, session) = ("_INBOX.client.ci", "victim1");
        let run = request(&node, inbox, session, &["cat"]);
        let output = output_of(&run).unwrap();
        assert!(output.ends_with(node.backing_id.as_str()), "{output}");
        let mut heard = ci.bus().serve(&format!("{output}.>"), None).await.unwrap();
        let started: ExecStarted = ci
            .bus()
            .call(&subjects::api(&ci_name, ApiOp::Exec), &run, SOON)
            .await
            .expect("ci runs in its own node");

        // Forged output on the session's own subject: refused by the bus, which the
        // attacker's connection is told ("Permissions Violation for Publish").
        let forged = format!("{output}.stdout");
        let refused = attacker
            .call_raw(&forged, Bytes::from_static(b"forged output\n"), REFUSED)
            .await
            .expect_err("another node's agent may not publish into ci's session");
        assert!(
            matches!(&refused, BusError::NotPermitted { subject, .. } if *subject == forged),
            "expected a permissions violation for {forged}, got {refused}"
        );
        attacker
            .publish_raw(
                format!("{output}.exit"),
                raw(&serde_json::json!({"code": 0})),
            )
            .await
            .unwrap();
        // Its own node's token in the subject is allowed, but ci does not listen there;
        // nor on the subject that named no node at all.
        let elsewhere = format!("{inbox}.exec.{session}.bn-attacker");
        for subject in [
            format!("{elsewhere}.stdout"),
            format!("{inbox}.exec.{session}.stdout"),
        ] {
            attacker
                .publish_raw(subject, Bytes::from_static(b"forged output\n"))
                .await
                .unwrap();
        }
        let _ = attacker.flush().await;

        // The session goes on: ci's input comes back, then the real exit.
        let (subjects, seen, exit) = feed_and_read(&ci, &started, b"from ci\n", &mut heard).await;
        for subject in &subjects {
            assert!(
                subject.starts_with(&format!("{output}.")),
                "the session heard {subject}"
            );
        }
        assert_eq!(String::from_utf8_lossy(&seen), "from ci\n");
        assert_eq!(String::from_utf8_lossy(&exit), r#"{"code":0}"#);
        let log = server_log(&pool);
        assert!(
            log.lines()
                .any(|l| l.contains("Publish Violation") && l.contains(&forged)),
            "{log}"
        );
    }

    /// The agent's resident memory in KiB, and the launcher's.
    fn rss_kib(pid: u32) -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    fn agent_pid(pool: &Pool) -> u32 {
        let dir = pool.work_dir().display().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .find_map(|e| {
                let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                let cmdline = String::from_utf8_lossy(&cmdline);
                (cmdline.contains("slotpool-agent") && cmdline.contains(&dir)).then_some(pid)
            })
            .expect("the agent's process")
    }

    /// A never-ending output (`cat /dev/zero`) to an HTTP client that stops reading:
    /// the agent and the launcher hold a window each, not the flood; the client that
    /// then reads gets it at speed; the one that leaves leaves nothing running.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_never_ending_output_to_a_stopped_reader_grows_no_daemon() {
        use futures::SinkExt;
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        use tokio_tungstenite::tungstenite::Message;
        let env = IsolationEnv::new();
        let pool = users_pool(&env, &["--http", "127.0.0.1:0"]).await;
        let addr = pool.http_addr(0).await;
        let ci = client_as(&pool, Role::Client, "ci").await;
        let node = held_node(&ci).await;
        let token = pool.nats.http_token(Role::Client, "ci");
        let (agent, launcher) = (agent_pid(&pool), pool.launcher_pid(0));
        let before = (rss_kib(agent), rss_kib(launcher));

        let mut request = format!("ws://{addr}/api/v1/nodes/{}/exec", node.id)
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut ws, _) = tokio_tungstenite::client_async(request, tcp).await.unwrap();
        ws.send(Message::text(r#"{"argv":["cat","/dev/zero"]}"#))
            .await
            .unwrap();
        wait_for("the flood runs", WAIT, || {
            let r = running(&env, "cat");
            async move { r }
        })
        .await;
        // Not a byte read for 6 s, while the command would write gigabytes.
        let mut peak = before;
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            peak = (peak.0.max(rss_kib(agent)), peak.1.max(rss_kib(launcher)));
        }
        let stalled = peak;
        // Then read 256 MiB as fast as we can.
        let mut read = 0usize;
        while read < 256 << 20 {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => read += b.len().saturating_sub(1),
                Some(Ok(_)) => {}
                other => panic!("the stream ended: {other:?}"),
            }
            if read % (16 << 20) < 65536 {
                peak = (peak.0.max(rss_kib(agent)), peak.1.max(rss_kib(launcher)));
            }
        }
        println!(
            "RSS KiB before (agent, launcher) {before:?}; peak while the reader stopped \
             {stalled:?}; peak after reading {read} bytes {peak:?}"
        );
        assert!(
            stalled.0 < before.0 + 32 * 1024 && stalled.1 < before.1 + 32 * 1024,
            "a stopped reader grew a daemon: {before:?} -> {stalled:?}"
        );
        assert!(
            peak.0 < before.0 + 48 * 1024 && peak.1 < before.1 + 48 * 1024,
            "the flood grew a daemon: {before:?} -> {peak:?}"
        );
        drop(ws);
        wait_for("the flood stops once its reader left", WAIT, || {
            let r = running(&env, "cat");
            async move { !r }
        })
        .await;
    }

    /// A job prints escape sequences (the clipboard, OSC 52) among coloured text:
    /// `slotpool exec` on a terminal shows them and keeps the colour; `--raw`, or a
    /// pipe, passes every byte.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_characters_from_a_job_reach_a_terminal_only_as_text_and_colour() {
        let env = IsolationEnv::new();
        let pool = users_pool(&env, &[]).await;
        let ci = client_as(&pool, Role::Client, "ci").await;
        let node = held_node(&ci).await;
        let dir = tempfile::tempdir().unwrap();
        const PRINTF: &str = r"'\033]52;c;ZXZpbA==\007\033[31mred\033[0m\n'";
        const HOSTILE: &[u8] = b"\x1b]52;c;ZXZpbA==\x07\x1b[31mred\x1b[0m\n";
        // The command line slotpool exec runs, as a script (run on a terminal by script(1)).
        let command = |raw: bool| {
            let path = dir.path().join(if raw { "raw.sh" } else { "shown.sh" });
            let mut args = pool.nats.args_as(Role::Client, "ci");
            args.extend(["exec".into(), "--node".into(), node.id.to_string()]);
            if raw {
                args.push("--raw".into());
            }
            let line = format!(
                "#!/bin/sh\nexec {} {} -- printf {PRINTF}\n",
                slotpool_tests::bin_path("slotpool").display(),
                args.join(" ")
            );
            std::fs::write(&path, line).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        let on_terminal = |raw: bool| {
            let out = Command::new("script")
                .args(["-qfec"])
                .arg(command(raw))
                .arg("/dev/null")
                .stdin(Stdio::null())
                .output()
                .expect("script(1)");
            assert!(out.status.success(), "{out:?}");
            out.stdout
        };
        let shown = on_terminal(false);
        let contains = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        assert!(
            contains(&shown, b"^[]52;c;ZXZpbA==^G\x1b[31mred\x1b[0m"),
            "{:?}",
            String::from_utf8_lossy(&shown)
        );
        assert!(
            !contains(&shown, b"\x1b]"),
            "{:?}",
            String::from_utf8_lossy(&shown)
        );
        let raw = on_terminal(true);
        assert!(contains(&raw, &HOSTILE[..HOSTILE.len() - 1]), "{raw:?}");
        // Through a pipe: byte for byte, without --raw.
        let out = Command::new(command(false))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.stdout, HOSTILE);
    }

    /// A job cannot write into anyone's stream: its slot cannot even reach the bus (the
    /// agent's bus guard), while a port of no importance on the same host answers it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_cannot_reach_the_bus_to_write_into_another_stream() {
        let env = IsolationEnv::new();
        // Slots in the host's network namespace, so that 127.0.0.1 is the host's and the
        // refusal is the bus guard's (with a namespace of its own, a slot's 127.0.0.1 is
        // its own and the bus is not even there).
        let args = [env.agent_args(), vec!["--slot-netns".into(), "off".into()]].concat();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let pool = Pool::start_serving_with(1, 5, &label("small", 2, 60, &[]), 1, &args, &[]).await;
        let ci = client_as(&pool, Role::Client, "ci").await;
        let node = held_node(&ci).await;
        let bus_port = pool.nats.url().rsplit(':').next().unwrap().to_string();
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other_port = other.local_addr().unwrap().port().to_string();
        let reach = |port: &str| {
            let out = Command::new(slotpool_tests::bin_path("slotpool"))
                .args(pool.nats.args_as(Role::Client, "ci"))
                .args(["exec", "--node", &node.id.to_string(), "--", "bash", "-c"])
                .arg(format!(
                    "exec 3<>/dev/tcp/127.0.0.1/{port} && echo reached || echo refused"
                ))
                .stdin(Stdio::null())
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        assert_eq!(
            reach(&other_port),
            "reached",
            "the control connection failed"
        );
        assert_eq!(reach(&bus_port), "refused", "a job reached the bus");
    }

    /// A job that hides a process from its session (a new session, its own process
    /// group, stdio closed, SIGHUP ignored) does not outlive its node's release.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_left_running_after_release_is_killed() {
        let env = IsolationEnv::new();
        let pool = users_pool(&env, &[]).await;
        let ci = client_as(&pool, Role::Client, "ci").await;
        let node = held_node(&ci).await;
        let out = Command::new(slotpool_tests::bin_path("slotpool"))
            .args(pool.nats.args_as(Role::Client, "ci"))
            .args(["exec", "--node", &node.id.to_string(), "--", "sh", "-c"])
            .arg(
                "setsid nohup sh -c 'trap \"\" HUP TERM; exec sleep 600' \
                 </dev/null >/dev/null 2>&1 & sleep 0.5; echo left",
            )
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "left\n");
        assert_eq!(out.status.code(), Some(0));
        // The exec ended, yet the hidden process runs on while the node is held...
        wait_for("the hidden process runs", WAIT, || {
            let r = running(&env, "sleep");
            async move { r }
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            running(&env, "sleep"),
            "the hidden process died with its exec"
        );
        // ...and no longer once the node is released.
        ci.release(vec![node.id.clone()]).await.unwrap();
        wait_for("the hidden process killed with the release", WAIT, || {
            let r = running(&env, "sleep");
            async move { !r }
        })
        .await;
    }
}
