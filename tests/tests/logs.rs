//! `--log-format json`: every line of the launcher's and the agent's logs is a JSON
//! object, and a request can be found by its id as a field.

use serde_json::Value;
use slotpool_tests::{label, wait_for, Pool, AGENT_ARGS};
use std::time::Duration;

/// The lines of `log`, each parsed as JSON (panics on one that is not).
fn json_lines(what: &str, log: &str) -> Vec<Value> {
    log.lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|err| panic!("{what}: a line is not JSON ({err}): {line}"))
        })
        .collect()
}

/// Whether a JSON log line has `field` = `value` in one of its spans.
fn in_span(line: &Value, field: &str, value: &str) -> bool {
    line["spans"]
        .as_array()
        .is_some_and(|spans| spans.iter().any(|s| s[field] == value))
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_carry_the_ids_as_fields() {
    let mut agent_args = AGENT_ARGS.to_vec();
    agent_args.extend(["--log-format", "json"]);
    let pool = Pool::start_serving_with(
        1,
        5,
        &label("small", 1, 60, &[]),
        1,
        &agent_args,
        &["--log-format", "json"],
    )
    .await;
    let id = pool.submit(&["small"]).await;
    let r = pool.fulfilled(&id).await;
    let id = id.to_string();
    wait_for(
        "the launcher to log the fulfilment",
        Duration::from_secs(30),
        || {
            let log = pool.launcher_log(0);
            let id = id.clone();
            async move { log.contains("fulfilled") && log.contains(&id) }
        },
    )
    .await;

    let launcher = json_lines("launcher", &pool.launcher_log(0));
    let fulfilled = launcher
        .iter()
        .find(|l| l["message"] == "fulfilled" && in_span(l, "request_id", &id))
        .unwrap_or_else(|| panic!("no `fulfilled` line with request_id {id}: {launcher:#?}"));
    assert_eq!(fulfilled["level"], "INFO");

    let node = pool.node(&r.nodes[0]).await;
    let backing_id = node.backing_id.to_string();
    let agent_log =
        std::fs::read_to_string(pool.agent_dir(&backing_id).join("agent.log")).expect("agent log");
    let agent = json_lines("agent", &agent_log);
    assert!(
        agent.iter().any(|l| in_span(l, "backing_id", &backing_id)),
        "no agent line in the span of backing node {backing_id}: {agent:#?}"
    );
}
