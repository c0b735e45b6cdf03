//! How a slotpool program reaches the bus: the usual NATS client options, as command-line
//! flags and environment variables shared by every slotpool program ([`NatsArgs`]: the
//! `slotpool` command line, the console and the agent), and the bus user name a program
//! run by a person acts as ([`NatsClientArgs`]).

use clap::Args;
use slotpool_protocol::connect::NatsOptions;
use std::path::PathBuf;

/// How to reach NATS (the usual NATS client options).
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long = "nats",
        global = true,
        env = "SLOTPOOL_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub url: String,
    /// NATS credentials file (JWT + NKey), from `slotpool nats-setup` (an agent's is
    /// minted by the launcher at launch or by `nats-setup --static-agent`; keep it 0600).
    #[arg(long, global = true, env = "SLOTPOOL_NATS_CREDS", value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// NATS user (with --password), for a server with plain user logins.
    #[arg(long, global = true, env = "SLOTPOOL_NATS_USER")]
    pub user: Option<String>,
    #[arg(
        long,
        global = true,
        env = "SLOTPOOL_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<String>,
    #[arg(
        long,
        global = true,
        env = "SLOTPOOL_NATS_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// CA certificate(s) to trust for TLS.
    #[arg(long, global = true, env = "SLOTPOOL_NATS_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate for mutual TLS (with --tls-key).
    #[arg(
        long,
        global = true,
        env = "SLOTPOOL_NATS_TLS_CERT",
        value_name = "FILE"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Client key for mutual TLS (with --tls-cert).
    #[arg(
        long,
        global = true,
        env = "SLOTPOOL_NATS_TLS_KEY",
        value_name = "FILE"
    )]
    pub tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// The connection's options, the connection named `name`.
    pub fn options(&self, name: &str) -> NatsOptions {
        NatsOptions {
            url: self.url.clone(),
            creds: self.creds.clone(),
            user: self.user.clone(),
            password: self.password.clone(),
            token: self.token.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            name: name.to_string(),
            act_as: None,
        }
    }

    /// Whether these options log in at all (credentials, user/password or a token).
    pub fn authenticates(&self) -> bool {
        self.creds.is_some() || self.user.is_some() || self.token.is_some()
    }
}

/// The NATS flags of a program run by a person (the `slotpool` command line, the
/// console): [`NatsArgs`] and the bus user name to act as.
#[derive(Debug, Clone, Args)]
pub struct NatsClientArgs {
    #[command(flatten)]
    pub bus: NatsArgs,
    /// The bus user name to act as on a bus without slotpool credentials (a development
    /// bus, or user/password logins); credentials from `slotpool nats-setup` carry their
    /// own name and this is ignored.
    #[arg(long, global = true, env = "SLOTPOOL_ACT_AS", value_name = "NAME")]
    pub act_as: Option<slotpool_protocol::UserName>,
}

impl NatsClientArgs {
    /// The connection's options, the connection named `name`.
    pub fn options(&self, name: &str) -> NatsOptions {
        NatsOptions {
            act_as: self.act_as.clone(),
            ..self.bus.options(name)
        }
    }

    /// Whether these options log in at all ([`NatsArgs::authenticates`]).
    pub fn authenticates(&self) -> bool {
        self.bus.authenticates()
    }
}
