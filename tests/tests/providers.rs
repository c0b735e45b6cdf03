//! End-to-end tests of the `static` and `exec` providers with real agents: static hosts
//! whose agents the test runs itself, and an exec provider (a script speaking the JSON
//! contract) whose "machines" are agent processes.

use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_protocol::model::{BackingState, NodeRequest, ProviderCall, RequestState};
use slotpool_tests::exec_provider::{exec_config, switch_on, KillUnder};
use slotpool_tests::metrics::{http_addr_in, scrape_as, value};
use slotpool_tests::{bin_path, wait_for, wait_for_some, wait_served, ChildGuard, NatsServer};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

const SOON: Duration = Duration::from_secs(20);

/// A `slotpool serve` process; its log is printed if the test fails.
struct Launcher {
    _child: ChildGuard,
    log: PathBuf,
}

impl Launcher {
    fn start(nats: &NatsServer, dir: &Path, config: &str) -> Launcher {
        Launcher::start_with(nats, dir, config, &[])
    }

    /// [`Launcher::start`] with `extra` added to `slotpool serve`'s arguments.
    fn start_with(nats: &NatsServer, dir: &Path, config: &str, extra: &[&str]) -> Launcher {
        let path = dir.join("pool.yaml");
        std::fs::write(&path, config).unwrap();
        let log = dir.join("launcher.log");
        let mut cmd = Command::new(bin_path("slotpool"));
        cmd.args(nats.serve_args(&path))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        Launcher {
            _child: ChildGuard::spawn("launcher", cmd).unwrap(),
            log,
        }
    }
}

impl Launcher {
    /// Where it serves HTTP (started with `--http`), once its log says.
    async fn http_addr(&self) -> std::net::SocketAddr {
        wait_for_some("the launcher to say where it serves HTTP", SOON, || async {
            http_addr_in(&std::fs::read_to_string(&self.log).unwrap_or_default())
        })
        .await
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- launcher log\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

async fn fulfilled(client: &Client, labels: &[&str]) -> NodeRequest {
    let sub = slotpool_protocol::client::submission(
        labels.iter().map(|l| l.to_string()).collect(),
        "providers-test",
    );
    let id = client.submit(&sub).await.expect("submit");
    let r = tokio::time::timeout(SOON, client.wait(&id, |_| {}))
        .await
        .unwrap_or_else(|_| panic!("request {id} not final in time"))
        .unwrap();
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    r
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Starts a real agent for static host `name` with `secret`.
fn static_agent(nats: &NatsServer, dir: &Path, name: &str, secret: &str) -> ChildGuard {
    let secret_file = dir.join(format!("{name}.secret"));
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let mut cmd = Command::new(bin_path("slotpool-agent"));
    cmd.args(nats.args_as(Role::Agent, name))
        .args(["--backing-id", name, "--slots", "2"])
        .args([
            "--heartbeat-interval-ms",
            "300",
            "--heartbeat-ttl-secs",
            "2",
        ])
        // Per-slot users and cgroups are the isolation tests' business; here they would
        // outlive the SIGKILLed agents.
        .args(["--isolation", "none"])
        .arg("--secret-file")
        .arg(&secret_file)
        .arg("--work-dir")
        .arg(dir.join(name))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap());
    ChildGuard::spawn(name.to_string(), cmd).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_hosts_are_used_released_and_used_again_but_never_deleted() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let mut agents = vec![
        static_agent(&nats, d, "lab-1", "secret-one"),
        static_agent(&nats, d, "lab-2", "secret-two"),
    ];
    let config = format!(
        "providers:
  - name: lab
    driver: static
    static:
      hosts:
        - {{name: lab-1, host: 192.0.2.11, secret-file: {d}/lab-1.secret, attributes: {{rack: a}}}}
        - {{name: lab-2, host: 192.0.2.12, secret-file: {d}/lab-2.secret}}
    pools:
      - name: main
        max-servers: 2
        labels:
          - {{name: small, backing-label: lab-host, max-parallel-jobs: 2, grace-time: 1,
              node-attributes: {{size: small}}}}
",
        d = d.display()
    );
    let _launcher = Launcher::start(&nats, d, &config);
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;

    let r = fulfilled(&client, &["small", "small", "small"]).await;
    let nodes = client.list_nodes().await.unwrap();
    assert_eq!(nodes.len(), 3);
    // Three slots of two 2-slot hosts: one host is full, the other has one node (which
    // host becomes ready first is a race).
    let hosts_of = |backing: &'static str| -> Vec<&str> {
        nodes
            .iter()
            .filter(|n| n.backing_id.as_str() == backing)
            .map(|n| n.host.as_str())
            .collect()
    };
    let (lab1, lab2) = (hosts_of("lab-1"), hosts_of("lab-2"));
    assert_eq!(
        (lab1.len() + lab2.len(), lab1.len().max(lab2.len())),
        (3, 2),
        "{nodes:?}"
    );
    assert!(lab1.iter().all(|h| *h == "192.0.2.11"), "{nodes:?}");
    assert!(lab2.iter().all(|h| *h == "192.0.2.12"), "{nodes:?}");
    let on_lab1 = nodes
        .iter()
        .find(|n| n.backing_id.as_str() == "lab-1")
        .unwrap();
    assert_eq!(on_lab1.attributes["rack"], "a", "{on_lab1:?}");
    assert_eq!(on_lab1.attributes["size"], "small", "{on_lab1:?}");

    client.release(r.nodes.clone()).await.unwrap();
    wait_for(
        "both static seats released after grace-time",
        SOON,
        || async { client.list_backing().await.unwrap().is_empty() },
    )
    .await;
    for agent in &mut agents {
        assert!(
            agent.try_wait().is_none(),
            "{} was stopped: static hosts are never deleted",
            agent.name()
        );
    }
    // The same hosts serve again.
    let again = fulfilled(&client, &["small"]).await;
    let node = &client.list_nodes().await.unwrap()[0];
    assert_eq!(again.nodes[0], node.id);
    assert!(node.backing_id.as_str().starts_with("lab-"), "{node:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_provider_launches_and_deletes_real_machines() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let state = dir.path().join("machines");
    // Whatever machine the launcher has not deleted when the test ends, passed or not.
    let _machines = KillUnder(state.clone());
    let _launcher = Launcher::start(&nats, dir.path(), &exec_config(&state, 3));
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;

    let r = fulfilled(&client, &["small"]).await;
    let node = client.list_nodes().await.unwrap().remove(0);
    assert_eq!(node.attributes["made-by"], "exec", "{node:?}");
    let backing = client.list_backing().await.unwrap().remove(0);
    assert_eq!(backing.state, BackingState::Ready);
    let instance = backing.instance.expect("instance recorded");
    let pid = instance.data["pid"].as_i64().unwrap() as i32;
    assert!(alive(pid), "the machine's agent is not running");

    client.release(r.nodes.clone()).await.unwrap();
    wait_for("the machine released after grace-time", SOON, || async {
        client.list_backing().await.unwrap().is_empty()
    })
    .await;
    wait_for("the machine's agent stopped by delete", SOON, || async {
        !alive(pid)
    })
    .await;
    let left: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .collect();
    assert!(left.is_empty(), "machines still listed: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_capacity_makes_requests_wait_and_a_broken_launch_fails_them() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let state = dir.path().join("machines");
    // Whatever machine the launcher has not deleted when the test ends, passed or not.
    let _machines = KillUnder(state.clone());
    switch_on(&state, "out-of-capacity", "");
    let http = ["--http", "127.0.0.1:0"];
    let launcher = Launcher::start_with(&nats, dir.path(), &exec_config(&state, 1), &http);
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;
    let addr = launcher.http_addr().await;
    let token = nats.http_token(Role::Operator, "ops");
    let scrape = |addr| scrape_as(addr, Some(&token));
    let cloud = [("provider", "cloud"), ("pool", "main")];

    // Out of capacity (exit 75): the request waits, saying why, even past launch-retries.
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "t");
    let id = client.submit(&sub).await.unwrap();
    wait_for(
        "the request to say the provider is out of capacity",
        SOON,
        || async {
            let r = client.request(&id).await.unwrap().unwrap();
            r.state == RequestState::Requested && r.status.contains("out of capacity")
        },
    )
    .await;
    // `/metrics`: the refused launch, the provider's error, and the seat in back-off.
    let s = scrape(addr).await;
    let capacity = [("outcome", "capacity")];
    assert!(
        value(
            &s,
            "slotpool_launches_total",
            &[&cloud[..], &capacity].concat()
        ) >= 1.0
    );
    let refused = [("call", "launch"), ("kind", "capacity")];
    assert!(
        value(
            &s,
            "slotpool_provider_errors_total",
            &[&cloud[..1], &refused].concat()
        ) >= 1.0
    );
    assert_eq!(value(&s, "slotpool_capacity_backoff_seats", &cloud), 1.0);
    // Capacity comes back: the next attempt (after the back-off) serves it.
    std::fs::remove_file(state.join("out-of-capacity")).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(40), client.wait(&id, |_| {}))
        .await
        .expect("served once capacity came back")
        .unwrap();
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    client.release(r.nodes).await.unwrap();

    // A launch that fails for good fails the request, quoting the provider's error.
    switch_on(&state, "broken", "");
    wait_for("the idle machine released", SOON, || async {
        client.list_backing().await.unwrap().is_empty()
    })
    .await;
    let id = client.submit(&sub).await.unwrap();
    let r = tokio::time::timeout(SOON, client.wait(&id, |_| {}))
        .await
        .expect("failed in time")
        .unwrap();
    assert_eq!(r.state, RequestState::Failed, "{r:?}");
    let why = r.failure.unwrap_or_default();
    assert!(why.contains("image not found"), "{why}");
    // `/metrics`: the failed launch, the provider's error, each failed backing node
    // (counted once its failure is written), and no seat left in back-off. The capacity
    // planner may launch once more on the next seat before the request's own step fails
    // it (the two see the first failure apart), so one or two launches fail; each is
    // counted once as a launch and once as a failed backing node.
    let s = wait_for_some(
        "/metrics to count each failed launch's backing node",
        SOON,
        || async {
            let s = scrape(addr).await;
            let failed_nodes = value(
                &s,
                "slotpool_backing_deletions_total",
                &[&cloud[..], &[("reason", "failure")]].concat(),
            );
            let failed_launches = value(
                &s,
                "slotpool_launches_total",
                &[&cloud[..], &[("outcome", "failed")]].concat(),
            );
            (failed_nodes >= 1.0 && failed_nodes == failed_launches).then_some(s)
        },
    )
    .await;
    let broken = [("call", "launch"), ("kind", "failed")];
    assert!(
        value(
            &s,
            "slotpool_provider_errors_total",
            &[&cloud[..1], &broken].concat()
        ) >= 1.0
    );
    assert_eq!(value(&s, "slotpool_capacity_backoff_seats", &cloud), 0.0);
}

/// A provider's failing launch is a record of its own (its last error, which call, how
/// many in a row) that `slotpool list providers` shows; the launch that works again
/// clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_last_error_is_recorded_listed_and_cleared_by_a_launch_that_works() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let state = dir.path().join("machines");
    // Whatever machine the launcher has not deleted when the test ends, passed or not.
    let _machines = KillUnder(state.clone());
    switch_on(&state, "broken", "");
    let _launcher = Launcher::start(&nats, dir.path(), &exec_config(&state, 2));
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;

    let sub = slotpool_protocol::client::submission(vec!["small".into()], "t");
    let id = client.submit(&sub).await.unwrap();
    let status = wait_for_some("the provider's last error recorded", SOON, || async {
        client
            .list_providers()
            .await
            .unwrap()
            .into_iter()
            .find(|p| p.provider == "cloud")
    })
    .await;
    assert_eq!(status.call, ProviderCall::Launch, "{status:?}");
    assert!(status.error.contains("image not found"), "{status:?}");
    assert!(status.failures >= 1, "{status:?}");
    assert_eq!(status.capacity_until, None, "{status:?}");

    let listed = Command::new(bin_path("slotpool"))
        .args(nats.args_as(Role::Operator, "op"))
        .args(["list", "providers"])
        .output()
        .expect("running slotpool");
    let out = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let row = out
        .lines()
        .find(|l| l.starts_with("cloud"))
        .unwrap_or_else(|| panic!("no row for the provider:\n{out}"));
    assert!(row.contains("launch"), "{out}");
    assert!(row.contains("image not found"), "{out}");

    let r = tokio::time::timeout(SOON, client.wait(&id, |_| {}))
        .await
        .expect("failed in time")
        .unwrap();
    assert_eq!(r.state, RequestState::Failed, "{r:?}");
    // The provider works again: the next launch clears the record.
    std::fs::remove_file(state.join("broken")).unwrap();
    fulfilled(&client, &["small"]).await;
    wait_for("the provider's last error cleared", SOON, || async {
        client.list_providers().await.unwrap().is_empty()
    })
    .await;
    let listed = Command::new(bin_path("slotpool"))
        .args(nats.args_as(Role::Operator, "op"))
        .args(["list", "providers"])
        .output()
        .expect("running slotpool");
    let out = String::from_utf8_lossy(&listed.stdout);
    assert!(!out.contains("cloud"), "{out}");
}

/// A create command that started its machine but hangs past `launch-timeout` printed no
/// instance, so none is recorded: the launcher asks the provider for what it lists under
/// the backing id and deletes it, long before any leak sweep (default 300 s) runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_that_times_out_leaves_no_machine_behind() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let state = dir.path().join("machines");
    // Dropped after the launcher: a launch it started again may still hang.
    let _cleanup = KillUnder(state.clone());
    switch_on(&state, "hang", "");
    let config = exec_config(&state, 1).replace(
        "boot-timeout: 20",
        "boot-timeout: 20\n        launch-timeout: 2",
    );
    let _launcher = Launcher::start(&nats, dir.path(), &config);
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "providers-test");
    client.submit(&sub).await.expect("submit");

    // A record the provider is still writing is read again on the next look.
    let machine = |entry: &std::fs::DirEntry| {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.ends_with(".json") {
            return None;
        }
        let bytes = std::fs::read(entry.path()).ok()?;
        let record: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        Some(record["data"]["pid"].as_i64()? as i32)
    };
    let machines = || -> Vec<i32> {
        std::fs::read_dir(&state)
            .map(|d| d.flatten().filter_map(|e| machine(&e)).collect())
            .unwrap_or_default()
    };
    let started = wait_for_some("the hanging create to start a machine", SOON, || async {
        machines().first().copied()
    })
    .await;
    assert!(alive(started));
    wait_for("the timed-out launch's machine deleted", SOON, || async {
        !alive(started) && !machines().contains(&started)
    })
    .await;
}

/// Kills the local provider's agents under a work dir when the test ends.
struct LocalAgents(PathBuf);

impl Drop for LocalAgents {
    fn drop(&mut self) {
        slotpool_tests::kill_agents(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_out_of_capacity_falls_back_to_the_next_pool_by_priority() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let state = dir.path().join("machines");
    // Whatever machine the launcher has not deleted when the test ends, passed or not.
    let _machines = KillUnder(state.clone());
    switch_on(&state, "out-of-capacity", "");
    let agents = LocalAgents(dir.path().join("agents"));
    let agent_args = serde_json::to_string(&slotpool_tests::AGENT_ARGS).unwrap();
    // The exec pool comes first by priority; the local pool serving the same label is
    // the fallback.
    let config = format!(
        "{}  - name: local
    driver: local
    local:
      work-dir: {}
      agent-args: {agent_args}
    pools:
      - name: spare
        priority: 10
        max-servers: 1
        boot-timeout: 20
        labels:
          - {{name: small, backing-label: vm, max-parallel-jobs: 2, grace-time: 30}}
",
        exec_config(&state, 1).replace("max-servers: 2", "priority: 0\n        max-servers: 1"),
        agents.0.display()
    );
    let _launcher = Launcher::start(&nats, dir.path(), &config);
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;

    let r = fulfilled(&client, &["small"]).await;
    let node = client.list_nodes().await.unwrap().remove(0);
    assert_eq!(r.nodes, vec![node.id.clone()]);
    let backing = client.list_backing().await.unwrap();
    let serving = backing
        .iter()
        .find(|b| b.id == node.backing_id)
        .expect("the node's backing node");
    assert_eq!(serving.provider, "local", "{backing:?}");
    assert!(
        backing
            .iter()
            .any(|b| b.provider == "cloud" && b.out_of_capacity),
        "the first pool was tried first: {backing:?}"
    );
}

/// A launcher killed after its exec provider started the machine (whose agent runs and
/// heartbeats) and before the end of the attempt was written leaves a record that says
/// only that the attempt began. With `launch-retries: 1` that failed the node, and with
/// it the waiting request, and left the machine's agent running with nothing owning it
/// until a leak sweep. The launcher that takes the seat over asks the provider for what
/// the attempt started and adopts it: the request is served on that very machine, and
/// no other is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_interrupted_by_the_launchers_death_is_adopted_by_the_next() {
    let nats = NatsServer::start().await;
    let dir = TempDir::new().unwrap();
    let state = dir.path().join("machines");
    // Dropped after the launchers: the hanging create outlives the first.
    let _cleanup = KillUnder(state.clone());
    switch_on(&state, "hang", "");
    let config = format!(
        "launcher:\n  lease-ttl: 3\n{}",
        exec_config(&state, 1).replace(
            "boot-timeout: 20",
            "boot-timeout: 20\n        launch-timeout: 120"
        )
    );
    let first_dir = dir.path().join("first");
    std::fs::create_dir_all(&first_dir).unwrap();
    let first = Launcher::start(&nats, &first_dir, &config);
    let client = Client::from_bus(nats.bus().await);
    wait_served(&client).await;
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "providers-test");
    let id = client.submit(&sub).await.expect("submit");

    // The create started its machine, whose agent reports in, and hangs.
    // A record the provider is still writing is read again on the next look.
    let machine = |entry: &std::fs::DirEntry| {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.ends_with(".json") {
            return None;
        }
        let bytes = std::fs::read(entry.path()).ok()?;
        let record: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        Some((
            record["id"].as_str()?.to_string(),
            record["backing_id"].as_str()?.to_string(),
        ))
    };
    let machines = || -> Vec<(String, String)> {
        std::fs::read_dir(&state)
            .map(|d| d.flatten().filter_map(|e| machine(&e)).collect())
            .unwrap_or_default()
    };
    let (started, backing_id) = wait_for_some("the create to start a machine", SOON, || async {
        machines().first().cloned()
    })
    .await;
    wait_for("the machine's agent to heartbeat", SOON, || async {
        client
            .list_agents()
            .await
            .is_ok_and(|agents| agents.iter().any(|a| a.backing_id.as_str() == backing_id))
    })
    .await;
    let b = client.list_backing().await.unwrap();
    assert!(
        b.iter().any(|b| b.id.as_str() == backing_id
            && b.state == BackingState::Launching
            && b.instance.is_none()),
        "the attempt is not recorded as begun and unended: {b:?}"
    );

    // The launcher dies with the create still running; the next one starts.
    drop(first);
    std::fs::remove_file(state.join("hang")).unwrap();
    let second_dir = dir.path().join("second");
    std::fs::create_dir_all(&second_dir).unwrap();
    let _second = Launcher::start(&nats, &second_dir, &config);

    let r = tokio::time::timeout(Duration::from_secs(60), client.wait(&id, |_| {}))
        .await
        .expect("the request ends in time")
        .unwrap();
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    let node = client.list_nodes().await.unwrap();
    assert_eq!(
        node[0].backing_id.as_str(),
        backing_id,
        "served on another machine: {node:?}"
    );
    let b = client.list_backing().await.unwrap();
    let adopted = b.iter().find(|b| b.id.as_str() == backing_id).unwrap();
    assert_eq!(adopted.state, BackingState::Ready, "{adopted:?}");
    assert_eq!(
        adopted.instance.as_ref().map(|i| i.id.as_str()),
        Some(started.as_str()),
        "{adopted:?}"
    );
    assert_eq!(adopted.attempts, 1, "{adopted:?}");
    assert_eq!(
        machines(),
        vec![(started, backing_id)],
        "a machine was made again or left behind"
    );
}
