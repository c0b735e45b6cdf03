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
//!   backing record owns; a relaunch deletes every one listed for its backing id).
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
}

/// The provider a config entry describes. `agent_default` is the agent binary the
/// `local` driver runs when the config names none (the launcher passes the
/// `slotpool-agent` next to its own executable), and `local_agents` whether its agents
/// outlive the launcher. Static hosts' secret files are read here, so a missing one fails
/// at startup.
pub(crate) fn build(
    provider: &ProviderConfig,
    agent_default: &Path,
    local_agents: local::AgentLifetime,
    local_tls: &crate::agent_bus::LocalTls,
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
                agent_args.clone(),
                work_dir.clone(),
            )
            .with_lifetime(local_agents)
            .with_tls(local_tls.clone()),
        ),
        DriverConfig::Exec {
            create,
            delete,
            list,
        } => Arc::new(exec::ExecProvider::new(
            name,
            create.clone(),
            delete.clone(),
            list.clone(),
        )?),
    };
    Ok(Arc::new(limit::Limited::new(inner, provider.create_limits)))
}
