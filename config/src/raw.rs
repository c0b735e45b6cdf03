//! The configuration file as written: serde types with spans, so that validation can
//! name the line and column of what it refuses.

use crate::Driver;
use serde::Deserialize;
use serde_saphyr::Spanned;
use slotpool_protocol::model::Attributes;
use std::path::PathBuf;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawConfig {
    #[serde(default)]
    pub(crate) launcher: RawLauncher,
    pub(crate) providers: Vec<RawProvider>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawLauncher {
    pub(crate) lease_ttl: Option<Spanned<u64>>,
    pub(crate) agent_nats_url: Option<String>,
    pub(crate) kv_replicas: Option<Spanned<u64>>,
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
    pub(crate) leak_sweep_interval: Option<Spanned<u64>>,
    pub(crate) leak_grace: Option<Spanned<u64>>,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawPool {
    pub(crate) name: Spanned<String>,
    pub(crate) max_servers: Spanned<u32>,
    #[serde(default = "default_priority")]
    pub(crate) priority: i32,
    #[serde(default = "default_launch_timeout")]
    pub(crate) launch_timeout: u64,
    #[serde(default = "default_boot_timeout")]
    pub(crate) boot_timeout: u64,
    pub(crate) launch_retries: Option<Spanned<u32>>,
    pub(crate) labels: Vec<RawLabel>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawLabel {
    pub(crate) name: Spanned<String>,
    pub(crate) backing_label: String,
    pub(crate) max_parallel_jobs: Spanned<u32>,
    #[serde(default = "default_grace_time")]
    pub(crate) grace_time: u64,
    #[serde(default)]
    pub(crate) min_retention_time: u64,
    #[serde(default)]
    pub(crate) max_age: u64,
    #[serde(default)]
    pub(crate) node_attributes: Attributes,
    #[serde(default)]
    pub(crate) limits: Option<Spanned<RawLimits>>,
    #[serde(default)]
    pub(crate) host_key_checking: bool,
    pub(crate) max_hold_time: Option<Spanned<u64>>,
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
