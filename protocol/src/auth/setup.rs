//! An installation's files, as `slotpool nats-setup` writes them (and the demo, the
//! benchmark and the tests, so what they run is what ships):
//!
//! - `nats-server.conf`: the server's configuration, trusting only this installation's
//!   operator (decentralised authentication, a full resolver keeping pushed accounts in
//!   `accounts/`), with JetStream on;
//! - `agent-signing.json` (0600): the signing key launchers mint agents' credentials
//!   with, and the keys they revoke credentials with (`slotpool serve
//!   --agent-signing-key`);
//! - `creds/<role>-<name>.creds` (0600): one credential per launcher, operator, client
//!   and static host's agent asked for, and beside each `creds/<role>-<name>.token`
//!   (0600), its token for the launchers' HTTP API ([`super::http_token`]).
//!
//! With a [`ClusterPlan`], `server-1.conf`… take the place of `nats-server.conf`: one
//! configuration per server of a JetStream cluster, each with its own `server_name`,
//! store (`jetstream/server-N`), resolver directory (`accounts/server-N`) and a
//! `cluster { }` block routing it to the others, all trusting the same installation.

use super::{AuthError, BusUser, Installation, Role};
use crate::BackingId;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What to write.
#[derive(Clone, Debug, Default)]
pub struct SetupPlan {
    pub dir: PathBuf,
    /// `host:port` the server listens on (`listen:`); none: the server's default.
    pub listen: Option<String>,
    /// JetStream's store directory (a `jetstream` block); none: JetStream is turned on
    /// on the server's command line (`-js -sd DIR`), as the demo and the tests do.
    pub store_dir: Option<PathBuf>,
    /// Users to issue credentials for (launchers, operators, clients).
    pub users: Vec<BusUser>,
    /// Static hosts whose agents get a credential of their own.
    pub static_agents: Vec<BackingId>,
    /// How long the users' credentials last (none: until the installation is replaced).
    pub valid_for: Option<Duration>,
    /// More server configuration, appended as is (a `tls { … }` block, say).
    pub extra_config: String,
    /// Servers of a cluster to write a configuration for each (none: one server).
    pub cluster: Option<ClusterPlan>,
}

/// The servers of a JetStream cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterPlan {
    /// The cluster's name (`cluster { name }`).
    pub name: String,
    pub servers: Vec<ClusterServer>,
    /// More configuration inside each `cluster { }` block (its `tls { … }`, say).
    pub extra_config: String,
}

/// One server of a cluster.
#[derive(Clone, Debug)]
pub struct ClusterServer {
    /// Its `server_name`, unique in the cluster; also names its configuration file.
    pub name: String,
    /// `host:port` it takes clients on.
    pub listen: String,
    /// `host:port` it takes the other servers' routes on (and they dial).
    pub route: String,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct SetupFiles {
    /// The server's configuration (a cluster's: its first server's).
    pub server_config: PathBuf,
    /// Every server's configuration (one unless a cluster was asked for).
    pub server_configs: Vec<PathBuf>,
    pub signing_key: PathBuf,
    pub creds: Vec<(BusUser, PathBuf)>,
}

impl SetupFiles {
    /// The credentials file of `role` `name`, if one was written.
    pub fn creds_of(&self, role: Role, name: &str) -> Option<&Path> {
        self.creds
            .iter()
            .find(|(u, _)| u.role == role && u.name.as_str() == name)
            .map(|(_, p)| p.as_path())
    }
}

/// The path of `user`'s credentials under `dir`.
pub fn creds_path(dir: &Path, user: &BusUser) -> PathBuf {
    dir.join("creds")
        .join(format!("{}-{}.creds", user.role, user.name))
}

/// Writes `creds` to `path` and their HTTP token beside them (`.token`), both 0600.
pub fn write_creds(creds: &super::Credentials, path: &Path) -> Result<(), AuthError> {
    creds.write_private(path)?;
    let token = super::http_token::http_token(creds)?;
    super::write_private(
        &path.with_extension("token"),
        format!("{token}\n").as_bytes(),
    )
}

/// Makes a new installation and writes its files into `plan.dir` (created if missing).
/// Refuses to overwrite an existing `nats-server.conf` or signing key: a new installation
/// invalidates every credential of the old one.
pub fn write(plan: &SetupPlan) -> Result<SetupFiles, AuthError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| AuthError::Io { path, source }
    };
    let server_configs: Vec<PathBuf> = match &plan.cluster {
        None => vec![plan.dir.join("nats-server.conf")],
        Some(cluster) => cluster
            .servers
            .iter()
            .map(|s| plan.dir.join(format!("{}.conf", s.name)))
            .collect(),
    };
    let signing_key = plan.dir.join("agent-signing.json");
    for existing in server_configs.iter().chain([&signing_key]) {
        if existing.exists() {
            return Err(AuthError::File {
                path: existing.clone(),
                message: "exists already: a new installation would invalidate every \
                          credential of this one (remove the directory to start over)"
                    .into(),
            });
        }
    }
    std::fs::create_dir_all(plan.dir.join("creds")).map_err(io(&plan.dir))?;
    let installation = Installation::generate();
    let minter = installation.minter();
    minter.save(&signing_key, Some(&installation.revoker()?))?;
    let mut creds = Vec::new();
    let users = plan
        .users
        .iter()
        .cloned()
        .chain(plan.static_agents.iter().map(BusUser::agent));
    for user in users {
        let path = creds_path(&plan.dir, &user);
        write_creds(&minter.mint(&user, plan.valid_for)?, &path)?;
        creds.push((user, path));
    }
    match &plan.cluster {
        None => {
            let text = server_config(
                plan,
                &installation,
                plan.listen.as_deref(),
                plan.store_dir.clone(),
                &plan.dir.join("accounts"),
                "",
            )?;
            std::fs::write(&server_configs[0], text).map_err(io(&server_configs[0]))?;
        }
        Some(cluster) => {
            for (server, path) in cluster.servers.iter().zip(&server_configs) {
                let routes: Vec<String> = cluster
                    .servers
                    .iter()
                    .filter(|other| other.name != server.name)
                    .map(|other| format!("\"nats-route://{}\"", other.route))
                    .collect();
                let block = format!(
                    "server_name: \"{name}\"\ncluster {{\n  name: \"{cluster}\"\n  \
                     listen: \"{route}\"\n  routes: [{routes}]\n{extra}}}\n",
                    name = server.name,
                    cluster = cluster.name,
                    route = server.route,
                    routes = routes.join(", "),
                    extra = cluster.extra_config,
                );
                let store_dir = plan.store_dir.as_ref().map(|d| d.join(&server.name));
                let resolver_dir = plan.dir.join("accounts").join(&server.name);
                let text = server_config(
                    plan,
                    &installation,
                    Some(&server.listen),
                    store_dir,
                    &resolver_dir,
                    &block,
                )?;
                std::fs::write(path, text).map_err(io(path))?;
            }
        }
    }
    Ok(SetupFiles {
        server_config: server_configs[0].clone(),
        server_configs,
        signing_key,
        creds,
    })
}

/// One server's configuration: `listen`, its store and resolver directories (the
/// resolver's created), the installation's trust, `plan.extra_config`, then `more`.
fn server_config(
    plan: &SetupPlan,
    installation: &Installation,
    listen: Option<&str>,
    store_dir: Option<PathBuf>,
    resolver_dir: &Path,
    more: &str,
) -> Result<String, AuthError> {
    let io = |source| AuthError::Io {
        path: resolver_dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(resolver_dir).map_err(io)?;
    let mut text = String::from("# slotpool's nats-server configuration (slotpool nats-setup).\n");
    if let Some(listen) = listen {
        text.push_str(&format!("listen: \"{listen}\"\n"));
    }
    if let Some(store_dir) = store_dir {
        text.push_str(&format!(
            "jetstream {{\n  store_dir: \"{}\"\n}}\n",
            store_dir.display()
        ));
    }
    let resolver_dir = std::path::absolute(resolver_dir).map_err(io)?;
    text.push_str(&installation.server_config(&resolver_dir)?);
    text.push_str(&plan.extra_config);
    text.push_str(more);
    Ok(text)
}
