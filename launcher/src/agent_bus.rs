//! What the agents this launcher's providers start get to reach the bus: a URL and, when
//! the launcher holds the installation's signing key, a credential of their own, minted
//! per launch for that backing node alone ([`slotpool_protocol::auth::permissions`]:
//! its command subject, its heartbeat key, its inbox) and expiring. With the
//! installation's revocation keys too, the launcher revokes credentials
//! ([`crate::revocation`]).

use crate::revoked::Desk;
use slotpool_protocol::auth::{AuthError, BusUser, Credentials, Minter};
use slotpool_protocol::BackingId;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long an agent's credential lasts when its label has no max-age. A backing node
/// that outlives it loses its bus connection, so its heartbeat stops and it is replaced:
/// set max-age below this for long-lived pools.
pub(crate) const AGENT_CREDENTIAL_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);

/// Slack added to a label's max-age: the time to launch and boot before max-age counts,
/// and to drain after it.
const CREDENTIAL_SLACK: Duration = Duration::from_secs(6 * 3600);

/// The agents' way onto the bus. Plain data after start-up.
#[derive(Clone)]
pub struct AgentBus {
    pub url: String,
    minter: Option<Arc<Minter>>,
    /// The TLS files of agents on the launcher's own host (the `local` provider's).
    pub local_tls: LocalTls,
    revocation: Option<Arc<Desk>>,
}

/// The TLS files an agent on the launcher's own host uses: the launcher's own `--tls-ca`,
/// `--tls-cert` and `--tls-key`, which such an agent, running as the same user, can read.
/// A server that asks for client certificates (`slotpool nats-setup`'s default) refuses
/// an agent without them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl LocalTls {
    /// The agent's options for these files.
    pub fn args(&self) -> Vec<std::ffi::OsString> {
        let mut args = Vec::new();
        for (flag, file) in [
            ("--tls-ca", &self.ca),
            ("--tls-cert", &self.cert),
            ("--tls-key", &self.key),
        ] {
            if let Some(file) = file {
                args.push(flag.into());
                args.push(file.into());
            }
        }
        args
    }
}

impl AgentBus {
    pub fn new(url: String, minter: Option<Minter>, revocation: Option<Desk>) -> AgentBus {
        AgentBus {
            url,
            minter: minter.map(Arc::new),
            local_tls: LocalTls::default(),
            revocation: revocation.map(Arc::new),
        }
    }

    /// The nkey of every credential of `user` this installation mints, when this
    /// launcher holds the signing key.
    pub fn user_key(&self, user: &BusUser) -> Option<String> {
        self.minter.as_ref().map(|m| m.user_key(user))
    }

    /// Where revocations are made, when this launcher holds the revocation keys.
    pub fn revocation(&self) -> Option<&Arc<Desk>> {
        self.revocation.as_ref()
    }

    /// How long the credential of an agent of a node retired at `max_age` (zero: no
    /// limit) lasts.
    pub fn lifetime(max_age: Duration) -> Duration {
        if max_age.is_zero() {
            AGENT_CREDENTIAL_LIFETIME
        } else {
            max_age + CREDENTIAL_SLACK
        }
    }

    /// The same, with the TLS files of agents on the launcher's own host.
    pub fn with_local_tls(self, local_tls: LocalTls) -> AgentBus {
        AgentBus { local_tls, ..self }
    }

    /// A credential for the agent of `backing`, valid for a node retired at `max_age`
    /// (zero: no limit). `None` when this launcher mints none (an anonymous development
    /// bus): the agent then connects with the URL alone.
    pub(crate) fn credential(
        &self,
        backing: &BackingId,
        max_age: Duration,
    ) -> Result<Option<Credentials>, AuthError> {
        let Some(minter) = &self.minter else {
            return Ok(None);
        };
        minter
            .mint(&BusUser::agent(backing), Some(AgentBus::lifetime(max_age)))
            .map(Some)
    }
}
