//! Phases that vary one thing against the plain run on the same bus, measured with the
//! same loads ([`Rig`]): a second launcher on the bus, and `serve --http` with
//! `/metrics` scraped every second (the cost of observability).

use super::load::Rig;
use super::phases::{self, Throughput, Warm};
use super::procs::LauncherProcess;
use super::scrape::{self, Scraper, Scrapes};
use anyhow::{bail, Context};
use serde::Serialize;
use slotpool_protocol::client::{Client, RequestWatcher};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a launcher started for a phase may take to be serving.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often readiness is looked at while waiting.
const READY_POLL: Duration = Duration::from_millis(50);

/// Throughput with several launchers on the bus, and with one launcher alone just before
/// and just after ([`launchers`]): the ratio is taken against the two loads beside it, so
/// a host whose other load changes during the run moves both sides alike.
#[derive(Clone, Debug, Serialize)]
pub struct Launchers {
    /// `first` alone, right before the others start and right after they stopped.
    pub alone: [Throughput; 2],
    /// `first` and the others.
    pub together: Throughput,
}

impl Launchers {
    /// Allocations/s of the launchers together over those of one alone
    /// ([`Throughput::over_mean`] of the loads before and after).
    pub fn allocations_per_sec_ratio(&self) -> f64 {
        let [before, after] = &self.alone;
        self.together
            .over_mean(|t| t.allocations_per_sec, before, after)
    }

    /// CPU of every process per allocation, together over alone (the same way).
    pub fn cpu_ratio(&self) -> f64 {
        let [before, after] = &self.alone;
        self.together
            .over_mean(|t| t.cpu_ms_per_allocation, before, after)
    }
}

/// Throughput with `launchers` `slotpool serve` processes on the bus: `first` and as many
/// more, all with the same config, between two loads of `first` alone. The extra ones
/// are stopped before the second load alone (and before this returns, also on failure).
pub async fn launchers(
    rig: &Rig,
    first: &LauncherProcess,
    launchers: usize,
    client: &Client,
) -> anyhow::Result<Launchers> {
    let before = rig.throughput(&[first.pid]).await?;
    let mut more = Vec::new();
    for i in 2..=launchers {
        more.push(rig.spawn_launcher(&[], &format!("launcher-{i}.log"))?);
    }
    let together = async {
        wait_for_launchers(client, launchers).await?;
        let pids: Vec<u32> = std::iter::once(first.pid)
            .chain(more.iter().map(|l| l.pid))
            .collect();
        rig.throughput(&pids).await
    }
    .await;
    for launcher in more {
        launcher.stop().await;
    }
    let together = together?;
    wait_for_launchers_at_most(client, 1).await?;
    let after = rig.throughput(&[first.pid]).await?;
    Ok(Launchers {
        alone: [before, after],
        together,
    })
}

/// Waits until `n` launchers hold their liveness lease (taken just before a launcher
/// answers its first request).
async fn wait_for_launchers(client: &Client, n: usize) -> anyhow::Result<()> {
    wait_for_live(client, |live| live >= n, &format!("{n} launchers serving")).await
}

/// Waits until at most `n` launchers hold their liveness lease (a launcher stopped gives
/// its lease back), so that the one left takes every slot again.
async fn wait_for_launchers_at_most(client: &Client, n: usize) -> anyhow::Result<()> {
    wait_for_live(
        client,
        |live| live <= n,
        &format!("at most {n} launchers live"),
    )
    .await
}

async fn wait_for_live(
    client: &Client,
    done: impl Fn(usize) -> bool,
    what: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let live = client
            .bus()
            .leases
            .list::<serde_json::Value>()
            .await?
            .into_iter()
            .filter_map(Result::ok)
            .filter(|l| l.key.starts_with("launcher."))
            .count();
        if done(live) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{live} launchers live after {READY_TIMEOUT:?}, waiting for {what}");
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

/// The same loads with the launcher serving `--http` and its `/metrics` scraped every
/// second.
#[derive(Clone, Debug, Serialize)]
pub struct Observed {
    pub scrape_interval_secs: u64,
    pub scrapes: Scrapes,
    pub warm: Warm,
    pub throughput: Throughput,
}

/// Replaces `launcher` with one serving `--http` on loopback, measures the warm and
/// throughput loads while scraping its `/metrics`, and puts a launcher without `--http`
/// back (also on failure), so what follows runs as before.
pub async fn observed(
    rig: &Rig,
    launcher: &mut LauncherProcess,
    client: &Client,
    watcher: &Arc<RequestWatcher>,
) -> anyhow::Result<Observed> {
    let addr = free_loopback_port()?;
    let base = format!("http://{addr}");
    swap(
        launcher,
        // The bench's bus is anonymous: no credentials to derive tokens from.
        rig.spawn_launcher(
            &["--http".into(), addr, "--http-no-auth".into()],
            "launcher-http.log",
        )?,
    )
    .await;
    let result = async {
        wait_ready(&base).await?;
        phases::first_served(client, watcher, rig.label, Instant::now()).await?;
        let scraper = Scraper::start(base.clone());
        let measured = async {
            let warm = rig.warm(client, watcher).await?;
            let throughput = rig.throughput(&[launcher.pid]).await?;
            anyhow::Ok((warm, throughput))
        }
        .await;
        let scrapes = scraper.stop().await;
        let (warm, throughput) = measured?;
        if scrapes.scrapes == 0 {
            bail!("no scrape of {base}/metrics succeeded");
        }
        anyhow::Ok(Observed {
            scrape_interval_secs: scrape::SCRAPE_INTERVAL.as_secs(),
            scrapes,
            warm,
            throughput,
        })
    }
    .await;
    swap(
        launcher,
        rig.spawn_launcher(&[], "launcher-after-http.log")?,
    )
    .await;
    phases::first_served(client, watcher, rig.label, Instant::now()).await?;
    result
}

/// Puts `next` in `launcher`'s place and stops the one it replaces.
async fn swap(launcher: &mut LauncherProcess, next: LauncherProcess) {
    std::mem::replace(launcher, next).stop().await;
}

async fn wait_ready(base: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    while let Err(err) = scrape::get(base, "/readyz").await {
        if Instant::now() > deadline {
            return Err(err.context(format!("not ready after {READY_TIMEOUT:?}")));
        }
        tokio::time::sleep(READY_POLL).await;
    }
    Ok(())
}

/// A loopback address with a port free right now.
fn free_loopback_port() -> anyhow::Result<String> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(socket.local_addr()?.to_string())
}
