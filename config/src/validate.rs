//! From the file as written ([`crate::raw`]) to a validated [`Config`]: every refusal
//! names the file, line and column and says what is accepted.

use crate::raw::*;
use crate::*;
use serde_saphyr::Spanned;
use slotpool_protocol::api::MIN_DISK_MB;
use slotpool_protocol::ids::is_key_token;

/// Longest `max-hold-time` a label may set: a year.
const MAX_HOLD_TIME_SECS: u64 = 365 * 24 * 3600;

/// How many YAML nodes a pool file may hold. The parser's default (250,000) guards
/// against documents made to exhaust memory; a pool file is the operator's own, and a
/// `static` provider listing some tens of thousands of hosts (each host a mapping of
/// three keys, about seven nodes) is a legitimate one.
pub(crate) const MAX_YAML_NODES: usize = 4_000_000;

fn parser_options(max_nodes: usize) -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_nodes: max_nodes,
            max_events: 4 * max_nodes,
        },
    }
}

/// Parses and validates `text`; errors name `path`, line and column.
pub(crate) fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
    parse_within(path, text, MAX_YAML_NODES)
}

/// [`parse`], reading at most `max_nodes` YAML nodes.
fn parse_within(path: &Path, text: &str, max_nodes: usize) -> Result<Config, ConfigError> {
    let blank = |l: &str| l.trim().is_empty() || l.trim_start().starts_with('#');
    if text.lines().all(blank) {
        return Err(ConfigError::Whole {
            path: path.to_path_buf(),
            message: "the file is empty: a pool file needs at least `providers:` (see \
                      examples/pool.yaml)"
                .into(),
        });
    }
    // Where in the document the parser stopped (`providers[0].pools[0].max-servers`), so
    // that a refused value is named by its key.
    let mut at = None;
    let raw: Result<RawConfig, _> = serde_saphyr::with_deserializer_from_str_with_options(
        text,
        parser_options(max_nodes),
        |de| {
            serde_path_to_error::deserialize(de).map_err(|err| {
                at = Some(err.path().clone());
                err.into_inner()
            })
        },
    );
    let raw = raw.map_err(|err| parse_error(path, text, at.as_ref(), &err, max_nodes))?;
    Validator { path }.config(raw)
}

/// A parser error as [`ConfigError`]: a refused value says its key, what the key takes and
/// what it got; a missing key points at the start of the mapping that lacks it.
fn parse_error(
    path: &Path,
    text: &str,
    at: Option<&serde_path_to_error::Path>,
    err: &serde_saphyr::Error,
    max_nodes: usize,
) -> ConfigError {
    use serde_saphyr::Error as E;
    let (mut line, mut column) = err
        .location()
        .map(|l| (l.line(), l.column()))
        .unwrap_or((0, 0));
    // The last key named, past `value`, the inside of a `Spanned` field.
    let key = at.and_then(|p| {
        p.iter()
            .rev()
            .find(|s| !matches!(s, serde_path_to_error::Segment::Map { key } if key == "value"))
            .and_then(|s| match s {
                serde_path_to_error::Segment::Map { key } => Some(key.as_str()),
                _ => None,
            })
    });
    let mut message = first_line(&err.to_string());
    // The parser's own words where a reader needs others: a duplicate key says where the
    // first one is (not how to configure the parser), a tab says where it is (not where
    // the scalar before it began).
    if let Some(rest) = message.strip_prefix("duplicate mapping key: ") {
        let dup = rest
            .split(", set DuplicateKeyPolicy")
            .next()
            .unwrap_or(rest)
            .trim();
        message = match earlier_key(text, line, column, dup) {
            Some(first) => {
                format!("`{dup}` is given twice in this mapping (first at line {first})")
            }
            None => format!("`{dup}` is given twice in this mapping"),
        };
    } else if message.contains("found a tab") || message.contains("tab character") {
        if let Some((l, c)) = first_tab(text, line) {
            (line, column) = (l, c);
            message = "a tab: YAML indents with spaces only".into();
        }
    }
    match (err.without_snippet(), key) {
        (E::Budget { breach, .. }, _) => {
            message = format!(
                "the file is larger than slotpool reads: at most {max_nodes} YAML nodes \
                 (values, keys, lists and mappings) and four times as many parser events \
                 ({breach:?})"
            );
        }
        (E::InvalidScalar { .. } | E::SerdeInvalidType { .. }, Some(key)) => {
            let got = scalar_at(text, line, column);
            message = match expected(key) {
                Some(what) => format!("{key}: expected {what}, got {got}"),
                None => format!("{key}: {message} (got {got})"),
            };
        }
        (E::Unexpected { .. }, Some(key)) => {
            message = match expected(key) {
                Some(what) => format!("{key}: expected {what}"),
                None => format!("{key}: {message}"),
            };
        }
        (E::SerdeInvalidValue { .. } | E::Message { .. }, Some(key)) => {
            message = format!("{key}: {message}");
        }
        (E::SerdeMissingField { field, .. }, _) => {
            if let Some((l, c)) = at.and_then(|p| mapping_start(text, p)) {
                (line, column) = (l, c);
            }
            if let Some((kl, kc)) = misindented(text, line, column, field) {
                message = format!(
                    "{message}: line {kl} has `{field}:` at column {kc}, but this mapping's \
                     keys are at column {column}: indent it like them"
                );
            }
        }
        _ => {}
    }
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
}

/// The line (1-based) of an earlier `key:` at `column` before `line`, in the same
/// mapping as far as indentation tells.
fn earlier_key(text: &str, line: u64, column: u64, key: &str) -> Option<u64> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = column.saturating_sub(1) as usize;
    for l in (0..(line as usize).saturating_sub(1).min(lines.len())).rev() {
        let this = lines[l];
        let start = this.len() - this.trim_start_matches([' ', '-']).len();
        let body = &this[start..];
        if body.starts_with(&format!("{key}:")) && start == indent {
            return Some(l as u64 + 1);
        }
        // Left of the mapping's keys: out of the mapping.
        if !body.is_empty() && !body.starts_with('#') && start < indent {
            return None;
        }
    }
    None
}

/// The first tab at or after `line` (1-based), else anywhere: (line, column).
fn first_tab(text: &str, line: u64) -> Option<(u64, u64)> {
    let find = |skip: usize| {
        text.lines().enumerate().skip(skip).find_map(|(i, l)| {
            l.find('\t')
                .map(|at| (i as u64 + 1, l[..at].chars().count() as u64 + 1))
        })
    };
    find(line.saturating_sub(1) as usize).or_else(|| find(0))
}

/// A `field:` key near the mapping whose keys start at `line`:`column` that is indented
/// otherwise (a key written at the wrong level is read as part of another mapping, and
/// this one misses it): (line, column) of it. Looks from the mapping's start to the
/// next line indented less than the mapping's parent.
fn misindented(text: &str, line: u64, column: u64, field: &str) -> Option<(u64, u64)> {
    let lines: Vec<&str> = text.lines().collect();
    let first = line.saturating_sub(1) as usize;
    let keys_at = column.saturating_sub(1) as usize;
    for (i, l) in lines.iter().enumerate().skip(first) {
        let start = l.len() - l.trim_start_matches([' ', '-']).len();
        let body = &l[start..];
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        // Dedented, or indented by one space: a nested mapping's own keys (two spaces
        // in, or more) are not this one's.
        if body.starts_with(&format!("{field}:")) && start != keys_at && start < keys_at + 2 {
            return Some((i as u64 + 1, start as u64 + 1));
        }
        // Two levels out (left of the mapping's parent): another part of the file.
        if i > first && start + 4 <= keys_at {
            return None;
        }
    }
    None
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
/// Longest `warm-window`: a day.
const MAX_WARM_SECS: u64 = 24 * 3600;
/// Shortest `stall-after`: a launcher's supervisor passes at least every resync (15 s).
const MIN_STALL_AFTER_SECS: u64 = 20;
/// `warm-lead` when left out: a typical boot.
const DEFAULT_WARM_LEAD: u64 = 60;

/// What a key takes, with its unit, for the keys whose value has a type of its own.
fn expected(key: &str) -> Option<&'static str> {
    Some(match key {
        "lease-ttl"
        | "stall-after"
        | "launch-timeout"
        | "boot-timeout"
        | "grace-time"
        | "min-retention-time"
        | "max-age"
        | "max-hold-time"
        | "leak-sweep-interval"
        | "leak-grace"
        | "warm-window"
        | "warm-lead" => SECONDS_EXPECTED,
        "max-servers" => "a whole number of backing nodes (1 to 100000)",
        "max-parallel-jobs" => "a whole number of slots per backing node (1 to 1024)",
        "launch-retries" => "a whole number of launch attempts (at least 1)",
        "min-ready" => "a whole number of free slots to keep ready (0 or more)",
        "max-uses" => "a whole number of jobs per backing node (at least 1)",
        "cost-per-hour" => "a positive number (what one backing node of this size costs an hour)",
        "sizes" => "a list of sizes, each with backing-label, max-parallel-jobs and cost-per-hour",
        "priority" => "a whole number (lower pools are tried first)",
        "cpu" => "a number of CPUs (e.g. 1.5)",
        "memory-mb" | "disk-mb" => "a whole number of MiB",
        "pids" => "a whole number of processes",
        "host-key-checking" => "true or false",
        _ => return None,
    })
}

/// The scalar written at `line`:`column` (1-based), quoted, for an error message.
fn scalar_at(text: &str, line: u64, column: u64) -> String {
    let found = (line > 0)
        .then(|| text.lines().nth(line as usize - 1))
        .flatten()
        .and_then(|l| l.get(column.saturating_sub(1) as usize..))
        .map(|rest| {
            let rest = rest.split(" #").next().unwrap_or(rest);
            rest.split([',', '}', ']'])
                .next()
                .unwrap_or(rest)
                .trim()
                .trim_matches(['"', '\''])
        });
    format!("{:?}", found.unwrap_or(""))
}

/// Where the mapping at `path` starts (its first key), found by reading the document
/// again as a tree of spanned nodes.
fn mapping_start(text: &str, path: &serde_path_to_error::Path) -> Option<(u64, u64)> {
    use serde_path_to_error::Segment;
    let mut node: Spanned<Node> = serde_saphyr::from_str(text).ok()?;
    for segment in path.iter() {
        // The inside of a `Spanned` field is named `value`; the document has no such key.
        if let Segment::Map { key } = segment {
            let has_key =
                matches!(&node.value, Node::Map(entries) if entries.iter().any(|(k, _)| k == key));
            if key == "value" && !has_key {
                continue;
            }
        }
        let next = match (segment, node.value) {
            (Segment::Map { key }, Node::Map(entries)) => {
                entries.into_iter().find(|(k, _)| k == key)?.1
            }
            (Segment::Seq { index }, Node::Seq(items)) => items.into_iter().nth(*index)?,
            _ => return None,
        };
        node = next;
    }
    Some((node.referenced.line(), node.referenced.column()))
}

/// A YAML document's shape with the place of every node, for [`mapping_start`].
enum Node {
    Map(Vec<(String, Spanned<Node>)>),
    Seq(Vec<Spanned<Node>>),
    Scalar,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Node;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any YAML node")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_str<E>(self, _: &str) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_unit<E>(self) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_none<E>(self) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Node::Seq(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Node::Map(entries))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

pub(crate) struct Validator<'p> {
    path: &'p Path,
}

impl Validator<'_> {
    pub(crate) fn at<T>(&self, spanned: &Spanned<T>, message: impl Into<String>) -> ConfigError {
        ConfigError::At {
            path: self.path.to_path_buf(),
            line: spanned.referenced.line(),
            column: spanned.referenced.column(),
            message: message.into(),
        }
    }

    pub(crate) fn name(&self, what: &str, name: &Spanned<String>) -> Result<String, ConfigError> {
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
            Some(s) if s.value.0 < 1 || s.value.0 > 300 => {
                return Err(self.at(
                    s,
                    format!("lease-ttl must be 1 to 300 seconds, got {}", s.value.0),
                ))
            }
            Some(s) => Duration::from_secs(s.value.0),
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
        let stall_after = match &raw.launcher.stall_after {
            Some(s) if s.value.0 < MIN_STALL_AFTER_SECS || s.value.0 > 3600 => {
                return Err(self.at(
                    s,
                    format!(
                        "stall-after must be {MIN_STALL_AFTER_SECS} to 3600 seconds (a launcher \
                         passes at least every 15 s), got {}",
                        s.value.0
                    ),
                ))
            }
            Some(s) => Duration::from_secs(s.value.0),
            None => DEFAULT_STALL_AFTER,
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
        let mut config = Config {
            lease_ttl,
            agent_nats_url: raw.launcher.agent_nats_url,
            kv_replicas,
            stall_after,
            providers,
            tenants: Default::default(),
        };
        let label_slots = config
            .label_names()
            .into_iter()
            .map(|l| (l.to_string(), config.max_nodes(l)))
            .collect();
        config.tenants = tenants::validate(self, raw.tenants, &label_slots)?;
        Ok(config)
    }

    fn provider(&self, name: String, p: RawProvider) -> Result<ProviderConfig, ConfigError> {
        let (leak_sweep_interval, leak_grace) = self.leak_sweep(&p)?;
        let create_limits = self.create_limits(&p)?;
        let mut pools = Vec::new();
        for pool in p.pools {
            if pools.iter().any(|x: &PoolConfig| x.name == pool.name.value) {
                return Err(self.at(
                    &pool.name,
                    format!(
                        "provider {name:?}: pool {:?} is defined twice",
                        pool.name.value
                    ),
                ));
            }
            pools.push(self.pool(pool, p.driver.value)?);
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
                let console = exec.value.console.as_ref();
                for (key, argv) in [
                    ("create", Some(&exec.value.create)),
                    ("delete", Some(&exec.value.delete)),
                    ("list", Some(&exec.value.list)),
                    ("console", console),
                ]
                .into_iter()
                .filter_map(|(key, argv)| Some((key, argv?)))
                {
                    if argv.is_empty() || argv[0].is_empty() {
                        return Err(self.at(&exec, format!("exec.{key} must be a non-empty command list, e.g. [\"/usr/local/bin/my-{key}\"]")));
                    }
                }
                let RawExec {
                    create,
                    delete,
                    list,
                    console,
                } = exec.value;
                DriverConfig::Exec {
                    create,
                    delete,
                    list,
                    console,
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
        let seconds = |v: &Option<Spanned<Seconds>>, key: &str, default: u64| match v {
            Some(s) if s.value.0 < 1 || s.value.0 > MAX_LEAK_SECONDS => Err(self.at(
                s,
                format!(
                    "{key} must be 1 to {MAX_LEAK_SECONDS} seconds, got {}",
                    s.value.0
                ),
            )),
            Some(s) => Ok(Duration::from_secs(s.value.0)),
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
        // Names seen, so that a list of tens of thousands of hosts is checked in one pass.
        let mut names = std::collections::HashSet::new();
        for h in raw_hosts {
            let name = self.name("host", &h.name)?;
            if !names.insert(name.clone()) {
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

    /// The sizes of the label `l` (whose mapping is at `whole`): its `backing-label` and
    /// `max-parallel-jobs`, or its list of `sizes`, never both.
    fn sizes(
        &self,
        l: &RawLabel,
        whole: &Spanned<()>,
        driver: Driver,
    ) -> Result<Vec<BackingSize>, ConfigError> {
        let Some(raw) = &l.sizes else {
            return match (&l.backing_label, &l.max_parallel_jobs) {
                (Some(backing_label), Some(slots)) => Ok(vec![BackingSize {
                    backing_label: backing_label.value.clone(),
                    slots: self.slots(slots)?,
                    cost_per_hour: None,
                }]),
                (None, _) => Err(self.at(
                    whole,
                    "missing field `backing-label` (or a list of `sizes`)",
                )),
                (Some(_), None) => Err(self.at(whole, "missing field `max-parallel-jobs`")),
            };
        };
        if let Some(single) = l
            .backing_label
            .as_ref()
            .map(|s| s.referenced)
            .or(l.max_parallel_jobs.as_ref().map(|s| s.referenced))
        {
            return Err(self.at(
                &Spanned::new((), single, single),
                "give either `backing-label` with `max-parallel-jobs` (one size) or a list \
                 of `sizes`, not both",
            ));
        }
        if raw.value.is_empty() {
            return Err(self.at(
                raw,
                "sizes must list at least one size (backing-label, max-parallel-jobs, \
                 cost-per-hour)",
            ));
        }
        if driver == Driver::Static && raw.value.len() > 1 {
            return Err(self.at(
                raw,
                "a static host has the slots its agent runs with: a label of driver static \
                 takes one size",
            ));
        }
        let mut sizes: Vec<BackingSize> = Vec::new();
        for size in &raw.value {
            let backing_label = &size.backing_label;
            if sizes.iter().any(|s| s.backing_label == backing_label.value) {
                return Err(self.at(
                    backing_label,
                    format!(
                        "backing-label {:?} is listed twice in the sizes of label {:?}",
                        backing_label.value, l.name.value
                    ),
                ));
            }
            let cost = &size.cost_per_hour;
            if !(cost.value.is_finite() && cost.value > 0.0) {
                return Err(self.at(
                    cost,
                    format!(
                        "cost-per-hour must be a positive number (what one backing node of \
                         this size costs an hour), got {}",
                        cost.value
                    ),
                ));
            }
            sizes.push(BackingSize {
                backing_label: backing_label.value.clone(),
                slots: self.slots(&size.max_parallel_jobs)?,
                cost_per_hour: Some(cost.value),
            });
        }
        Ok(sizes)
    }

    /// A `max-parallel-jobs`: 1 to 1024 slots.
    fn slots(&self, slots: &Spanned<u32>) -> Result<u32, ConfigError> {
        if slots.value == 0 || slots.value > 1024 {
            return Err(self.at(
                slots,
                format!("max-parallel-jobs must be 1 to 1024, got {}", slots.value),
            ));
        }
        Ok(slots.value)
    }

    fn pool(&self, p: RawPool, driver: Driver) -> Result<PoolConfig, ConfigError> {
        let name = self.name("pool", &p.name)?;
        if p.max_servers.value == 0 || p.max_servers.value > MAX_SERVERS {
            return Err(self.at(
                &p.max_servers,
                format!(
                    "max-servers must be 1 to {}, got {}",
                    MAX_SERVERS, p.max_servers.value
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
            let Spanned {
                value: l,
                referenced,
                defined,
            } = l;
            let label_name = self.name("label", &l.name)?;
            if labels.iter().any(|x| x.name == label_name) {
                return Err(self.at(
                    &l.name,
                    format!("label {label_name:?} is listed twice in pool {name:?}"),
                ));
            }
            let sizes = self.sizes(&l, &Spanned::new((), referenced, defined), driver)?;
            let most_slots = sizes.iter().map(|s| s.slots).max().unwrap_or(0);
            let slots_allowed = u64::from(p.max_servers.value) * u64::from(most_slots);
            let limits = match &l.limits {
                None => SlotLimits::default(),
                Some(raw) => self.limits(raw)?,
            };
            let max_hold_time = match &l.max_hold_time {
                Some(s) if s.value.0 == 0 || s.value.0 > MAX_HOLD_TIME_SECS => {
                    return Err(self.at(
                        s,
                        format!(
                            "max-hold-time must be 1 to {MAX_HOLD_TIME_SECS} seconds (leave it \
                             out for no limit), got {}",
                            s.value.0
                        ),
                    ))
                }
                Some(s) => Some(Duration::from_secs(s.value.0)),
                None => None,
            };
            let min_ready = match &l.min_ready {
                Some(m) if u64::from(m.value) > slots_allowed => {
                    return Err(self.at(
                        m,
                        format!(
                            "min-ready must be 0 to {slots_allowed} (max-servers {} x \
                             max-parallel-jobs {most_slots}), got {}",
                            p.max_servers.value, m.value
                        ),
                    ))
                }
                Some(m) => m.value,
                None => 0,
            };
            let warm = match (&l.warm_window, &l.warm_lead) {
                (None, Some(lead)) => {
                    return Err(
                        self.at(lead, "warm-lead needs warm-window (the arrivals it counts)")
                    )
                }
                (None, None) => None,
                (Some(w), lead) => {
                    if w.value.0 == 0 || w.value.0 > MAX_WARM_SECS {
                        return Err(self.at(
                            w,
                            format!(
                                "warm-window must be 1 to {MAX_WARM_SECS} seconds, got {}",
                                w.value.0
                            ),
                        ));
                    }
                    let lead = match lead {
                        Some(d) if d.value.0 == 0 || d.value.0 > w.value.0 => {
                            return Err(self.at(
                                d,
                                format!(
                                    "warm-lead must be 1 to warm-window ({}) seconds, got {}",
                                    w.value.0, d.value.0
                                ),
                            ))
                        }
                        Some(d) => d.value.0,
                        None => DEFAULT_WARM_LEAD.min(w.value.0),
                    };
                    Some(Warm {
                        window: Duration::from_secs(w.value.0),
                        lead: Duration::from_secs(lead),
                    })
                }
            };
            if let Some(m) = l.max_uses.as_ref().filter(|m| m.value == 0) {
                return Err(self.at(
                    m,
                    "max-uses must be at least 1 (leave it out for no limit), got 0",
                ));
            }
            labels.push(LabelConfig {
                name: label_name,
                sizes,
                grace_time: Duration::from_secs(l.grace_time),
                min_retention_time: Duration::from_secs(l.min_retention_time),
                max_age: Duration::from_secs(l.max_age),
                node_attributes: l.node_attributes,
                limits,
                host_key_checking: l.host_key_checking,
                max_hold_time,
                min_ready,
                warm,
                max_uses: l.max_uses.map(|m| m.value),
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

    /// A pool file with a `static` provider of `n` hosts.
    fn static_pool(n: usize) -> String {
        let mut text = String::from(
            "providers:\n  - name: fleet\n    driver: static\n    static:\n      hosts:\n",
        );
        for i in 0..n {
            text.push_str(&format!(
                "        - {{name: bn-{i:06}, host: 10.{}.{}.{}, secret-file: /etc/slotpool/secret}}\n",
                (i >> 16) & 255,
                (i >> 8) & 255,
                i & 255
            ));
        }
        text.push_str(&format!(
            "    pools:\n      - name: main\n        max-servers: {n}\n        labels:\n          - name: small\n            backing-label: vm\n            max-parallel-jobs: 8\n"
        ));
        text
    }

    #[test]
    fn a_file_past_the_parsers_budget_is_refused_saying_so() {
        let text = static_pool(50);
        let path = Path::new("pool.yaml");
        assert!(parse_within(path, &text, 100_000).is_ok());
        let err = parse_within(path, &text, 100).unwrap_err().to_string();
        assert!(
            err.starts_with("pool.yaml:")
                && err.contains("larger than slotpool reads: at most 100 YAML nodes"),
            "{err}"
        );
    }

    #[test]
    fn a_static_provider_of_sixty_thousand_hosts_is_read() {
        // Past the YAML parser's default budget of 250,000 nodes; read in one pass (the
        // duplicate check walked the hosts read so far for each one: minutes).
        let config = parse(Path::new("pool.yaml"), &static_pool(60_000)).unwrap();
        assert_eq!(config.sites("small")[0].pool.max_servers, 60_000);
    }
}
