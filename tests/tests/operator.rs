//! End-to-end tests of operators' orders through the real `slotpool` CLI: hold, drain, run,
//! kill and release with a reason, against a real nats-server, launchers and agents.

use slotpool_protocol::api::ErrorCode;
use slotpool_protocol::auth::Role;
use slotpool_protocol::connect::BusError;
use slotpool_protocol::model::{
    BackingNode, BackingState, EventKind, IdleBehaviour, NodeState, OperatorAction,
};
use slotpool_protocol::{BackingId, NodeId};
use slotpool_tests::metrics::{scrape_as, value};
use slotpool_tests::{bin_path, label, wait_for, Pool, AGENT_ARGS};
use std::process::Command;
use std::time::Duration;

const SOON: Duration = Duration::from_secs(15);

/// Runs `slotpool <args>` as an operator named `op`; returns its stdout (panics on failure).
fn slotpool(pool: &Pool, args: &[&str]) -> String {
    let out = Command::new(bin_path("slotpool"))
        .args(pool.nats.args_as(Role::Operator, "op"))
        .args(args)
        .output()
        .expect("running slotpool");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "slotpool {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `slotpool <args>` as operator `op` with its stdout a pipe whose read end is
/// closed at once.
fn into_closed_pipe(pool: &Pool, args: &[&str]) -> std::process::Output {
    use std::process::Stdio;
    let mut child = Command::new(bin_path("slotpool"))
        .args(pool.nats.args_as(Role::Operator, "op"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running slotpool");
    drop(child.stdout.take());
    child.wait_with_output().expect("waiting for slotpool")
}

async fn backing_of(pool: &Pool, node: &NodeId) -> BackingNode {
    let (id, _) = node.slot().expect("node id names its slot");
    pool.backing()
        .await
        .into_iter()
        .find(|b| b.id == id)
        .expect("backing node present")
}

async fn gone(pool: &Pool, id: &BackingId) -> bool {
    !pool.backing().await.iter().any(|b| &b.id == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_drain_and_kill_take_effect_and_are_recorded() {
    let http = ["--http", "127.0.0.1:0"];
    let pool =
        Pool::start_serving_with(3, 5, &label("small", 2, 60, &[]), 1, &AGENT_ARGS, &http).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let a = backing_of(&pool, &first.nodes[0]).await;

    // Hold: A takes no new slots, so the next request gets a new backing node.
    let out = slotpool(&pool, &["hold", a.id.as_str(), "--reason", "maintenance"]);
    assert!(out.contains("held"), "{out}");
    let second = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let b = backing_of(&pool, &second.nodes[0]).await;
    assert_ne!(a.id, b.id, "a held backing node took a new slot");
    let held = backing_of(&pool, &first.nodes[0]).await;
    assert_eq!(held.idle, IdleBehaviour::Hold);
    let order = held.order.expect("the order is recorded on the node");
    assert_eq!(
        (order.action, order.actor.as_str(), order.reason.as_deref()),
        (OperatorAction::Hold, "op", Some("maintenance"))
    );

    // Drain: released as soon as its last slot returns, grace-time (60 s) ignored.
    let out = slotpool(&pool, &["drain", a.id.as_str()]);
    assert!(out.contains("released once its 1 slots"), "{out}");
    assert!(!gone(&pool, &a.id).await, "drained while a slot is in use");
    pool.client.release(first.nodes.clone()).await.unwrap();
    wait_for("the drained node released", SOON, || gone(&pool, &a.id)).await;

    // Kill: B fails now and its node says why.
    slotpool(
        &pool,
        &["kill", b.id.as_str(), "--yes", "--reason", "bad disk"],
    );
    wait_for("the killed node's slot marked failed", SOON, || async {
        pool.nodes().await.iter().any(|n| {
            n.id == second.nodes[0]
                && n.state == NodeState::Failed
                && n.failure
                    .as_deref()
                    .unwrap_or("")
                    .contains("killed by op: bad disk")
        })
    })
    .await;
    let killed = backing_of(&pool, &second.nodes[0]).await;
    assert_eq!(killed.state, BackingState::Failed);
    wait_for("the killed node's instance deleted", SOON, || async {
        backing_of(&pool, &second.nodes[0]).await.instance.is_none()
    })
    .await;
    assert!(
        !pool
            .work_dir()
            .join(b.id.as_str())
            .join("agent.pid")
            .exists(),
        "the local agent of a killed node still runs"
    );

    // Every order is in the event log with who and why, next to the state changes.
    let events = pool.client.list_events().await.unwrap();
    let said = |kind: EventKind, text: &str| {
        events
            .iter()
            .any(|e| e.kind == kind && e.message.contains(text))
    };
    assert!(
        said(EventKind::Operator, "hold by op: maintenance"),
        "{events:#?}"
    );
    assert!(said(EventKind::Operator, "drain by op"), "{events:#?}");
    assert!(
        said(EventKind::Operator, "kill by op: bad disk"),
        "{events:#?}"
    );
    assert!(
        said(EventKind::Backing, "releasing: drained by an operator"),
        "{events:#?}"
    );
    assert!(
        said(EventKind::Backing, "failed: killed by op: bad disk"),
        "{events:#?}"
    );
    let listed = slotpool(&pool, &["list", "events"]);
    assert!(listed.contains("kill by op: bad disk"), "{listed}");

    // `/metrics` counts the drain and the kill, each for its reason.
    let s = scrape_as(pool.http_addr(0).await, Some(&pool.operator_token())).await;
    let deleted = |reason| {
        value(
            &s,
            "slotpool_backing_deletions_total",
            &[("reason", reason)],
        )
    };
    assert_eq!((deleted("drain"), deleted("kill")), (1.0, 1.0));
    assert_eq!(value(&s, "slotpool_backing_deletions_total", &[]), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_survives_a_launcher_restart_and_run_releases_after_grace_time() {
    let mut pool = Pool::start(2, 2, &label("small", 2, 1, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let a = backing_of(&pool, &r.nodes[0]).await;
    slotpool(&pool, &["hold", a.id.as_str()]);
    pool.kill_launcher(0);
    pool.spawn_launcher();
    pool.wait_served().await;
    pool.client.release(r.nodes.clone()).await.unwrap();
    // Grace-time is 1 s: a node that is not held would be gone well before this.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let still = backing_of(&pool, &r.nodes[0]).await;
    assert_eq!(
        (still.state, still.idle),
        (BackingState::Ready, IdleBehaviour::Hold),
        "a held node was released"
    );
    // Empty and idle past its grace-time: running it again releases it at once, and the
    // order's answer says so (not "released after grace-time").
    let said = slotpool(&pool, &["run", a.id.as_str()]);
    assert!(said.contains("released now"), "{said}");
    wait_for("the node released once running again", SOON, || {
        gone(&pool, &a.id)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_with_bad_input_get_clear_errors_and_release_with_reason_is_recorded() {
    let pool = Pool::start(2, 5, &label("small", 2, 60, &[]), 1).await;
    let missing = BackingId::parse("bn-nosuchnode").unwrap();
    let err = pool
        .client
        .order(OperatorAction::Drain, missing, None)
        .await
        .unwrap_err();
    match err {
        BusError::Api(e) => {
            assert_eq!(e.code, ErrorCode::NotFound);
            assert!(e.message.contains("bn-nosuchnode"), "{}", e.message);
        }
        other => panic!("unexpected {other:?}"),
    }
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let a = backing_of(&pool, &r.nodes[0]).await;
    match pool
        .client
        .order(
            OperatorAction::Hold,
            a.id.clone(),
            Some("two\nlines".into()),
        )
        .await
        .unwrap_err()
    {
        BusError::Api(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains("reason"), "{}", e.message);
        }
        other => panic!("unexpected {other:?}"),
    }
    // Kill without --yes and without a terminal is refused, and nothing happens.
    let out = Command::new(bin_path("slotpool"))
        .args(pool.nats.args_as(Role::Operator, "op"))
        .args(["kill", a.id.as_str()])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--yes"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        backing_of(&pool, &r.nodes[0]).await.state,
        BackingState::Ready
    );

    let out = slotpool(
        &pool,
        &[
            "release",
            r.nodes[0].as_str(),
            "--reason",
            "job hung",
            "--wait",
        ],
    );
    assert!(out.contains("released"), "{out}");
    assert!(
        pool.nodes().await.is_empty(),
        "release --wait returns once the slot is free"
    );
    let events = pool.client.list_events().await.unwrap();
    assert!(
        events.iter().any(|e| e.kind == EventKind::Operator
            && e.node_id.as_ref() == Some(&r.nodes[0])
            && e.message.contains("release_node by op: job hung")),
        "{events:#?}"
    );
}

/// The CLI behaves like a Unix tool: a reader that stops early (`| head`) ends it
/// quietly, not with a panic, and a command that prints a result keeps stderr free of
/// connection chatter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_ends_quietly_on_a_closed_pipe_and_keeps_stderr_for_problems() {
    use std::os::unix::process::ExitStatusExt;
    let pool = Pool::start(1, 5, &label("small", 2, 30, &[]), 1).await;
    pool.fulfilled(&pool.submit(&["small"]).await).await;

    let listed = Command::new(bin_path("slotpool"))
        .args(pool.nats.args_as(Role::Operator, "op"))
        .args(["list", "requests"])
        .output()
        .expect("running slotpool");
    assert!(listed.status.success());
    assert!(
        listed.stderr.is_empty(),
        "stderr of a successful list: {}",
        String::from_utf8_lossy(&listed.stderr)
    );

    // The pipe's read end is closed before the command has connected and printed.
    let out = into_closed_pipe(&pool, &["list", "requests"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "slotpool list | (closed): {:?}\n{stderr}",
        out.status
    );
}

/// `slotpool config validate` names the key, what it takes and what it got, and takes
/// durations with a unit.
#[test]
fn config_validate_names_the_key_and_its_unit() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pool.yaml");
    let config = |grace: &str| {
        format!(
            "providers:\n  - name: local\n    driver: local\n    pools:\n      - name: main\n        max-servers: 2\n        labels:\n          - name: small\n            backing-label: vm\n            max-parallel-jobs: 4\n            grace-time: {grace}\n"
        )
    };
    let validate = |text: &str| {
        std::fs::write(&file, text).unwrap();
        Command::new(bin_path("slotpool"))
            .args(["config", "validate"])
            .arg(&file)
            .output()
            .expect("running slotpool")
    };
    let out = validate(&config("2m"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = validate(&config("two minutes please"));
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "error: {}:11:25: grace-time: expected seconds as a whole number (e.g. 120) or a duration with a unit (e.g. 2m, 90s, 1h 30m), got \"two minutes please\"\n",
            file.display()
        )
    );
}

/// `list backing` says why a held node is held (the order, who gave it and why), and
/// `list events` shows when each event happened and which backing node it is about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_backing_and_list_events_show_orders_times_and_backing_ids() {
    let pool = Pool::start(1, 5, &label("small", 2, 60, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let a = backing_of(&pool, &r.nodes[0]).await;
    slotpool(&pool, &["hold", a.id.as_str(), "--reason", "disk check"]);

    let backing = slotpool(&pool, &["list", "backing"]);
    let row = backing
        .lines()
        .find(|l| l.starts_with(a.id.as_str()))
        .unwrap_or_else(|| panic!("no row for {}:\n{backing}", a.id));
    assert!(row.ends_with("hold by op: disk check"), "{backing}");

    let events = slotpool(&pool, &["list", "events"]);
    let mut lines = events.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["TIME", "AGE", "KIND", "ACTOR", "BACKING", "EVENT"],
        "{events}"
    );
    let order = lines
        .find(|l| l.contains("operator") && l.contains("disk check"))
        .unwrap_or_else(|| panic!("no event of the order:\n{events}"));
    let cells: Vec<&str> = order.split_whitespace().collect();
    assert!(
        cells[0].len() == 20 && cells[0].ends_with('Z') && cells[0].contains('T'),
        "TIME is UTC to the second: {order}"
    );
    assert_eq!(cells[4], a.id.as_str(), "{order}");

    // Completion of live names: what the shell's script asks (`COMPLETE=<shell>`), with
    // the bus the environment names.
    let complete = |words: &[&str]| {
        let out = Command::new(bin_path("slotpool"))
            .env("COMPLETE", "fish")
            .env("SLOTPOOL_NATS_URL", pool.nats.url())
            .env("SLOTPOOL_NATS_CREDS", pool.nats.creds(Role::Operator, "op"))
            .arg("--")
            .args(words)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let offered = complete(&["slotpool", "hold", "bn-"]);
    assert!(offered.contains(a.id.as_str()), "backing ids: {offered}");
    let offered = complete(&["slotpool", "release", "node-"]);
    assert!(offered.contains(r.nodes[0].as_str()), "node ids: {offered}");
    let offered = complete(&["slotpool", "request", "--label", "sm"]);
    assert!(
        offered.lines().any(|l| l.starts_with("small")),
        "labels: {offered}"
    );

    // `list` filters, and a column named as the console names it (MODE).
    assert!(
        backing.lines().next().unwrap().contains(" MODE "),
        "{backing}"
    );
    let held = slotpool(
        &pool,
        &[
            "list",
            "backing",
            "--pool",
            "local/main",
            "--state",
            "ready",
        ],
    );
    assert!(held.contains(a.id.as_str()), "{held}");
    let none = slotpool(&pool, &["list", "backing", "--pool", "other"]);
    assert_eq!(none.lines().count(), 1, "{none}");
    let nodes = slotpool(&pool, &["list"]);
    assert!(
        nodes.contains(r.nodes[0].as_str()),
        "`list` lists the nodes: {nodes}"
    );
    let requests = slotpool(&pool, &["list", "requests", "--label", "small"]);
    assert!(
        requests.contains(r.id.as_str()),
        "a request holding a node: {requests}"
    );
    pool.client.release(r.nodes.clone()).await.unwrap();
    wait_for("the request to be over", SOON, || async {
        !slotpool(&pool, &["list", "requests"]).contains(r.id.as_str())
    })
    .await;
    let finished = slotpool(&pool, &["list", "requests", "--finished", "--limit", "1"]);
    assert!(finished.contains(r.id.as_str()), "{finished}");
    let out = Command::new(bin_path("slotpool"))
        .args(pool.nats.args_as(Role::Operator, "op"))
        .args(["list", "events", "--label", "small"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--label does not apply to `list events`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--help` keeps the NATS options apart from a command's own and shows examples; the
/// ignored `--actor` is gone; completions and manual pages are generated.
#[test]
fn the_cli_documents_itself() {
    let run = |args: &[&str]| {
        let out = Command::new(bin_path("slotpool"))
            .args(args)
            .output()
            .expect("running slotpool");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, help, _) = run(&["hold", "--help"]);
    assert!(ok);
    let own = help.find("--reason").expect("hold's own option");
    let nats = help.find("\nNATS options:\n").expect("a NATS heading");
    let creds = help.find("--creds").expect("--creds");
    assert!(own < nats && nats < creds, "{help}");
    assert!(help.contains("\nExample:\n  slotpool hold bn-"), "{help}");
    // Every status the code returns, in every --help.
    assert!(help.contains("\nExit status:\n  0    success"), "{help}");
    assert!(help.contains("\n  3    `release`"), "{help}");
    assert!(!help.contains("--actor"), "{help}");
    let (ok, _, err) = run(&["hold", "bn-x", "--actor", "bob"]);
    assert!(!ok && err.contains("--actor"), "{err}");

    let (ok, bash, _) = run(&["completions", "bash"]);
    // The script asks `slotpool` as the shell completes (live names, see the list test).
    assert!(ok && bash.contains("_clap_complete_slotpool"), "{bash}");
    let dir = tempfile::tempdir().unwrap();
    let (ok, _, err) = run(&["man", dir.path().to_str().unwrap()]);
    assert!(ok, "{err}");
    for page in [
        "slotpool.1",
        "slotpool-request.1",
        "slotpool-config-validate.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        let title = format!(".TH {} 1", page.trim_end_matches(".1"));
        assert!(text.contains(&title), "{page}: {text}");
        for section in [".SH \"EXIT STATUS\"", ".SH \"SEE ALSO\""] {
            assert!(text.contains(section), "{page} has no {section}");
        }
    }
    let request = std::fs::read_to_string(dir.path().join("slotpool-request.1")).unwrap();
    assert!(request.contains(".SH ENVIRONMENT") && request.contains("SLOTPOOL_SSH_KEY"));
    // Every page a page names exists (`slotpool-help(1)` did not).
    for entry in std::fs::read_dir(dir.path()).unwrap().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap();
        for named in text.split("\\fB").skip(1) {
            let Some((page, rest)) = named.split_once("\\fR") else {
                continue;
            };
            if rest.starts_with("(1)") {
                let file = format!("{}.1", page.replace("\\-", "-"));
                assert!(
                    dir.path().join(&file).exists(),
                    "{} names {file}, which is not written",
                    entry.path().display()
                );
            }
        }
    }
}

/// An operator asks who is in a slot through the launcher, which relays the agent's
/// answer; a client may not ask (the subject is an operator's), and an unknown backing
/// node is `not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_operator_may_ask_who_is_in_a_slot() {
    use slotpool_protocol::client::Client;
    let pool = Pool::start(1, 5, &label("small", 2, 30, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (backing, slot) = r.nodes[0].slot().expect("node id names its slot");

    let op = Client::connect(&pool.nats.options_as(Role::Operator, "op"))
        .await
        .expect("connecting as an operator");
    let occupants = op
        .slot_occupants(&backing, slot)
        .await
        .expect("an operator's question is answered");
    // The pool's agents run without slot users: nobody to count.
    assert_eq!(occupants.processes, 0, "{occupants:?}");
    assert!(occupants.logins.is_empty(), "{occupants:?}");

    let unknown = BackingId::parse("bn-01jq3m2f7h8g9k0m1n2p3q4r99").unwrap();
    match op.slot_occupants(&unknown, 0).await {
        Err(BusError::Api(e)) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("an unknown backing node: {other:?}"),
    }

    let ci = Client::connect(&pool.nats.options_as(Role::Client, "ci"))
        .await
        .expect("connecting as a client");
    let refused = ci.slot_occupants(&backing, slot).await;
    assert!(refused.is_err(), "a client was answered: {refused:?}");
}

/// `slotpool occupants` asks who is in a slot as the console does and prints it as a
/// line (and a table of SSH logins, if any) or JSON; an unknown backing node or slot is a
/// clear error, and a closed pipe no panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slotpool_occupants_says_who_is_in_a_slot() {
    let pool = Pool::start(1, 5, &label("small", 2, 30, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (backing, slot) = r.nodes[0].slot().expect("node id names its slot");
    let slot = slot.to_string();

    // The pool's agents run without slot users: nobody to count.
    let out = slotpool(&pool, &["occupants", backing.as_str(), &slot]);
    assert_eq!(
        out,
        format!("slot {slot} of {backing}: 0 processes, 0 SSH logins\n")
    );
    let out = slotpool(
        &pool,
        &["occupants", backing.as_str(), &slot, "--output", "json"],
    );
    let answer: slotpool_protocol::api::SlotOccupants =
        serde_json::from_str(&out).expect("JSON occupants");
    assert_eq!(answer, Default::default());

    let fails = |args: &[&str]| {
        let out = Command::new(bin_path("slotpool"))
            .args(pool.nats.args_as(Role::Operator, "op"))
            .arg("occupants")
            .args(args)
            .output()
            .expect("running slotpool");
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let unknown = "bn-01jq3m2f7h8g9k0m1n2p3q4r99";
    let err = fails(&[unknown, "0"]);
    assert!(
        err.starts_with(&format!("error: asking who is in slot 0 of {unknown}: ")),
        "{err}"
    );
    assert!(err.contains(&format!("no backing node {unknown}")), "{err}");
    let err = fails(&[backing.as_str(), "9"]);
    assert!(
        err.contains("slot 9 does not exist: this node has 2 slots (0 to 1)"),
        "{err}"
    );
    let err = fails(&["not-a-backing-id", "0"]);
    assert!(err.starts_with("error: "), "{err}");

    // The pipe's read end is closed before the answer is printed.
    let out = into_closed_pipe(&pool, &["occupants", backing.as_str(), &slot]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// An operator reads a backing node's agent log through the launcher: the lines the agent
/// logged (a slot prepared), newest last, as many as asked; a client may ask neither the
/// launcher (the subject is an operator's) nor the agent itself (only launchers command
/// agents).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_reads_an_agents_log_tail_and_a_client_is_refused() {
    use slotpool_protocol::api::AgentCommand;
    use slotpool_protocol::client::Client;
    use slotpool_protocol::layout::subjects;
    let pool = Pool::start(1, 5, &label("small", 2, 30, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (backing, _) = r.nodes[0].slot().expect("node id names its slot");

    let op = Client::connect(&pool.nats.options_as(Role::Operator, "op"))
        .await
        .expect("connecting as an operator");
    let tail = op
        .log_tail(&backing, 200)
        .await
        .expect("an operator's question is answered");
    assert!(
        tail.lines.iter().any(|l| l.contains("slot prepared")),
        "{:#?}",
        tail.lines
    );
    assert!(
        tail.lines.iter().all(|l| !l.chars().any(char::is_control)),
        "{:#?}",
        tail.lines
    );
    let two = op.log_tail(&backing, 2).await.expect("a shorter tail");
    assert_eq!(two.lines.len(), 2, "{two:?}");

    let unknown = BackingId::parse("bn-01jq3m2f7h8g9k0m1n2p3q4r99").unwrap();
    match op.log_tail(&unknown, 10).await {
        Err(BusError::Api(e)) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("an unknown backing node: {other:?}"),
    }

    let ci = Client::connect(&pool.nats.options_as(Role::Client, "ci"))
        .await
        .expect("connecting as a client");
    let refused = ci.log_tail(&backing, 10).await;
    assert!(refused.is_err(), "a client was answered: {refused:?}");
    let direct: Result<slotpool_protocol::api::LogTail, _> = ci
        .bus()
        .call(
            &subjects::agent(&backing),
            &AgentCommand::LogTail { lines: 10 },
            Duration::from_secs(3),
        )
        .await;
    assert!(direct.is_err(), "the agent answered a client: {direct:?}");
}

/// `slotpool logs` prints a backing node's agent log tail, and ends quietly when its
/// reader has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slotpool_logs_prints_the_agent_log_tail_and_ends_quietly_on_a_closed_pipe() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let pool = Pool::start(1, 5, &label("small", 2, 30, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (backing, _) = r.nodes[0].slot().expect("node id names its slot");
    let backing = backing.to_string();

    let printed = slotpool(&pool, &["logs", &backing, "--lines", "200"]);
    assert!(printed.contains("slot prepared"), "{printed}");
    let three = slotpool(&pool, &["logs", &backing, "-n", "3"]);
    assert_eq!(three.lines().count(), 3, "{three}");
    let json = slotpool(&pool, &["logs", &backing, "-n", "3", "--output", "json"]);
    let lines: Vec<String> = serde_json::from_str(&json).expect("a JSON list of lines");
    assert_eq!(lines.len(), 3, "{json}");

    let mut child = Command::new(bin_path("slotpool"))
        .args(pool.nats.args_as(Role::Operator, "op"))
        .args(["logs", &backing])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running slotpool");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("waiting for slotpool");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "slotpool logs | (closed): {:?}\n{stderr}",
        out.status
    );
}
