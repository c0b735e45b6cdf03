//! `slotpool simulate`: a discrete-event simulation of a pool over a trace, deciding with
//! the launcher's own code. Pure: no NATS, no clock, no sleeping; a day runs in seconds.
//!
//! Events (arrivals, boots, job ends, timers a decision asked for) wait in a heap by
//! time. After each, [`slotpool`] asks `request::plan::next` what each waiting request
//! does, `planner::choose_seats` which seats to take, and `lifecycle::next` what each
//! backing node does, and carries the steps out on records of its own, as the launcher's
//! executors do on KV. [`nodepool`] plays Nodepool's policy on the same trace for the
//! comparison. [`ledger`] counts slot-seconds paid and busy and the waits.

pub mod ledger;
pub mod nodepool;
pub mod rng;
pub mod slotpool;
pub mod svg;
pub mod trace;

use ledger::{NodeKind, Report};
use slotpool_config::Config;
use slotpool_protocol::model::BackingNode;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use trace::Job;

/// The start of simulated time (a Unix time in milliseconds): the decisions see real-looking
/// times, and the reports count from here.
pub const EPOCH_MS: u64 = 1_700_000_000_000;

/// Which policy decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// The launcher's own decisions.
    Slotpool,
    /// Nodepool's: fixed size, first fit by creation order, release on a cleanup pass.
    Nodepool,
}

/// The simulated provider.
#[derive(Clone, Debug, PartialEq)]
pub struct Provider {
    /// Seconds from a launch to the agent's first heartbeat.
    pub boot_secs: f64,
    /// Boot times are uniform in `boot_secs ± boot_jitter_secs`.
    pub boot_jitter_secs: f64,
    /// Chance that a launch is refused for capacity.
    pub capacity_error_rate: f64,
    /// What one backing node costs an hour when its size has no `cost-per-hour`.
    pub node_cost_per_hour: f64,
}

/// Everything a run depends on.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The pools and labels, as the launcher reads them.
    pub config: Config,
    pub provider: Provider,
    /// Nodepool's cleanup interval (only for [`Policy::Nodepool`]).
    pub cleanup_interval_ms: u64,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("job {job} asks for label {label:?}, which no pool of the configuration serves")]
    UnknownLabel { job: usize, label: String },
    #[error("the decisions did something the simulator does not model: {0}")]
    Unmodelled(String),
}

/// Runs `jobs` under `policy`.
pub fn run(jobs: &[Job], setup: &Setup, policy: Policy) -> Result<Report, SimError> {
    for (job, j) in jobs.iter().enumerate() {
        if let Some(label) = j.labels.iter().find(|l| setup.config.sites(l).is_empty()) {
            return Err(SimError::UnknownLabel {
                job,
                label: label.clone(),
            });
        }
    }
    match policy {
        Policy::Slotpool => slotpool::run(jobs, setup),
        Policy::Nodepool => nodepool::run(jobs, setup),
    }
}

/// What the backing node `b` is, for the ledger: its size's price from the
/// configuration, or the simulated provider's `node_cost_per_hour` when the size has none.
fn kind_of(setup: &Setup, b: &BackingNode) -> NodeKind {
    let cost = setup
        .config
        .label_in(&b.provider, &b.pool, &b.label)
        .and_then(|s| s.label.size(&b.backing_label)?.cost_per_hour);
    NodeKind {
        backing_label: b.backing_label.clone(),
        slots: b.slots,
        cost_per_hour: cost.unwrap_or(setup.provider.node_cost_per_hour),
    }
}

/// A boot time drawn from the provider's distribution, in milliseconds.
fn boot_ms(provider: &Provider, rng: &mut rng::Rng) -> u64 {
    let jitter = provider.boot_jitter_secs * (2.0 * rng.unit() - 1.0);
    ((provider.boot_secs + jitter).max(0.0) * 1000.0).round() as u64
}

/// Timed events, earliest first; events at the same time in the order they were added,
/// so that a run is the same for the same seed.
pub(crate) struct Events<E> {
    heap: BinaryHeap<Reverse<(u64, u64, Slot<E>)>>,
    seq: u64,
}

/// An event, ordered only by the time and sequence around it.
struct Slot<E>(E);

impl<E> PartialEq for Slot<E> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<E> Eq for Slot<E> {}
impl<E> PartialOrd for Slot<E> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Slot<E> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl<E> Events<E> {
    pub(crate) fn new() -> Self {
        Events {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }

    pub(crate) fn at(&mut self, at: u64, event: E) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, Slot(event))));
    }

    pub(crate) fn pop(&mut self) -> Option<(u64, E)> {
        self.heap.pop().map(|Reverse((at, _, Slot(e)))| (at, e))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

/// The configuration `slotpool simulate` builds when given none: one pool of a simulated
/// provider serving every label of the trace with the same backing node.
#[derive(Clone, Debug, PartialEq)]
pub struct Synthetic {
    pub slots_per_node: u32,
    /// Several sizes instead (slots, cost per hour), the planner choosing among them;
    /// empty: one size of `slots_per_node`.
    pub sizes: Vec<(u32, f64)>,
    pub grace_secs: u64,
    pub max_servers: u32,
    /// Free slots of each label kept ready (`min-ready`).
    pub min_ready: u32,
    /// Predictive warm slots (`warm-window`, `warm-lead`, seconds); `None`: off.
    pub warm: Option<(u64, u64)>,
}

impl Synthetic {
    /// The configuration file's text (the labels sorted).
    pub fn yaml(&self, labels: &[String]) -> String {
        let mut out = format!(
            "providers:\n  - name: sim\n    driver: exec\n    exec:\n      create: [\"true\"]\n      delete: [\"true\"]\n      list: [\"true\"]\n    pools:\n      - name: main\n        max-servers: {}\n        boot-timeout: 3600\n        labels:\n",
            self.max_servers
        );
        for label in labels {
            out.push_str(&format!(
                "          - name: {label}\n            grace-time: {}\n            min-ready: {}\n",
                self.grace_secs, self.min_ready
            ));
            if let Some((window, lead)) = self.warm {
                out.push_str(&format!(
                    "            warm-window: {window}\n            warm-lead: {lead}\n"
                ));
            }
            if self.sizes.is_empty() {
                out.push_str(&format!(
                    "            backing-label: {label}-{0}\n            max-parallel-jobs: {0}\n",
                    self.slots_per_node
                ));
            } else {
                out.push_str("            sizes:\n");
                for (slots, cost) in &self.sizes {
                    out.push_str(&format!(
                        "              - {{backing-label: {label}-{slots}, max-parallel-jobs: {slots}, cost-per-hour: {cost}}}\n"
                    ));
                }
            }
        }
        out
    }

    /// The configuration for the labels of `jobs`.
    pub fn config(&self, jobs: &[Job]) -> Result<Config, slotpool_config::ConfigError> {
        let mut labels: Vec<String> = jobs.iter().flat_map(|j| j.labels.clone()).collect();
        labels.sort();
        labels.dedup();
        Config::parse(
            std::path::Path::new("(simulated pool)"),
            &self.yaml(&labels),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOT_HOUR_SECS: f64 = 3600.0;

    /// A synthetic pool of one size, at most 100 backing nodes, no predictive warm slots.
    fn synthetic(slots_per_node: u32, grace_secs: u64, min_ready: u32) -> Synthetic {
        Synthetic {
            slots_per_node,
            sizes: Vec::new(),
            grace_secs,
            max_servers: 100,
            min_ready,
            warm: None,
        }
    }

    fn setup(slots_per_node: u32, jobs: &[Job], provider: Provider) -> Setup {
        Setup {
            config: synthetic(slots_per_node, 60, 0).config(jobs).unwrap(),
            provider,
            cleanup_interval_ms: 60_000,
            seed: 5,
        }
    }

    fn fixed_boot() -> Provider {
        Provider {
            boot_secs: 60.0,
            boot_jitter_secs: 0.0,
            capacity_error_rate: 0.0,
            node_cost_per_hour: 2.0,
        }
    }

    fn job(arrival_secs: u64, duration_secs: u64) -> Job {
        Job {
            arrival_ms: arrival_secs * 1000,
            labels: vec!["small".into()],
            duration_ms: duration_secs * 1000,
            tenant: None,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn one_job_waits_the_boot_and_pays_boot_job_and_grace() {
        let jobs = [job(0, 600)];
        let r = run(&jobs, &setup(8, &jobs, fixed_boot()), Policy::Slotpool).unwrap();
        assert_eq!(r.wait_p50_secs, 60.0);
        assert_eq!(r.wait_max_secs, 60.0);
        assert_eq!((r.backing_nodes_launched, r.backing_nodes_released), (1, 1));
        // 60 s boot + 600 s job + 60 s grace, eight slots.
        assert!(
            close(r.paid_slot_hours, 8.0 * 720.0 / SLOT_HOUR_SECS),
            "{r:?}"
        );
        assert!(close(r.busy_slot_hours, 600.0 / SLOT_HOUR_SECS));
        assert!(close(r.cost, 2.0 * 720.0 / SLOT_HOUR_SECS));
        assert_eq!(r.unserved, 0);
    }

    #[test]
    fn nodepool_releases_on_its_cleanup_pass_and_ours_at_the_grace_time() {
        // Two-slot nodes. The first job runs 60..670; the node is empty from 670. The
        // second comes at 700, inside the grace time, takes the same node, and runs to
        // 800. Ours releases at 800 + 60 = 860; Nodepool's pass at 840 finds it empty
        // for only 40 s and releases it at 900.
        let jobs = [job(0, 610), job(700, 100)];
        let s = setup(2, &jobs, fixed_boot());
        let ours = run(&jobs, &s, Policy::Slotpool).unwrap();
        let theirs = run(&jobs, &s, Policy::Nodepool).unwrap();
        for r in [&ours, &theirs] {
            assert_eq!((r.backing_nodes_launched, r.backing_nodes_released), (1, 1));
            assert_eq!((r.wait_p50_secs, r.wait_max_secs), (0.0, 60.0));
            assert!(close(r.busy_slot_hours, 710.0 / SLOT_HOUR_SECS));
        }
        assert!(
            close(ours.paid_slot_hours, 2.0 * 860.0 / SLOT_HOUR_SECS),
            "{ours:?}"
        );
        assert!(
            close(theirs.paid_slot_hours, 2.0 * 900.0 / SLOT_HOUR_SECS),
            "{theirs:?}"
        );
        assert!(close(ours.efficiency, 710.0 / 1720.0));
        assert!(close(theirs.efficiency, 710.0 / 1800.0));
    }

    #[test]
    fn ours_packs_the_fullest_node_so_the_other_empties() {
        // Two two-slot nodes come up at 60 for three jobs that came at 0: the first two
        // jobs fill the node at seat 0, the third takes seat 1. Both short jobs end at
        // 160, emptying seat 0. The fourth job, at 200, goes to seat 1, the fullest node
        // (not the first by seat), so seat 0 is released after its grace, at 220.
        let jobs = [job(0, 100), job(0, 100), job(0, 1000), job(200, 600)];
        let s = setup(2, &jobs, fixed_boot());
        let ours = run(&jobs, &s, Policy::Slotpool).unwrap();
        assert_eq!(ours.backing_nodes_launched, 2);
        assert_eq!(ours.wait_max_secs, 60.0);
        // Seat 0: 0..220. Seat 1 (jobs 3 and 4): empty at 1060, released at 1120.
        assert!(
            close(
                ours.paid_slot_hours,
                2.0 * (220.0 + 1120.0) / SLOT_HOUR_SECS
            ),
            "{ours:?}"
        );
    }

    #[test]
    fn a_seed_gives_the_same_report_and_another_seed_another() {
        let day = trace::Diurnal {
            peak_per_min: 2.0,
            hours: 4.0,
            median_job_secs: 600.0,
            sigma: 0.8,
            label: "small".into(),
            seed: 9,
        }
        .generate();
        let provider = Provider {
            boot_jitter_secs: 30.0,
            capacity_error_rate: 0.2,
            ..fixed_boot()
        };
        let mut s = setup(8, &day, provider);
        for policy in [Policy::Slotpool, Policy::Nodepool] {
            let a = run(&day, &s, policy).unwrap();
            assert_eq!(a, run(&day, &s, policy).unwrap());
            assert_eq!(a.unserved, 0);
            assert!(a.efficiency > 0.3 && a.efficiency < 1.0, "{}", a.efficiency);
            s.seed += 1;
            assert_ne!(a, run(&day, &s, policy).unwrap());
            s.seed -= 1;
        }
    }

    #[test]
    fn a_grace_time_of_zero_serves_the_waiting_jobs_before_releasing() {
        let jobs = [job(0, 100), job(30, 100)];
        let mut s = setup(2, &jobs, fixed_boot());
        s.config = synthetic(2, 0, 0).config(&jobs).unwrap();
        let r = run(&jobs, &s, Policy::Slotpool).unwrap();
        assert_eq!((r.unserved, r.backing_nodes_launched), (0, 1), "{r:?}");
        // Ready at 60, both jobs run 60..160, released at once.
        assert!(
            close(r.paid_slot_hours, 2.0 * 160.0 / SLOT_HOUR_SECS),
            "{r:?}"
        );
    }

    #[test]
    fn min_ready_keeps_a_warm_node_through_the_launchers_own_rules() {
        // Jobs at 300 s and 1000 s, long after the first boot and each other's end.
        let jobs = [job(300, 100), job(1000, 100), job(1010, 100)];
        let warm = |min_ready| {
            let mut s = setup(2, &jobs, fixed_boot());
            s.config = synthetic(2, 0, min_ready).config(&jobs).unwrap();
            run(&jobs, &s, Policy::Slotpool).unwrap()
        };
        let cold = warm(0);
        assert_eq!(cold.wait_max_secs, 60.0, "every job waits a boot: {cold:?}");
        assert_eq!(cold.backing_nodes_launched, 2, "{cold:?}");
        let r = warm(2);
        assert_eq!(r.unserved, 0);
        assert_eq!(r.wait_max_secs, 0.0, "a warm slot was always there: {r:?}");
        // One node at the start; one more each time a claim leaves fewer than two free
        // (the second job takes one of two, the third the last), and no launch and
        // release in a loop.
        assert!(r.backing_nodes_launched <= 3, "{r:?}");
        // The warm node is still up when the run ends: launched, not released.
        assert_eq!(
            r.backing_nodes_released,
            r.backing_nodes_launched - 1,
            "{r:?}"
        );
    }

    /// `jobs` on 4-slot nodes with a 600 s grace-time and `max_uses`, if any.
    fn with_max_uses(jobs: &[Job], max_uses: Option<u32>) -> Report {
        let mut s = setup(4, jobs, fixed_boot());
        let limit = max_uses.map_or(String::new(), |n| format!("            max-uses: {n}\n"));
        let yaml = synthetic(4, 600, 0)
            .yaml(&["small".into()])
            .replace("min-ready: 0\n", &format!("min-ready: 0\n{limit}"));
        s.config = Config::parse(std::path::Path::new("pool.yaml"), &yaml).unwrap();
        run(jobs, &s, Policy::Slotpool).unwrap()
    }

    #[test]
    fn max_uses_retires_a_node_after_its_jobs_as_the_launcher_does() {
        // Four jobs one after another, each within the grace-time of the one before:
        // without max-uses one node serves them all; with max-uses 2 it retires after two
        // claims, and the third job waits for a second node's boot.
        let jobs = [job(0, 10), job(100, 10), job(200, 10), job(300, 10)];
        let unlimited = with_max_uses(&jobs, None);
        assert_eq!(unlimited.backing_nodes_launched, 1, "{unlimited:?}");
        let r = with_max_uses(&jobs, Some(2));
        assert_eq!(r.unserved, 0, "{r:?}");
        assert_eq!(r.backing_nodes_launched, 2, "{r:?}");
        assert_eq!(r.wait_max_secs, 60.0, "the third job waits a boot: {r:?}");
        // Three jobs at once on a node that may hand out two: the third is refused the
        // node's free slot, as the launcher's claim is, and gets a node of its own.
        let r = with_max_uses(&[job(0, 10), job(0, 10), job(0, 10)], Some(2));
        assert_eq!(r.unserved, 0, "{r:?}");
        assert_eq!(r.backing_nodes_launched, 2, "{r:?}");
    }

    #[test]
    fn a_node_set_gets_all_its_labels_at_once() {
        let jobs = [Job {
            arrival_ms: 0,
            labels: vec!["big".into(), "small".into(), "small".into()],
            duration_ms: 100_000,
            tenant: None,
        }];
        let r = run(&jobs, &setup(2, &jobs, fixed_boot()), Policy::Slotpool).unwrap();
        assert_eq!(r.backing_nodes_launched, 2);
        assert_eq!(r.wait_max_secs, 60.0);
        assert!(close(r.busy_slot_hours, 3.0 * 100.0 / SLOT_HOUR_SECS));
    }

    #[test]
    fn sizes_follow_the_queue_and_each_is_paid_its_price() {
        // One job: a 2-slot node (0.10 an hour). Later a node set of ten at once: an
        // 8-slot node and a 2-slot one (0.46), not five 2-slot ones (0.50).
        let jobs = [
            job(0, 600),
            Job {
                arrival_ms: 1_000_000,
                labels: vec!["small".into(); 10],
                duration_ms: 600_000,
                tenant: None,
            },
        ];
        let mut s = setup(2, &jobs, fixed_boot());
        s.config = Synthetic {
            sizes: vec![(2, 0.10), (8, 0.36)],
            ..synthetic(8, 60, 0)
        }
        .config(&jobs)
        .unwrap();
        let r = run(&jobs, &s, Policy::Slotpool).unwrap();
        assert_eq!((r.unserved, r.backing_nodes_launched), (0, 3), "{r:?}");
        let launched: Vec<(&str, u32)> = r
            .sizes
            .iter()
            .map(|z| (z.backing_label.as_str(), z.launched))
            .collect();
        assert_eq!(launched, [("small-2", 2), ("small-8", 1)]);
        // The first node 0..720 s; the two others 1000..1720 s.
        assert!(
            close(
                r.paid_slot_hours,
                (2.0 * 720.0 + 10.0 * 720.0) / SLOT_HOUR_SECS
            ),
            "{r:?}"
        );
        assert!(
            close(r.cost, (0.10 * 720.0 + 0.46 * 720.0) / SLOT_HOUR_SECS),
            "{r:?}"
        );
        // Nodepool's fixed size is the largest, at its price.
        let theirs = run(&jobs, &s, Policy::Nodepool).unwrap();
        assert_eq!(theirs.sizes.len(), 1, "{theirs:?}");
        assert_eq!(theirs.sizes[0].backing_label, "small-8");
    }

    #[test]
    fn a_label_no_pool_serves_is_refused() {
        let jobs = [job(0, 1)];
        let s = setup(2, &jobs, fixed_boot());
        let other = [Job {
            labels: vec!["gpu".into()],
            ..job(0, 1)
        }];
        let err = run(&other, &s, Policy::Slotpool).unwrap_err().to_string();
        assert!(err.contains("label \"gpu\""), "{err}");
    }
}

#[cfg(test)]
mod tenant_tests {
    use super::*;

    /// Jobs of `tenant` arriving at `per_min` a minute from `from` to `to` seconds, each
    /// one node of `small` for a lognormal time around five minutes.
    fn arrivals(tenant: &str, per_min: f64, from: f64, to: f64, rng: &mut rng::Rng) -> Vec<Job> {
        let mut jobs = Vec::new();
        let mut t = from;
        loop {
            t += rng.exponential(per_min / 60.0);
            if t >= to {
                return jobs;
            }
            jobs.push(Job {
                arrival_ms: (t * 1000.0) as u64,
                labels: vec!["small".into()],
                duration_ms: (rng.lognormal(300.0, 0.5) * 1000.0) as u64,
                tenant: Some(tenant.into()),
            });
        }
    }

    /// Three teams, each asking for about 6 of the pool's 40 slots on average over six
    /// hours; in the second hour team a floods at ten times its rate (about 60 slots
    /// wanted). Under first come, first served, the flood's backlog holds b and c for
    /// as long as it lasts; with tenants of equal weight, b and c keep their share.
    #[test]
    fn a_flooding_team_does_not_hold_the_quiet_ones_up_under_fair_share() {
        let mut rng = rng::Rng::new(11);
        let hours = 6.0 * 3600.0;
        let mut jobs = Vec::new();
        for team in ["a", "b", "c"] {
            jobs.extend(arrivals(team, 1.2, 0.0, hours, &mut rng));
        }
        jobs.extend(arrivals("a", 10.8, 3600.0, 7200.0, &mut rng));
        jobs.sort_by_key(|j| j.arrival_ms);
        let pool = Synthetic {
            slots_per_node: 4,
            sizes: Vec::new(),
            grace_secs: 300,
            max_servers: 10,
            min_ready: 0,
            warm: None,
        };
        let fcfs_yaml = pool.yaml(&["small".to_string()]);
        let fair_yaml = format!(
            "{fcfs_yaml}tenants:\n  - {{name: a, clients: [ci-a]}}\n  - {{name: b, clients: [ci-b]}}\n  - {{name: c, clients: [ci-c]}}\n"
        );
        let setup = |yaml: &str| Setup {
            config: Config::parse(std::path::Path::new("pool.yaml"), yaml).unwrap(),
            provider: Provider {
                boot_secs: 60.0,
                boot_jitter_secs: 10.0,
                capacity_error_rate: 0.0,
                node_cost_per_hour: 1.0,
            },
            cleanup_interval_ms: 60_000,
            seed: 3,
        };
        let fcfs = run(&jobs, &setup(&fcfs_yaml), Policy::Slotpool).unwrap();
        let fair = run(&jobs, &setup(&fair_yaml), Policy::Slotpool).unwrap();
        let p95 = |r: &Report, team: &str| {
            r.fairness
                .tenants
                .iter()
                .find(|t| t.tenant == team)
                .map(|t| t.wait_p95_secs)
                .unwrap()
        };
        for (name, r) in [("first come, first served", &fcfs), ("fair share", &fair)] {
            eprintln!(
                "{name}: Jain's index over {} contended minutes: mean {:.3}, min {:.3}; \
                 p95 wait a {:.0} s, b {:.0} s, c {:.0} s; busy {:.1} slot-hours",
                r.fairness.contended_windows,
                r.fairness.jain_mean.unwrap_or(0.0),
                r.fairness.jain_min.unwrap_or(0.0),
                p95(r, "a"),
                p95(r, "b"),
                p95(r, "c"),
                r.busy_slot_hours
            );
        }
        assert_eq!(fcfs.jobs, fair.jobs);
        assert_eq!((fcfs.unserved, fair.unserved), (0, 0));
        for team in ["b", "c"] {
            assert!(
                p95(&fair, team) < p95(&fcfs, team) / 2.0,
                "team {team}: {} s with fair share against {} s first come, first served",
                p95(&fair, team),
                p95(&fcfs, team)
            );
        }
        assert!(
            fair.fairness.jain_mean > fcfs.fairness.jain_mean,
            "{:?} against {:?}",
            fair.fairness,
            fcfs.fairness
        );
    }
}
