//! The pool configuration (the launcher's YAML file): parsed once, validated once, plain
//! data after; shared by the launcher and the console, with the timing rules both apply
//! ([`timing`]).
//!
//! - [`raw`]: the file as written (serde types with spans);
//! - [`validate`]: from the file to [`Config`], every error with file:line:col;
//! - [`timing`]: when an idle backing node is released and when it reaches max-age;
//! - [`warm`]: how many free slots of a label to keep ready, and the arrival log it
//!   counts;
//! - [`bus`]: how a program reaches the bus (NATS flags and environment variables).
//!
//! ```yaml
//! launcher: { lease-ttl: 10 }
//! providers:
//!   - name: local
//!     driver: local            # static | local | exec
//!     local: { work-dir: /var/lib/slotpool/local }
//!     pools:
//!       - name: main
//!         max-servers: 2
//!         labels:
//!           - name: small
//!             backing-label: large-node
//!             max-parallel-jobs: 4
//!             grace-time: 60
//! ```

#![forbid(unsafe_code)]

pub mod bus;
pub mod hold;
mod raw;
pub mod tenants;
pub mod timing;
mod validate;
pub mod warm;

use serde::Deserialize;
use slotpool_protocol::api::SlotLimits;
use slotpool_protocol::model::Attributes;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The most backing nodes one pool may hold (`max-servers`); a larger fleet is several
/// pools.
pub const MAX_SERVERS: u32 = 100_000;

/// A configuration problem, with where it is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read. The io error is part of the message, not a source, so
    /// that a chain printed with `{:#}` says it once.
    #[error("reading {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    At {
        path: PathBuf,
        line: u64,
        column: u64,
        message: String,
    },
    #[error("{path}: {message}")]
    Whole { path: PathBuf, message: String },
}

/// The whole launcher configuration, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// How long a launcher's lease lives without renewal.
    pub lease_ttl: Duration,
    /// The NATS URL handed to agents the launcher starts (default: the launcher's own).
    pub agent_nats_url: Option<String>,
    /// Copies of each bucket the launcher creates: 1 on a single nats-server, 3 on a
    /// three-server JetStream cluster (so one server may fail), 5 at most.
    pub kv_replicas: usize,
    /// How long a launcher's supervisor may go without finishing a pass before its
    /// `/readyz` says it is stalled (`stall-after`, default [`DEFAULT_STALL_AFTER`]);
    /// the console marks such a launcher with the same threshold.
    pub stall_after: Duration,
    pub providers: Vec<ProviderConfig>,
    /// The teams sharing the pool ([`tenants`]).
    pub tenants: tenants::Tenants,
}

/// `stall-after` when the configuration does not say: how long a launcher's supervisor
/// may go without finishing a pass before it counts as stalled.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, PartialEq)]
pub struct ProviderConfig {
    pub name: String,
    pub driver: DriverConfig,
    pub pools: Vec<PoolConfig>,
    /// How often each launcher looks for leaked machines of this provider.
    pub leak_sweep_interval: Duration,
    /// How old an unowned machine must be before the sweep deletes it.
    pub leak_grace: Duration,
    /// Limits on this provider's `launch` calls, per launcher process.
    pub create_limits: CreateLimits,
}

/// How fast one launcher may ask a provider for machines (`max-creates-per-second`,
/// `max-concurrent-creates`); `None`: no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CreateLimits {
    pub per_second: Option<f64>,
    pub concurrent: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum DriverConfig {
    Static {
        hosts: Vec<StaticHost>,
    },
    Local {
        agent_command: Option<PathBuf>,
        agent_args: Vec<String>,
        work_dir: PathBuf,
    },
    Exec {
        create: Vec<String>,
        delete: Vec<String>,
        list: Vec<String>,
        /// Reads a machine's console output, for the event of a failed boot (optional).
        console: Option<Vec<String>>,
    },
}

/// A host whose agent is already running, with the id and secret it was started with.
#[derive(Clone, Debug, PartialEq)]
pub struct StaticHost {
    /// Its backing id.
    pub name: String,
    pub host: String,
    /// The pool it belongs to (default: the provider's only pool).
    pub pool: String,
    pub secret_file: PathBuf,
    pub attributes: Attributes,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    pub name: String,
    pub max_servers: u32,
    pub priority: i32,
    pub launch_timeout: Duration,
    pub boot_timeout: Duration,
    /// Launch attempts before a backing node is marked failed (at least 1).
    pub launch_retries: u32,
    pub labels: Vec<LabelConfig>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LabelConfig {
    pub name: String,
    /// The kinds of backing node that serve the label, as written (at least one, no
    /// backing label twice): one for the single-size form (`backing-label` +
    /// `max-parallel-jobs`), several for `sizes`, among which the planner picks by cost
    /// and queue depth.
    pub sizes: Vec<BackingSize>,
    pub grace_time: Duration,
    pub min_retention_time: Duration,
    /// Zero: no maximum age.
    pub max_age: Duration,
    pub node_attributes: Attributes,
    /// Resource limits of each slot's cgroup, sent to the agent on prepare.
    pub limits: SlotLimits,
    /// Check the backing node's SSH host keys with a key scan before handing out a slot.
    pub host_key_checking: bool,
    /// Longest a fulfilled request may hold a node of this label before it is
    /// reclaimed; `None`: no limit.
    pub max_hold_time: Option<Duration>,
    /// Free slots of this label the pool keeps ready with no request waiting for them
    /// (`min-ready`): the planner launches backing nodes until that many are free or
    /// booting, and an idle backing node whose free slots are needed for it is kept past
    /// its grace-time. At most `max-servers` x the largest size's `max-parallel-jobs`.
    pub min_ready: u32,
    /// Free slots kept ready from the recent arrival rate (`warm-window`, `warm-lead`);
    /// `None`: only `min-ready`.
    pub warm: Option<Warm>,
    /// Slots a backing node of this label hands out in its life (`max-uses`); after the
    /// last it is retired and released once empty. `None`: no limit.
    pub max_uses: Option<u32>,
}

/// A label's predictive warm slots: keep ready what the requests of the last `window`
/// say will arrive within the next `lead` (a boot time), beyond `min-ready`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Warm {
    /// How far back arrivals are counted (`warm-window`).
    pub window: Duration,
    /// How far ahead the arrivals are kept ready for (`warm-lead`, default 60 s).
    pub lead: Duration,
}

/// One kind of backing node a label may be served by.
#[derive(Clone, Debug, PartialEq)]
pub struct BackingSize {
    /// What kind of machine it is (passed to the provider).
    pub backing_label: String,
    /// Slots each backing node of this size is carved into (`max-parallel-jobs`).
    pub slots: u32,
    /// What one backing node of this size costs an hour (`cost-per-hour`, in the
    /// operator's money); `None` in the single-size form, which needs no choice.
    pub cost_per_hour: Option<f64>,
}

impl LabelConfig {
    /// The size with the most slots (of those, the first written).
    pub fn largest(&self) -> &BackingSize {
        self.sizes
            .iter()
            .rev()
            .max_by_key(|s| s.slots)
            .expect("a label has at least one size")
    }

    /// The size whose backing label is `backing_label`.
    pub fn size(&self, backing_label: &str) -> Option<&BackingSize> {
        self.sizes.iter().find(|s| s.backing_label == backing_label)
    }
}

/// Where a label is served: a provider's pool.
#[derive(Clone, Copy, Debug)]
pub struct LabelSite<'a> {
    pub provider: &'a ProviderConfig,
    pub pool: &'a PoolConfig,
    pub label: &'a LabelConfig,
}

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_path_buf(),
            error,
        })?;
        Config::parse(path, &text)
    }

    /// Parses and validates `text`; errors name `path`, line and column.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        validate::parse(path, text)
    }

    /// Every place a label is served, lowest pool priority first.
    pub fn sites(&self, label: &str) -> Vec<LabelSite<'_>> {
        let mut out = Vec::new();
        for provider in &self.providers {
            for pool in &provider.pools {
                for l in pool.labels.iter().filter(|l| l.name == label) {
                    out.push(LabelSite {
                        provider,
                        pool,
                        label: l,
                    });
                }
            }
        }
        out.sort_by_key(|s| s.pool.priority);
        out
    }

    /// The pool `pool` of provider `provider`.
    pub fn pool(&self, provider: &str, pool: &str) -> Option<(&ProviderConfig, &PoolConfig)> {
        let p = self.providers.iter().find(|p| p.name == provider)?;
        Some((p, p.pools.iter().find(|x| x.name == pool)?))
    }

    /// The label `label` as configured in `provider`/`pool`.
    pub fn label_in(&self, provider: &str, pool: &str, label: &str) -> Option<LabelSite<'_>> {
        let (provider, pool) = self.pool(provider, pool)?;
        let label = pool.labels.iter().find(|l| l.name == label)?;
        Some(LabelSite {
            provider,
            pool,
            label,
        })
    }

    /// The most nodes of `label` the configured pools could ever hold at once: each pool
    /// serving it at `max-servers` backing nodes of its largest size.
    pub fn max_nodes(&self, label: &str) -> u64 {
        self.sites(label)
            .iter()
            .map(|s| u64::from(s.pool.max_servers) * u64::from(s.label.largest().slots))
            .sum()
    }

    /// The predictive warm slots of `label` (the first pool serving it that sets
    /// `warm-window`), with the most slots they may come to: `max-servers` x the largest
    /// size of every pool serving it.
    pub fn warm(&self, label: &str) -> Option<(Warm, u32)> {
        let warm = self
            .providers
            .iter()
            .flat_map(|p| p.pools.iter())
            .flat_map(|p| p.labels.iter())
            .filter(|l| l.name == label)
            .find_map(|l| l.warm)?;
        let bound = self
            .providers
            .iter()
            .flat_map(|p| p.pools.iter())
            .flat_map(|p| p.labels.iter().map(move |l| (p, l)))
            .filter(|(_, l)| l.name == label)
            .map(|(p, l)| u64::from(p.max_servers) * u64::from(l.largest().slots))
            .sum::<u64>();
        Some((warm, u32::try_from(bound).unwrap_or(u32::MAX)))
    }

    /// Free slots of `label` to keep ready: the sum of the `min-ready` of every pool
    /// serving it (0: none). Does not allocate; asked on every slot change.
    pub fn min_ready(&self, label: &str) -> u32 {
        self.providers
            .iter()
            .flat_map(|p| p.pools.iter())
            .flat_map(|p| p.labels.iter())
            .filter(|l| l.name == label)
            .map(|l| l.min_ready)
            .sum()
    }

    /// Whether some pool serving `label` sets a `max-hold-time`.
    pub fn hold_limited(&self, label: &str) -> bool {
        self.sites(label)
            .iter()
            .any(|s| s.label.max_hold_time.is_some())
    }

    /// Every label name served, sorted.
    pub fn label_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .providers
            .iter()
            .flat_map(|p| p.pools.iter())
            .flat_map(|p| p.labels.iter())
            .map(|l| l.name.as_str())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

/// Which provider driver a provider uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Driver {
    Static,
    Local,
    Exec,
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
providers:
  - name: local
    driver: local
    local:
      work-dir: /tmp/x
    pools:
      - name: main
        max-servers: 2
        labels:
          - name: small
            backing-label: large-node
            max-parallel-jobs: 4
            grace-time: 2
            node-attributes: {zone: a}
";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("pool.yaml"), text)
    }

    #[test]
    fn parses_a_valid_config() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.lease_ttl, Duration::from_secs(10));
        let site = c.sites("small")[0];
        assert_eq!(site.pool.max_servers, 2);
        assert_eq!(site.label.grace_time, Duration::from_secs(2));
        assert_eq!(site.label.node_attributes["zone"], serde_json::json!("a"));
        assert_eq!(c.label_names(), vec!["small"]);
    }

    #[test]
    fn kv_replicas_default_to_one_and_take_an_odd_count_up_to_five() {
        assert_eq!(parse(GOOD).unwrap().kv_replicas, 1);
        let three = format!("launcher:\n  kv-replicas: 3\n{GOOD}");
        assert_eq!(parse(&three).unwrap().kv_replicas, 3);
        for bad in ["0", "2", "7"] {
            let text = format!("launcher:\n  kv-replicas: {bad}\n{GOOD}");
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.starts_with("pool.yaml:2:16: kv-replicas must be 1, 3 or 5"),
                "{err}"
            );
        }
    }

    #[test]
    fn max_nodes_adds_up_every_pool_serving_a_label() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.max_nodes("small"), 8, "2 servers x 4 slots");
        assert_eq!(c.max_nodes("gpu"), 0, "no pool serves it");
        let second_pool = format!(
            "{GOOD}      - name: spare\n        max-servers: 3\n        labels:\n          - name: small\n            backing-label: vm\n            max-parallel-jobs: 2\n"
        );
        assert_eq!(parse(&second_pool).unwrap().max_nodes("small"), 8 + 6);
    }

    #[test]
    fn warm_window_is_opt_in_and_validated_with_its_place() {
        assert_eq!(parse(GOOD).unwrap().warm("small"), None);
        let with = |keys: &str| GOOD.replace("grace-time: 2", &format!("grace-time: 2\n{keys}"));
        let c = parse(&with("            warm-window: 10m")).unwrap();
        assert_eq!(
            c.warm("small"),
            Some((
                Warm {
                    window: Duration::from_secs(600),
                    lead: Duration::from_secs(60)
                },
                8
            )),
            "lead defaults to 60 s; bound 2 servers x 4 slots"
        );
        let err = parse(&with("            warm-lead: 30"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("pool.yaml:14:24: warm-lead needs warm-window"),
            "{err}"
        );
        let err = parse(&with(
            "            warm-window: 60\n            warm-lead: 120",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with(
                "pool.yaml:15:24: warm-lead must be 1 to warm-window (60) seconds, got 120"
            ),
            "{err}"
        );
    }

    #[test]
    fn min_ready_defaults_to_zero_and_is_bounded_by_the_pool() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.min_ready("small"), 0);
        let with = |n: &str| {
            GOOD.replace(
                "grace-time: 2",
                &format!("grace-time: 2\n            min-ready: {n}"),
            )
        };
        assert_eq!(
            parse(&with("8")).unwrap().min_ready("small"),
            8,
            "2 servers x 4 slots"
        );
        assert_eq!(parse(&with("0")).unwrap().min_ready("small"), 0);
        let err = parse(&with("9")).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "pool.yaml:14:24: min-ready must be 0 to 8 (max-servers 2 x max-parallel-jobs 4), got 9"
            ),
            "{err}"
        );
        let err = parse(&with("-1")).unwrap_err().to_string();
        assert!(err.starts_with("pool.yaml:14:24:"), "{err}");
        assert!(err.contains("min-ready"), "{err}");
    }

    /// GOOD with the label's `backing-label` and `max-parallel-jobs` (lines 11 and 12)
    /// replaced by `with`.
    fn sized(with: &str) -> String {
        GOOD.replace(
            "            backing-label: large-node\n            max-parallel-jobs: 4\n",
            with,
        )
    }

    const SIZES: &str = "            sizes:
              - backing-label: vm-2
                max-parallel-jobs: 2
                cost-per-hour: 0.10
              - backing-label: vm-8
                max-parallel-jobs: 8
                cost-per-hour: 0.36
";

    #[test]
    fn a_label_takes_one_size_or_a_list_of_sizes_with_prices() {
        let one = parse(GOOD).unwrap();
        assert_eq!(
            one.sites("small")[0].label.sizes,
            vec![BackingSize {
                backing_label: "large-node".into(),
                slots: 4,
                cost_per_hour: None
            }]
        );
        let c = parse(&sized(SIZES)).unwrap();
        let label = c.sites("small")[0].label;
        assert_eq!(
            label.sizes,
            vec![
                BackingSize {
                    backing_label: "vm-2".into(),
                    slots: 2,
                    cost_per_hour: Some(0.10)
                },
                BackingSize {
                    backing_label: "vm-8".into(),
                    slots: 8,
                    cost_per_hour: Some(0.36)
                }
            ]
        );
        assert_eq!(label.largest().backing_label, "vm-8");
        assert_eq!(label.size("vm-2").map(|s| s.slots), Some(2));
        assert_eq!(c.max_nodes("small"), 16, "2 servers of the largest size, 8");
        let warm = sized(&format!("{SIZES}            min-ready: 17\n"));
        let err = parse(&warm).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "pool.yaml:18:24: min-ready must be 0 to 16 (max-servers 2 x max-parallel-jobs 8)"
            ),
            "{err}"
        );
    }

    #[test]
    fn sizes_are_refused_where_written() {
        let err = |text: &str| parse(text).unwrap_err().to_string();
        // Both forms.
        let both = GOOD.replace(
            "            grace-time: 2\n",
            &format!("            grace-time: 2\n{SIZES}"),
        );
        assert_eq!(
            err(&both),
            "pool.yaml:11:28: give either `backing-label` with `max-parallel-jobs` (one size) \
             or a list of `sizes`, not both"
        );
        // Neither.
        assert_eq!(
            err(&sized("")),
            "pool.yaml:10:13: missing field `backing-label` (or a list of `sizes`)"
        );
        // An empty list.
        assert!(
            err(&sized("            sizes: []\n"))
                .starts_with("pool.yaml:11:20: sizes must list at least one size"),
            "{}",
            err(&sized("            sizes: []\n"))
        );
        // The same backing label twice.
        let twice = sized(&SIZES.replace("vm-8", "vm-2"));
        assert_eq!(
            err(&twice),
            "pool.yaml:15:32: backing-label \"vm-2\" is listed twice in the sizes of label \"small\""
        );
        // A cost that is not a positive number.
        for (cost, got) in [("0", "0"), ("-0.5", "-0.5"), (".nan", "NaN")] {
            let text = sized(&SIZES.replace("0.36", cost));
            assert_eq!(
                err(&text),
                format!(
                    "pool.yaml:17:32: cost-per-hour must be a positive number (what one \
                     backing node of this size costs an hour), got {got}"
                )
            );
        }
        assert_eq!(
            err(&sized(&SIZES.replace("0.36", "cheap"))),
            "pool.yaml:17:32: cost-per-hour: expected a positive number (what one backing node \
             of this size costs an hour), got \"cheap\""
        );
        // A size without its price, or with a bad slot count.
        let unpriced = sized(&SIZES.replace("                cost-per-hour: 0.36\n", ""));
        assert_eq!(
            err(&unpriced),
            "pool.yaml:15:17: missing field `cost-per-hour`"
        );
        assert!(err(&sized(
            &SIZES.replace("max-parallel-jobs: 8", "max-parallel-jobs: 0")
        ))
        .starts_with("pool.yaml:16:36: max-parallel-jobs must be 1 to 1024, got 0"),);
    }

    #[test]
    fn a_static_label_takes_one_size() {
        let text = "\
providers:
  - name: lab
    driver: static
    static:
      hosts:
        - {name: h1, host: 10.0.0.1, secret-file: /s}
    pools:
      - name: main
        max-servers: 1
        labels:
          - name: small
            sizes:
              - {backing-label: a, max-parallel-jobs: 2, cost-per-hour: 1}
              - {backing-label: b, max-parallel-jobs: 4, cost-per-hour: 2}
";
        let err = parse(text).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:13:15: a static host has the slots its agent runs with"),
            "{err}"
        );
        let one = text.replace(
            "              - {backing-label: b, max-parallel-jobs: 4, cost-per-hour: 2}\n",
            "",
        );
        assert_eq!(parse(&one).unwrap().sites("small")[0].label.sizes.len(), 1);
    }

    #[test]
    fn max_uses_is_optional_and_at_least_one() {
        assert_eq!(parse(GOOD).unwrap().sites("small")[0].label.max_uses, None);
        let with = |n: &str| {
            GOOD.replace(
                "grace-time: 2",
                &format!("grace-time: 2\n            max-uses: {n}"),
            )
        };
        let c = parse(&with("5")).unwrap();
        assert_eq!(c.sites("small")[0].label.max_uses, Some(5));
        let err = parse(&with("0")).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:14:23: max-uses must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn max_hold_time_is_optional_and_checked_where_written() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.sites("small")[0].label.max_hold_time, None);
        assert!(!c.hold_limited("small"));
        let text = GOOD.replace(
            "grace-time: 2",
            "grace-time: 2\n            max-hold-time: 3600",
        );
        let c = parse(&text).unwrap();
        assert_eq!(
            c.sites("small")[0].label.max_hold_time,
            Some(Duration::from_secs(3600))
        );
        assert!(c.hold_limited("small"));
        let text = GOOD.replace(
            "grace-time: 2",
            "grace-time: 2\n            max-hold-time: 0",
        );
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:14:28: max-hold-time must be 1 to 31536000 seconds"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_names_file_line_and_column() {
        let text = GOOD.replace("grace-time: 2", "grace-tme: 2");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:13:13: unknown field `grace-tme`"),
            "{err}"
        );
        assert!(err.contains("grace-tme"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key_what_it_takes_and_what_it_got() {
        let err = |from: &str, to: &str| parse(&GOOD.replace(from, to)).unwrap_err().to_string();
        assert_eq!(
            err("max-servers: 2", "max-servers: two"),
            "pool.yaml:8:22: max-servers: expected a whole number of backing nodes (1 to 100000), got \"two\""
        );
        assert_eq!(
            err("max-parallel-jobs: 4", "max-parallel-jobs: [4]"),
            "pool.yaml:12:32: max-parallel-jobs: expected a whole number of slots per backing node (1 to 1024)"
        );
        assert_eq!(
            err("grace-time: 2", "grace-time: soon"),
            "pool.yaml:13:25: grace-time: expected seconds as a whole number (e.g. 120) or a duration with a unit (e.g. 2m, 90s, 1h 30m), got \"soon\""
        );
        assert_eq!(
            err("grace-time: 2", "grace-time: 1.5"),
            "pool.yaml:13:25: grace-time: expected seconds as a whole number (e.g. 120) or a duration with a unit (e.g. 2m, 90s, 1h 30m), got 1.5"
        );
        assert_eq!(
            err(
                "{zone: a}",
                "{zone: a}\n            limits: {memory-mb: lots}"
            ),
            "pool.yaml:15:33: memory-mb: expected a whole number of MiB, got \"lots\""
        );
    }

    #[test]
    fn durations_take_seconds_or_a_unit() {
        let grace = |value: &str| {
            let c = parse(&GOOD.replace("grace-time: 2", &format!("grace-time: {value}"))).unwrap();
            c.sites("small")[0].label.grace_time
        };
        assert_eq!(grace("120"), Duration::from_secs(120));
        assert_eq!(grace("2m"), Duration::from_secs(120));
        assert_eq!(grace("90s"), Duration::from_secs(90));
        assert_eq!(grace("1h 30m"), Duration::from_secs(5400));
        let c = parse(&format!("launcher: {{lease-ttl: 30s}}\n{GOOD}")).unwrap();
        assert_eq!(c.lease_ttl, Duration::from_secs(30));
    }

    /// What `config validate` says of the mistakes people make: each names where it is
    /// and what to do, in slotpool's words rather than the parser's.
    #[test]
    fn common_mistakes_are_named_where_they_are() {
        let cases = [
            // A key given twice: where the first one is, not the parser's options.
            (
                GOOD.replace("        max-servers: 2\n", "        max-servers: 2\n        max-servers: 3\n"),
                "pool.yaml:9:9: `max-servers` is given twice in this mapping (first at line 8)",
            ),
            // A pool name given twice: where the second is.
            (
                GOOD.replace(
                    "    pools:\n",
                    "    pools:\n      - name: main\n        max-servers: 1\n        labels: [{name: x, backing-label: y, max-parallel-jobs: 1}]\n",
                ),
                "pool.yaml:10:15: provider \"local\": pool \"main\" is defined twice",
            ),
            // A key dedented out of its mapping: which line, and how to indent it.
            (
                GOOD.replace("        max-servers: 2\n", "      max-servers: 2\n"),
                "pool.yaml:7:9: missing field `max-servers`: line 8 has `max-servers:` at column 7, but this mapping's keys are at column 9: indent it like them",
            ),
            // A tab: where it is, not where the scalar before it began.
            (
                GOOD.replace("        max-servers: 2\n", "\tmax-servers: 2\n"),
                "pool.yaml:8:1: a tab: YAML indents with spaces only",
            ),
            // Nothing at all.
            (
                "# nothing yet\n\n".to_string(),
                "pool.yaml: the file is empty: a pool file needs at least `providers:` (see examples/pool.yaml)",
            ),
        ];
        for (text, want) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert_eq!(err, want, "for:\n{text}");
        }
    }

    /// A file that cannot be read says why once (the io error is no source of its own, so
    /// `{:#}` does not repeat it).
    #[test]
    fn a_missing_file_says_why_once() {
        let err =
            anyhow_like_chain(&Config::load(Path::new("/nonexistent/pool.yaml")).unwrap_err());
        assert_eq!(
            err,
            "reading /nonexistent/pool.yaml: No such file or directory (os error 2)"
        );
    }

    /// The error and its sources, joined as `anyhow`'s `{:#}` joins them.
    fn anyhow_like_chain(err: &dyn std::error::Error) -> String {
        let mut out = err.to_string();
        let mut source = err.source();
        while let Some(s) = source {
            out.push_str(&format!(": {s}"));
            source = s.source();
        }
        out
    }

    #[test]
    fn a_missing_key_is_reported_where_its_mapping_starts() {
        let text = GOOD.replace("            max-parallel-jobs: 4\n", "");
        let err = parse(&text).unwrap_err().to_string();
        assert_eq!(err, "pool.yaml:10:13: missing field `max-parallel-jobs`");
        let text = GOOD.replace(
            "          - name: small\n",
            "          - host-key-checking: false\n",
        );
        let err = parse(&text).unwrap_err().to_string();
        assert_eq!(err, "pool.yaml:10:13: missing field `name`");
    }

    #[test]
    fn semantic_errors_point_at_the_value() {
        let text = GOOD.replace("max-parallel-jobs: 4", "max-parallel-jobs: 0");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:12:32: max-parallel-jobs must be 1 to 1024"),
            "{err}"
        );
        let text = GOOD.replace("name: small", "name: sm.all");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:10:") && err.contains("invalid label name \"sm.all\""),
            "{err}"
        );
    }

    #[test]
    fn limits_and_host_key_checking() {
        let text = GOOD.replace(
            "node-attributes: {zone: a}",
            "node-attributes: {zone: a}\n            limits: {cpu: 1.5, memory-mb: 512, pids: 64, disk-mb: 2048}\n            host-key-checking: true",
        );
        let c = parse(&text).unwrap();
        let label = c.sites("small")[0].label;
        assert_eq!(
            label.limits,
            SlotLimits {
                cpu_millis: Some(1500),
                memory_bytes: Some(512 << 20),
                pids: Some(64),
                disk_bytes: Some(2048 << 20),
            }
        );
        assert!(label.host_key_checking);
        let plain = parse(GOOD).unwrap();
        assert!(plain.sites("small")[0].label.limits.is_empty());
        assert!(!plain.sites("small")[0].label.host_key_checking);
        let bad = GOOD.replace(
            "node-attributes: {zone: a}",
            "node-attributes: {zone: a}\n            limits: {pids: 0}",
        );
        let err = parse(&bad).unwrap_err().to_string();
        assert!(err.starts_with("pool.yaml:15:21: limits.pids"), "{err}");
        let tiny = GOOD.replace(
            "node-attributes: {zone: a}",
            "node-attributes: {zone: a}\n            limits: {disk-mb: 8}",
        );
        let err = parse(&tiny).unwrap_err().to_string();
        assert!(err.contains("limits.disk-mb must be at least 16"), "{err}");
        let typo = GOOD.replace(
            "node-attributes: {zone: a}",
            "node-attributes: {zone: a}\n            limits: {memory: 5}",
        );
        let err = parse(&typo).unwrap_err().to_string();
        assert!(err.contains("unknown field `memory`"), "{err}");
    }

    #[test]
    fn leak_sweep_and_create_limits() {
        let c = parse(GOOD).unwrap();
        let p = &c.providers[0];
        assert_eq!(p.leak_sweep_interval, Duration::from_secs(300));
        assert_eq!(p.leak_grace, Duration::from_secs(600));
        assert_eq!(p.create_limits, CreateLimits::default());
        let set = GOOD.replace(
            "    driver: local\n",
            "    driver: local\n    leak-sweep-interval: 30\n    leak-grace: 5\n    max-creates-per-second: 0.5\n    max-concurrent-creates: 2\n",
        );
        let c = parse(&set).unwrap();
        let p = &c.providers[0];
        assert_eq!(p.leak_sweep_interval, Duration::from_secs(30));
        assert_eq!(p.leak_grace, Duration::from_secs(5));
        assert_eq!(
            p.create_limits,
            CreateLimits {
                per_second: Some(0.5),
                concurrent: Some(2)
            }
        );
        for (line, want) in [
            (
                "leak-grace: 0",
                "pool.yaml:4:17: leak-grace must be 1 to 604800 seconds, got 0",
            ),
            (
                "leak-sweep-interval: 0",
                "pool.yaml:4:26: leak-sweep-interval must be 1 to",
            ),
            (
                "max-creates-per-second: 0",
                "pool.yaml:4:29: max-creates-per-second must be 0.001 to 10000",
            ),
            (
                "max-concurrent-creates: 0",
                "pool.yaml:4:29: max-concurrent-creates must be 1 to 10000",
            ),
        ] {
            let text = GOOD.replace(
                "    driver: local\n",
                &format!("    driver: local\n    {line}\n"),
            );
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.starts_with(want), "{err}");
        }
    }

    #[test]
    fn an_exec_provider_may_have_a_console_command_and_it_is_not_empty() {
        let exec = GOOD.replace(
            "    driver: local\n    local:\n      work-dir: /tmp/x\n",
            "    driver: exec\n    exec:\n      create: [c]\n      delete: [d]\n      list: [l]\n",
        );
        let c = parse(&exec).unwrap();
        assert!(matches!(
            &c.providers[0].driver,
            DriverConfig::Exec { console: None, .. }
        ));
        let with = exec.replace("list: [l]\n", "list: [l]\n      console: [p, console]\n");
        let c = parse(&with).unwrap();
        assert!(matches!(
            &c.providers[0].driver,
            DriverConfig::Exec { console: Some(argv), .. } if argv == &["p", "console"]
        ));
        let empty = exec.replace("list: [l]\n", "list: [l]\n      console: []\n");
        let err = parse(&empty).unwrap_err().to_string();
        assert!(
            err.contains("exec.console must be a non-empty command list"),
            "{err}"
        );
    }

    #[test]
    fn driver_sections_must_match() {
        let text = GOOD.replace("driver: local", "driver: exec");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("does not fit driver Exec"), "{err}");
    }
}
