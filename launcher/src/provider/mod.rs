//! Where backing nodes come from. Every provider implements [`Provider`]; the launcher
//! never knows which kind it talks to.
//!
//! Guarantees a provider gives:
//! - `launch` starts an instance whose agent connects with the given backing id, secret
//!   and bus credential (never on a command line or in a file others can read);
//!   it returns once the instance exists (not once its agent is up: the launcher waits for
//!   the agent's heartbeat itself, up to `boot-timeout`);
//! - `delete` is idempotent: deleting an instance that is already gone is not an error;
//! - `list` returns the instances this provider created, with the backing id each was
//!   launched for when it can tell (the leak sweep, [`crate::backing::leak`], deletes those no
//!   backing record owns; a relaunch deletes every one listed for its backing id);
//! - `console`, when the provider has one, returns what the instance printed on its
//!   console: the launcher reads it before it gives up on an instance whose agent did not
//!   come up, and puts its end ([`console_tail`]) into the failure's event.
//!
//! [`build`] wraps every provider in [`limit::Limited`], which applies the provider's
//! `max-creates-per-second` and `max-concurrent-creates` and `launch-timeout` to `launch`;
//! the launcher wraps each in [`status::Recorded`], which keeps the provider's last error
//! in KV for operators.

pub mod exec;
pub(crate) mod limit;
pub mod local;
pub(crate) mod static_hosts;
pub(crate) mod status;

use crate::config::{DriverConfig, ProviderConfig};
use crate::metrics::ProviderErrorKind;
use slotpool_protocol::auth::Credentials;
use slotpool_protocol::model::{Attributes, Instance};
use slotpool_protocol::BackingId;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long after a launch refused for capacity (a quota, a sold-out region) the launcher
/// asks the provider again; meanwhile the pool counts as out of capacity.
pub const CAPACITY_BACKOFF: Duration = Duration::from_secs(10);

/// What the launcher asks a provider to start.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub backing_id: BackingId,
    /// Given to the agent so the launcher can recognise it; never logged.
    pub secret: String,
    pub provider: String,
    pub pool: String,
    /// The provider-side kind of machine (`backing-label`).
    pub backing_label: String,
    /// Slots the backing node is carved into (passed to the agent).
    pub slots: u32,
    /// NATS URL the agent should connect to.
    pub nats_url: String,
    /// The agent's own bus credential (secret, like `secret`); `None` on an anonymous
    /// development bus.
    pub credentials: Option<Credentials>,
    /// How long the provider may take (`launch-timeout`).
    pub timeout: Duration,
    /// Told when the launch must wait for its provider's create limits
    /// ([`limit::Limited`]) and when it is past them: what the record's
    /// `create_queued` says. `None`: nobody listens.
    pub create_queue: Option<Arc<CreateQueue>>,
}

/// What a launch's create limits tell the launcher writing its record
/// ([`LaunchSpec::create_queue`]): `queued` when the launch must wait for them, then
/// `admitted` when it goes to the provider (neither when it never waits).
#[derive(Debug, Default)]
pub struct CreateQueue {
    pub queued: tokio::sync::Notify,
    pub admitted: tokio::sync::Notify,
}

/// An instance the provider knows of (from `list`).
#[derive(Clone, Debug, PartialEq)]
pub struct ListedInstance {
    pub instance: Instance,
    /// The backing id it was launched for, when the provider can tell.
    pub backing_id: Option<BackingId>,
}

/// What a provider reports back from a launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launched {
    pub instance: Instance,
    /// Attributes of the machine itself (nodes get these, overlaid with the label's).
    pub attributes: Attributes,
}

/// A fixed identity for a seat (static hosts: the agent already runs with it).
#[derive(Clone, Debug, PartialEq)]
pub struct FixedIdentity {
    pub backing_id: BackingId,
    pub secret: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("{provider}: {message}")]
    Failed { provider: String, message: String },
    #[error("{provider}: timed out after {timeout:?}")]
    Timeout { provider: String, timeout: Duration },
    /// The provider is out of quota or capacity; retry later.
    #[error("{provider}: out of capacity: {message}")]
    Capacity { provider: String, message: String },
}

impl ProviderError {
    /// Its kind, as `/metrics` counts it.
    pub(crate) fn kind(&self) -> ProviderErrorKind {
        match self {
            ProviderError::Failed { .. } => ProviderErrorKind::Failed,
            ProviderError::Timeout { .. } => ProviderErrorKind::Timeout,
            ProviderError::Capacity { .. } => ProviderErrorKind::Capacity,
        }
    }
}

#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// The provider's name from the config.
    fn name(&self) -> &str;

    /// For providers whose machines exist already: the identity of seat `seat` of `pool`.
    fn fixed_identity(&self, _pool: &str, _seat: u32) -> Option<FixedIdentity> {
        None
    }

    /// Whether `launch` creates machines (not for static hosts, which exist already and
    /// which the leak sweep leaves alone).
    fn creates_machines(&self) -> bool {
        true
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError>;

    async fn delete(&self, instance: &Instance) -> Result<(), ProviderError>;

    async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError>;

    /// The instance's console output, oldest first (`None`: this provider cannot tell).
    /// A diagnostic: its failures are said where it is used, not counted as the
    /// provider's.
    async fn console(&self, _instance: &Instance) -> Result<Option<String>, ProviderError> {
        Ok(None)
    }
}

/// The longest end of a console output the launcher keeps, in bytes once escaped (the
/// event log takes records of at most 16 KiB).
pub const CONSOLE_TAIL_BYTES: usize = 4096;
/// The most lines of a console output the launcher keeps.
pub const CONSOLE_TAIL_LINES: usize = 40;

/// The end of a console output as the event log keeps it, on one line: its last
/// non-blank lines (at most [`CONSOLE_TAIL_LINES`], and whole lines as long as they fit
/// [`CONSOLE_TAIL_BYTES`]), every control character escaped
/// ([`slotpool_protocol::text::printable`]: the lines are joined by a visible `\u{a}`,
/// and an escape sequence the machine printed does nothing on a terminal showing it), a
/// `…` first when lines were left out; `None` when nothing is left.
pub fn console_tail(output: &str) -> Option<String> {
    const NEWLINE: &str = "\\u{a}";
    const CUT: &str = "…";
    let lines: Vec<&str> = output
        .lines()
        .map(|l| l.trim_end_matches(['\r', ' ', '\t']))
        .filter(|l| !l.trim().is_empty())
        .collect();
    let escaped: Vec<String> = lines[lines.len().saturating_sub(CONSOLE_TAIL_LINES)..]
        .iter()
        .map(|l| slotpool_protocol::text::printable(l).into_owned())
        .collect();
    let last = escaped.last()?;
    let budget = CONSOLE_TAIL_BYTES - CUT.len() - NEWLINE.len();
    if last.len() > budget {
        // One line too long on its own: its end.
        let mut start = last.len() - budget;
        while !last.is_char_boundary(start) {
            start += 1;
        }
        return Some(format!("{CUT}{}", &last[start..]));
    }
    let mut from = escaped.len() - 1;
    let mut used = last.len();
    while from > 0 && used + NEWLINE.len() + escaped[from - 1].len() <= budget {
        from -= 1;
        used += NEWLINE.len() + escaped[from].len();
    }
    let cut = from > 0 || lines.len() > escaped.len();
    let kept = escaped[from..].join(NEWLINE);
    Some(if cut {
        format!("{CUT}{NEWLINE}{kept}")
    } else {
        kept
    })
}

/// The provider a config entry describes. `agent_default` is the agent binary the
/// `local` driver runs when the config names none (the launcher passes the
/// `slotpool-agent` next to its own executable), `local_agents` whether its agents
/// outlive the launcher, and `guard_ports` the launcher's own listening ports its local
/// agents keep slot users from (`--guard-port`). Static hosts' secret files are read
/// here, so a missing one fails at startup.
pub(crate) fn build(
    provider: &ProviderConfig,
    agent_default: &Path,
    local_agents: local::AgentLifetime,
    local_tls: &crate::agent_bus::LocalTls,
    guard_ports: &[u16],
) -> Result<Arc<dyn Provider>, ProviderError> {
    let name = provider.name.as_str();
    let inner: Arc<dyn Provider> = match &provider.driver {
        DriverConfig::Static { hosts } => Arc::new(static_hosts::StaticProvider::new(name, hosts)?),
        DriverConfig::Local {
            agent_command,
            agent_args,
            work_dir,
        } => Arc::new(
            local::LocalProvider::new(
                name,
                agent_command
                    .clone()
                    .unwrap_or_else(|| agent_default.to_path_buf()),
                guard_ports
                    .iter()
                    .flat_map(|port| ["--guard-port".to_string(), port.to_string()])
                    .chain(agent_args.iter().cloned())
                    .collect(),
                work_dir.clone(),
            )
            .with_lifetime(local_agents)
            .with_tls(local_tls.clone()),
        ),
        DriverConfig::Exec {
            create,
            delete,
            list,
            console,
        } => {
            let exec = exec::ExecProvider::new(name, create.clone(), delete.clone(), list.clone())?;
            Arc::new(match console {
                Some(console) => exec.with_console(console.clone())?,
                None => exec,
            })
        }
    };
    Ok(Arc::new(limit::Limited::new(inner, provider.create_limits)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_console_tail_is_its_last_lines_escaped_on_one_line() {
        assert_eq!(console_tail(""), None);
        assert_eq!(console_tail("\r\n  \n"), None);
        assert_eq!(
            console_tail("Booting\r\n\r\n\x1b[31mcloud-init failed\x1b[0m\r\n"),
            Some("Booting\\u{a}\\u{1b}[31mcloud-init failed\\u{1b}[0m".into())
        );
        let many: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let tail = console_tail(&many).unwrap();
        assert!(tail.starts_with("…\\u{a}line 60\\u{a}"), "{tail}");
        assert!(tail.ends_with("line 99"), "{tail}");
    }

    #[test]
    fn a_console_tail_is_bounded_whatever_the_machine_printed() {
        for output in [
            "x".repeat(100_000),
            "\x1b".repeat(100_000),
            "é\n".repeat(30_000),
            format!("{}\nlast", "y".repeat(10_000)),
            "ü".repeat(5_000),
        ] {
            let tail = console_tail(&output).unwrap();
            assert!(tail.len() <= CONSOLE_TAIL_BYTES, "{} bytes", tail.len());
            assert!(!tail.chars().any(|c| c.is_control()), "{tail}");
            assert!(tail.starts_with('…'), "{tail}");
        }
        assert!(console_tail(&format!("{}\nlast", "y".repeat(10_000)))
            .unwrap()
            .ends_with("\\u{a}last"));
    }
}
