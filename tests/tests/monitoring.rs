//! The monitoring files shipped in `packaging/`: the alert rules pass `promtool check
//! rules`, every metric the rules and the Grafana dashboard use is served by a real
//! launcher, and a real Prometheus scrapes a launcher and answers PromQL over it.

use slotpool_tests::metrics::get;
use slotpool_tests::prometheus::{Prometheus, PROMTOOL};
use slotpool_tests::{label, wait_for_some, workspace_root, Pool, AGENT_ARGS};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn alert_rules() -> PathBuf {
    workspace_root().join("packaging/prometheus/slotpool-alerts.yml")
}

fn dashboard() -> PathBuf {
    workspace_root().join("packaging/grafana/slotpool-dashboard.json")
}

/// A pool of one launcher serving `--http` on an ephemeral loopback port.
async fn pool_with_http() -> Pool {
    let labels = label("small", 2, 60, &[]);
    Pool::start_serving_with(2, 5, &labels, 1, &AGENT_ARGS, &["--http", "127.0.0.1:0"]).await
}

/// Every `slotpool_*` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("slotpool_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

#[test]
fn the_alert_rules_pass_promtool() {
    let out = Command::new(PROMTOOL)
        .arg("check")
        .arg("rules")
        .arg(alert_rules())
        .output()
        .unwrap_or_else(|err| {
            panic!("cannot run {PROMTOOL} ({err}): install Debian's prometheus package")
        });
    assert!(
        out.status.success(),
        "promtool check rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The alerts that say a launcher stopped deciding fire on the series a stalled
/// launcher serves (tests/tests/stall.rs shows that it serves them) and stay quiet on a
/// healthy one's: `promtool test rules` over synthetic series.
#[test]
fn the_stall_alerts_fire_on_a_stalled_launcher_only() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tests =
        std::fs::read_to_string(workspace_root().join("tests/fixtures/alerts-stall.test.yml"))
            .expect("the alert tests")
            .replace("RULES", &alert_rules().display().to_string());
    let path = dir.path().join("alerts.test.yml");
    std::fs::write(&path, tests).expect("writing the alert tests");
    let out = Command::new(PROMTOOL)
        .arg("test")
        .arg("rules")
        .arg(&path)
        .output()
        .unwrap_or_else(|err| {
            panic!("cannot run {PROMTOOL} ({err}): install Debian's prometheus package")
        });
    assert!(
        out.status.success(),
        "promtool test rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_metric_the_dashboard_and_the_alerts_use_is_served() {
    let rules = std::fs::read_to_string(alert_rules()).expect("the alert rules");
    let board = std::fs::read_to_string(dashboard()).expect("the dashboard");
    // The dashboard is Grafana JSON whose panels each query Prometheus.
    let json: serde_json::Value = serde_json::from_str(&board).expect("the dashboard is JSON");
    let panels = json["panels"].as_array().expect("panels");
    let exprs: Vec<&str> = panels
        .iter()
        .filter_map(|p| p["targets"].as_array())
        .flatten()
        .map(|t| t["expr"].as_str().expect("a target's expr"))
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    let rules: String = rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let used: BTreeSet<String> = metric_names(&rules)
        .into_iter()
        .chain(metric_names(&board))
        .collect();
    assert!(used.len() >= 10, "{used:?}");

    let pool = pool_with_http().await;
    let token = pool.operator_token();
    let (status, text) = get(pool.http_addr(0).await, "/metrics", Some(&token)).await;
    assert_eq!(status, 200, "{text}");
    let served: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    let missing: Vec<&String> = used.difference(&served).collect();
    assert!(
        missing.is_empty(),
        "used by the dashboard or the alerts but not served: {missing:?}\nserved: {served:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_scrapes_a_launcher_and_answers_promql() {
    let pool = pool_with_http().await;
    let token = pool.operator_token();
    let prometheus = Prometheus::start(&[pool.http_addr(0).await], Some(&token)).await;
    // Two requests fulfilled: Prometheus sees the launch and both fulfilments, with the
    // labels the launcher gives them.
    for _ in 0..2 {
        pool.fulfilled(&pool.submit(&["small"]).await).await;
    }
    let launched = wait_for_some("Prometheus to have scraped the launch", WAIT, || async {
        let r = prometheus
            .query(
                r#"sum by (provider, pool, label) (slotpool_launches_total{outcome="launched"})"#,
            )
            .await;
        r.into_iter().find(|(_, v)| *v >= 1.0)
    })
    .await;
    assert_eq!(launched.0["label"], "small", "{launched:?}");
    let fulfilled = wait_for_some("Prometheus to count both fulfilments", WAIT, || async {
        let r = prometheus
            .query("sum(slotpool_allocation_seconds_count)")
            .await;
        r.into_iter().find(|(_, v)| *v == 2.0)
    })
    .await;
    assert_eq!(fulfilled.1, 2.0);
    // The backing node that serves them booted once.
    wait_for_some("Prometheus to count the boot", WAIT, || async {
        let r = prometheus.query("sum(slotpool_boot_seconds_count)").await;
        r.into_iter().find(|(_, v)| *v == 1.0)
    })
    .await;
    // A pool-wide gauge the way the alerts read it: the slots in use.
    wait_for_some("Prometheus to see two slots in use", WAIT, || async {
        let r = prometheus
            .query(r#"max by (label) (slotpool_slots{state="used"})"#)
            .await;
        r.into_iter()
            .find(|(l, v)| l["label"] == "small" && *v == 2.0)
    })
    .await;
    // The scrape target is up, as Prometheus itself says.
    let up = prometheus.query(r#"up{job="slotpool"}"#).await;
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0].1, 1.0, "{up:?}");
}
