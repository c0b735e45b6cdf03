//! The `slotpool-agent` binary: flags, logging, signals and the NATS connection; the
//! agent itself is [`slotpool_agent::run`].
//!
//! `slotpool-agent enter-slot [--run-dir DIR]` is the login helper sshd runs for slot
//! users (see [`slotpool_agent::isolation::enter`]); it never connects to NATS.

use anyhow::Context;
use clap::Parser;
use slotpool_agent::config::{Args, DEFAULT_RUN_DIR, SECRET_ENV};
use slotpool_agent::log_tail::LogTail;
use slotpool_protocol::connect::Bus;
use std::io::IsTerminal;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// Longest wait for the NATS connection and the buckets at start-up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Threads for blocking work (slot set-up and wiping, /proc scans) at most; more wait.
const MAX_BLOCKING_THREADS: usize = 8;
/// How long an idle blocking thread lives before it exits.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(2);

/// `slotpool-agent enter-slot`: have the agent start this login's shell inside its slot,
/// and end as it ends.
#[derive(Debug, Parser)]
#[command(name = "slotpool-agent enter-slot")]
struct EnterArgs {
    /// Directory of the agents' placement sockets (the agent's --run-dir).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_RUN_DIR)]
    run_dir: std::path::PathBuf,
}

fn enter_slot() -> anyhow::Result<()> {
    let args = EnterArgs::parse_from(std::env::args_os().skip(1));
    let command = std::env::var("SSH_ORIGINAL_COMMAND").ok();
    match slotpool_agent::isolation::enter::enter_slot(&args.run_dir, command) {
        Ok(end) => slotpool_agent::isolation::enter::end_as(end),
        Err(err @ slotpool_agent::isolation::enter::EnterSlotError::AgentGone) => {
            eprintln!("slotpool-agent enter-slot: {err}");
            std::process::exit(255)
        }
        Err(err) => Err(anyhow::Error::new(err).context("login refused")),
    }
}

fn main() -> anyhow::Result<()> {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "enter-slot")
    {
        return enter_slot();
    }
    let args = Args::parse();
    // The newest lines also stay in memory, for operators' `log_tail`.
    let tail = LogTail::default();
    slotpool_protocol::logging::init_with(
        args.log_format,
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        std::io::stderr,
        std::io::stderr().is_terminal(),
        tail.layer(),
    );

    // Take the secret out of the environment before any thread or child process exists,
    // so slot processes started later cannot inherit it.
    let secret_env = std::env::var_os(SECRET_ENV);
    std::env::remove_var(SECRET_ENV);
    let nats = args.nats_options();
    let config = args
        .into_config(secret_env)
        .context("invalid configuration")?;

    // One thread runs every task: the agent's work is I/O waits and short bookkeeping,
    // and file-system or process work goes to the blocking pool (kept small, its threads
    // exiting when idle), so a big backing node does not get one worker per core.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        watch_signals(shutdown.clone())?;
        // A signal while the bus cannot be reached stops the agent at once, not after
        // the connect timeout: it has nothing to clean up yet.
        let connect = tokio::time::timeout(CONNECT_TIMEOUT, Bus::connect(&nats));
        let connected = tokio::select! {
            connected = connect => connected,
            () = shutdown.cancelled() => {
                tracing::info!("stopped before reaching NATS");
                return Ok(());
            }
        };
        let bus = connected
            .with_context(|| {
                format!(
                    "connecting to NATS at {}: timed out after {CONNECT_TIMEOUT:?}",
                    nats.url
                )
            })?
            .with_context(|| format!("connecting to NATS at {}", nats.url))?;
        slotpool_agent::run(config, bus, tail, shutdown)
            .await
            .context("agent failed")
    })
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT; a second one exits at once.
fn watch_signals(shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::spawn(async move {
        let mut signals = 0;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            signals += 1;
            if signals == 1 {
                tracing::info!("signal received: shutting down (again to force)");
                shutdown.cancel();
            } else {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    });
    Ok(())
}
