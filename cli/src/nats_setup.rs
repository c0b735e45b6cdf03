//! `slotpool nats-setup`: a new installation's nats-server configuration and credentials
//! (see [`slotpool_protocol::auth::setup`] for the files), and `slotpool nats-setup
//! mint` for one more credential later.

use crate::pki::{self, PkiPlan};
use anyhow::Context;
use clap::{Args, Subcommand};
use slotpool_protocol::auth::setup::{self, SetupPlan};
use slotpool_protocol::auth::{BusUser, Minter, Role};
use slotpool_protocol::BackingId;

/// How long the certificates `nats-setup` makes are valid.
const TLS_VALIDITY_DAYS: u32 = 825;
/// How long the credentials `nats-setup` makes are valid unless told otherwise.
pub const CREDENTIAL_VALIDITY_DAYS: u64 = 365;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  slotpool nats-setup --dir /etc/slotpool/nats --listen 0.0.0.0:4222 \\
      --launcher launcher-1 --operator alice --client zuul --static-agent build-01
  nats-server -c /etc/slotpool/nats/nats-server.conf
  slotpool --nats tls://nats.example:4222 --tls-ca /etc/slotpool/nats/tls/ca.pem \\
      --tls-cert /etc/slotpool/nats/tls/launcher-launcher-1-cert.pem \\
      --tls-key /etc/slotpool/nats/tls/launcher-launcher-1-key.pem \\
      --creds /etc/slotpool/nats/creds/launcher-launcher-1.creds \\
      serve --config pool.yaml --agent-signing-key /etc/slotpool/nats/agent-signing.json
  slotpool nats-setup mint --signing-key /etc/slotpool/nats/agent-signing.json \\
      --role client --name jenkins --out jenkins.creds")]
pub struct NatsSetupArgs {
    #[command(subcommand)]
    pub command: Option<SetupCommand>,
    /// Directory to write into (created; refused if it holds an installation already).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Address the server listens on, `host:port`.
    #[arg(long, default_value = "127.0.0.1:4222")]
    pub listen: String,
    /// A launcher's credential (repeat for several launchers).
    #[arg(long = "launcher", value_name = "NAME", default_value = "launcher")]
    pub launchers: Vec<String>,
    /// An operator's credential: orders recorded under this name.
    #[arg(long = "operator", value_name = "NAME")]
    pub operators: Vec<String>,
    /// A client's credential (a CI system): its requests and nodes are its own.
    #[arg(long = "client", value_name = "NAME")]
    pub clients: Vec<String>,
    /// A static host's agent credential (its backing id, as in the launcher's config).
    #[arg(long = "static-agent", value_name = "BACKING_ID")]
    pub static_agents: Vec<String>,
    /// Do not make the PKI. By default `nats-setup` makes a small one in `<dir>/tls` (a
    /// CA, the server's certificate, a client certificate per launcher, operator, client
    /// and static agent) and the server requires TLS with client certificates. With
    /// this, bring your own: add a `tls { }` block with your CA's certificates.
    #[arg(long)]
    pub no_tls: bool,
    /// Names and addresses the server's certificate is valid for.
    #[arg(long = "server-name", value_name = "NAME", default_values = ["localhost", "127.0.0.1"])]
    pub server_names: Vec<String>,
    #[command(flatten)]
    pub validity: Validity,
}

/// How long credentials are valid.
#[derive(Debug, Clone, Copy, Args)]
pub struct Validity {
    /// Days the credentials are valid; mint new ones (`nats-setup mint`) before then.
    /// Launchers warn when theirs has less than 30 days left.
    #[arg(long, value_name = "DAYS", default_value_t = CREDENTIAL_VALIDITY_DAYS,
          value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "no_expiry")]
    pub valid_days: u64,
    /// Credentials that never expire (until revoked: `slotpool revoke`).
    #[arg(long)]
    pub no_expiry: bool,
}

impl Validity {
    fn duration(self) -> Option<std::time::Duration> {
        (!self.no_expiry).then(|| std::time::Duration::from_secs(self.valid_days * 24 * 3600))
    }
}

#[derive(Debug, Subcommand)]
pub enum SetupCommand {
    /// Mint one more credential with an installation's signing key.
    Mint {
        #[arg(long, value_name = "FILE")]
        signing_key: PathBuf,
        #[arg(long, value_enum)]
        role: RoleArg,
        /// The user's name (an agent's: its backing id).
        #[arg(long)]
        name: String,
        #[command(flatten)]
        validity: Validity,
        /// Where to write it (mode 0600); its HTTP token goes beside it (`.token`).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum RoleArg {
    Launcher,
    Operator,
    Client,
    Agent,
}

impl From<RoleArg> for Role {
    fn from(r: RoleArg) -> Role {
        match r {
            RoleArg::Launcher => Role::Launcher,
            RoleArg::Operator => Role::Operator,
            RoleArg::Client => Role::Client,
            RoleArg::Agent => Role::Agent,
        }
    }
}

pub fn run(args: NatsSetupArgs) -> anyhow::Result<ExitCode> {
    if let Some(SetupCommand::Mint {
        signing_key,
        role,
        name,
        validity,
        out,
    }) = args.command
    {
        let minter = Minter::load(&signing_key)?;
        let user = BusUser::new(role.into(), &name)?;
        setup::write_creds(&minter.mint(&user, validity.duration())?, &out)?;
        println!(
            "{}: credentials of {user}, and {} its HTTP token",
            out.display(),
            out.with_extension("token").display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let dir = args
        .dir
        .context("--dir is required: where to write the installation")?;
    let mut users = Vec::new();
    for (role, names) in [
        (Role::Launcher, &args.launchers),
        (Role::Operator, &args.operators),
        (Role::Client, &args.clients),
    ] {
        for name in names {
            users.push(BusUser::new(role, name).with_context(|| format!("--{role} {name}"))?);
        }
    }
    let static_agents = args
        .static_agents
        .iter()
        .map(|id| BackingId::parse(id).with_context(|| format!("--static-agent {id}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut extra_config = String::new();
    if !args.no_tls {
        let clients = users
            .iter()
            .map(|u| format!("{}-{}", u.role, u.name))
            .chain(static_agents.iter().map(|b| format!("agent-{b}")))
            .collect();
        let pki = pki::write_pki(&PkiPlan {
            dir: dir.join("tls"),
            server_names: args.server_names.clone(),
            clients,
            validity_days: TLS_VALIDITY_DAYS,
            overwrite: false,
        })?;
        extra_config = pki::tls_server_block(&pki, true);
        println!(
            "{}: CA certificate (--tls-ca); server and client certificates beside it",
            pki.ca_cert.display()
        );
    }
    let files = setup::write(&SetupPlan {
        dir: dir.clone(),
        listen: Some(args.listen),
        store_dir: Some(dir.join("jetstream")),
        users,
        static_agents,
        extra_config,
        valid_for: args.validity.duration(),
    })?;
    println!(
        "{}: nats-server configuration (nats-server -c …)",
        files.server_config.display()
    );
    println!(
        "{}: signing key for `slotpool serve --agent-signing-key` (secret, 0600)",
        files.signing_key.display()
    );
    for (user, path) in &files.creds {
        println!("{}: credentials of {user} (secret, 0600)", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
