//! `slotpool simulate`: replays a trace through the launcher's decisions (see the
//! library's `simulate` module) and prints what it cost and how long jobs waited.

use super::output::print_table;
use super::Output;
use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use slotpool_config::Config;
use slotpool_simulate::ledger::Report;
use slotpool_simulate::trace::{self, Diurnal, Job};
use slotpool_simulate::{self as simulate, Policy, Provider, Setup, Synthetic};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SimulateArgs {
    #[command(subcommand)]
    command: Option<SimulateCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum SimulateCommand {
    /// Write a synthetic diurnal day as a CSV trace on stdout.
    Generate(DayArgs),
}

#[derive(Debug, Args)]
struct DayArgs {
    /// Jobs a minute at the day's peak (noon; a tenth of it at midnight).
    #[arg(long, default_value_t = 6.0)]
    peak: f64,
    #[arg(long, default_value_t = 24.0)]
    hours: f64,
    /// Median job duration (lognormal).
    #[arg(long, default_value_t = 600.0)]
    median_job_secs: f64,
    /// Shape of the job durations' lognormal.
    #[arg(long, default_value_t = 0.8)]
    sigma: f64,
    /// The label every job asks for.
    #[arg(long, default_value = "small")]
    label: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    Slotpool,
    Nodepool,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The trace: CSV (`arrival_secs,labels,duration_secs`) or JSON lines.
    #[arg(required_unless_present = "generate", conflicts_with = "generate")]
    trace: Option<PathBuf>,
    /// Instead of a trace, the synthetic day with this peak in jobs a minute (the
    /// `generate` defaults, with --seed).
    #[arg(long, value_name = "PEAK")]
    generate: Option<f64>,
    /// The policy that decides.
    #[arg(long, value_enum, default_value = "slotpool")]
    policy: PolicyArg,
    /// Run both policies on the trace and report them side by side.
    #[arg(long, conflicts_with = "policy")]
    compare: bool,
    /// A pool configuration file to take the pools and labels from (as `serve` reads
    /// it; its providers are simulated). Without it: one pool serving every label of the
    /// trace with the options below.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Slots per backing node (without --config).
    #[arg(long, default_value_t = 8)]
    slots_per_node: u32,
    /// Several sizes of backing node for the planner to choose among, instead of
    /// --slots-per-node (without --config): SLOTS:COST-PER-HOUR, comma-separated, e.g.
    /// 2:0.10,4:0.19,8:0.36.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, conflicts_with = "slots_per_node")]
    sizes: Vec<(u32, f64)>,
    /// Grace time of an empty backing node (without --config).
    #[arg(long, default_value_t = 60)]
    grace_secs: u64,
    /// Backing nodes at most (without --config).
    #[arg(long, default_value_t = 1000)]
    max_servers: u32,
    /// Free slots of each label kept ready, with no job waiting for them (without
    /// --config; a configuration file's `min-ready` is honoured).
    #[arg(long, default_value_t = 0)]
    min_ready: u32,
    /// Keep ready, beyond --min-ready, the slots the arrivals of the last this many
    /// seconds say will arrive within --warm-lead-secs (without --config; a configuration
    /// file's `warm-window` is honoured).
    #[arg(long)]
    warm_window_secs: Option<u64>,
    /// With --warm-window-secs: how far ahead arrivals are kept ready for (a boot time).
    #[arg(long, default_value_t = 60, requires = "warm_window_secs")]
    warm_lead_secs: u64,
    /// Seconds from a launch to the agent's first heartbeat.
    #[arg(long, default_value_t = 60.0)]
    boot_secs: f64,
    /// Boot times are uniform in boot-secs ± this.
    #[arg(long, default_value_t = 0.0)]
    boot_jitter_secs: f64,
    /// Chance that a launch is refused for capacity (asked again after the back-off).
    #[arg(long, default_value_t = 0.0)]
    capacity_error_rate: f64,
    /// What one backing node costs an hour, when its size sets no cost-per-hour.
    #[arg(long, default_value_t = 1.0)]
    node_cost_per_hour: f64,
    /// The nodepool policy's cleanup interval.
    #[arg(long, default_value_t = 60)]
    cleanup_interval_secs: u64,
    /// Seed of the boot times, capacity errors and the generated day.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write a plot of slots paid vs busy over the day and the wait distribution here
    /// (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t)]
    output: Output,
}

/// One `--sizes` entry: `SLOTS:COST-PER-HOUR`.
fn parse_size(s: &str) -> Result<(u32, f64), String> {
    let (slots, cost) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected SLOTS:COST-PER-HOUR, e.g. 8:0.36"))?;
    let slots = slots
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: {slots:?} is not a whole number of slots"))?;
    let cost = cost
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: {cost:?} is not a cost per hour"))?;
    Ok((slots, cost))
}

impl DayArgs {
    fn day(&self) -> Diurnal {
        Diurnal {
            peak_per_min: self.peak,
            hours: self.hours,
            median_job_secs: self.median_job_secs,
            sigma: self.sigma,
            label: self.label.clone(),
            seed: self.seed,
        }
    }
}

pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    if let Some(SimulateCommand::Generate(day)) = args.command {
        anyhow::ensure!(
            day.peak >= 0.0 && day.hours > 0.0,
            "--peak and --hours must be positive"
        );
        print!("{}", trace::to_csv(&day.day().generate()));
        return Ok(ExitCode::SUCCESS);
    }
    let a = args.run;
    let jobs: Vec<Job> = match (&a.trace, a.generate) {
        (Some(path), _) => trace::load(path)?,
        (None, Some(peak)) => DayArgs {
            peak,
            hours: 24.0,
            median_job_secs: 600.0,
            sigma: 0.8,
            label: "small".into(),
            seed: a.seed,
        }
        .day()
        .generate(),
        (None, None) => anyhow::bail!("give a trace or --generate PEAK"),
    };
    let config = match &a.config {
        Some(path) => Config::load(path)?,
        None => Synthetic {
            slots_per_node: a.slots_per_node,
            sizes: a.sizes.clone(),
            grace_secs: a.grace_secs,
            max_servers: a.max_servers,
            min_ready: a.min_ready,
            warm: a.warm_window_secs.map(|w| (w, a.warm_lead_secs)),
        }
        .config(&jobs)
        .context("building the simulated pool")?,
    };
    let setup = Setup {
        config,
        provider: Provider {
            boot_secs: a.boot_secs,
            boot_jitter_secs: a.boot_jitter_secs,
            capacity_error_rate: a.capacity_error_rate,
            node_cost_per_hour: a.node_cost_per_hour,
        },
        cleanup_interval_ms: a.cleanup_interval_secs * 1000,
        seed: a.seed,
    };
    let policies = match (a.compare, a.policy) {
        (true, _) => vec![Policy::Slotpool, Policy::Nodepool],
        (false, PolicyArg::Slotpool) => vec![Policy::Slotpool],
        (false, PolicyArg::Nodepool) => vec![Policy::Nodepool],
    };
    let reports = policies
        .into_iter()
        .map(|p| simulate::run(&jobs, &setup, p))
        .collect::<Result<Vec<Report>, _>>()?;
    if let Some(path) = &a.svg {
        std::fs::write(path, simulate::svg::plot(&reports))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    match a.output {
        Output::Json if reports.len() == 1 => {
            println!("{}", serde_json::to_string_pretty(&reports[0])?)
        }
        Output::Json => println!("{}", serde_json::to_string_pretty(&reports)?),
        Output::Table => print_reports(&reports),
    }
    Ok(ExitCode::SUCCESS)
}

fn print_reports(reports: &[Report]) {
    let name = |r: &Report| match r.policy {
        Policy::Slotpool => "slotpool",
        Policy::Nodepool => "nodepool",
    };
    let mut header = vec!["".to_string()];
    header.extend(reports.iter().map(|r| name(r).to_string()));
    let row = |what: &str, f: &dyn Fn(&Report) -> String| {
        let mut r = vec![what.to_string()];
        r.extend(reports.iter().map(f));
        r
    };
    let rows = vec![
        row("jobs", &|r| format!("{} ({} unserved)", r.jobs, r.unserved)),
        row("paid slot-hours", &|r| format!("{:.1}", r.paid_slot_hours)),
        row("busy slot-hours", &|r| format!("{:.1}", r.busy_slot_hours)),
        row("efficiency", &|r| format!("{:.3}", r.efficiency)),
        row("cost", &|r| format!("{:.2}", r.cost)),
        row("backing nodes launched / released", &|r| {
            format!(
                "{} / {}",
                r.backing_nodes_launched, r.backing_nodes_released
            )
        }),
        row("launched by size", &|r| {
            r.sizes
                .iter()
                .map(|z| format!("{} x{}", z.backing_label, z.launched))
                .collect::<Vec<_>>()
                .join(", ")
        }),
        row("wait p50 / p99 / max (s)", &|r| {
            format!(
                "{:.0} / {:.0} / {:.0}",
                r.wait_p50_secs, r.wait_p99_secs, r.wait_max_secs
            )
        }),
    ];
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    print_table(&header, &rows);
    for r in reports {
        println!("\n{} by hour:", name(r));
        let rows: Vec<Vec<String>> = r
            .hours
            .iter()
            .map(|h| {
                vec![
                    h.hour.to_string(),
                    h.jobs.to_string(),
                    format!("{:.1}", h.paid_slot_hours),
                    format!("{:.1}", h.busy_slot_hours),
                    format!("{:.2}", h.efficiency),
                    format!("{:.0}", h.wait_p99_secs),
                    h.launched.to_string(),
                ]
            })
            .collect();
        print_table(
            &[
                "hour",
                "jobs",
                "paid",
                "busy",
                "efficiency",
                "wait p99 (s)",
                "launched",
            ],
            &rows,
        );
        let f = &r.fairness;
        if !f.tenants.is_empty() {
            println!(
                "\n{} by tenant (Jain's index over {} contended minutes: mean {:.3}, min {:.3}):",
                name(r),
                f.contended_windows,
                f.jain_mean.unwrap_or(1.0),
                f.jain_min.unwrap_or(1.0)
            );
            let rows: Vec<Vec<String>> = f
                .tenants
                .iter()
                .map(|t| {
                    vec![
                        t.tenant.clone(),
                        t.jobs.to_string(),
                        format!("{:.0}", t.wait_p50_secs),
                        format!("{:.0}", t.wait_p95_secs),
                    ]
                })
                .collect();
            print_table(&["tenant", "jobs", "wait p50 (s)", "wait p95 (s)"], &rows);
        }
    }
}
