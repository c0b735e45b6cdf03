//! `slotpool serve`: the launcher daemon.

use super::NatsClientArgs;
use anyhow::Context;
use slotpool_config::Config;
use slotpool_launcher::agent_bus::{AgentBus, LocalTls};
use slotpool_launcher::http::tls::TlsFiles;
use slotpool_launcher::http::{HttpListener, HttpSettings};
use slotpool_launcher::provider::local::AgentLifetime;
use slotpool_launcher::revoked::Desk;
use slotpool_launcher::{run, LauncherDeps};
use slotpool_protocol::auth::{Minter, Revoker};
use slotpool_protocol::connect::Bus;
use std::path::PathBuf;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[arg(long, short, env = "SLOTPOOL_CONFIG")]
    pub config: PathBuf,
    /// NATS URL handed to agents this launcher starts (default: --nats).
    #[arg(long, env = "SLOTPOOL_AGENT_NATS", value_name = "URL")]
    pub agent_nats: Option<String>,
    /// The installation's signing key (`agent-signing.json` from `slotpool nats-setup`):
    /// each backing node launched gets a bus credential of its own, minted with it.
    #[arg(long, env = "SLOTPOOL_AGENT_SIGNING_KEY", value_name = "FILE")]
    pub agent_signing_key: Option<PathBuf>,
    /// Run on a bus without authentication. Anyone who reaches it (a CI job in a slot,
    /// say) can then read every record, forge agents' replies and give operators'
    /// orders: for development only.
    #[arg(long, env = "SLOTPOOL_ALLOW_ANONYMOUS_BUS")]
    pub allow_anonymous_bus: bool,
    /// Serve `/metrics`, `/healthz`, `/readyz` and the read-only JSON API (`/api/v1/`)
    /// over HTTP on this IP:PORT (off by default). Port 0 picks a free port; the log says
    /// which ("http listening on"). Callers show a token (`slotpool http-token`): a
    /// client sees its own requests and nodes, an operator everything.
    #[arg(long, env = "SLOTPOOL_HTTP", value_name = "ADDR")]
    pub http: Option<std::net::SocketAddr>,
    /// A file holding a bearer token that sees everything (`Authorization: Bearer …`), for
    /// Prometheus, say; tokens of bus credentials (`slotpool http-token`) are accepted
    /// beside it.
    #[arg(
        long,
        env = "SLOTPOOL_HTTP_TOKEN_FILE",
        value_name = "FILE",
        requires = "http"
    )]
    pub http_token_file: Option<PathBuf>,
    /// Serve HTTPS only, with this certificate chain (PEM, the server's certificate
    /// first); needs --http-tls-key.
    #[arg(long, env = "SLOTPOOL_HTTP_TLS_CERT", value_name = "FILE", requires_all = ["http", "http_tls_key"])]
    pub http_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --http-tls-cert.
    #[arg(
        long,
        env = "SLOTPOOL_HTTP_TLS_KEY",
        value_name = "FILE",
        requires = "http_tls_cert"
    )]
    pub http_tls_key: Option<PathBuf>,
    /// Require every HTTPS client to show a certificate issued by a CA in this file
    /// (PEM). Such a client needs no bearer token, and the listener may then be exposed
    /// without --http-token-file; with one, clients need both.
    #[arg(
        long,
        env = "SLOTPOOL_HTTP_CLIENT_CA",
        value_name = "FILE",
        requires = "http_tls_cert"
    )]
    pub http_client_ca: Option<PathBuf>,
    /// At most this many HTTP connections at once (change streams included); more wait
    /// in the kernel's backlog until one closes.
    #[arg(long, value_name = "N", default_value_t = slotpool_launcher::http::DEFAULT_MAX_CONNECTIONS)]
    pub http_max_connections: usize,
    /// Serve the HTTP API without asking who calls: everyone who reaches it (a CI job in
    /// a slot on this host, say) reads every request and node, other clients' SSH keys
    /// included. Loopback only, logged loudly; for development.
    #[arg(long, requires = "http")]
    pub http_no_auth: bool,
}

pub async fn serve(nats: &NatsClientArgs, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(&args.config)?;
    let http = match args.http {
        Some(addr) => {
            let tls = args.http_tls_cert.map(|cert| TlsFiles {
                cert,
                key: args.http_tls_key.expect("clap requires --http-tls-key"),
                client_ca: args.http_client_ca,
            });
            Some(
                HttpListener::bind(&HttpSettings {
                    addr,
                    token_file: args.http_token_file,
                    tls,
                    max_connections: args.http_max_connections,
                    creds: nats.bus.creds.clone(),
                    no_auth: args.http_no_auth,
                })
                .await?,
            )
        }
        None => None,
    };
    if !nats.authenticates() {
        if !args.allow_anonymous_bus {
            anyhow::bail!(
                "refusing to run on an anonymous bus: give --creds (see `slotpool nats-setup`), \
                 or --allow-anonymous-bus for a development bus that no untrusted job can reach"
            );
        }
        tracing::warn!(
            "ANONYMOUS BUS: no authentication; anyone who reaches NATS controls this pool \
             (--allow-anonymous-bus)"
        );
    }
    if let Some(path) = &nats.bus.creds {
        warn_if_expiring(path);
    }
    let (minter, revocation) = match &args.agent_signing_key {
        Some(path) => {
            let minter = Minter::load(path).context("loading --agent-signing-key")?;
            let revoker = Revoker::load(path).context("loading --agent-signing-key")?;
            if revoker.is_none() {
                tracing::warn!(
                    "--agent-signing-key holds no revocation keys (made by an older \
                     `slotpool nats-setup`): deleted nodes' agent credentials stay valid \
                     until they expire, and `slotpool revoke` is refused"
                );
            }
            let server = nats.options("slotpool-revoker");
            (Some(minter), revoker.map(|r| Desk::new(r, server)))
        }
        None => {
            if nats.authenticates() {
                tracing::warn!(
                    "no --agent-signing-key: agents this launcher starts get no credentials \
                     and cannot log in to an authenticated bus (static hosts bring their own)"
                );
            }
            (None, None)
        }
    };
    let bus = Bus::connect_replicated(&nats.options("slotpool-launcher"), config.kv_replicas)
        .await
        .context("connecting to NATS")?;
    let agent_nats_url = args
        .agent_nats
        .or_else(|| config.agent_nats_url.clone())
        .unwrap_or_else(|| nats.bus.url.clone());
    let shutdown = CancellationToken::new();
    super::stop_on_signals(shutdown.clone())?;
    let stopping = shutdown.clone();
    tokio::spawn(async move {
        stopping.cancelled().await;
        tracing::info!("stopping: finishing steps in flight and releasing leases");
    });
    let deps = LauncherDeps {
        agent_bus: AgentBus::new(agent_nats_url, minter, revocation).with_local_tls(LocalTls {
            ca: absolute(&nats.bus.tls_ca)?,
            cert: absolute(&nats.bus.tls_cert)?,
            key: absolute(&nats.bus.tls_key)?,
        }),
        agent_binary: super::sibling_agent_binary(),
        // Like VMs: a restarted launcher takes them up again.
        local_agents: AgentLifetime::OutliveLauncher,
        http,
    };
    run(config, bus, deps, shutdown).await.context("launcher")?;
    Ok(ExitCode::SUCCESS)
}

/// `path` made absolute: a local agent runs in a directory of its own.
fn absolute(path: &Option<PathBuf>) -> anyhow::Result<Option<PathBuf>> {
    path.as_deref()
        .map(|p| std::path::absolute(p).with_context(|| format!("resolving {}", p.display())))
        .transpose()
}

/// How long before its credential expires a launcher starts saying so.
const EXPIRY_WARNING: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// Warns when the launcher's own credential expires within [`EXPIRY_WARNING`]: the
/// server then closes its connection, and the pool stops.
fn warn_if_expiring(path: &std::path::Path) {
    let expires = std::fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            slotpool_protocol::auth::Credentials::from_text(t)
                .expires_at()
                .ok()
        })
        .flatten();
    let Some(expires) = expires else { return };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    if expires <= now + EXPIRY_WARNING.as_secs() {
        tracing::warn!(
            creds = %path.display(),
            days_left = expires.saturating_sub(now) / 86_400,
            "this launcher's bus credential expires soon: mint a new one with `slotpool \
             nats-setup mint --role launcher` and restart with it"
        );
    }
}
