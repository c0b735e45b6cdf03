//! Command-line flags and the validated [`AgentConfig`] built from them.
//!
//! Everything is checked once here; after [`Args::into_config`] the config is plain data.
//! The secret never comes from argv (it would show in `ps`): only from the environment
//! ([`SECRET_ENV`]) or a file (`--secret-file`), and only its SHA-256 is kept.

use clap::Parser;
use slotpool_protocol::connect::NatsOptions;
use slotpool_protocol::{model, BackingId};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Environment variable holding the agent's secret (the alternative to `--secret-file`).
pub const SECRET_ENV: &str = "SLOTPOOL_AGENT_SECRET";

/// slotpool agent: prepares and wipes the slots of one backing node and reports its health.
#[derive(Clone, Debug, Parser)]
#[command(name = "slotpool-agent", version, about)]
pub struct Args {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        env = "SLOTPOOL_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats: String,
    /// NATS credentials file (JWT + NKey).
    #[arg(long, value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// CA bundle to trust for TLS.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate for mutual TLS (with --tls-key).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Client key for mutual TLS (with --tls-cert).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// The backing node this agent runs on (given by the launcher at launch).
    #[arg(long, env = "SLOTPOOL_BACKING_ID", value_name = "ID")]
    pub backing_id: String,
    /// File holding the agent secret (otherwise it is read from SLOTPOOL_AGENT_SECRET).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Directory for slot workspaces and agent state.
    #[arg(
        long,
        env = "SLOTPOOL_AGENT_WORK_DIR",
        value_name = "DIR",
        default_value = "/var/lib/slotpool/agent"
    )]
    pub work_dir: PathBuf,
    /// Number of slots this node is carved into (valid slot indexes are 0..N).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub slots: u32,
    /// Time between heartbeats, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub heartbeat_interval_ms: u64,
    /// How long a heartbeat lives in KV, in whole seconds (>= 1, longer than the interval).
    #[arg(long, value_name = "SECS", default_value_t = 6)]
    pub heartbeat_ttl_secs: u64,
}

/// The agent's validated settings. Plain data.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    pub backing_id: BackingId,
    /// SHA-256 (hex) of the agent secret; the secret itself is not kept.
    pub secret_sha256: String,
    pub work_dir: PathBuf,
    /// Slots this node has; valid indexes are `0..slots`.
    pub slots: u32,
    pub heartbeat_interval: Duration,
    pub heartbeat_ttl: Duration,
}

/// Why the flags do not make a valid configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid --backing-id: {0}")]
    BackingId(slotpool_protocol::ids::InvalidId),
    #[error("no agent secret: set {SECRET_ENV} or pass --secret-file")]
    NoSecret,
    #[error("agent secret given twice: set {SECRET_ENV} or pass --secret-file, not both")]
    TwoSecrets,
    #[error("reading secret file {path}: {error}")]
    SecretFile {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("the agent secret from {origin} is empty")]
    EmptySecret { origin: String },
    #[error("{SECRET_ENV} is not valid utf-8")]
    SecretNotUtf8,
    #[error("--slots must be at least 1, got {0}")]
    NoSlots(u32),
    #[error("--heartbeat-interval-ms must be at least 1, got {0}")]
    ZeroInterval(u64),
    #[error("--heartbeat-ttl-secs must be at least 1, got {0}")]
    ZeroTtl(u64),
    #[error(
        "--heartbeat-ttl-secs ({ttl_secs} s) must be longer than --heartbeat-interval-ms ({interval_ms} ms)"
    )]
    TtlNotAboveInterval { ttl_secs: u64, interval_ms: u64 },
}

impl Args {
    /// Validates the flags. `secret_env` is the value of [`SECRET_ENV`], if set.
    pub fn into_config(
        self,
        secret_env: Option<std::ffi::OsString>,
    ) -> Result<AgentConfig, ConfigError> {
        let backing_id = BackingId::parse(&self.backing_id).map_err(ConfigError::BackingId)?;
        let secret = load_secret(secret_env, self.secret_file.as_deref())?;
        if self.slots == 0 {
            return Err(ConfigError::NoSlots(self.slots));
        }
        if self.heartbeat_interval_ms == 0 {
            return Err(ConfigError::ZeroInterval(self.heartbeat_interval_ms));
        }
        if self.heartbeat_ttl_secs == 0 {
            return Err(ConfigError::ZeroTtl(self.heartbeat_ttl_secs));
        }
        let heartbeat_interval = Duration::from_millis(self.heartbeat_interval_ms);
        let heartbeat_ttl = Duration::from_secs(self.heartbeat_ttl_secs);
        if heartbeat_ttl <= heartbeat_interval {
            return Err(ConfigError::TtlNotAboveInterval {
                ttl_secs: self.heartbeat_ttl_secs,
                interval_ms: self.heartbeat_interval_ms,
            });
        }
        Ok(AgentConfig {
            secret_sha256: model::secret_digest(&secret),
            backing_id,
            work_dir: self.work_dir,
            slots: self.slots,
            heartbeat_interval,
            heartbeat_ttl,
        })
    }

    /// How to reach NATS; the connection is named after the backing node.
    pub fn nats_options(&self) -> NatsOptions {
        NatsOptions {
            url: self.nats.clone(),
            creds: self.creds.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            name: format!("slotpool-agent-{}", self.backing_id),
            ..NatsOptions::default()
        }
    }
}

/// The secret from exactly one of the environment or a file. A file's trailing newline
/// is not part of the secret.
fn load_secret(
    env: Option<std::ffi::OsString>,
    file: Option<&Path>,
) -> Result<String, ConfigError> {
    let (secret, origin) = match (env, file) {
        (Some(_), Some(_)) => return Err(ConfigError::TwoSecrets),
        (None, None) => return Err(ConfigError::NoSecret),
        (Some(value), None) => (
            value
                .into_string()
                .map_err(|_| ConfigError::SecretNotUtf8)?,
            SECRET_ENV.to_string(),
        ),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|error| ConfigError::SecretFile {
                path: path.to_path_buf(),
                error,
            })?;
            (
                // Surrounding whitespace is not part of a secret, as for static hosts'
                // secret files on the launcher side: both hash the same bytes.
                text.trim().to_string(),
                path.display().to_string(),
            )
        }
    };
    if secret.is_empty() {
        return Err(ConfigError::EmptySecret { origin });
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["slotpool-agent", "--backing-id", "bn-1"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("flags parse")
    }

    fn env_secret() -> Option<std::ffi::OsString> {
        Some("s3cret".into())
    }

    #[test]
    fn defaults_make_a_valid_config() {
        let c = args(&[]).into_config(env_secret()).unwrap();
        assert_eq!(c.backing_id.as_str(), "bn-1");
        assert_eq!(c.slots, 8);
        assert_eq!(c.heartbeat_interval, Duration::from_millis(2000));
        assert_eq!(c.heartbeat_ttl, Duration::from_secs(6));
        assert_eq!(c.secret_sha256, model::secret_digest("s3cret"));
    }

    #[test]
    fn secret_comes_from_exactly_one_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "from-file\n").unwrap();
        let file_flag = ["--secret-file", file.to_str().unwrap()];

        let c = args(&file_flag).into_config(None).unwrap();
        assert_eq!(c.secret_sha256, model::secret_digest("from-file"));
        assert!(matches!(
            args(&file_flag).into_config(env_secret()),
            Err(ConfigError::TwoSecrets)
        ));
        assert!(matches!(
            args(&[]).into_config(None),
            Err(ConfigError::NoSecret)
        ));
        assert!(matches!(
            args(&[]).into_config(Some("".into())),
            Err(ConfigError::EmptySecret { .. })
        ));
        let missing = dir.path().join("nope");
        let err = args(&["--secret-file", missing.to_str().unwrap()])
            .into_config(None)
            .unwrap_err()
            .to_string();
        assert!(err.contains(missing.to_str().unwrap()), "{err}");
    }

    #[test]
    fn bad_values_are_refused() {
        let bad_id = Args::try_parse_from(["slotpool-agent", "--backing-id", "bn.1"]).unwrap();
        let err = bad_id.into_config(env_secret()).unwrap_err().to_string();
        assert!(
            err.contains("invalid --backing-id") && err.contains("bn.1"),
            "{err}"
        );
        let cases: [(&[&str], &str); 4] = [
            (&["--slots", "0"], "--slots"),
            (&["--heartbeat-interval-ms", "0"], "--heartbeat-interval-ms"),
            (&["--heartbeat-ttl-secs", "0"], "at least 1"),
            (
                &[
                    "--heartbeat-interval-ms",
                    "3000",
                    "--heartbeat-ttl-secs",
                    "3",
                ],
                "must be longer",
            ),
        ];
        for (flags, wanted) in cases {
            let err = args(flags)
                .into_config(env_secret())
                .unwrap_err()
                .to_string();
            assert!(err.contains(wanted), "{flags:?}: {err}");
        }
    }

    #[test]
    fn secret_is_not_a_flag() {
        assert!(
            Args::try_parse_from(["slotpool-agent", "--backing-id", "bn-1", "--secret", "x"])
                .is_err()
        );
    }
}
