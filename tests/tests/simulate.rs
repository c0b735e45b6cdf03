//! `slotpool simulate` through the real CLI, on the traces shipped in examples/traces.

use slotpool_tests::bin_path;
use std::path::PathBuf;
use std::process::{Command, Output};

fn trace(name: &str) -> PathBuf {
    slotpool_tests::workspace_root()
        .join("examples/traces")
        .join(name)
}

fn simulate(args: &[&str]) -> Output {
    Command::new(bin_path("slotpool"))
        .arg("simulate")
        .args(args)
        .output()
        .expect("running slotpool simulate")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// Both policies on the shipped low-load day, side by side, with the report's fields and
/// a plot; and the same figures again for the same seed.
#[test]
fn simulate_compares_the_policies_on_a_shipped_trace() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("day.svg");
    let day = trace("day-peak2.csv");
    let args = [
        day.to_str().unwrap(),
        "--compare",
        "--boot-jitter-secs",
        "20",
        "--output",
        "json",
        "--svg",
        svg.to_str().unwrap(),
    ];
    let out = simulate(&args);
    let reports = json(&out);
    let reports = reports.as_array().expect("one report per policy");
    assert_eq!(reports.len(), 2);
    assert_eq!(reports[0]["policy"], "slotpool");
    assert_eq!(reports[1]["policy"], "nodepool");
    let jobs = std::fs::read_to_string(&day).unwrap().lines().count() - 1;
    for r in reports {
        assert_eq!(r["jobs"], jobs, "{r}");
        assert_eq!(r["unserved"], 0, "{r}");
        let (paid, busy) = (
            r["paid_slot_hours"].as_f64().unwrap(),
            r["busy_slot_hours"].as_f64().unwrap(),
        );
        assert!(busy > 0.0 && paid > busy, "{r}");
        assert!((r["efficiency"].as_f64().unwrap() - busy / paid).abs() < 1e-9);
        assert!(r["backing_nodes_launched"].as_u64().unwrap() > 0);
        let (p50, p99, max) = (
            r["wait_p50_secs"].as_f64().unwrap(),
            r["wait_p99_secs"].as_f64().unwrap(),
            r["wait_max_secs"].as_f64().unwrap(),
        );
        assert!(p50 <= p99 && p99 <= max && max <= 80.0 + 60.0, "{r}");
        let hours = r["hours"].as_array().unwrap();
        assert!(hours.len() >= 24, "{}", hours.len());
        let hourly_busy: f64 = hours
            .iter()
            .map(|h| h["busy_slot_hours"].as_f64().unwrap())
            .sum();
        assert!((hourly_busy - busy).abs() < 1e-6);
    }
    assert_eq!(
        reports[0]["busy_slot_hours"], reports[1]["busy_slot_hours"],
        "the same jobs run under both policies"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("polyline"),
        "{plot}"
    );
    assert_eq!(
        json(&simulate(&args)),
        json(&out),
        "the same seed gives the same figures"
    );
}

/// A bad trace line is named by file and line, with what a line may be.
#[test]
fn simulate_names_a_bad_trace_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("day.csv");
    std::fs::write(
        &file,
        "arrival_secs,labels,duration_secs\n0,small,60\n30,small\n",
    )
    .unwrap();
    let out = simulate(&[file.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "error: {}:3: 2 fields, not 3 or 4; accepted: CSV `arrival_secs,labels,duration_secs[,tenant]`",
            file.display()
        )),
        "{stderr}"
    );
}

/// The generated day reads back as a trace.
#[test]
fn simulate_generate_writes_a_trace_simulate_reads() {
    let out = simulate(&["generate", "--peak", "1", "--hours", "2", "--seed", "3"]);
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gen.csv");
    std::fs::write(&file, &out.stdout).unwrap();
    let lines = String::from_utf8_lossy(&out.stdout).lines().count() - 1;
    let r = json(&simulate(&[
        file.to_str().unwrap(),
        "--policy",
        "nodepool",
        "--output",
        "json",
    ]));
    assert_eq!(r["jobs"], lines);
    assert_eq!(r["policy"], "nodepool");
}

/// A configuration with several sizes replayed on a shipped trace: the planner launches
/// the small size for single jobs, each size is paid its own price, and `--sizes` builds
/// the same pool; Nodepool's fixed size is the largest.
#[test]
fn simulate_replays_a_pool_with_sizes_and_prices() {
    let day = trace("day-peak2.csv");
    let pool = trace("sized-pool.yaml");
    let r = json(&simulate(&[
        day.to_str().unwrap(),
        "--config",
        pool.to_str().unwrap(),
        "--compare",
        "--output",
        "json",
    ]));
    let (ours, theirs) = (&r[0], &r[1]);
    let sizes = |r: &serde_json::Value| -> Vec<(String, u64)> {
        r["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|z| {
                (
                    z["backing_label"].as_str().unwrap().to_string(),
                    z["launched"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    // Jobs one at a time want one slot each: the 2-slot size covers that cheapest.
    let launched = sizes(ours);
    assert_eq!(launched[0].0, "vm-2", "{launched:?}");
    assert_eq!(
        launched.iter().map(|s| s.1).sum::<u64>(),
        ours["backing_nodes_launched"].as_u64().unwrap()
    );
    let fixed = sizes(theirs);
    assert_eq!(fixed.len(), 1, "{fixed:?}");
    assert_eq!(fixed[0].0, "vm-8");
    // Each size is paid its price: cost = paid node-hours x cost-per-hour, summed.
    for r in [ours, theirs] {
        let mut cost = 0.0;
        let mut paid = 0.0;
        for z in r["sizes"].as_array().unwrap() {
            let node_hours = z["paid_slot_hours"].as_f64().unwrap() / z["slots"].as_f64().unwrap();
            let size_cost = node_hours * z["cost_per_hour"].as_f64().unwrap();
            assert!(
                (z["cost"].as_f64().unwrap() - size_cost).abs() < 1e-9,
                "{z}"
            );
            cost += size_cost;
            paid += z["paid_slot_hours"].as_f64().unwrap();
        }
        assert!((r["cost"].as_f64().unwrap() - cost).abs() < 1e-9, "{r}");
        assert!(
            (r["paid_slot_hours"].as_f64().unwrap() - paid).abs() < 1e-6,
            "{r}"
        );
    }
    assert!(
        ours["cost"].as_f64().unwrap() < theirs["cost"].as_f64().unwrap(),
        "right-sized nodes cost less than the fixed 8-slot ones"
    );
    // The synthetic pool with the same sizes decides the same.
    let same = json(&simulate(&[
        day.to_str().unwrap(),
        "--sizes",
        "2:0.10,4:0.19,8:0.36",
        "--output",
        "json",
    ]));
    for key in [
        "paid_slot_hours",
        "cost",
        "backing_nodes_launched",
        "wait_p99_secs",
    ] {
        assert_eq!(same[key], ours[key], "{key}");
    }
}

/// `--warm-window-secs` keeps ready the slots the recent arrivals say are coming within a
/// boot, so on the synthetic day most jobs no longer wait a boot; off, the queue of now
/// launches a node for each arrival and the p99 wait is that boot.
#[test]
fn simulate_keeps_predictive_warm_slots_from_the_arrival_rate() {
    let day = |extra: &[&str]| {
        let mut args = vec![
            "--generate",
            "6",
            "--seed",
            "1",
            "--sizes",
            "2:0.10,4:0.19,8:0.36",
            "--output",
            "json",
        ];
        args.extend_from_slice(extra);
        json(&simulate(&args))
    };
    let off = day(&[]);
    let on = day(&["--warm-window-secs", "600", "--warm-lead-secs", "60"]);
    let p99 = |r: &serde_json::Value| r["wait_p99_secs"].as_f64().unwrap();
    assert!(
        p99(&off) >= 50.0,
        "without it a job waits a boot: {}",
        p99(&off)
    );
    assert!(
        p99(&on) < 10.0,
        "kept ready from the arrival rate: {}",
        p99(&on)
    );
    assert!(
        on["backing_nodes_launched"].as_u64() > off["backing_nodes_launched"].as_u64(),
        "the warm slots are paid: {} against {}",
        on["backing_nodes_launched"],
        off["backing_nodes_launched"]
    );
    let err = simulate(&["--generate", "6", "--warm-lead-secs", "30"]);
    assert!(!err.status.success());
}
