//! `slotpool nats-setup`: a new installation's nats-server configuration and credentials
//! (see [`slotpool_protocol::auth::setup`] for the files), and `slotpool nats-setup
//! mint` for one more credential later.

use crate::pki::{self, PkiPlan};
use anyhow::Context;
use clap::{Args, Subcommand};
use slotpool_protocol::auth::setup::{self, ClusterPlan, ClusterServer, SetupPlan};
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
      --role client --name jenkins --out jenkins.creds
  slotpool nats-setup --dir /etc/slotpool/nats --cluster 3 \\
      --cluster-hosts nats-a.example,nats-b.example,nats-c.example
  nats-server -c /etc/slotpool/nats/server-1.conf   # on nats-a; server-2.conf on nats-b…")]
pub struct NatsSetupArgs {
    #[command(subcommand)]
    pub command: Option<SetupCommand>,
    /// Directory to write into (created; refused if it holds an installation already).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Address the server listens on, `host:port`.
    #[arg(long, default_value = "127.0.0.1:4222")]
    pub listen: String,
    /// Write a JetStream cluster of N servers instead of one: `server-1.conf`… (unique
    /// `server_name`, its own store `jetstream/server-I` and resolver directory
    /// `accounts/server-I`, a `cluster { }` block routing it to the others, with TLS
    /// from the same CA unless --no-tls), the same installation trusted by all. At least
    /// 3 (odd: 3 or 5), so a majority is left when one dies; run the launchers with
    /// `kv-replicas: 3` (or 5) and give every process all servers' URLs, as printed.
    #[arg(long, value_name = "N", conflicts_with = "listen")]
    pub cluster: Option<usize>,
    /// The cluster's servers' hosts (names or addresses), one per server, comma-separated:
    /// server I listens on host I. Default: all on 127.0.0.1.
    #[arg(
        long,
        value_name = "HOST,…",
        value_delimiter = ',',
        requires = "cluster"
    )]
    pub cluster_hosts: Vec<String>,
    /// With --cluster: server I takes clients on this port + I - 1.
    #[arg(
        long,
        value_name = "PORT",
        default_value_t = 4222,
        requires = "cluster"
    )]
    pub client_port: u16,
    /// With --cluster: server I takes the others' routes on this port + I - 1.
    #[arg(
        long,
        value_name = "PORT",
        default_value_t = 6222,
        requires = "cluster"
    )]
    pub cluster_port: u16,
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
    let mut cluster = args
        .cluster
        .map(|size| {
            cluster_plan(
                size,
                &args.cluster_hosts,
                args.client_port,
                args.cluster_port,
            )
        })
        .transpose()?;
    let mut server_names = args.server_names.clone();
    for host in &args.cluster_hosts {
        if !server_names.contains(host) {
            server_names.push(host.clone());
        }
    }
    let mut extra_config = String::new();
    if !args.no_tls {
        let clients = users
            .iter()
            .map(|u| format!("{}-{}", u.role, u.name))
            .chain(static_agents.iter().map(|b| format!("agent-{b}")))
            .collect();
        let pki = pki::write_pki(&PkiPlan {
            dir: dir.join("tls"),
            server_names,
            clients,
            validity_days: TLS_VALIDITY_DAYS,
            overwrite: false,
        })?;
        extra_config = pki::tls_server_block(&pki, true);
        if let Some(cluster) = &mut cluster {
            // The servers dial each other with the server certificate and verify it.
            cluster.extra_config = pki::tls_server_block(&pki, true);
        }
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
        cluster: cluster.clone(),
    })?;
    for config in &files.server_configs {
        println!(
            "{}: nats-server configuration (nats-server -c …)",
            config.display()
        );
    }
    println!(
        "{}: signing key for `slotpool serve --agent-signing-key` (secret, 0600)",
        files.signing_key.display()
    );
    for (user, path) in &files.creds {
        println!("{}: credentials of {user} (secret, 0600)", path.display());
    }
    if let Some(cluster) = &cluster {
        let scheme = if args.no_tls { "nats" } else { "tls" };
        let urls: Vec<String> = cluster
            .servers
            .iter()
            .map(|s| format!("{scheme}://{}", s.listen))
            .collect();
        println!(
            "next: start each server on its host (nats-server -c server-I.conf), set \
             `kv-replicas: {}` in the launchers' pool configuration, and give launchers, \
             agents and clients every server: --nats {}",
            cluster.servers.len(),
            urls.join(",")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The servers of a cluster of `size`: server I (from 1) on host I of `hosts` (all on
/// 127.0.0.1 when none are given), clients on `client_port` + I - 1, routes on
/// `cluster_port` + I - 1.
fn cluster_plan(
    size: usize,
    hosts: &[String],
    client_port: u16,
    cluster_port: u16,
) -> anyhow::Result<ClusterPlan> {
    if size < 3 {
        anyhow::bail!(
            "--cluster {size}: a cluster needs at least 3 servers (3 or 5): JetStream \
             keeps serving only while a majority is up, and of 2 servers one dying leaves \
             no majority"
        );
    }
    if !hosts.is_empty() && hosts.len() != size {
        anyhow::bail!(
            "--cluster-hosts names {} hosts for --cluster {size}: give one per server",
            hosts.len()
        );
    }
    let port = |base: u16, i: usize, flag: &str| {
        u16::try_from(usize::from(base) + i).map_err(|_| {
            anyhow::anyhow!(
                "--{flag} {base}: server {} would need a port above 65535",
                i + 1
            )
        })
    };
    let servers = (0..size)
        .map(|i| {
            let host = match hosts.get(i).map_or("127.0.0.1", String::as_str) {
                ipv6 if ipv6.contains(':') => format!("[{ipv6}]"),
                host => host.to_string(),
            };
            Ok(ClusterServer {
                name: format!("server-{}", i + 1),
                listen: format!("{host}:{}", port(client_port, i, "client-port")?),
                route: format!("{host}:{}", port(cluster_port, i, "cluster-port")?),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(ClusterPlan {
        name: "slotpool".into(),
        servers,
        extra_config: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_of_two_is_refused_for_its_quorum() {
        let err = cluster_plan(2, &[], 4222, 6222).unwrap_err().to_string();
        assert!(
            err.contains("at least 3") && err.contains("majority"),
            "{err}"
        );
    }

    #[test]
    fn each_server_has_its_own_ports_on_its_host() {
        let plan = cluster_plan(3, &[], 4222, 6222).unwrap();
        let got: Vec<_> = plan
            .servers
            .iter()
            .map(|s| (s.name.as_str(), s.listen.as_str(), s.route.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("server-1", "127.0.0.1:4222", "127.0.0.1:6222"),
                ("server-2", "127.0.0.1:4223", "127.0.0.1:6223"),
                ("server-3", "127.0.0.1:4224", "127.0.0.1:6224"),
            ]
        );
        let hosts = ["a".to_string(), "b".into(), "::1".into()];
        let plan = cluster_plan(3, &hosts, 4222, 6222).unwrap();
        assert_eq!(plan.servers[0].listen, "a:4222");
        assert_eq!(plan.servers[2].route, "[::1]:6224");
    }

    #[test]
    fn hosts_must_match_the_servers() {
        let err = cluster_plan(3, &["a".into(), "b".into()], 4222, 6222)
            .unwrap_err()
            .to_string();
        assert!(err.contains("one per server"), "{err}");
        let err = cluster_plan(3, &[], 65534, 6222).unwrap_err().to_string();
        assert!(err.contains("above 65535"), "{err}");
    }
}
