//! `slotpool-console`: the operator's terminal UI for slotpool pools.

#![forbid(unsafe_code)]

use anyhow::Context;
use clap::Parser;
use slotpool_config::bus::NatsClientArgs;
use slotpool_config::Config;
use slotpool_tui::{run_console, Rules, Settings, Theme};
use std::path::PathBuf;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "slotpool-console",
    version,
    about = "The operator's console: the whole pool at a glance, live, with hold, drain, run and kill"
)]
struct Args {
    #[command(flatten)]
    nats: NatsClientArgs,
    /// The launcher's config file: with it the console shows exact release, min-retention
    /// and max-age countdowns and each pool's max-servers; without it, idle times only.
    #[arg(long, short, env = "SLOTPOOL_CONFIG")]
    config: Option<PathBuf>,
    /// Write the console's own log here (nothing is logged otherwise: the screen is ours).
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// Log filter for --log-file (tracing env-filter syntax).
    #[arg(long, env = "SLOTPOOL_LOG", default_value = "info")]
    log: String,
    /// Format of --log-file: `text`, or `json` (one object a line) for a log system.
    #[arg(long, env = "SLOTPOOL_LOG_FORMAT", default_value = "text")]
    log_format: slotpool_protocol::logging::LogFormat,
    /// Quit after the first screen with everything loaded, printing the start-up time.
    #[arg(long, hide = true)]
    exit_after_first_render: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.log_file {
        match std::fs::File::create(path) {
            Ok(file) => slotpool_protocol::logging::init(
                args.log_format,
                tracing_subscriber::EnvFilter::try_new(&args.log)
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                std::sync::Mutex::new(file),
                false,
            ),
            Err(err) => {
                eprintln!("error: creating {}: {err}", path.display());
                return ExitCode::from(2);
            }
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let rules = match &args.config {
        Some(path) => Rules::from_config(&Config::load(path).context("reading --config")?),
        None => Rules::unknown(),
    };
    let settings = Settings {
        rules,
        theme: Theme::from_env(),
        exit_after_first_render: args.exit_after_first_render,
    };
    let shutdown = CancellationToken::new();
    // SIGTERM or SIGHUP (the demo stopping, a closed terminal): leave cleanly, restoring
    // the terminal. Ctrl-C is a key press in raw mode, handled by the console itself.
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
        on_signal.cancel();
    });
    let outcome = run_console(args.nats.options("slotpool-console"), settings, shutdown).await?;
    if args.exit_after_first_render {
        match outcome.first_full_render {
            Some(t) => println!(
                "first full render after {:.0} ms with {} backing nodes",
                t.as_secs_f64() * 1000.0,
                outcome.backing_nodes
            ),
            None => println!("quit before everything was loaded"),
        }
    }
    Ok(())
}
