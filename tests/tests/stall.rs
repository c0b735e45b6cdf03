//! A launcher whose decisions stall cannot look healthy: `/readyz` says it is stalled,
//! `slotpool_launcher_pass_age_seconds` grows past the alert's threshold, and a stop
//! signal still ends it within its grace. The stall is the debug builds' test hook: the
//! supervisor blocks the thread it runs on while a file exists, as a task that never
//! yields would. It is the only test of this binary, since the hook is read from the
//! environment the launcher inherits.

use slotpool_tests::metrics::{get, http_addr_in};
use slotpool_tests::{config_yaml, kill_agents, spawn_serve, AgentsGuard};
use slotpool_tests::{label, wait_for_some, NatsServer};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_launcher_is_not_ready_and_still_stops() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let stall = dir.path().join("stall");
    std::env::set_var("SLOTPOOL_TEST_STALL_FILE", &stall);
    let agents = dir.path().join("agents");
    let _agents = AgentsGuard(agents.clone());
    let config = dir.path().join("pool.yaml");
    let yaml = config_yaml(&agents, 1, 5, &label("small", 1, 60, &[])).replacen(
        "launcher:\n",
        "launcher:\n  stall-after: 20\n",
        1,
    );
    std::fs::write(&config, yaml).expect("config");
    let log = dir.path().join("launcher.log");
    let mut args = nats.serve_args(&config);
    args.extend(["--http".to_string(), "127.0.0.1:0".to_string()]);
    let mut launcher = spawn_serve("launcher", &args, &log);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let addr = wait_for_some(
        "the launcher's HTTP address",
        Duration::from_secs(30),
        || async { http_addr_in(&read_log()) },
    )
    .await;
    wait_for_some(
        "the launcher to be ready",
        Duration::from_secs(30),
        || async { (get(addr, "/readyz", None).await.0 == 200).then_some(()) },
    )
    .await;

    // The supervisor's next pass (the resync, at the latest) blocks its thread.
    std::fs::write(&stall, b"").expect("stall file");
    let stalled_at = Instant::now();
    let (status, body) = wait_for_some(
        "/readyz to say stalled",
        Duration::from_secs(60),
        || async {
            let (status, body) = get(addr, "/readyz", None).await;
            (status == 503).then_some((status, body))
        },
    )
    .await;
    assert!(
        body.starts_with("stalled: the supervisor has not finished a pass for"),
        "{status} {body}"
    );
    let token = nats.http_token(slotpool_protocol::auth::Role::Operator, "ops");
    let (_, metrics) = get(addr, "/metrics", Some(&token)).await;
    let age: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("slotpool_launcher_pass_age_seconds "))
        .unwrap_or_else(|| panic!("the pass age is not served:\n{metrics}"))
        .parse()
        .expect("a number");
    assert!(age >= 20.0, "pass age {age}\n{metrics}");
    eprintln!(
        "stalled after {:?}: /readyz {status} {body:?}, pass age {age} s",
        stalled_at.elapsed()
    );

    // A stop signal ends it although its supervisor never sees the shutdown.
    let asked = Instant::now();
    let exit = launcher.terminate(Duration::from_secs(30)).await;
    let took = asked.elapsed();
    eprintln!("stopped in {took:?}: {exit:?}");
    assert!(
        took < Duration::from_secs(20),
        "SIGTERM took {took:?} to stop a stalled launcher\n{}",
        read_log()
    );
    assert!(
        !exit.success(),
        "a forced stop exits with a failure: {exit:?}"
    );
    assert!(read_log().contains("exiting now"), "{}", read_log());
    std::fs::remove_file(&stall).ok();
    kill_agents(&agents);
}
