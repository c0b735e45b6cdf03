//! The pool configuration (the launcher's YAML file): parsed once, validated once, plain
//! data after; shared by the launcher and the console, with the timing rules both apply
//! ([`timing`]).
//!
//! - [`raw`]: the file as written (serde types with spans);
//! - [`validate`]: from the file to [`Config`], every error with file:line:col;
//! - [`timing`]: when an idle backing node is released and when it reaches max-age;
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
mod raw;
pub mod timing;
mod validate;

use serde::Deserialize;
use slotpool_protocol::api::SlotLimits;
use slotpool_protocol::model::Attributes;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A configuration problem, with where it is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
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
    pub providers: Vec<ProviderConfig>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ProviderConfig {
    pub name: String,
    pub driver: DriverConfig,
    pub pools: Vec<PoolConfig>,
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
    pub backing_label: String,
    pub max_parallel_jobs: u32,
    pub grace_time: Duration,
    pub min_retention_time: Duration,
    /// Zero: no maximum age.
    pub max_age: Duration,
    pub node_attributes: Attributes,
    /// Resource limits of each slot's cgroup, sent to the agent on prepare.
    pub limits: SlotLimits,
    /// Check the backing node's SSH host keys with a key scan before handing out a slot.
    pub host_key_checking: bool,
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
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
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
    /// serving it at `max-servers` backing nodes of `max-parallel-jobs` slots.
    pub fn max_nodes(&self, label: &str) -> u64 {
        self.sites(label)
            .iter()
            .map(|s| u64::from(s.pool.max_servers) * u64::from(s.label.max_parallel_jobs))
            .sum()
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

    #[test]
    fn a_missing_key_is_reported_where_its_mapping_starts() {
        let text = GOOD.replace("            backing-label: large-node\n", "");
        let err = parse(&text).unwrap_err().to_string();
        assert_eq!(err, "pool.yaml:10:13: missing field `backing-label`");
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
    fn driver_sections_must_match() {
        let text = GOOD.replace("driver: local", "driver: exec");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("does not fit driver Exec"), "{err}");
    }
}
