//! From the file as written ([`crate::raw`]) to a validated [`Config`]: every refusal
//! names the file, line and column and says what is accepted.

use crate::raw::*;
use crate::*;
use serde_saphyr::Spanned;
use slotpool_protocol::api::MIN_DISK_MB;
use slotpool_protocol::ids::is_key_token;

/// Longest `max-hold-time` a label may set: a year.
const MAX_HOLD_TIME_SECS: u64 = 365 * 24 * 3600;

/// Parses and validates `text`; errors name `path`, line and column.
pub(crate) fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
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

/// Defaults and bound of `leak-sweep-interval` and `leak-grace`, in seconds.
const DEFAULT_LEAK_SWEEP_INTERVAL: u64 = 300;
const DEFAULT_LEAK_GRACE: u64 = 600;
const MAX_LEAK_SECONDS: u64 = 7 * 24 * 3600;

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
        let kv_replicas = match &raw.launcher.kv_replicas {
            Some(s) if ![1, 3, 5].contains(&s.value) => {
                return Err(self.at(
                    s,
                    format!(
                        "kv-replicas must be 1, 3 or 5 (a JetStream cluster of that many \
                         servers keeps working while a minority fails), got {}",
                        s.value
                    ),
                ))
            }
            Some(s) => s.value as usize,
            None => 1,
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
            kv_replicas,
            providers,
        })
    }

    fn provider(&self, name: String, p: RawProvider) -> Result<ProviderConfig, ConfigError> {
        let (leak_sweep_interval, leak_grace) = self.leak_sweep(&p)?;
        let create_limits = self.create_limits(&p)?;
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
            leak_sweep_interval,
            leak_grace,
            create_limits,
        })
    }

    /// `leak-sweep-interval` and `leak-grace` of a provider.
    fn leak_sweep(&self, p: &RawProvider) -> Result<(Duration, Duration), ConfigError> {
        let seconds = |v: &Option<Spanned<u64>>, key: &str, default: u64| match v {
            Some(s) if s.value < 1 || s.value > MAX_LEAK_SECONDS => Err(self.at(
                s,
                format!(
                    "{key} must be 1 to {MAX_LEAK_SECONDS} seconds, got {}",
                    s.value
                ),
            )),
            Some(s) => Ok(Duration::from_secs(s.value)),
            None => Ok(Duration::from_secs(default)),
        };
        Ok((
            seconds(
                &p.leak_sweep_interval,
                "leak-sweep-interval",
                DEFAULT_LEAK_SWEEP_INTERVAL,
            )?,
            seconds(&p.leak_grace, "leak-grace", DEFAULT_LEAK_GRACE)?,
        ))
    }

    /// `max-creates-per-second` and `max-concurrent-creates` of a provider.
    fn create_limits(&self, p: &RawProvider) -> Result<CreateLimits, ConfigError> {
        let per_second = match &p.max_creates_per_second {
            Some(s) if !(s.value.is_finite() && (0.001..=10_000.0).contains(&s.value)) => {
                return Err(self.at(
                    s,
                    format!(
                        "max-creates-per-second must be 0.001 to 10000, got {}",
                        s.value
                    ),
                ))
            }
            other => other.as_ref().map(|s| s.value),
        };
        let concurrent = match &p.max_concurrent_creates {
            Some(s) if s.value == 0 || s.value > 10_000 => {
                return Err(self.at(
                    s,
                    format!("max-concurrent-creates must be 1 to 10000, got {}", s.value),
                ))
            }
            other => other.as_ref().map(|s| s.value),
        };
        Ok(CreateLimits {
            per_second,
            concurrent,
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
            let max_hold_time = match &l.max_hold_time {
                Some(s) if s.value == 0 || s.value > MAX_HOLD_TIME_SECS => {
                    return Err(self.at(
                        s,
                        format!(
                            "max-hold-time must be 1 to {MAX_HOLD_TIME_SECS} seconds (leave it \
                             out for no limit), got {}",
                            s.value
                        ),
                    ))
                }
                Some(s) => Some(Duration::from_secs(s.value)),
                None => None,
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
                max_hold_time,
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
