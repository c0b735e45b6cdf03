//! `slotpool-agent --metrics`: a real agent, started by a launcher's local provider,
//! serving its metrics; read back with a Prometheus text-format parser while a slot is
//! prepared and released.

use prometheus_parse::Scrape;
use slotpool_tests::metrics::{self, scrape};
use slotpool_tests::{label, wait_for, wait_for_some, Pool, AGENT_ARGS};
use std::net::SocketAddr;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

/// The value of `metric` with `labels` (a histogram: its count), if the agent serves it.
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    (!metrics::samples(scrape, metric, labels).is_empty())
        .then(|| metrics::value(scrape, metric, labels))
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_counts_its_slots_prepares_releases_and_heartbeats() {
    let mut agent_args = AGENT_ARGS.to_vec();
    agent_args.extend(["--metrics", "127.0.0.1:0"]);
    let pool =
        Pool::start_serving_with(1, 5, &label("small", 2, 60, &[]), 1, &agent_args, &[]).await;
    let id = pool.submit(&["small"]).await;
    let request = pool.fulfilled(&id).await;
    let backing = pool.backing().await;
    assert_eq!(backing.len(), 1, "{backing:?}");
    let log = pool.agent_dir(backing[0].id.as_str()).join("agent.log");
    let addr: SocketAddr = wait_for_some("the agent to say where it serves metrics", WAIT, || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        async move {
            text.lines()
                .find_map(|l| l.split("metrics listening on ").nth(1))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|a| a.parse().ok())
        }
    })
    .await;

    let s = scrape(addr).await;
    let count = |s: &Scrape, m| value(s, m, &[]).unwrap_or_else(|| panic!("{m} missing"));
    assert_eq!(
        value(&s, "slotpool_agent_slots", &[("state", "used")]),
        Some(1.0)
    );
    assert_eq!(
        value(&s, "slotpool_agent_slots", &[("state", "free")]),
        Some(1.0)
    );
    assert_eq!(
        value(&s, "slotpool_agent_slots", &[("state", "dirty")]),
        Some(0.0)
    );
    assert_eq!(count(&s, "slotpool_agent_prepare_seconds"), 1.0);
    assert_eq!(count(&s, "slotpool_agent_release_seconds"), 0.0);
    assert_eq!(count(&s, "slotpool_agent_wipe_failures_total"), 0.0);
    assert!(
        value(
            &s,
            "slotpool_agent_heartbeats_total",
            &[("outcome", "written")]
        )
        .is_some_and(|n| n >= 1.0),
        "{:?}",
        s.samples
    );

    pool.release_and_wait(&request.nodes).await;
    wait_for(
        "the release to show in the agent's metrics",
        WAIT,
        || async {
            let s = scrape(addr).await;
            count(&s, "slotpool_agent_release_seconds") == 1.0
                && value(&s, "slotpool_agent_slots", &[("state", "used")]) == Some(0.0)
                && value(&s, "slotpool_agent_slots", &[("state", "free")]) == Some(2.0)
        },
    )
    .await;
}
