//! The configuration file as written: serde types with spans, so that validation can
//! name the line and column of what it refuses.

use crate::Driver;
use serde::{de, Deserialize, Deserializer};
use serde_saphyr::Spanned;
use slotpool_protocol::model::Attributes;
use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawConfig {
    #[serde(default)]
    pub(crate) launcher: RawLauncher,
    pub(crate) providers: Vec<RawProvider>,
    #[serde(default)]
    pub(crate) tenants: Vec<Spanned<RawTenant>>,
}

/// One entry of `tenants` ([`crate::tenants`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawTenant {
    pub(crate) name: Spanned<String>,
    #[serde(default)]
    pub(crate) clients: Vec<Spanned<String>>,
    pub(crate) weight: Option<Spanned<u32>>,
    #[serde(default)]
    pub(crate) guaranteed: std::collections::BTreeMap<String, Spanned<u32>>,
    pub(crate) guaranteed_slots: Option<Spanned<u32>>,
    pub(crate) max_slots: Option<Spanned<u32>>,
    pub(crate) max_waiting: Option<Spanned<u32>>,
    pub(crate) max_submits_per_second: Option<Spanned<f64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawLauncher {
    pub(crate) lease_ttl: Option<Spanned<Seconds>>,
    pub(crate) agent_nats_url: Option<String>,
    pub(crate) kv_replicas: Option<Spanned<u64>>,
    pub(crate) stall_after: Option<Spanned<Seconds>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawProvider {
    pub(crate) name: Spanned<String>,
    pub(crate) driver: Spanned<Driver>,
    #[serde(rename = "static")]
    pub(crate) static_hosts: Option<Spanned<RawStatic>>,
    pub(crate) local: Option<Spanned<RawLocal>>,
    pub(crate) exec: Option<Spanned<RawExec>>,
    pub(crate) pools: Vec<RawPool>,
    pub(crate) leak_sweep_interval: Option<Spanned<Seconds>>,
    pub(crate) leak_grace: Option<Spanned<Seconds>>,
    pub(crate) max_creates_per_second: Option<Spanned<f64>>,
    pub(crate) max_concurrent_creates: Option<Spanned<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawStatic {
    pub(crate) hosts: Vec<RawHost>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawHost {
    pub(crate) name: Spanned<String>,
    pub(crate) host: String,
    pub(crate) pool: Option<String>,
    pub(crate) secret_file: PathBuf,
    #[serde(default)]
    pub(crate) attributes: Attributes,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawLocal {
    pub(crate) agent_command: Option<PathBuf>,
    pub(crate) work_dir: Option<PathBuf>,
    #[serde(default)]
    pub(crate) agent_args: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawExec {
    pub(crate) create: Vec<String>,
    pub(crate) delete: Vec<String>,
    pub(crate) list: Vec<String>,
    #[serde(default)]
    pub(crate) console: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawPool {
    pub(crate) name: Spanned<String>,
    pub(crate) max_servers: Spanned<u32>,
    #[serde(default = "default_priority")]
    pub(crate) priority: i32,
    #[serde(default = "default_launch_timeout", deserialize_with = "seconds")]
    pub(crate) launch_timeout: u64,
    #[serde(default = "default_boot_timeout", deserialize_with = "seconds")]
    pub(crate) boot_timeout: u64,
    pub(crate) launch_retries: Option<Spanned<u32>>,
    pub(crate) labels: Vec<Spanned<RawLabel>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawLabel {
    pub(crate) name: Spanned<String>,
    /// The single-size form: one kind of backing node (with `max-parallel-jobs`).
    pub(crate) backing_label: Option<Spanned<String>>,
    pub(crate) max_parallel_jobs: Option<Spanned<u32>>,
    /// The several-sizes form, instead of the two keys above.
    pub(crate) sizes: Option<Spanned<Vec<RawSize>>>,
    #[serde(default = "default_grace_time", deserialize_with = "seconds")]
    pub(crate) grace_time: u64,
    #[serde(default, deserialize_with = "seconds")]
    pub(crate) min_retention_time: u64,
    #[serde(default, deserialize_with = "seconds")]
    pub(crate) max_age: u64,
    #[serde(default)]
    pub(crate) node_attributes: Attributes,
    #[serde(default)]
    pub(crate) limits: Option<Spanned<RawLimits>>,
    #[serde(default)]
    pub(crate) host_key_checking: bool,
    pub(crate) max_hold_time: Option<Spanned<Seconds>>,
    pub(crate) min_ready: Option<Spanned<u32>>,
    pub(crate) warm_window: Option<Spanned<Seconds>>,
    pub(crate) warm_lead: Option<Spanned<Seconds>>,
    pub(crate) max_uses: Option<Spanned<u32>>,
}

/// One entry of a label's `sizes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawSize {
    pub(crate) backing_label: Spanned<String>,
    pub(crate) max_parallel_jobs: Spanned<u32>,
    pub(crate) cost_per_hour: Spanned<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawLimits {
    pub(crate) cpu: Option<f64>,
    pub(crate) memory_mb: Option<u64>,
    pub(crate) pids: Option<u32>,
    pub(crate) disk_mb: Option<u64>,
}

pub(crate) fn default_priority() -> i32 {
    100
}
pub(crate) fn default_launch_timeout() -> u64 {
    300
}
pub(crate) fn default_boot_timeout() -> u64 {
    300
}
pub(crate) fn default_grace_time() -> u64 {
    60
}

/// A duration in whole seconds, as written: a number of seconds (`120`) or a number with a
/// unit (`2m`, `90s`, `1h 30m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seconds(pub(crate) u64);

/// What a duration key accepts, for its error message.
pub(crate) const SECONDS_EXPECTED: &str =
    "seconds as a whole number (e.g. 120) or a duration with a unit (e.g. 2m, 90s, 1h 30m)";

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        fn refuse<E: de::Error>(got: impl fmt::Display) -> E {
            E::custom(format!("expected {SECONDS_EXPECTED}, got {got}"))
        }
        impl de::Visitor<'_> for Visitor {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(SECONDS_EXPECTED)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seconds, E> {
                Ok(Seconds(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seconds, E> {
                u64::try_from(v).map(Seconds).map_err(|_| refuse(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seconds, E> {
                Err(refuse(v))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Seconds, E> {
                Err(refuse(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seconds, E> {
                match humantime::parse_duration(v.trim()) {
                    Ok(d) if d.subsec_nanos() == 0 => Ok(Seconds(d.as_secs())),
                    _ => Err(refuse(format_args!("{v:?}"))),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// `#[serde(deserialize_with)]` for a duration key kept as plain seconds.
pub(crate) fn seconds<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    Seconds::deserialize(deserializer).map(|s| s.0)
}
