//! The launcher's YAML configuration: parsed once, validated once, plain data after.
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

use serde::Deserialize;
use serde_saphyr::Spanned;
use slotpool_protocol::api::{SlotLimits, MIN_DISK_MB};
use slotpool_protocol::ids::is_key_token;
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

// ---- the file as written -------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawConfig {
    #[serde(default)]
    launcher: RawLauncher,
    providers: Vec<RawProvider>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawLauncher {
    lease_ttl: Option<Spanned<u64>>,
    agent_nats_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawProvider {
    name: Spanned<String>,
    driver: Spanned<Driver>,
    #[serde(rename = "static")]
    static_hosts: Option<Spanned<RawStatic>>,
    local: Option<Spanned<RawLocal>>,
    exec: Option<Spanned<RawExec>>,
    pools: Vec<RawPool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Driver {
    Static,
    Local,
    Exec,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawStatic {
    hosts: Vec<RawHost>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawHost {
    name: Spanned<String>,
    host: String,
    pool: Option<String>,
    secret_file: PathBuf,
    #[serde(default)]
    attributes: Attributes,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawLocal {
    agent_command: Option<PathBuf>,
    work_dir: Option<PathBuf>,
    #[serde(default)]
    agent_args: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawExec {
    create: Vec<String>,
    delete: Vec<String>,
    list: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawPool {
    name: Spanned<String>,
    max_servers: Spanned<u32>,
    #[serde(default = "default_priority")]
    priority: i32,
    #[serde(default = "default_launch_timeout")]
    launch_timeout: u64,
    #[serde(default = "default_boot_timeout")]
    boot_timeout: u64,
    launch_retries: Option<Spanned<u32>>,
    labels: Vec<RawLabel>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawLabel {
    name: Spanned<String>,
    backing_label: String,
    max_parallel_jobs: Spanned<u32>,
    #[serde(default = "default_grace_time")]
    grace_time: u64,
    #[serde(default)]
    min_retention_time: u64,
    #[serde(default)]
    max_age: u64,
    #[serde(default)]
    node_attributes: Attributes,
    #[serde(default)]
    limits: Option<Spanned<RawLimits>>,
    #[serde(default)]
    host_key_checking: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawLimits {
    cpu: Option<f64>,
    memory_mb: Option<u64>,
    pids: Option<u32>,
    disk_mb: Option<u64>,
}

fn default_priority() -> i32 {
    100
}
fn default_launch_timeout() -> u64 {
    300
}
fn default_boot_timeout() -> u64 {
    300
}
fn default_grace_time() -> u64 {
    60
}

// ---- the validated config ------------------------------------------------------------

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
        let raw: RawConfig = serde_saphyr::from_str(text).map_err(|err| {
            let (line, column) = err
                .location()
                .map(|l| (l.line(), l.column()))
                .unwrap_or((0, 0));
            let message = first_line(&err.to_string());
            if line == 0 {
                ConfigError::Whole {
                    path: path.to_path_buf(),
                    message,
                }
            } else {
                ConfigError::At {
                    path: path.to_path_buf(),
                    line,
                    column,
                    message,
                }
            }
        })?;
        Validator { path }.config(raw)
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

/// The parser's message without its own "error: line L column C: " prefix.
fn first_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or(s).trim();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    match line
        .strip_prefix("line ")
        .and_then(|rest| rest.split_once(": "))
    {
        Some((_, message)) => message.to_string(),
        None => line.to_string(),
    }
}

struct Validator<'p> {
    path: &'p Path,
}

impl Validator<'_> {
    fn at<T>(&self, spanned: &Spanned<T>, message: impl Into<String>) -> ConfigError {
        ConfigError::At {
            path: self.path.to_path_buf(),
            line: spanned.referenced.line(),
            column: spanned.referenced.column(),
            message: message.into(),
        }
    }

    fn name(&self, what: &str, name: &Spanned<String>) -> Result<String, ConfigError> {
        if is_key_token(&name.value) {
            Ok(name.value.clone())
        } else {
            Err(self.at(
                name,
                format!(
                    "invalid {what} name {:?}: use 1-128 characters of a-z, A-Z, 0-9, '-' and '_'",
                    name.value
                ),
            ))
        }
    }

    fn config(&self, raw: RawConfig) -> Result<Config, ConfigError> {
        let lease_ttl = match &raw.launcher.lease_ttl {
            Some(s) if s.value < 1 || s.value > 300 => {
                return Err(self.at(
                    s,
                    format!("lease-ttl must be 1 to 300 seconds, got {}", s.value),
                ))
            }
            Some(s) => Duration::from_secs(s.value),
            None => Duration::from_secs(10),
        };
        if raw.providers.is_empty() {
            return Err(ConfigError::Whole {
                path: self.path.to_path_buf(),
                message: "no providers: add at least one under `providers:`".into(),
            });
        }
        let mut providers = Vec::new();
        let mut provider_names = BTreeMap::new();
        for p in raw.providers {
            let name = self.name("provider", &p.name)?;
            if provider_names.insert(name.clone(), ()).is_some() {
                return Err(self.at(&p.name, format!("provider {name:?} is defined twice")));
            }
            providers.push(self.provider(name, p)?);
        }
        Ok(Config {
            lease_ttl,
            agent_nats_url: raw.launcher.agent_nats_url,
            providers,
        })
    }

    fn provider(&self, name: String, p: RawProvider) -> Result<ProviderConfig, ConfigError> {
        let mut pools = Vec::new();
        for pool in p.pools {
            let pool = self.pool(pool)?;
            if pools.iter().any(|x: &PoolConfig| x.name == pool.name) {
                return Err(ConfigError::Whole {
                    path: self.path.to_path_buf(),
                    message: format!("provider {name:?}: pool {:?} is defined twice", pool.name),
                });
            }
            pools.push(pool);
        }
        if pools.is_empty() {
            return Err(self.at(&p.name, format!("provider {name:?} has no pools")));
        }
        let section = |present: bool, key: &str| {
            if present {
                Ok(())
            } else {
                Err(self.at(&p.driver, format!("driver {key} needs a `{key}:` section")))
            }
        };
        let stray = [
            ("static", p.static_hosts.is_some(), Driver::Static),
            ("local", p.local.is_some(), Driver::Local),
            ("exec", p.exec.is_some(), Driver::Exec),
        ]
        .into_iter()
        .find(|(_, present, d)| *present && *d != p.driver.value);
        if let Some((key, ..)) = stray {
            return Err(self.at(
                &p.driver,
                format!(
                    "provider {name:?}: a `{key}:` section does not fit driver {:?}",
                    p.driver.value
                ),
            ));
        }
        let driver = match p.driver.value {
            Driver::Static => {
                section(p.static_hosts.is_some(), "static")?;
                let raw = p.static_hosts.expect("checked");
                DriverConfig::Static {
                    hosts: self.static_hosts(&name, &pools, raw)?,
                }
            }
            Driver::Local => {
                let local = p.local.map(|s| s.value).unwrap_or_default();
                DriverConfig::Local {
                    agent_command: local.agent_command,
                    agent_args: local.agent_args,
                    work_dir: local
                        .work_dir
                        .unwrap_or_else(|| PathBuf::from("/var/lib/slotpool/local")),
                }
            }
            Driver::Exec => {
                section(p.exec.is_some(), "exec")?;
                let exec = p.exec.expect("checked");
                for (key, argv) in [
                    ("create", &exec.value.create),
                    ("delete", &exec.value.delete),
                    ("list", &exec.value.list),
                ] {
                    if argv.is_empty() || argv[0].is_empty() {
                        return Err(self.at(&exec, format!("exec.{key} must be a non-empty command list, e.g. [\"/usr/local/bin/my-{key}\"]")));
                    }
                }
                let RawExec {
                    create,
                    delete,
                    list,
                } = exec.value;
                DriverConfig::Exec {
                    create,
                    delete,
                    list,
                }
            }
        };
        Ok(ProviderConfig {
            name,
            driver,
            pools,
        })
    }

    fn static_hosts(
        &self,
        provider: &str,
        pools: &[PoolConfig],
        raw: Spanned<RawStatic>,
    ) -> Result<Vec<StaticHost>, ConfigError> {
        let mut hosts: Vec<StaticHost> = Vec::new();
        let Spanned {
            value: RawStatic { hosts: raw_hosts },
            referenced,
            defined,
        } = raw;
        let raw = Spanned::new((), referenced, defined);
        for h in raw_hosts {
            let name = self.name("host", &h.name)?;
            if hosts.iter().any(|x| x.name == name) {
                return Err(self.at(&h.name, format!("host {name:?} is listed twice")));
            }
            let pool = match (h.pool, pools) {
                (Some(p), _) if pools.iter().any(|x| x.name == p) => p,
                (Some(p), _) => return Err(self.at(&h.name, format!("host {name:?} names pool {p:?}, which provider {provider:?} does not have"))),
                (None, [only]) => only.name.clone(),
                (None, _) => return Err(self.at(&h.name, format!("host {name:?}: say which pool it belongs to (`pool:`); provider {provider:?} has several"))),
            };
            hosts.push(StaticHost {
                name,
                host: h.host,
                pool,
                secret_file: h.secret_file,
                attributes: h.attributes,
            });
        }
        for pool in pools {
            let n = hosts.iter().filter(|h| h.pool == pool.name).count() as u32;
            if n < pool.max_servers {
                return Err(self.at(
                    &raw,
                    format!(
                        "pool {:?} has max-servers {} but only {n} static hosts",
                        pool.name, pool.max_servers
                    ),
                ));
            }
        }
        Ok(hosts)
    }

    fn limits(&self, raw: &Spanned<RawLimits>) -> Result<SlotLimits, ConfigError> {
        let l = &raw.value;
        let cpu_millis = match l.cpu {
            None => None,
            Some(cpu) if cpu.is_finite() && (0.01..=4096.0).contains(&cpu) => {
                Some((cpu * 1000.0).round() as u32)
            }
            Some(cpu) => {
                return Err(self.at(
                    raw,
                    format!("limits.cpu must be 0.01 to 4096 CPUs, got {cpu}"),
                ))
            }
        };
        if l.memory_mb == Some(0) {
            return Err(self.at(raw, "limits.memory-mb must be at least 1"));
        }
        if l.pids == Some(0) {
            return Err(self.at(raw, "limits.pids must be at least 1"));
        }
        if l.disk_mb.is_some_and(|mb| mb < MIN_DISK_MB) {
            return Err(self.at(
                raw,
                format!("limits.disk-mb must be at least {MIN_DISK_MB}"),
            ));
        }
        Ok(SlotLimits {
            cpu_millis,
            memory_bytes: l.memory_mb.map(|mb| mb.saturating_mul(1024 * 1024)),
            pids: l.pids,
            disk_bytes: l.disk_mb.map(|mb| mb.saturating_mul(1024 * 1024)),
        })
    }

    fn pool(&self, p: RawPool) -> Result<PoolConfig, ConfigError> {
        let name = self.name("pool", &p.name)?;
        if p.max_servers.value == 0 || p.max_servers.value > 100_000 {
            return Err(self.at(
                &p.max_servers,
                format!(
                    "max-servers must be 1 to 100000, got {}",
                    p.max_servers.value
                ),
            ));
        }
        let launch_retries = match &p.launch_retries {
            Some(r) if r.value == 0 => {
                return Err(self.at(
                    r,
                    "launch-retries must be at least 1 (the first attempt counts)",
                ))
            }
            Some(r) => r.value,
            None => 3,
        };
        if p.labels.is_empty() {
            return Err(self.at(&p.name, format!("pool {name:?} has no labels")));
        }
        let mut labels: Vec<LabelConfig> = Vec::new();
        for l in p.labels {
            let label_name = self.name("label", &l.name)?;
            if labels.iter().any(|x| x.name == label_name) {
                return Err(self.at(
                    &l.name,
                    format!("label {label_name:?} is listed twice in pool {name:?}"),
                ));
            }
            if l.max_parallel_jobs.value == 0 || l.max_parallel_jobs.value > 1024 {
                return Err(self.at(
                    &l.max_parallel_jobs,
                    format!(
                        "max-parallel-jobs must be 1 to 1024, got {}",
                        l.max_parallel_jobs.value
                    ),
                ));
            }
            let limits = match &l.limits {
                None => SlotLimits::default(),
                Some(raw) => self.limits(raw)?,
            };
            labels.push(LabelConfig {
                name: label_name,
                backing_label: l.backing_label,
                max_parallel_jobs: l.max_parallel_jobs.value,
                grace_time: Duration::from_secs(l.grace_time),
                min_retention_time: Duration::from_secs(l.min_retention_time),
                max_age: Duration::from_secs(l.max_age),
                node_attributes: l.node_attributes,
                limits,
                host_key_checking: l.host_key_checking,
            });
        }
        Ok(PoolConfig {
            name,
            max_servers: p.max_servers.value,
            priority: p.priority,
            launch_timeout: Duration::from_secs(p.launch_timeout.max(1)),
            boot_timeout: Duration::from_secs(p.boot_timeout.max(1)),
            launch_retries,
            labels,
        })
    }
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
    fn wrong_type_names_file_line_and_column() {
        let text = GOOD.replace("max-servers: 2", "max-servers: two");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.starts_with("pool.yaml:8:22: invalid u32"), "{err}");
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
