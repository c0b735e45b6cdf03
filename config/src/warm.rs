//! Warm slots: how many free slots of a label to keep ready ([`ready_target`]): its
//! `min-ready`, or, where it sets a `warm-window`, the slots the recent arrivals say
//! will be asked for within `warm-lead` ([`predicted_ready`]) if more. The one rule the
//! launcher's planner and backing workers, the simulator and the console decide by.
//!
//! [`Arrivals`] is the log that rule counts: every node request seen, finished or not,
//! once, kept for its label's window. A launcher's mirror of requests holds only open
//! ones (a finished request leaves it at once), so it cannot be counted instead.

use crate::tenants::Tenants;
use crate::{Config, Warm};
use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::UserName;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::time::Duration;

/// The share of the arrivals of one `warm-lead` the predictive warm slots cover: the
/// 0.9 quantile of a Poisson count at the recent rate.
pub const WARM_QUANTILE: f64 = 0.9;

/// Slots to keep ready for the arrivals expected within the next `warm.lead`, from
/// `arrivals` (node requests for the label) counted over the last `warm.window`: the
/// [`WARM_QUANTILE`] of a Poisson count with mean arrivals x lead / window, at most
/// `bound`. No arrivals: none.
pub fn predicted_ready(arrivals: u32, warm: &Warm, bound: u32) -> u32 {
    if arrivals == 0 || bound == 0 {
        return 0;
    }
    let mean = f64::from(arrivals) * warm.lead.as_secs_f64() / warm.window.as_secs_f64();
    if mean > 500.0 {
        // e^-mean underflows: the normal approximation is close there.
        let k = (mean + 1.2816 * mean.sqrt()).ceil();
        return if k >= f64::from(bound) {
            bound
        } else {
            k as u32
        };
    }
    let (mut k, mut p) = (0u32, (-mean).exp());
    let mut cdf = p;
    while cdf < WARM_QUANTILE && k < bound {
        k += 1;
        p *= mean / f64::from(k);
        cdf += p;
    }
    k
}

/// What decides how many free slots of a label to keep ready: its `min-ready` (summed
/// over the pools serving it) and its `warm-window` with the most the pools can hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmRule {
    pub min_ready: u32,
    pub warm: Option<(Warm, u32)>,
}

impl WarmRule {
    /// The label's `min-ready`, or, with a `warm-window`, the slots the recent arrivals
    /// predict if more ([`predicted_by_tenant`]). `arrivals` is asked only with a
    /// `warm-window`: the arrivals in it by tenant, each with the tenant's weight.
    pub fn target(&self, arrivals: impl FnOnce(&Warm) -> Vec<TenantArrivals>) -> u32 {
        match self.warm {
            Some((warm, bound)) => {
                self.min_ready
                    .max(predicted_by_tenant(&arrivals(&warm), &warm, bound))
            }
            None => self.min_ready,
        }
    }
}

/// One tenant's arrivals in a label's window, and its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantArrivals {
    pub count: u32,
    pub weight: u32,
}

/// The slots to keep ready for the arrivals of several tenants: each tenant's
/// [`predicted_ready`] at its own rate, at most its weighted share of `bound` among the
/// tenants that arrived, summed (at most `bound`). A tenant alone gets what its rate
/// says, as with no tenants; one tenant's flood buys at most its share of warm slots,
/// never the others'.
pub fn predicted_by_tenant(arrivals: &[TenantArrivals], warm: &Warm, bound: u32) -> u32 {
    let weights: u64 = arrivals
        .iter()
        .filter(|a| a.count > 0)
        .map(|a| u64::from(a.weight))
        .sum();
    let total: u64 = arrivals
        .iter()
        .filter(|a| a.count > 0)
        .map(|a| {
            let share = (u64::from(bound) * u64::from(a.weight)).div_ceil(weights.max(1));
            u64::from(predicted_ready(a.count, warm, bound)).min(share)
        })
        .sum();
    total.min(u64::from(bound)) as u32
}

impl Config {
    /// The [`WarmRule`] of `label`.
    pub fn warm_rule(&self, label: &str) -> WarmRule {
        WarmRule {
            min_ready: self.min_ready(label),
            warm: self.warm(label),
        }
    }
}

/// Free slots of `label` to keep ready ([`WarmRule::target`]).
pub fn ready_target(
    config: &Config,
    label: &str,
    arrivals: impl FnOnce(&Warm) -> Vec<TenantArrivals>,
) -> u32 {
    config.warm_rule(label).target(arrivals)
}

/// [`ready_target`] from an arrival log at `now`.
pub fn ready_from(config: &Config, label: &str, arrivals: &Arrivals, now: UnixMillis) -> u32 {
    ready_target(config, label, |warm| {
        arrivals.by_tenant(label, warm.window, now)
    })
}

/// When [`ready_from`] may fall with nothing else changing: when the oldest arrival it
/// counts leaves the window (`None`: no warm-window, or nothing in it).
pub fn ready_falls_at(
    config: &Config,
    label: &str,
    arrivals: &Arrivals,
    now: UnixMillis,
) -> Option<UnixMillis> {
    let (warm, _) = config.warm(label)?;
    arrivals
        .oldest(label, warm.window, now)
        .map(|t| t + millis(warm.window))
}

/// The node requests seen, by label and creation time, each counted once however often
/// its record is seen (every revision, and again after a reload), for the labels that
/// set a `warm-window`; an arrival is forgotten once it is a window older than the
/// newest one seen, so the log holds one window of arrivals, not every request served.
/// One label's arrivals: (creation time, id hash) → (nodes of the label, tenant index).
type ArrivalLog = BTreeMap<(UnixMillis, u64), (u32, usize)>;

#[derive(Clone, Debug, Default)]
pub struct Arrivals {
    /// Labels counted, with their window.
    windows: HashMap<String, Duration>,
    /// By label: (creation time, a hash of the request id) → the request's nodes of it
    /// and its tenant (by index in `tenants`).
    by_label: HashMap<String, ArrivalLog>,
    /// Whose each request is, and the tenants' weights.
    tenants: Tenants,
}

impl Arrivals {
    /// A log of the labels of `config` that set a `warm-window`.
    pub fn of(config: &Config) -> Arrivals {
        Arrivals {
            tenants: config.tenants.clone(),
            ..Arrivals::counting(
                config
                    .label_names()
                    .into_iter()
                    .filter_map(|label| Some((label.to_string(), config.warm(label)?.0.window))),
            )
        }
    }

    /// A log of the given labels, each with its window, every request in one tenant.
    pub fn counting(windows: impl IntoIterator<Item = (String, Duration)>) -> Arrivals {
        Arrivals {
            windows: windows.into_iter().collect(),
            by_label: HashMap::new(),
            tenants: Tenants::default(),
        }
    }

    /// Whether any label is counted.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Records request `id` of client `client`, asking for `labels`, created at
    /// `created_at`.
    pub fn note(
        &mut self,
        id: &str,
        client: Option<&UserName>,
        labels: &[String],
        created_at: UnixMillis,
    ) {
        if self.windows.is_empty() {
            return;
        }
        let tenant = self.tenants.of(client);
        let mut hasher = DefaultHasher::new();
        id.hash(&mut hasher);
        let key = (created_at, hasher.finish());
        for (label, window) in &self.windows {
            let n = labels.iter().filter(|l| *l == label).count() as u32;
            if n == 0 {
                continue;
            }
            let log = self.by_label.entry(label.clone()).or_default();
            log.insert(key, (n, tenant));
            let newest = log.last_key_value().map_or(created_at, |((t, _), _)| *t);
            let cutoff = newest.saturating_sub(millis(*window));
            if log
                .first_key_value()
                .is_some_and(|((t, _), _)| *t <= cutoff)
            {
                *log = log.split_off(&(cutoff + 1, 0));
            }
        }
    }

    /// Nodes of `label` asked for by requests created in (`now` - `window`, `now`].
    pub fn count(&self, label: &str, window: Duration, now: UnixMillis) -> u32 {
        self.in_window(label, window, now)
            .map(|(_, (n, _))| *n)
            .sum()
    }

    /// [`Arrivals::count`] by tenant (those with none left out), with their weights.
    pub fn by_tenant(&self, label: &str, window: Duration, now: UnixMillis) -> Vec<TenantArrivals> {
        let mut counts = vec![0u32; self.tenants.len()];
        for (_, (n, tenant)) in self.in_window(label, window, now) {
            counts[*tenant] += n;
        }
        counts
            .into_iter()
            .enumerate()
            .filter(|(_, count)| *count > 0)
            .map(|(i, count)| TenantArrivals {
                count,
                weight: self.tenants.get(i).weight,
            })
            .collect()
    }

    /// The creation time of the oldest request [`Arrivals::count`] counts.
    pub fn oldest(&self, label: &str, window: Duration, now: UnixMillis) -> Option<UnixMillis> {
        self.in_window(label, window, now)
            .next()
            .map(|((t, _), _)| *t)
    }

    fn in_window(
        &self,
        label: &str,
        window: Duration,
        now: UnixMillis,
    ) -> impl Iterator<Item = (&(UnixMillis, u64), &(u32, usize))> {
        let since = now.saturating_sub(millis(window));
        self.by_label
            .get(label)
            .into_iter()
            .flat_map(move |log| log.range((since + 1, 0)..=(now, u64::MAX)))
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warm(window: u64, lead: u64) -> Warm {
        Warm {
            window: Duration::from_secs(window),
            lead: Duration::from_secs(lead),
        }
    }

    fn config(extra: &str) -> Config {
        let text = format!(
            "providers:\n  - name: p\n    driver: exec\n    exec:\n      create: [\"true\"]\n      delete: [\"true\"]\n      list: [\"true\"]\n    pools:\n      - name: main\n        max-servers: 10\n        labels:\n          - name: small\n            backing-label: vm\n            max-parallel-jobs: 2\n            min-ready: 2\n{extra}          - name: big\n            backing-label: vm\n            max-parallel-jobs: 2\n"
        );
        Config::parse(std::path::Path::new("pool.yaml"), &text).unwrap()
    }

    fn one(count: u32) -> Vec<TenantArrivals> {
        vec![TenantArrivals { count, weight: 1 }]
    }

    #[test]
    fn a_flooding_tenant_buys_at_most_its_share_of_warm_slots() {
        let w = warm(600, 60);
        let (flood, quiet) = (
            TenantArrivals {
                count: 6_000,
                weight: 1,
            },
            TenantArrivals {
                count: 60,
                weight: 1,
            },
        );
        assert_eq!(
            predicted_by_tenant(&[flood], &w, 100),
            100,
            "alone: its rate"
        );
        assert_eq!(
            predicted_by_tenant(&[quiet], &w, 100),
            9,
            "as with no tenants"
        );
        assert_eq!(
            predicted_by_tenant(&[flood, quiet], &w, 100),
            50 + 9,
            "the flood is held to half the bound, the quiet one keeps its 9"
        );
        let heavy = TenantArrivals {
            count: 6_000,
            weight: 3,
        };
        assert_eq!(predicted_by_tenant(&[heavy, quiet], &w, 100), 75 + 9);
        assert_eq!(predicted_by_tenant(&[], &w, 100), 0);
    }

    #[test]
    fn arrivals_are_counted_by_tenant() {
        let text = format!(
            "{}tenants:\n  - {{name: a, clients: [ci-a], weight: 2}}\n",
            POOLS_WARM
        );
        let config = Config::parse(std::path::Path::new("pool.yaml"), &text).unwrap();
        let mut log = Arrivals::of(&config);
        let small = vec!["small".to_string()];
        let a = UserName::parse("ci-a").unwrap();
        log.note("req-1", Some(&a), &small, 1_000);
        log.note("req-2", Some(&a), &small, 2_000);
        log.note("req-3", None, &small, 3_000);
        assert_eq!(
            log.by_tenant("small", Duration::from_secs(300), 3_000),
            [
                TenantArrivals {
                    count: 2,
                    weight: 2
                },
                TenantArrivals {
                    count: 1,
                    weight: 1
                }
            ]
        );
    }

    const POOLS_WARM: &str = "providers:\n  - name: p\n    driver: local\n    pools:\n      - name: main\n        max-servers: 2\n        labels:\n          - {name: small, backing-label: vm, max-parallel-jobs: 4, warm-window: 300}\n";

    #[test]
    fn predicted_ready_covers_the_arrivals_of_one_lead_at_the_recent_rate() {
        let w = warm(600, 60);
        assert_eq!(
            predicted_ready(0, &w, 100),
            0,
            "nothing arrived: nothing kept"
        );
        // 60 in 10 minutes: a mean of 6 in a minute; P(N <= 9) = 0.916, P(N <= 8) = 0.847.
        assert_eq!(predicted_ready(60, &w, 100), 9);
        // 20 in 10 minutes: a mean of 2; P(N <= 4) = 0.947, P(N <= 3) = 0.857.
        assert_eq!(predicted_ready(20, &w, 100), 4);
        // One in 10 minutes: a mean of 0.1; P(N = 0) = 0.905.
        assert_eq!(predicted_ready(1, &w, 100), 0);
        assert_eq!(predicted_ready(60, &w, 5), 5, "bounded by the pool");
        // A half lead halves the mean: 3; P(N <= 5) = 0.916.
        assert_eq!(predicted_ready(60, &warm(600, 30), 100), 5);
        // Huge rates take the normal approximation and stay bounded.
        assert_eq!(predicted_ready(u32::MAX, &w, 1000), 1000);
    }

    #[test]
    fn the_ready_target_is_min_ready_or_the_prediction_if_more() {
        let off = config("");
        assert_eq!(ready_target(&off, "small", |_| panic!("not asked")), 2);
        let on = config("            warm-window: 600\n");
        assert_eq!(
            ready_target(&on, "small", |_| one(0)),
            2,
            "min-ready stays the floor"
        );
        assert_eq!(ready_target(&on, "small", |_| one(60)), 9);
        assert_eq!(
            ready_target(&on, "small", |_| one(100_000)),
            20,
            "10 servers x 2 slots"
        );
    }

    #[test]
    fn arrivals_count_each_request_of_the_label_once_in_the_window() {
        let on = config("            warm-window: 300\n");
        let mut log = Arrivals::of(&on);
        let small = vec!["small".to_string()];
        let two = vec!["small".to_string(), "small".to_string()];
        let big = vec!["big".to_string()];
        log.note("req-1", None, &small, 1_000);
        log.note("req-2", None, &two, 500_000);
        log.note("req-3", None, &big, 550_000);
        log.note("req-4", None, &small, 600_000);
        // Every revision of a request, and a reload, deliver it again: counted once.
        log.note("req-4", None, &small, 600_000);
        log.note("req-5", None, &small, 700_000);
        let window = Duration::from_secs(300);
        // At 600 s the window is (300 s, 600 s]: two nodes of one request and one more.
        assert_eq!(log.count("small", window, 600_000), 3);
        assert_eq!(log.oldest("small", window, 600_000), Some(500_000));
        // Later requests are not counted, earlier ones leave the window.
        assert_eq!(log.count("small", window, 1_000_000), 0);
        assert_eq!(log.count("small", window, 700_000), 4);
        assert_eq!(
            log.count("big", window, 700_000),
            0,
            "big sets no warm-window"
        );
        assert_eq!(
            ready_falls_at(&on, "small", &log, 700_000),
            Some(800_000),
            "req-2 leaves the window at 500 s + 300 s"
        );
        assert_eq!(ready_falls_at(&on, "big", &log, 700_000), None);
        assert_eq!(ready_from(&on, "small", &log, 700_000), 2, "min-ready");
    }

    #[test]
    fn the_log_forgets_what_is_a_window_older_than_the_newest_arrival() {
        let mut log = Arrivals::of(&config("            warm-window: 10\n"));
        let small = vec!["small".to_string()];
        for i in 0..10_000u64 {
            log.note(&format!("req-{i}"), None, &small, i * 100);
        }
        let held = log.by_label["small"].len();
        assert!(
            held <= 101,
            "the log holds one window, not every request: {held}"
        );
        let mut off = Arrivals::of(&config(""));
        off.note("req-1", None, &small, 1_000);
        assert!(off.is_empty() && off.by_label.is_empty(), "nothing counted");
    }
}
