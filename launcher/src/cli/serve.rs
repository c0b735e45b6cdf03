//! `slotpool serve`: the launcher daemon.

use super::NatsArgs;
use crate::config::Config;
use crate::{run, LauncherDeps};
use anyhow::Context;
use slotpool_protocol::connect::Bus;
use std::path::Path;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

pub async fn serve(
    nats: &NatsArgs,
    config_path: &Path,
    agent_nats: Option<String>,
) -> anyhow::Result<ExitCode> {
    let config = Config::load(config_path)?;
    let bus = Bus::connect(&nats.options("slotpool-launcher"))
        .await
        .context("connecting to NATS")?;
    let agent_nats_url = agent_nats
        .or_else(|| config.agent_nats_url.clone())
        .unwrap_or_else(|| nats.url.clone());
    let shutdown = CancellationToken::new();
    let stopper = shutdown.clone();
    tokio::spawn(async move {
        super::stop_signal().await;
        tracing::info!("stopping: finishing steps in flight and releasing leases");
        stopper.cancel();
    });
    let deps = LauncherDeps {
        agent_nats_url,
        agent_binary: super::sibling_agent_binary(),
    };
    run(config, bus, deps, shutdown).await.context("launcher")?;
    Ok(ExitCode::SUCCESS)
}
