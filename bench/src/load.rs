//! One bus with its launcher config and local agents, and the two measured loads every
//! comparison runs on it: sequential warm allocations and `clients` concurrent clients,
//! each on a NATS connection of its own, as CI jobs on many machines are. Each load counts the NATS messages it cost (`/varz`) and, under throughput, the CPU
//! time of every process involved, so a phase that varies one thing (a second launcher,
//! `--http` scraped) is measured exactly as the plain one.

use super::phases::{self, Throughput, Warm};
use super::procs::{self, CpuMeter, LauncherProcess, Role};
use super::scrape::{Messages, Varz};
use slotpool_protocol::client::{Client, RequestWatcher};
use slotpool_protocol::connect::NatsOptions;
use std::path::PathBuf;
use std::time::Duration;

/// A bus and what runs on it: its server, the launcher config, the local agents.
pub struct Rig {
    pub server_pid: Option<u32>,
    /// nats-server's monitoring URL (`http://…`), for `/varz`.
    pub monitor: Option<String>,
    pub nats_url: String,
    /// How the benchmark's clients reach the bus (credentials, TLS): each throughput
    /// client connects with these.
    pub client_options: NatsOptions,
    /// `slotpool serve` arguments besides --nats and --config.
    pub serve_args: Vec<String>,
    pub config: PathBuf,
    pub agent_binary: PathBuf,
    /// Holds the launchers' logs and, under `agents/`, the local agents.
    pub run_dir: PathBuf,
    pub label: &'static str,
    pub warm: usize,
    pub clients: usize,
    pub load_time: Duration,
}

impl Rig {
    /// A `slotpool serve` on this bus with `more_args`, logging to `run_dir/<log>`.
    pub fn spawn_launcher(
        &self,
        more_args: &[String],
        log: &str,
    ) -> anyhow::Result<LauncherProcess> {
        let args: Vec<&String> = self.serve_args.iter().chain(more_args).collect();
        LauncherProcess::spawn(&self.config, &self.nats_url, &args, &self.run_dir.join(log))
    }

    /// Sequential warm allocations, with the messages they cost.
    pub async fn warm(&self, client: &Client, watcher: &RequestWatcher) -> anyhow::Result<Warm> {
        let before = self.varz().await?;
        let mut warm = phases::warm(client, watcher, self.label, self.warm).await?;
        warm.messages = self.messages_since(before, warm.cycles).await?;
        Ok(warm)
    }

    /// `clients` concurrent clients for `load_time`, each on a connection of its own
    /// (made before the load starts), served by `launchers`, with the CPU time of every
    /// process and the messages per allocation.
    pub async fn throughput(&self, launchers: &[u32]) -> anyhow::Result<Throughput> {
        let clients = self.connect_clients().await?;
        let cpu = CpuMeter::start(vec![
            Role {
                name: "launcher",
                pids: launchers.to_vec(),
            },
            Role {
                name: "nats-server",
                pids: self.server_pid.into_iter().collect(),
            },
            Role {
                name: "agents",
                pids: procs::pids_of(&self.agent_binary, &self.run_dir),
            },
            Role {
                name: "benchmark clients",
                pids: vec![std::process::id()],
            },
        ]);
        let before = self.varz().await?;
        let mut t = phases::throughput(&clients, self.label, self.load_time).await?;
        t.cpu = cpu.per_allocation(t.allocations);
        t.cpu_ms_per_allocation = t.cpu.iter().map(|c| c.ms_per_allocation).sum();
        t.stolen_percent = cpu.stolen_percent();
        t.messages = self.messages_since(before, t.allocations).await?;
        Ok(t)
    }

    /// One client per connection, named apart so the server's connection list tells
    /// them from each other.
    async fn connect_clients(&self) -> anyhow::Result<Vec<Client>> {
        let connections = (0..self.clients).map(|i| {
            let opts = NatsOptions {
                name: format!("{}-client-{i}", self.client_options.name),
                ..self.client_options.clone()
            };
            async move { phases::connect(&opts).await.map(Client::from_bus) }
        });
        futures::future::try_join_all(connections).await
    }

    async fn varz(&self) -> anyhow::Result<Option<Varz>> {
        match &self.monitor {
            Some(monitor) => Ok(Some(Varz::read(monitor).await?)),
            None => Ok(None),
        }
    }

    async fn messages_since(
        &self,
        before: Option<Varz>,
        allocations: usize,
    ) -> anyhow::Result<Option<Messages>> {
        let Some(before) = before else {
            return Ok(None);
        };
        let after = self.varz().await?.unwrap_or_default();
        Ok(Some(before.per_allocation(&after, allocations)))
    }
}
