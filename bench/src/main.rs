//! `slotpool-bench`: measures slotpool against the floor of its own bus, in one run. A
//! development tool: built with the workspace, not shipped in the packages.
//!
//! It starts a nats-server of its own (in a temp dir) and everything else it needs:
//! the launcher as a separate `slotpool serve` process (so its memory and CPU can be
//! read from `/proc`), real agents through the local provider, and for the scale
//! figures simulated agents ([`sim_agents`]) on a second nats-server. The figures are
//! printed as a table and, with `--json FILE`, written as JSON. See docs/benchmarks.md.
//!
//! The headline is the installation users run: warm-up, warm allocations and throughput
//! on a nats-server with the shipped authorisation and TLS with client certificates (as
//! `slotpool nats-setup` makes it by default), with agents in `users` mode when run as root.
//! The same loads run on an anonymous bus without TLS (where every other figure is
//! measured too) and, in users mode, on a secure bus with agents in mode `none`; the
//! report gives each ratio with its target.
//!
//! Clients submit and wait through [`slotpool_protocol::client::RequestWatcher`]: a
//! `status` call per request that a launcher answers when the request ends (clients
//! read no bucket).

mod compare;
mod exec_job;
mod load;
mod phases;
mod procs;
mod scrape;
mod sim_agents;
mod soak;
mod stats;

use anyhow::Context;
use clap::Args;
use phases::Throughput;
use serde::Serialize;
use slotpool_cli::pki::{self, PkiPlan};
use slotpool_launcher::provider::local::LocalProvider;
use slotpool_local_run::{
    find_nats_server, sibling_binary, start_monitored_nats_server, start_nats_server, stop_child,
};
use slotpool_protocol::auth::setup::{self, SetupPlan};
use slotpool_protocol::auth::{BusUser, Role};
use slotpool_protocol::client::{Client, RequestWatcher};
use slotpool_protocol::connect::NatsOptions;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// nats-server binary (>= 2.11); default: $SLOTPOOL_NATS_SERVER, then `nats-server`
    /// on PATH, then `.tools/nats/bin/nats-server`.
    #[arg(long, env = "SLOTPOOL_NATS_SERVER")]
    pub nats_server: Option<PathBuf>,
    /// Also write the figures as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Tiny counts, to check that the benchmark works (CI); the figures mean nothing.
    #[arg(long, conflicts_with = "quick")]
    pub smoke: bool,
    /// The headline and its comparisons in about two minutes: fewer warm allocations,
    /// 5 s loads, no cold, scale or `--http` phases.
    #[arg(long)]
    pub quick: bool,
    /// Floor chains measured (default 2000; quick 500; smoke 20).
    #[arg(long)]
    pub floor: Option<usize>,
    /// Sequential warm allocations (default 2000; quick 500; smoke 20).
    #[arg(long)]
    pub warm: Option<usize>,
    /// Concurrent clients for the throughput figures (default 64; smoke 4).
    #[arg(long)]
    pub clients: Option<usize>,
    /// Seconds of each throughput load (default 10; quick 5; smoke 1).
    #[arg(long)]
    pub throughput_secs: Option<u64>,
    /// Cold allocations, each followed by a release after grace-time (default 100;
    /// quick 0; smoke 2).
    #[arg(long)]
    pub cold: Option<usize>,
    /// grace-time of the backing nodes of the cold/release figure, in seconds.
    #[arg(long, default_value_t = 2)]
    pub grace_time: u64,
    /// Simulated backing nodes for the scale figures (default 10000; quick 0; smoke 20;
    /// 0 skips).
    #[arg(long)]
    pub scale_backing: Option<usize>,
    /// Slots per simulated backing node.
    #[arg(long, default_value_t = 8)]
    pub scale_slots: u32,
    /// Heartbeat interval of the simulated agents, in ms (the real agent's default).
    #[arg(long, default_value_t = 2000)]
    pub scale_heartbeat_ms: u64,
    /// Warm allocations measured at scale (default 1000; quick 0; smoke 5).
    #[arg(long)]
    pub scale_warm: Option<usize>,
    /// Seconds over which idle memory and CPU are measured (default 20; quick 2; smoke 1).
    #[arg(long)]
    pub idle_secs: Option<u64>,
    /// Keep the temp dir (logs, configs, stores) instead of removing it. It is also kept,
    /// without this, when a figure is an outlier (see the report's `outliers`).
    #[arg(long)]
    pub keep: bool,
    /// `slotpool serve` processes on the bus for the second throughput load, reported
    /// against one launcher's (default 2; 1 skips that load).
    #[arg(long, default_value_t = 2)]
    pub launchers: usize,
    /// Skip the warm and throughput loads with `serve --http` scraped every second (the
    /// cost of observability; skipped with `--quick` too).
    #[arg(long)]
    pub no_http_compare: bool,
    /// The agents' slot isolation (default: `users`, a production backing node's
    /// per-slot Unix users and cgroups, when run as root; else `none`). In `users` mode
    /// the headline's loads run again with agents in mode `none`, for the ratio.
    #[arg(long, value_parser = ["none", "users"])]
    pub isolation: Option<String>,
    /// After the cold phase, N allocations + releases at full speed (with --clients
    /// clients) on the real request TTL and mirror, with the launcher's RSS every N/10
    /// (default 0: no soak).
    #[arg(long, value_name = "N")]
    pub soak: Option<usize>,
    /// `slotpool exec --label L -- true` jobs timed one after another on the production
    /// bus, and as many again in a held node beside `ssh node true` (users mode), and
    /// `--exec-parallel` at a time (default 200; quick 50; smoke 3; 0 skips).
    #[arg(long, value_name = "N")]
    pub exec_rounds: Option<usize>,
    /// Jobs run at a time for the jobs-per-second figure (default 16; smoke 2).
    #[arg(long, value_name = "N")]
    pub exec_parallel: Option<usize>,
}

/// The counts a run uses.
#[derive(Clone, Debug, Serialize)]
struct Settings {
    smoke: bool,
    quick: bool,
    floor: usize,
    warm: usize,
    clients: usize,
    throughput_secs: u64,
    cold: usize,
    grace_time_secs: u64,
    scale_backing: usize,
    scale_slots: u32,
    scale_heartbeat_ms: u64,
    scale_warm: usize,
    idle_secs: u64,
    isolation: String,
    launchers: usize,
    http_compare: bool,
    soak: usize,
    exec_rounds: usize,
    exec_parallel: usize,
}

impl Settings {
    fn from(a: &BenchArgs) -> Settings {
        // A count given, else the default of the run's kind: full, quick or smoke.
        let pick = |given: Option<usize>, full: usize, quick: usize, smoke: usize| {
            given.unwrap_or(if a.smoke {
                smoke
            } else if a.quick {
                quick
            } else {
                full
            })
        };
        let secs = |given: Option<u64>, full: usize, quick: usize, smoke: usize| {
            pick(given.map(|s| s as usize), full, quick, smoke) as u64
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        Settings {
            smoke: a.smoke,
            quick: a.quick,
            floor: pick(a.floor, 2000, 500, 20),
            warm: pick(a.warm, 2000, 500, 20),
            clients: pick(a.clients, 64, 64, 4).max(1),
            throughput_secs: secs(a.throughput_secs, 10, 5, 1),
            cold: pick(a.cold, 100, 0, 2),
            grace_time_secs: a.grace_time,
            scale_backing: pick(a.scale_backing, 10_000, 0, 20),
            scale_slots: a.scale_slots,
            scale_heartbeat_ms: a.scale_heartbeat_ms,
            scale_warm: pick(a.scale_warm, 1000, 0, 5),
            idle_secs: secs(a.idle_secs, 20, 2, 1),
            isolation: a
                .isolation
                .clone()
                .unwrap_or_else(|| if root { "users" } else { "none" }.into()),
            launchers: a.launchers.max(1),
            http_compare: !a.no_http_compare && !a.quick,
            soak: a.soak.unwrap_or(0),
            exec_rounds: pick(a.exec_rounds, 200, 50, 3),
            exec_parallel: pick(a.exec_parallel, 16, 16, 2).max(1),
        }
    }
}

#[derive(Debug, Serialize)]
struct Machine {
    cpus: usize,
    cpu_model: String,
    mem_total_mb: u64,
    kernel: String,
    nats_server: String,
    /// 1-minute load average at the start and at the end of the run: other work on the
    /// machine shows here.
    load_at_start: f64,
    load_at_end: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    date: String,
    command: String,
    settings: Settings,
    machine: Machine,
    floor: phases::Floor,
    warm: phases::Warm,
    throughput: Throughput,
    /// The plain bus's release to reusable ([`phases::release_to_reusable`]).
    release_to_reusable: stats::Summary,
    /// The plain bus's sequential allocations again, with the production run's launcher
    /// and agents up and warm, before its loads, taking turns with production's
    /// (`production.warm_taking_turns`, [`phases::taking_turns`]): the plain comparison's
    /// warm ratios are of these two.
    warm_before_production: phases::Warm,
    /// The plain bus's throughput load after `warm_before_production`.
    throughput_before_production: Throughput,
    /// The plain bus's sequential allocations again, right after the production run's
    /// loads, its launcher and agents still up.
    warm_after_production: phases::Warm,
    /// The plain bus's throughput load after `warm_after_production`: the plain
    /// comparison's throughput ratios are over the mean of
    /// `throughput_before_production` and this.
    throughput_after_production: Throughput,
    /// The launcher process after the throughput load (RSS, CPU while idle).
    launcher_idle: procs::Usage,
    cold_and_release: phases::ColdAndRelease,
    /// With `--soak N`.
    soak: Option<soak::Soak>,
    agent: phases::Agent,
    scale: Option<phases::Scale>,
    /// Throughput with `--launchers` launchers on the bus, against one launcher's.
    launchers: Option<MoreLaunchers>,
    /// Warm and throughput with `serve --http` scraped every second, against without.
    observability: Option<Observability>,
    /// The headline: the default installation (authentication and TLS, agents in the
    /// run's isolation mode). `warm` and `throughput` above are the plain bus's.
    production: Production,
    /// In `users` mode: the same loads on a secure bus with agents in mode `none`.
    isolation_none: Option<Allocations>,
    /// A CI job's turnaround through `slotpool exec`, beside `ssh`, on the production
    /// bus after its loads (`--exec-rounds 0`: none).
    exec: Option<exec_job::ExecFigures>,
    /// The production run over each comparison run, with their targets in `targets`.
    comparisons: Vec<Comparison>,
    /// Every latency figure of the run with its ratios to this run's floor (the rows of
    /// the printed table).
    latencies: Vec<Latency>,
    /// Figures far out of line with their kind; the working directory is then kept.
    outliers: Vec<String>,
    targets: Vec<Target>,
}

/// One latency figure and its ratios to the floor (get + create + CAS update) p50 and
/// p99 measured in the same run.
#[derive(Debug, Serialize)]
struct Latency {
    figure: String,
    #[serde(flatten)]
    summary: stats::Summary,
    p50_to_floor: f64,
    p99_to_floor: f64,
}

#[derive(Debug, Serialize)]
struct MoreLaunchers {
    launchers: usize,
    throughput: Throughput,
    /// One launcher alone, the same load right before and right after `throughput`.
    alone: [Throughput; 2],
    /// Allocations/s over one launcher's alone (the mean of `alone`).
    allocations_per_sec_ratio: f64,
    /// CPU of all processes per allocation over one launcher's alone (the same way).
    cpu_ratio: f64,
}

#[derive(Debug, Serialize)]
struct Observability {
    /// What was on that the plain run had off.
    with: String,
    #[serde(flatten)]
    observed: compare::Observed,
    /// With over without.
    ratios: Ratios,
}

/// Warm allocations, throughput and release to reusable on one bus.
#[derive(Debug, Serialize)]
struct Allocations {
    warm: phases::Warm,
    throughput: Throughput,
    /// A one-slot node released and asked for again at once: from the release call to
    /// the next request fulfilled on that slot ([`phases::release_to_reusable`]).
    release_to_reusable: stats::Summary,
}

#[derive(Debug, Serialize)]
struct Production {
    /// What this bus has on that the plain one has not.
    bus: &'static str,
    /// The agents' slot isolation.
    isolation: String,
    warm: phases::Warm,
    /// Its sequential allocations taking turns with the plain bus's
    /// (`warm_before_production`), for the plain comparison's warm ratios.
    warm_taking_turns: phases::Warm,
    throughput: Throughput,
    /// From a release call to the next request fulfilled on the same slot.
    release_to_reusable: stats::Summary,
}

/// The production run against one that differs in one thing.
#[derive(Debug, Serialize)]
struct Comparison {
    /// What the other run had instead.
    against: String,
    /// Production over the other run.
    ratios: Ratios,
}

#[derive(Debug, Serialize)]
struct Ratios {
    warm_p50: f64,
    /// Measured taking turns: `warm_p50` of each pair of blocks
    /// ([`phases::block_ratios`]), how much it moves within the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    warm_p50_blocks: Option<phases::Spread>,
    warm_p99: f64,
    allocations_per_sec: f64,
    cpu_ms_per_allocation: f64,
}

impl Ratios {
    /// `warm` and `throughput` over `base`'s.
    fn of(warm: &phases::Warm, throughput: &Throughput, base: &Allocations) -> Ratios {
        let (w, bw) = (&warm.allocation, &base.warm.allocation);
        let bt = &base.throughput;
        Ratios {
            warm_p50: w.p50_ms / bw.p50_ms,
            warm_p50_blocks: None,
            warm_p99: w.p99_ms / bw.p99_ms,
            allocations_per_sec: throughput.allocations_per_sec / bt.allocations_per_sec,
            cpu_ms_per_allocation: throughput.cpu_ms_per_allocation / bt.cpu_ms_per_allocation,
        }
    }

    /// Warm allocations `turns` (production's, then the other bus's, measured taking
    /// turns: [`phases::taking_turns`]), and `throughput` over the mean of `base`'s and
    /// `again`'s, the same load run before and after it: a host whose other load
    /// drifts, or that still works off the loads before (a namespace's cleanup outlives
    /// its slot), moves both sides alike.
    fn beside(
        turns: (&phases::Warm, &phases::Warm),
        throughput: &Throughput,
        base: &Again,
        again: &Again,
    ) -> Ratios {
        let over_both = |f| throughput.over_mean(f, &base.throughput, &again.throughput);
        let (w, other) = (&turns.0.allocation, &turns.1.allocation);
        Ratios {
            warm_p50: w.p50_ms / other.p50_ms,
            warm_p50_blocks: phases::block_ratios(turns.1, turns.0),
            warm_p99: w.p99_ms / other.p99_ms,
            allocations_per_sec: over_both(|t| t.allocations_per_sec),
            cpu_ms_per_allocation: over_both(|t| t.cpu_ms_per_allocation),
        }
    }
}

const SECURE_BUS: &str = "per-role credentials (decentralised JWT), TLS with client certificates";

/// What the plain comparison's bus lacks.
const PLAIN_BUS: &str = "plain bus (anonymous, no TLS), same isolation";
/// What the `none` comparison's agents lack.
const NONE_AGENTS: &str = "agents in slot mode none, same bus";

#[derive(Debug, Serialize)]
struct Target {
    figure: String,
    target: String,
    value: String,
    met: bool,
}

/// The benchmark's command line: its own flags and the log filter.
#[derive(Debug, clap::Parser)]
#[command(
    name = "slotpool-bench",
    version,
    about = "Measures slotpool against the floor of its own bus (starts its own nats-server; see docs/benchmarks.md)"
)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
    /// Log filter (tracing env-filter syntax), e.g. `warn` or `slotpool_launcher=debug`.
    #[arg(long, env = "SLOTPOOL_LOG", default_value = "info")]
    log: String,
}

fn main() -> ExitCode {
    let cli = <Cli as clap::Parser>::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run_bench(cli.bench)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(1)
        }
    }
}

pub async fn run_bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let settings = Settings::from(&args);
    let binary = find_nats_server(args.nats_server.as_deref())?;
    let agent_binary = sibling_binary("slotpool-agent");
    anyhow::ensure!(
        agent_binary.is_file(),
        "the benchmark needs the slotpool-agent binary next to slotpool ({}): build with `cargo build --release --workspace --bins`",
        agent_binary.display()
    );
    let dir = std::env::temp_dir().join(format!("slotpool-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    eprintln!("slotpool-bench: working in {}", dir.display());
    let load_at_start = load1();
    let result = run_all(&settings, &binary, &agent_binary, &dir).await;
    // Normally none are left (run_all stops them); this catches the ones a failed run left.
    remove_local_agents(&agent_binary, &dir).await;
    for run in [SECURE_DIR, NONE_DIR] {
        remove_local_agents(&agent_binary, &dir.join(run)).await;
    }
    let report = result.map(|figures| report(settings, figures, &binary, load_at_start));
    match &report {
        Ok(r) if !args.keep && r.outliers.is_empty() => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok(r) => {
            for outlier in &r.outliers {
                eprintln!("slotpool-bench: outlier: {outlier}");
            }
            eprintln!(
                "slotpool-bench: logs and working directory kept in {}",
                dir.display()
            );
        }
        Err(_) => eprintln!(
            "slotpool-bench: the run failed; logs and working directory kept in {}",
            dir.display()
        ),
    }
    let report = report?;
    print_table(&report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("slotpool-bench: figures written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn report(settings: Settings, f: Figures, nats_binary: &Path, load_at_start: f64) -> Report {
    let machine = Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model: cpu_model(),
        mem_total_mb: mem_total_mb(),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        nats_server: nats_version(nats_binary),
        load_at_start,
        load_at_end: load1(),
    };
    let plain = f.plain;
    let mut report = Report {
        date: utc_now(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine,
        floor: f.floor,
        launchers: f.launchers.map(|l| MoreLaunchers {
            launchers: settings.launchers,
            allocations_per_sec_ratio: l.allocations_per_sec_ratio(),
            cpu_ratio: l.cpu_ratio(),
            throughput: l.together,
            alone: l.alone,
        }),
        observability: f.observed.map(|observed| Observability {
            with: format!(
                "serve --http, /metrics scraped every {} s",
                observed.scrape_interval_secs
            ),
            ratios: Ratios::of(&observed.warm, &observed.throughput, &plain),
            observed,
        }),
        comparisons: std::iter::once(Comparison {
            against: PLAIN_BUS.into(),
            ratios: Ratios::beside(
                (&f.production_turns, &f.plain_before.warm),
                &f.production.throughput,
                &f.plain_before,
                &f.plain_again,
            ),
        })
        .chain(f.isolation_none.as_ref().map(|none| Comparison {
            against: NONE_AGENTS.into(),
            ratios: Ratios::of(&f.production.warm, &f.production.throughput, none),
        }))
        .collect(),
        production: Production {
            bus: SECURE_BUS,
            isolation: settings.isolation.clone(),
            warm: f.production.warm,
            warm_taking_turns: f.production_turns,
            throughput: f.production.throughput,
            release_to_reusable: f.production.release_to_reusable,
        },
        isolation_none: f.isolation_none,
        exec: f.exec,
        settings,
        warm: plain.warm,
        throughput: plain.throughput,
        release_to_reusable: plain.release_to_reusable,
        warm_before_production: f.plain_before.warm,
        throughput_before_production: f.plain_before.throughput,
        warm_after_production: f.plain_again.warm,
        throughput_after_production: f.plain_again.throughput,
        launcher_idle: f.launcher_idle,
        cold_and_release: f.cold_and_release,
        soak: f.soak,
        agent: f.agent,
        scale: f.scale,
        latencies: Vec::new(),
        outliers: Vec::new(),
        targets: Vec::new(),
    };
    report.latencies = latencies(&report);
    report.outliers = outliers(&report);
    report.targets = targets(&report);
    report
}

/// Everything `run_all` measured.
struct Figures {
    floor: phases::Floor,
    plain: Allocations,
    launcher_idle: procs::Usage,
    cold_and_release: phases::ColdAndRelease,
    soak: Option<soak::Soak>,
    agent: phases::Agent,
    launchers: Option<compare::Launchers>,
    observed: Option<compare::Observed>,
    scale: Option<phases::Scale>,
    production: Allocations,
    /// Production's sequential allocations taking turns with the plain bus's
    /// ([`phases::taking_turns`]), whose are `plain_before.warm`.
    production_turns: phases::Warm,
    /// The plain bus's loads with the production run's agents warm, before its loads:
    /// its warm allocations taking turns with production's.
    plain_before: Again,
    /// The plain bus's loads again, right after the production run.
    plain_again: Again,
    isolation_none: Option<Allocations>,
    exec: Option<exec_job::ExecFigures>,
}

/// A bus's sequential allocations and throughput load, run again after another run's.
struct Again {
    warm: phases::Warm,
    throughput: Throughput,
}

/// What runs while the plain bus's launcher and agents are up, after their warm and
/// throughput loads: the production run, the plain loads again, the `none` run, and what
/// the plain bus alone measures.
struct PlainMore {
    production: Allocations,
    production_turns: phases::Warm,
    exec: Option<exec_job::ExecFigures>,
    plain_before: Again,
    plain_again: Again,
    isolation_none: Option<Allocations>,
    idle: procs::Usage,
    cold: phases::ColdAndRelease,
    launchers: Option<compare::Launchers>,
    observed: Option<compare::Observed>,
    soak: Option<soak::Soak>,
}

const WARM_LABEL: &str = "warm";
const COLD_LABEL: &str = "cold";
/// One backing node of one slot: release to reusable.
const REUSE_LABEL: &str = "reuse";
const SLOTS_PER_WARM_NODE: usize = 8;
/// The production run's directory (its server, PKI, credentials, launcher and agents).
const SECURE_DIR: &str = "secure";
/// The directory of the production bus's run with agents in mode `none`.
const NONE_DIR: &str = "secure-none";

async fn run_all(
    s: &Settings,
    nats_binary: &Path,
    agent_binary: &Path,
    dir: &Path,
) -> anyhow::Result<Figures> {
    let nats_dir = dir.join("nats");
    std::fs::create_dir_all(&nats_dir)?;
    let (mut server, url, monitor) =
        start_monitored_nats_server(nats_binary, &nats_dir, None).await?;
    let server_pid = server.id();
    let result = async {
        let bus = phases::connect(&phases::anonymous(&url, "slotpool-bench")).await?;
        step(format!("floor: {} KV get+create+update chains", s.floor));
        let floor = phases::floor(&bus, s.floor).await?;

        step(format!("agent: one real agent, idle for {}s", s.idle_secs));
        let agent = phases::agent(
            &bus,
            &url,
            dir,
            &s.isolation,
            Duration::from_secs(s.idle_secs),
        )
        .await?;

        // The plain bus's loads come first and again right after the production run
        // (which runs meanwhile on a bus of its own, the plain one's launcher and agents
        // idle): the plain comparison's ratios are over the mean of the two
        // ([`Ratios::over_both`]).
        step(format!(
            "plain bus: anonymous, no TLS, agents in mode {}",
            s.isolation
        ));
        let plain = BusSetup {
            client: phases::anonymous(&url, "slotpool-bench"),
            serve_args: procs::ANONYMOUS_BUS.iter().map(|a| a.to_string()).collect(),
            agent_args: Vec::new(),
            isolation: s.isolation.clone(),
        };
        let client = Client::from_bus(bus.clone());
        let (plain, (), more) = on_bus(
            s,
            &plain,
            client,
            (server_pid, Some(monitor)),
            agent_binary,
            dir,
            async |_: &Client, _: &RequestWatcher| anyhow::Ok(()),
            async |rig: &load::Rig,
                   launcher: &mut procs::LauncherProcess,
                   client: &Client,
                   watcher: &Arc<RequestWatcher>| {
                step(format!(
                    "production: {SECURE_BUS}, agents in mode {}",
                    s.isolation
                ));
                // The plain loads the production run is compared with run while both
                // buses' launchers and agents are up, as the production loads do.
                let launcher_pid = launcher.pid;
                let plain_loads = async |when: &str| {
                    step(format!(
                        "plain bus {when}: warm, then throughput, {} clients for {}s",
                        s.clients, s.throughput_secs
                    ));
                    anyhow::Ok(Again {
                        warm: rig.warm(client, watcher).await?,
                        throughput: rig.throughput(&[launcher_pid]).await?,
                    })
                };
                // The warm allocations the comparison's warm ratios are of: the two
                // buses taking turns, once production's agents are warm.
                let beside = async |production: &Client, its_watcher: &RequestWatcher| {
                    step(format!(
                        "plain bus and production taking turns: {} sequential allocations each, in {} blocks; then plain throughput, {} clients for {}s",
                        s.warm,
                        phases::TURNS,
                        s.clients,
                        s.throughput_secs
                    ));
                    let (plain, production) = phases::taking_turns(
                        (client, watcher),
                        (production, its_watcher),
                        WARM_LABEL,
                        s.warm,
                    )
                    .await?;
                    let again = Again {
                        warm: plain,
                        throughput: rig.throughput(&[launcher_pid]).await?,
                    };
                    anyhow::Ok((again, production))
                };
                let (production, exec, (plain_before, production_turns), plain_again) =
                    run_secure(
                        s,
                        &s.isolation,
                        nats_binary,
                        agent_binary,
                        &dir.join(SECURE_DIR),
                        s.exec_rounds > 0,
                        beside,
                        async || plain_loads("again, right after production's loads").await,
                    )
                    .await?;
                launcher.check_alive()?;
                let isolation_none = if s.isolation != "none" {
                    step("production bus, agents in mode none".into());
                    let none = dir.join(NONE_DIR);
                    Some(
                        run_secure(
                            s,
                            "none",
                            nats_binary,
                            agent_binary,
                            &none,
                            false,
                            async |_: &Client, _: &RequestWatcher| anyhow::Ok(()),
                            async || anyhow::Ok(()),
                        )
                        .await?
                        .0,
                    )
                } else {
                    None
                };
                let launchers = if s.launchers > 1 {
                    step(format!(
                        "throughput: {} clients for {}s, one launcher, then {} launchers, then one again",
                        s.clients, s.throughput_secs, s.launchers
                    ));
                    Some(compare::launchers(rig, launcher, s.launchers, client).await?)
                } else {
                    None
                };
                let observed = if s.http_compare {
                    step(format!(
                        "warm and throughput with serve --http, /metrics scraped every {}s",
                        scrape::SCRAPE_INTERVAL.as_secs()
                    ));
                    Some(compare::observed(rig, launcher, client, watcher).await?)
                } else {
                    None
                };
                step(format!("launcher idle for {}s", s.idle_secs));
                let idle =
                    procs::usage_over(launcher.pid, Duration::from_secs(s.idle_secs)).await?;
                step(format!(
                    "cold + release: {} allocations, grace-time {}s",
                    s.cold, s.grace_time_secs
                ));
                let cold = phases::cold_and_release(
                    &bus,
                    client,
                    watcher,
                    COLD_LABEL,
                    &slotpool_protocol::layout::seat_key("local", COLD_LABEL, 0),
                    Duration::from_secs(s.grace_time_secs),
                    s.cold,
                )
                .await?;
                launcher.check_alive()?;
                let soak = if s.soak > 0 {
                    step(format!(
                        "soak: {} allocations + releases, {} clients",
                        s.soak, s.clients
                    ));
                    let soak =
                        soak::soak(client, watcher, WARM_LABEL, s.clients, s.soak, launcher.pid)
                            .await?;
                    launcher.check_alive()?;
                    Some(soak)
                } else {
                    None
                };
                anyhow::Ok(PlainMore {
                    production,
                    production_turns,
                    exec,
                    plain_before,
                    plain_again,
                    isolation_none,
                    idle,
                    cold,
                    launchers,
                    observed,
                    soak,
                })
            },
        )
        .await?;
        anyhow::Ok((floor, plain, more, agent))
    }
    .await;
    stop_child(&mut server).await;
    let (floor, plain, more, agent) = result?;

    let scale = if s.scale_backing > 0 {
        step(format!(
            "scale: {} simulated backing nodes x {} slots",
            s.scale_backing, s.scale_slots
        ));
        let scale_dir = dir.join("scale");
        std::fs::create_dir_all(&scale_dir)?;
        let (mut server, url) = start_nats_server(nats_binary, &scale_dir, None).await?;
        let settings = phases::ScaleSettings {
            backing: s.scale_backing,
            slots: s.scale_slots,
            heartbeat: Duration::from_millis(s.scale_heartbeat_ms),
            settle: Duration::from_secs(if s.smoke { 1 } else { 15 }),
            idle_window: Duration::from_secs(s.idle_secs),
            allocations: s.scale_warm,
        };
        let scale = phases::scale(&url, &scale_dir, &settings).await;
        stop_child(&mut server).await;
        Some(scale?)
    } else {
        None
    };
    Ok(Figures {
        floor,
        plain,
        launcher_idle: more.idle,
        cold_and_release: more.cold,
        soak: more.soak,
        agent,
        launchers: more.launchers,
        observed: more.observed,
        scale,
        production: more.production,
        production_turns: more.production_turns,
        plain_before: more.plain_before,
        plain_again: more.plain_again,
        isolation_none: more.isolation_none,
        exec: more.exec,
    })
}

/// The command-line options (`--creds`, `--tls-ca`, `--tls-cert`, `--tls-key`) that
/// log in and reach the bus the way `opts` do; the URL is given apart.
fn nats_args(opts: &NatsOptions) -> Vec<String> {
    [
        ("--creds", &opts.creds),
        ("--tls-ca", &opts.tls_ca),
        ("--tls-cert", &opts.tls_cert),
        ("--tls-key", &opts.tls_key),
    ]
    .into_iter()
    .filter_map(|(flag, path)| Some([flag.to_string(), path_arg(path.as_ref()?)]))
    .flatten()
    .collect()
}

fn path_arg(path: &Path) -> String {
    path.display().to_string()
}

/// How the benchmark's clients, the launcher and its local agents reach one bus.
struct BusSetup {
    /// The benchmark's clients.
    client: NatsOptions,
    /// `slotpool serve` arguments besides --nats and --config.
    serve_args: Vec<String>,
    /// More arguments of the local agents (`agent-args`).
    agent_args: Vec<String>,
    /// The local agents' `--isolation`.
    isolation: String,
}

/// Warm-up, warm allocations and throughput on one bus, with a launcher and local agents
/// (under `run_dir/agents`) of their own; then `more` while they still run. The launcher
/// and its agents are stopped before this returns, also on failure.
#[allow(clippy::too_many_arguments)]
async fn on_bus<R, T>(
    s: &Settings,
    setup: &BusSetup,
    client: Client,
    server: (Option<u32>, Option<String>),
    agent_binary: &Path,
    run_dir: &Path,
    warmed: impl AsyncFnOnce(&Client, &RequestWatcher) -> anyhow::Result<R>,
    more: impl AsyncFnOnce(
        &load::Rig,
        &mut procs::LauncherProcess,
        &Client,
        &Arc<RequestWatcher>,
    ) -> anyhow::Result<T>,
) -> anyhow::Result<(Allocations, R, T)> {
    let warm_nodes = s.clients.div_ceil(SLOTS_PER_WARM_NODE) + 1;
    let config = run_dir.join("launcher.yaml");
    std::fs::write(
        &config,
        launcher_config(
            &run_dir.join("agents"),
            agent_binary,
            &setup.agent_args,
            warm_nodes,
            s.grace_time_secs,
            &setup.isolation,
        ),
    )?;
    let (server_pid, monitor) = server;
    let rig = load::Rig {
        server_pid,
        monitor,
        nats_url: setup.client.url.clone(),
        client_options: setup.client.clone(),
        serve_args: setup.serve_args.clone(),
        config,
        agent_binary: agent_binary.to_path_buf(),
        run_dir: run_dir.to_path_buf(),
        label: WARM_LABEL,
        warm: s.warm,
        clients: s.clients,
        load_time: Duration::from_secs(s.throughput_secs),
    };
    let mut launcher = rig.spawn_launcher(&[], "launcher.log")?;
    let figures = async {
        let watcher = Arc::new(client.watcher().await?);
        step(format!(
            "warm-up: {warm_nodes} backing nodes of {SLOTS_PER_WARM_NODE} slots"
        ));
        let start = std::time::Instant::now();
        phases::first_served(&client, &watcher, WARM_LABEL, start).await?;
        phases::prewarm(
            &client,
            &watcher,
            WARM_LABEL,
            warm_nodes * SLOTS_PER_WARM_NODE,
        )
        .await?;
        let warmed = warmed(&client, &watcher).await?;
        step(format!("warm: {} sequential allocations", s.warm));
        let warm = rig.warm(&client, &watcher).await?;
        step(format!(
            "throughput: {} clients for {}s",
            s.clients, s.throughput_secs
        ));
        let throughput = rig.throughput(&[launcher.pid]).await?;
        launcher.check_alive()?;
        let cycles = (s.warm / 10).max(2);
        step(format!(
            "release to reusable: a one-slot node released and asked for again, {cycles} times"
        ));
        let release_to_reusable =
            phases::release_to_reusable(&client, &watcher, REUSE_LABEL, cycles).await?;
        let more = more(&rig, &mut launcher, &client, &watcher).await?;
        anyhow::Ok((
            Allocations {
                warm,
                throughput,
                release_to_reusable,
            },
            warmed,
            more,
        ))
    }
    .await;
    launcher.stop().await;
    // While nats-server still runs, so each agent writes its last heartbeat and exits.
    remove_local_agents(agent_binary, run_dir).await;
    figures
}

/// [`on_bus`] on a nats-server of its own with the shipped authorisation and TLS with
/// client certificates, as `slotpool nats-setup` makes it by default: the benchmark's clients
/// log in as a client, the launcher as a launcher that mints each local agent its own
/// credential, and every one shows a certificate from the installation's CA. With
/// `exec`, the `slotpool exec` figures follow the loads ([`exec_job`]). `before` runs
/// once its agents are warm, before its loads, and `after` right after them (before the
/// `exec` jobs): another bus's loads measured beside this run's launcher and agents.
#[allow(clippy::too_many_arguments)]
async fn run_secure<B, A>(
    s: &Settings,
    isolation: &str,
    nats_binary: &Path,
    agent_binary: &Path,
    dir: &Path,
    exec: bool,
    before: impl AsyncFnOnce(&Client, &RequestWatcher) -> anyhow::Result<B>,
    after: impl AsyncFnOnce() -> anyhow::Result<A>,
) -> anyhow::Result<(Allocations, Option<exec_job::ExecFigures>, B, A)> {
    let launcher = BusUser::new(Role::Launcher, "bench-launcher")?;
    let clients = BusUser::new(Role::Client, "bench-clients")?;
    let pki = pki::write_pki(&PkiPlan {
        dir: dir.join("tls"),
        server_names: vec!["127.0.0.1".into(), "localhost".into()],
        clients: vec!["launcher".into(), "client".into(), "agent".into()],
        validity_days: 1,
        overwrite: false,
    })?;
    let files = setup::write(&SetupPlan {
        dir: dir.join("auth"),
        users: vec![launcher.clone(), clients.clone()],
        extra_config: pki::tls_server_block(&pki, true),
        ..Default::default()
    })?;
    let nats_dir = dir.join("nats");
    std::fs::create_dir_all(&nats_dir)?;
    let (mut server, url, monitor) =
        start_monitored_nats_server(nats_binary, &nats_dir, Some(&files.server_config)).await?;
    let url = url.replacen("nats://", "tls://", 1);
    let server_pid = server.id();
    // How `user` (none: a local agent, whose credential the launcher mints) reaches the
    // bus with the certificate of the PKI's client `cert`.
    let options = |user: Option<&BusUser>, cert: &str| {
        let cert = pki.client(cert).expect("made above");
        NatsOptions {
            url: url.clone(),
            name: "slotpool-bench".into(),
            creds: user.map(|u| {
                files
                    .creds_of(u.role, u.name.as_str())
                    .expect("written above")
                    .to_path_buf()
            }),
            tls_ca: Some(pki.ca_cert.clone()),
            tls_cert: Some(cert.cert.clone()),
            tls_key: Some(cert.key.clone()),
            ..Default::default()
        }
    };
    let launcher = options(Some(&launcher), "launcher");
    let bus = BusSetup {
        client: options(Some(&clients), "client"),
        serve_args: ["--agent-signing-key".into(), path_arg(&files.signing_key)]
            .into_iter()
            .chain(nats_args(&launcher))
            .collect(),
        // The launcher hands its own TLS files to the agents it starts on its host
        // (the `local` provider), so the agents need no options of their own here.
        agent_args: Vec::new(),
        isolation: isolation.into(),
    };
    let result = async {
        // A client may not create slotpool's buckets: a launcher makes them, as the one
        // about to start would.
        drop(phases::connect(&launcher).await?);
        let client = Client::from_bus(phases::connect(&bus.client).await?);
        on_bus(
            s,
            &bus,
            client,
            (server_pid, Some(monitor)),
            agent_binary,
            dir,
            before,
            async |_: &load::Rig,
                   launcher: &mut procs::LauncherProcess,
                   client: &Client,
                   _: &Arc<RequestWatcher>| {
                let after = after().await?;
                if !exec {
                    return anyhow::Ok((None, after));
                }
                let plan = exec_job::Plan {
                    slotpool: sibling_binary("slotpool"),
                    bus_args: ["--nats".to_string(), bus.client.url.clone()]
                        .into_iter()
                        .chain(nats_args(&bus.client))
                        .collect(),
                    label: WARM_LABEL,
                    rounds: s.exec_rounds,
                    parallel: s.exec_parallel,
                    ssh: isolation == "users",
                    agent_binary,
                    run_dir: dir,
                    dir: dir.join("exec"),
                };
                step(format!(
                    "exec: {} jobs with slotpool exec --label {WARM_LABEL}, {} in a held node beside ssh, {} at a time",
                    s.exec_rounds, s.exec_rounds, s.exec_parallel
                ));
                let figures = exec_job::measure(&plan, client).await?;
                launcher.check_alive()?;
                Ok((Some(figures), after))
            },
        )
        .await
    }
    .await;
    stop_child(&mut server).await;
    let (allocations, before, (exec, after)) = result?;
    Ok((allocations, exec, before, after))
}

fn step(what: String) {
    eprintln!("slotpool-bench: {what}");
}

/// Stops and removes the local agents the launcher started: they outlive a launcher by
/// design.
async fn remove_local_agents(agent_binary: &Path, dir: &Path) {
    let local = LocalProvider::new(
        "local",
        agent_binary.to_path_buf(),
        vec![],
        dir.join("agents"),
    );
    if let Err(err) = local.delete_all().await {
        eprintln!("slotpool-bench: cannot stop every local agent: {err}");
    }
}

fn launcher_config(
    work_dir: &Path,
    agent: &Path,
    agent_args: &[String],
    warm_nodes: usize,
    grace: u64,
    isolation: &str,
) -> String {
    // A JSON list is a YAML flow sequence, with every path quoted.
    let agent_args = serde_json::to_string(
        // The agents remove their slots (users, cgroups) when stopped, and do not mount
        // a /proc that hides processes (a host-wide mount an agent leaves in place, made
        // once at start, so it costs no allocation anything): the host is left as it
        // was found.
        &[
            "--isolation",
            isolation,
            "--remove-slots-on-stop",
            "--hide-processes",
            "off",
        ]
        .into_iter()
        .chain(agent_args.iter().map(String::as_str))
        .collect::<Vec<_>>(),
    )
    .expect("strings serialize");
    format!(
        "\
launcher:
  lease-ttl: 10
providers:
  - name: local
    driver: local
    local:
      work-dir: {work}
      agent-command: {agent}
      agent-args: {agent_args}
    pools:
      - name: {WARM_LABEL}
        max-servers: {warm_nodes}
        boot-timeout: 60
        labels:
          - name: {WARM_LABEL}
            backing-label: bench-vm
            max-parallel-jobs: {SLOTS_PER_WARM_NODE}
            grace-time: 86400
      - name: {COLD_LABEL}
        max-servers: 1
        boot-timeout: 60
        labels:
          - name: {COLD_LABEL}
            backing-label: bench-vm
            max-parallel-jobs: 1
            grace-time: {grace}
      - name: {REUSE_LABEL}
        max-servers: 1
        boot-timeout: 60
        labels:
          - name: {REUSE_LABEL}
            backing-label: bench-vm
            max-parallel-jobs: 1
            grace-time: 86400
",
        work = work_dir.display(),
        agent = agent.display(),
    )
}

// ---- the report ----------------------------------------------------------------------

/// A figure over this is an outlier whatever its kind.
const OUTLIER_MS: f64 = 5000.0;
/// A cold allocation over this many times the cold p50 is an outlier.
const COLD_OUTLIER_FACTOR: f64 = 10.0;

/// Every latency figure of the report, in the table's order, with its ratios to the
/// floor of the same run.
fn latencies(r: &Report) -> Vec<Latency> {
    let mut rows: Rows = vec![
        ("floor: KV get + create + CAS update".into(), r.floor.chain),
        ("  floor: KV get".into(), r.floor.get),
        ("  floor: KV create".into(), r.floor.create),
        ("  floor: KV CAS update".into(), r.floor.update),
    ];
    warm_rows(&mut rows, "plain: ", &r.warm);
    warm_rows(
        &mut rows,
        "plain, taking turns with production: ",
        &r.warm_before_production,
    );
    warm_rows(
        &mut rows,
        "plain, right after production: ",
        &r.warm_after_production,
    );
    load_rows(&mut rows, "plain: ", &r.throughput);
    rows.push((
        "plain: release to reusable (one slot)".into(),
        r.release_to_reusable,
    ));
    if let Some(l) = &r.launchers {
        load_rows(
            &mut rows,
            &format!("{} launchers: ", l.launchers),
            &l.throughput,
        );
    }
    if let Some(o) = &r.observability {
        warm_rows(&mut rows, "--http scraped: ", &o.observed.warm);
        load_rows(&mut rows, "--http scraped: ", &o.observed.throughput);
    }
    let c = &r.cold_and_release;
    rows.push(("cold allocation (local provider)".into(), c.cold_allocation));
    rows.push((
        format!("release after grace-time {}s, lateness", c.grace_time_secs),
        c.release_late,
    ));
    if let Some(s) = &r.scale {
        rows.push((
            format!("warm allocation at {} slots", s.slots),
            s.allocation,
        ));
    }
    let p = &r.production;
    warm_rows(&mut rows, "production: ", &p.warm);
    warm_rows(
        &mut rows,
        "production, taking turns with plain: ",
        &p.warm_taking_turns,
    );
    load_rows(&mut rows, "production: ", &p.throughput);
    rows.push((
        "production: release to reusable (one slot)".into(),
        p.release_to_reusable,
    ));
    if let Some(e) = &r.exec {
        rows.push((
            format!("exec: slotpool exec --label {} -- true", e.label),
            e.job,
        ));
        rows.push((
            "exec: slotpool exec --node N -- true".into(),
            e.exec_in_held_node,
        ));
        if let Some(ssh) = e.ssh {
            rows.push(("exec: ssh USER@HOST true (sshd drop-in)".into(), ssh));
        }
    }
    if let Some(n) = &r.isolation_none {
        warm_rows(&mut rows, "production bus, mode none: ", &n.warm);
        load_rows(&mut rows, "production bus, mode none: ", &n.throughput);
        rows.push((
            "production bus, mode none: release to reusable".into(),
            n.release_to_reusable,
        ));
    }
    let floor = &r.floor.chain;
    rows.into_iter()
        .map(|(figure, summary)| Latency {
            figure,
            p50_to_floor: summary.p50_ms / floor.p50_ms,
            p99_to_floor: summary.p99_ms / floor.p99_ms,
            summary,
        })
        .collect()
}

type Rows = Vec<(String, stats::Summary)>;

fn warm_rows(rows: &mut Rows, prefix: &str, w: &phases::Warm) {
    rows.push((
        format!("{prefix}warm allocation (sequential)"),
        w.allocation,
    ));
    rows.push((format!("  {prefix}release round trip"), w.release));
}

fn load_rows(rows: &mut Rows, prefix: &str, t: &Throughput) {
    rows.push((
        format!("{prefix}allocation under load ({} clients)", t.clients),
        t.allocation,
    ));
    rows.push((format!("  {prefix}release under load"), t.release));
}

/// Figures far out of line: any latency over [`OUTLIER_MS`], and cold allocations over
/// [`COLD_OUTLIER_FACTOR`] times the cold p50 (named by backing node and time, to find
/// in the kept logs).
fn outliers(r: &Report) -> Vec<String> {
    let c = &r.cold_and_release;
    let cold_p50 = c.cold_allocation.p50_ms;
    let mut out: Vec<String> = r
        .latencies
        .iter()
        .filter(|l| l.summary.max_ms > OUTLIER_MS && l.summary.count > 0)
        .filter(|l| !l.figure.starts_with("cold allocation"))
        .map(|l| format!("{}: max {:.0} ms", l.figure.trim(), l.summary.max_ms))
        .collect();
    out.extend(
        c.slowest
            .iter()
            .filter(|s| s.ms > OUTLIER_MS || s.ms > COLD_OUTLIER_FACTOR * cold_p50)
            .map(|s| {
                format!(
                    "cold allocation of {:.0} ms ({:.0}x the cold p50) on backing node {}, submitted at {} ms since the epoch",
                    s.ms,
                    s.ms / cold_p50,
                    s.backing_id,
                    s.submitted_at_ms
                )
            }),
    );
    out
}

/// The targets of the current round of work, decided on figures of this run: latencies
/// as ratios to its floor, throughput as ratios to its own one-launcher load.
/// The launcher's RSS (MB) and the time to its first request served (s, after a start or
/// a `kill -9`) that a fleet of `slots` may take: round one's targets up to 80,000 slots
/// (10,000 backing nodes of 8), the million-slot ones (125,000 of 8) from there.
fn scale_limits(slots: usize) -> (f64, f64) {
    if slots >= 1_000_000 {
        (600.0, 10.0)
    } else {
        (250.0, 5.0)
    }
}

fn targets(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    let mut add = |figure: &str, target: &str, value: String, met: bool| {
        t.push(Target {
            figure: figure.into(),
            target: target.into(),
            value,
            met,
        })
    };
    for c in &r.comparisons {
        let (what, throughput_at_least, warm_p50_at_most) = if c.against == PLAIN_BUS {
            ("auth + TLS / plain", 0.9, 1.1)
        } else {
            ("users / none", 0.25, 3.0)
        };
        add(
            &format!("{what}, throughput"),
            &format!(">= {throughput_at_least}x"),
            format!("{:.3}x", c.ratios.allocations_per_sec),
            c.ratios.allocations_per_sec >= throughput_at_least,
        );
        add(
            &format!("{what}, warm p50"),
            &format!("<= {warm_p50_at_most}x"),
            match &c.ratios.warm_p50_blocks {
                Some(b) => format!(
                    "{:.2}x (blocks {:.2}-{:.2}x)",
                    c.ratios.warm_p50, b.min, b.max
                ),
                None => format!("{:.2}x", c.ratios.warm_p50),
            },
            c.ratios.warm_p50 <= warm_p50_at_most,
        );
    }
    let reuse = &r.production.release_to_reusable;
    add(
        "release to reusable p50 (production)",
        "<= 100 ms",
        format!("{:.1} ms", reuse.p50_ms),
        reuse.p50_ms <= 100.0,
    );
    let floor = r.floor.chain.p50_ms;
    let w = &r.warm.allocation;
    add(
        "warm allocation p50 / floor p50",
        "<= 1.5x",
        format!("{:.2}x ({:.2} ms)", w.p50_ms / floor, w.p50_ms),
        w.p50_ms <= 1.5 * floor,
    );
    add(
        "warm allocation p99",
        "<= 10 ms",
        format!("{:.2} ms", w.p99_ms),
        w.p99_ms <= 10.0,
    );
    let cpu = r.throughput.cpu_ms_per_allocation;
    add(
        "CPU per allocation (all processes)",
        "<= 0.5 ms under load",
        format!("{cpu:.3} ms"),
        cpu <= 0.5,
    );
    if let Some(m) = &r.warm.messages {
        add(
            "NATS messages per allocation",
            "<= 9 in, <= 14 out",
            format!("{:.1} in, {:.1} out", m.in_msgs, m.out_msgs),
            m.in_msgs <= 9.0 && m.out_msgs <= 14.0,
        );
    }
    let c = &r.cold_and_release;
    // No cold allocation (`--quick`, `--cold 0`): nothing to hold to these targets.
    if c.cold_allocation.count > 0 {
        add(
            &format!("cold allocation p99 (of {})", c.cold_allocation.count),
            "<= 1 s",
            format!("{:.0} ms", c.cold_allocation.p99_ms),
            c.cold_allocation.p99_ms <= 1000.0,
        );
        add(
            "release after grace-time",
            "p99 <= 1 s late, never early",
            format!(
                "p99 {:.0} ms late, {} early",
                c.release_late.p99_ms, c.early
            ),
            c.release_late.p99_ms <= 1000.0 && c.early == 0,
        );
    }
    if let Some(l) = &r.launchers {
        add(
            &format!("{} launchers / one, throughput", l.launchers),
            ">= 0.9x",
            format!(
                "{:.2}x ({:.0}/s)",
                l.allocations_per_sec_ratio, l.throughput.allocations_per_sec
            ),
            l.allocations_per_sec_ratio >= 0.9,
        );
    }
    if let Some(s) = &r.scale {
        let (rss_mb, serve_secs) = scale_limits(s.slots);
        add(
            "scale: launcher RSS",
            &format!("<= {rss_mb:.0} MB"),
            format!("{:.0} MB", s.idle.rss_mb),
            s.idle.rss_mb <= rss_mb,
        );
        let restart = s
            .start_to_first_served_secs
            .max(s.restart_after_kill_to_first_served_secs);
        add(
            "scale: start to first served",
            &format!("<= {serve_secs:.0} s"),
            format!("{restart:.2} s"),
            restart <= serve_secs,
        );
        add(
            "scale: warm allocation p99",
            "<= 20 ms",
            format!("{:.2} ms", s.allocation.p99_ms),
            s.allocation.p99_ms <= 20.0,
        );
    }
    if let Some(s) = &r.soak {
        add(
            "launcher RSS after the soak",
            "<= 100 MB",
            format!("{:.1} MB after {}", s.rss_end_mb(), s.allocations),
            s.rss_end_mb() <= 100.0,
        );
    }
    let a = &r.agent.idle;
    add(
        "agent idle",
        "RSS <= 15 MB, CPU <= 0.5 %",
        format!("{:.1} MB, {:.2} %", a.rss_mb, a.cpu_percent),
        a.rss_mb <= 15.0 && a.cpu_percent <= 0.5,
    );
    t
}

fn print_table(r: &Report) {
    let m = &r.machine;
    println!(
        "slotpool-bench, {} — {} CPU(s) {}, {} MB, nats-server {}, load {:.1} → {:.1}{}",
        r.date,
        m.cpus,
        m.cpu_model,
        m.mem_total_mb,
        m.nats_server,
        m.load_at_start,
        m.load_at_end,
        if r.settings.smoke {
            " (SMOKE: figures mean nothing)"
        } else {
            ""
        }
    );
    println!();
    let p = &r.production;
    println!(
        "PRODUCTION ({}; agents in mode {}): warm allocation p50 {:.2} ms, p99 {:.2} ms",
        p.bus, p.isolation, p.warm.allocation.p50_ms, p.warm.allocation.p99_ms
    );
    print_throughput("production: throughput", &p.throughput);
    print_throughput(
        "plain bus, before production's loads (its agents warm): throughput",
        &r.throughput_before_production,
    );
    print_throughput(
        "plain bus, right after production's loads: throughput",
        &r.throughput_after_production,
    );
    println!(
        "warm allocation p50 taking turns ({} blocks each): production {:.2} ms, plain bus {:.2} ms; plain bus right after production's loads {:.2} ms (alone, first: {:.2} ms)",
        phases::TURNS,
        p.warm_taking_turns.allocation.p50_ms,
        r.warm_before_production.allocation.p50_ms,
        r.warm_after_production.allocation.p50_ms,
        r.warm.allocation.p50_ms
    );
    println!(
        "production: release to reusable (a one-slot node released and asked for again) p50 {:.1} ms, p99 {:.1} ms",
        p.release_to_reusable.p50_ms, p.release_to_reusable.p99_ms
    );
    for c in &r.comparisons {
        print_ratios(&format!("production against {}", c.against), &c.ratios);
    }
    if let Some(e) = &r.exec {
        exec_job::print(e);
    }
    println!();
    println!(
        "{:<48} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "latency (ms)", "n", "p50", "p90", "p99", "max", "p50/floor", "p99/floor"
    );
    for l in &r.latencies {
        let s = &l.summary;
        println!(
            "{:<48} {:>6} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8.2}x {:>8.2}x",
            l.figure,
            s.count,
            s.p50_ms,
            s.p90_ms,
            s.p99_ms,
            s.max_ms,
            l.p50_to_floor,
            l.p99_to_floor
        );
    }
    println!();
    if let Some(m) = &r.warm.messages {
        print_messages("warm allocations", m);
    }
    print_throughput("throughput", &r.throughput);
    if let Some(l) = &r.launchers {
        print_throughput(
            &format!("throughput, {} launchers", l.launchers),
            &l.throughput,
        );
        println!(
            "{} launchers against one: allocations/s {:.2}x, CPU per allocation {:.2}x",
            l.launchers, l.allocations_per_sec_ratio, l.cpu_ratio
        );
    }
    if let Some(o) = &r.observability {
        print_throughput(&format!("throughput, {}", o.with), &o.observed.throughput);
        print_ratios(&format!("{} against off", o.with), &o.ratios);
        println!(
            "  {} scrapes of {} bytes, {} failed",
            o.observed.scrapes.scrapes, o.observed.scrapes.bytes, o.observed.scrapes.failures
        );
    }
    if let Some(n) = &r.isolation_none {
        print_throughput(
            "production bus, agents in mode none: throughput",
            &n.throughput,
        );
    }
    let c = &r.cold_and_release;
    println!(
        "release after grace-time: {} early; {} distinct backing nodes launched",
        c.early, c.distinct_backing_nodes
    );
    if let Some(s) = &r.soak {
        soak::print(s);
    }
    print_usage_and_targets(r);
}

fn print_ratios(name: &str, r: &Ratios) {
    println!(
        "{name}: warm p50 {:.2}x, warm p99 {:.2}x, allocations/s {:.2}x, CPU per allocation {:.2}x",
        r.warm_p50, r.warm_p99, r.allocations_per_sec, r.cpu_ms_per_allocation
    );
    if let Some(b) = &r.warm_p50_blocks {
        println!(
            "  warm p50 per pair of blocks taking turns: {:.2}x to {:.2}x, median {:.2}x ({} pairs)",
            b.min, b.max, b.median, b.pairs
        );
    }
}

fn print_messages(name: &str, m: &scrape::Messages) {
    println!(
        "NATS messages per allocation and release, {name}: {:.1} in, {:.1} out; {:.0} B in, {:.0} B out (/varz, over {})",
        m.in_msgs, m.out_msgs, m.in_bytes, m.out_bytes, m.allocations
    );
}

/// The throughput figure, the CPU each role spent per allocation, the messages, and the
/// steal.
fn print_throughput(name: &str, t: &Throughput) {
    println!(
        "{name}: {:.0} allocations/s ({} in {:.1} s, {} clients)",
        t.allocations_per_sec, t.allocations, t.seconds, t.clients
    );
    let cpu: Vec<String> = t
        .cpu
        .iter()
        .map(|c| {
            format!(
                "{} {:.3} ms ({:.0} % of a core{})",
                c.role,
                c.ms_per_allocation,
                c.cpu_percent,
                if c.processes > 1 {
                    format!(", {} processes", c.processes)
                } else {
                    String::new()
                }
            )
        })
        .collect();
    println!(
        "  CPU per allocation and release: {:.3} ms in all: {}",
        t.cpu_ms_per_allocation,
        cpu.join("; ")
    );
    if let Some(m) = &t.messages {
        print_messages("under that load", m);
    }
    if let Some(stolen) = t.stolen_percent {
        println!(
            "  CPU time the host took from this machine during that load (steal): {stolen:.1} %"
        );
    }
}

fn print_usage_and_targets(r: &Report) {
    println!(
        "launcher after load, idle: RSS {:.1} MB, CPU {:.2} %",
        r.launcher_idle.rss_mb, r.launcher_idle.cpu_percent
    );
    println!(
        "agent (8 slots), idle: RSS {:.1} MB, CPU {:.2} %",
        r.agent.idle.rss_mb, r.agent.idle.cpu_percent
    );
    if let Some(s) = &r.scale {
        println!(
            "scale, {} backing nodes x {} slots (heartbeat every {} ms): launcher RSS {:.1} MB, idle CPU {:.1} %, {:.0} lease writes/s",
            s.backing_nodes,
            s.slots / s.backing_nodes.max(1),
            s.heartbeat_interval_ms,
            s.idle.rss_mb,
            s.idle.cpu_percent,
            s.idle_lease_writes_per_sec
        );
        println!(
            "scale: start to first served {:.2} s; restart after kill -9 to first served {:.2} s",
            s.start_to_first_served_secs, s.restart_after_kill_to_first_served_secs
        );
    }
    for outlier in &r.outliers {
        println!("outlier: {outlier}");
    }
    println!();
    println!("{:<36} {:<30} {:<28} target", "figure", "wanted", "got");
    for t in &r.targets {
        println!(
            "{:<36} {:<30} {:<28} {}",
            t.figure,
            t.target,
            t.value,
            if t.met { "met" } else { "MISSED" }
        );
    }
}

fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default()
}

fn mem_total_mb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next().and_then(|v| v.parse().ok()))
        })
        .map_or(0, |kb: u64| kb / 1024)
}

fn nats_version(binary: &Path) -> String {
    std::process::Command::new(binary)
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .trim_start_matches("nats-server: ")
                .to_string()
        })
        .unwrap_or_default()
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
