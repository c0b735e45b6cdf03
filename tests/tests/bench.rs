//! `slotpool-bench --smoke`: the benchmark runs end to end with tiny counts, so it cannot
//! rot. Its figures are not checked (timing assertions do not belong in CI); only that it
//! completes and writes every figure: the production run (authentication and TLS, and,
//! as root, agents in users mode) with its comparisons (the plain bus; agents in mode
//! `none`) and their targets, the ratios to the floor, the messages per allocation from
//! nats-server's `/varz`, two launchers on one bus, `--http` scraped, and `slotpool exec`
//! jobs beside `ssh` into a slot.

use slotpool_tests::{bin_path, nats_server_binary, set_mode, slot_visible_tempdir, ChildGuard};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

/// Generous: the smoke run takes well under a minute even on a busy 2-core machine.
const SMOKE_TIMEOUT: Duration = Duration::from_secs(600);

#[tokio::test]
async fn bench_smoke_run_completes_and_writes_every_figure() {
    // Slot users log in over ssh through the benchmark's working dir (their homes and
    // the login's agent binary are there), so they must be able to pass through it.
    let dir = slot_visible_tempdir("slotpool-bench-smoke-");
    set_mode(dir.path(), 0o711);
    let json = dir.path().join("bench.json");
    let mut cmd = Command::new(bin_path("slotpool-bench"));
    cmd.args(["--smoke", "--json"])
        .arg(&json)
        .env("SLOTPOOL_NATS_SERVER", nats_server_binary())
        .env("SLOTPOOL_LOG", "warn")
        .env("TMPDIR", dir.path());
    let mut bench = ChildGuard::spawn("slotpool-bench", cmd).unwrap();
    let status = bench
        .wait_timeout(SMOKE_TIMEOUT)
        .await
        .expect("slotpool-bench --smoke did not finish in time");
    assert!(status.success(), "slotpool-bench --smoke failed: {status}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for figure in [
        "floor",
        "warm",
        "throughput",
        "launcher_idle",
        "cold_and_release",
        "agent",
        "scale",
        "production",
        "comparisons",
        "launchers",
        "observability",
        "latencies",
        "outliers",
        "targets",
        "exec",
    ] {
        assert!(!report[figure].is_null(), "{figure} missing from {report}");
    }
    // Tests run as root: the default installation's agents are in users mode, and the
    // loads run again with agents in mode none.
    assert_eq!(report["production"]["isolation"], "users", "{report}");
    let production = &report["production"];
    let none = &report["isolation_none"];
    let observed = &report["observability"];
    for figures in [&report, production, none] {
        let reuse = &figures["release_to_reusable"];
        assert!(reuse["count"].as_u64().unwrap() > 0, "{report}");
        assert!(reuse["p50_ms"].as_f64().unwrap() > 0.0, "{report}");
    }
    for figures in [&report, production, none, observed] {
        assert!(figures["warm"]["allocation"]["count"].as_u64().unwrap() > 0);
        assert!(figures["throughput"]["allocations"].as_u64().unwrap() > 0);
        for load in [&figures["warm"], &figures["throughput"]] {
            let messages = &load["messages"];
            for count in ["in_msgs", "out_msgs", "in_bytes", "out_bytes"] {
                let n = messages[count].as_f64().unwrap_or(0.0);
                assert!(n > 0.0, "{count} {n}: {report}");
            }
        }
        assert!(
            figures["throughput"]["cpu_ms_per_allocation"]
                .as_f64()
                .unwrap()
                > 0.0
        );
        // The CPU meter found every process of the load, the local agents included (in
        // users mode an agent's helpers, such as a slot's namespace set-up, count with
        // the agents when the meter sees them).
        let cpu = figures["throughput"]["cpu"].as_array().unwrap();
        let roles: BTreeMap<&str, u64> = cpu
            .iter()
            .map(|c| {
                (
                    c["role"].as_str().unwrap(),
                    c["processes"].as_u64().unwrap(),
                )
            })
            .collect();
        for (role, at_least, at_most) in [
            ("launcher", 1, 1),
            ("nats-server", 1, 1),
            // Its agents, and a namespace holder (a fork of the agent) for each slot
            // warming up at that moment: the smoke run's 2 warm nodes have 8 slots each.
            ("agents", 2, 2 + 16),
            ("benchmark clients", 1, 1),
        ] {
            let n = roles.get(role).copied().unwrap_or(0);
            assert!(
                (at_least..=at_most).contains(&n),
                "{role}: {n} processes, not {at_least} to {at_most}: {roles:?}"
            );
        }
        assert_eq!(roles.len(), 4, "{roles:?}");
    }
    let comparisons = report["comparisons"].as_array().unwrap();
    assert_eq!(comparisons.len(), 2, "plain and none: {report}");
    let ratios = comparisons
        .iter()
        .map(|c| &c["ratios"])
        .chain([&observed["ratios"]]);
    for ratios in ratios {
        for ratio in [
            "warm_p50",
            "warm_p99",
            "allocations_per_sec",
            "cpu_ms_per_allocation",
        ] {
            let r = ratios[ratio].as_f64().unwrap();
            assert!(r.is_finite() && r > 0.0, "{ratio} {r}: {report}");
        }
    }
    assert!(
        observed["scrapes"]["scrapes"].as_u64().unwrap() > 0,
        "{report}"
    );
    let launchers = &report["launchers"];
    assert_eq!(launchers["launchers"], 2, "{report}");
    assert_eq!(
        launchers["throughput"]["cpu"][0]["processes"], 2,
        "both launchers counted: {report}"
    );
    assert!(launchers["allocations_per_sec_ratio"].as_f64().unwrap() > 0.0);
    // The ratio's other side: one launcher alone right before and right after.
    let alone = launchers["alone"].as_array().expect("launchers.alone");
    assert_eq!(alone.len(), 2, "{report}");
    for load in alone {
        assert_eq!(
            load["cpu"][0]["processes"], 1,
            "one launcher counted: {report}"
        );
        assert!(load["allocations"].as_u64().unwrap() > 0, "{report}");
    }
    // The plain comparison's other side: the plain loads beside the production run's
    // warm agents before its loads and again right after them, each ratio over the mean
    // of the two.
    let before = &report["throughput_before_production"];
    let again = &report["throughput_after_production"];
    for load in [before, again] {
        assert!(load["allocations"].as_u64().unwrap() > 0, "{report}");
        assert_eq!(load["cpu"][0]["processes"], 1, "{report}");
    }
    let per_sec = |t: &serde_json::Value| t["allocations_per_sec"].as_f64().unwrap();
    let plain_mean = (per_sec(before) + per_sec(again)) / 2.0;
    let over_plain = comparisons[0]["ratios"]["allocations_per_sec"]
        .as_f64()
        .unwrap();
    let expected = per_sec(&report["production"]["throughput"]) / plain_mean;
    assert!(
        (over_plain - expected).abs() < 1e-9 * expected,
        "plain ratio {over_plain}, not production over the mean of both plain loads {expected}: {report}"
    );
    // And the warm ratio: production's warm allocations over the plain bus's, the two
    // taking turns.
    let p50 = |w: &serde_json::Value| w["allocation"]["p50_ms"].as_f64().unwrap();
    let plain_turns = &report["warm_before_production"];
    let production_turns = &report["production"]["warm_taking_turns"];
    assert!(
        p50(plain_turns) > 0.0 && p50(production_turns) > 0.0,
        "{report}"
    );
    assert!(p50(&report["warm_after_production"]) > 0.0, "{report}");
    let warm_over_plain = comparisons[0]["ratios"]["warm_p50"].as_f64().unwrap();
    let expected = p50(production_turns) / p50(plain_turns);
    assert!(
        (warm_over_plain - expected).abs() < 1e-9 * expected,
        "plain warm ratio {warm_over_plain}, not production's over the plain bus's, taking turns, {expected}: {report}"
    );
    // How that ratio moves within the run: one ratio per pair of blocks, the k-th
    // block of each bus with the other's k-th.
    let blocks = |w: &serde_json::Value| -> Vec<f64> {
        w["block_p50_ms"]
            .as_array()
            .expect("block_p50_ms")
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let (plain_blocks, production_blocks) = (blocks(plain_turns), blocks(production_turns));
    assert!(
        !plain_blocks.is_empty() && plain_blocks.len() == production_blocks.len(),
        "{report}"
    );
    let mut pairs: Vec<f64> = plain_blocks
        .iter()
        .zip(&production_blocks)
        .map(|(plain, production)| production / plain)
        .collect();
    pairs.sort_by(f64::total_cmp);
    let spread = &comparisons[0]["ratios"]["warm_p50_blocks"];
    assert_eq!(spread["pairs"], pairs.len(), "{report}");
    // Close, as the ratios above, not equal: serde_json's default parsing of a float may
    // be one ulp off the value the benchmark wrote (exact parsing is `float_roundtrip`).
    let same = |reported: &serde_json::Value, computed: Option<&f64>| {
        let (reported, computed) = (reported.as_f64().unwrap(), *computed.unwrap());
        (reported - computed).abs() < 1e-9 * computed
    };
    assert!(same(&spread["min"], pairs.first()), "{report}");
    assert!(same(&spread["max"], pairs.last()), "{report}");
    assert!(
        comparisons[1]["ratios"].get("warm_p50_blocks").is_none(),
        "the none comparison does not take turns: {report}"
    );
    let latencies = report["latencies"].as_array().unwrap();
    assert!(latencies.len() >= 10, "{report}");
    for latency in latencies {
        let r = latency["p50_to_floor"].as_f64().unwrap();
        assert!(r.is_finite() && r > 0.0, "{latency}");
    }
    let targets = report["targets"].as_array().unwrap();
    for figure in [
        "auth + TLS / plain, throughput",
        "auth + TLS / plain, warm p50",
        "users / none, throughput",
        "users / none, warm p50",
        "NATS messages per allocation",
        "2 launchers / one, throughput",
        "release to reusable p50 (production)",
    ] {
        assert!(
            targets.iter().any(|t| t["figure"] == figure),
            "no target {figure}: {report}"
        );
    }
    assert_eq!(report["cold_and_release"]["early"], 0, "{report}");
    // Whole `slotpool exec` jobs, commands in a held node beside ssh into it (users
    // mode), and jobs at once.
    let exec = &report["exec"];
    for figure in ["job", "exec_in_held_node", "ssh"] {
        let count = exec[figure]["count"].as_u64().unwrap_or(0);
        assert!(count > 0, "exec {figure}: {exec}");
    }
    assert!(exec["jobs_per_sec"].as_f64().unwrap() > 0.0, "{exec}");
    assert!(exec["exec_over_ssh_p50"].as_f64().unwrap() > 0.0, "{exec}");
}
