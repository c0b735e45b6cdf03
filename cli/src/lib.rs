//! The `slotpool` command line: argument types and dispatch. Each subcommand lives in its
//! own module; this one only wires them up.

mod client_cmds;
mod complete;
mod demo;
mod exec_cmd;
mod nats_setup;
mod operator_cmds;
mod output;
pub mod pki;
mod provider_check;
mod serve;
mod simulate;
mod terminal_text;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use slotpool_protocol::model::OperatorAction;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "slotpool",
    version,
    about = "Slots carved out of backing nodes, for CI jobs",
    after_help = "Examples:
  slotpool demo                                  a whole pool on this machine
  slotpool config validate /etc/slotpool/pool.yaml
  slotpool --creds ci.creds request --label small --wait
  slotpool --creds ops.creds list backing
  slotpool --creds ops.creds drain bn-01J... --reason \"kernel update\"
  slotpool completions bash > ~/.local/share/bash-completion/completions/slotpool

The NATS options apply to every command; each also reads an environment variable
(SLOTPOOL_NATS_URL, SLOTPOOL_NATS_CREDS, ...), shown with `slotpool <command> --help`."
)]
pub struct Cli {
    #[command(flatten, next_help_heading = "NATS options")]
    pub nats: NatsClientArgs,
    /// Log filter (tracing env-filter syntax), e.g. `info` or `slotpool_launcher=debug`.
    /// Default: `info` for `serve` and `demo`, `warn` for the commands that print results
    /// (their stderr stays quiet unless something is wrong).
    #[arg(
        long,
        global = true,
        env = "SLOTPOOL_LOG",
        help_heading = "Global options"
    )]
    pub log: Option<String>,
    /// Log format: `text`, or `json` (one object a line, with the fields of the request,
    /// node and backing node spans) for a log system.
    #[arg(
        long,
        global = true,
        env = "SLOTPOOL_LOG_FORMAT",
        default_value = "text",
        help_heading = "Global options"
    )]
    pub log_format: LogFormat,
    /// Threads of the async runtime (default: one per CPU). On a small machine shared
    /// with nats-server, 1 can serve more requests per CPU second.
    #[arg(long, global = true, env = "SLOTPOOL_WORKER_THREADS", help_heading = "Global options", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
    #[command(subcommand)]
    pub command: Command,
}

pub use slotpool_config::bus::NatsClientArgs;
use slotpool_protocol::logging::LogFormat;

#[derive(Debug, Clone, Copy, Default, ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the launcher daemon.
    Serve(serve::ServeArgs),
    /// Ask for nodes.
    #[command(after_help = "Examples:
  slotpool request --label small --wait
  slotpool request --label small --count 2 --label big --timeout 600 --wait --output json")]
    Request(client_cmds::RequestArgs),
    /// Run a command in a node: request one held only while it runs (or use one you
    /// hold), stream its output, release it, and exit with the command's status, or
    /// with one of slotpool's own (201-205) when the infrastructure failed.
    #[command(after_help = "Examples:
  slotpool exec --label small -- make test
  slotpool exec --label small --timeout 10m --env CI=1 -- sh -c 'cargo test 2>&1'
  slotpool exec --node node-bn-01J...-s2 -- ls -l")]
    Exec(exec_cmd::ExecArgs),
    /// Return nodes to the pool. With --reason, as an operator: the release is recorded
    /// in the event log with who and why.
    Release {
        #[arg(required = true, add = complete::node())]
        nodes: Vec<String>,
        /// Why (makes this an operator's release, recorded in the event log).
        #[arg(long)]
        reason: Option<String>,
        /// Wait until the slots are wiped and free (a release is acknowledged as soon as
        /// it is recorded; the wipe follows in the background).
        #[arg(long)]
        wait: bool,
        #[arg(long, value_enum, default_value_t)]
        output: Output,
    },
    /// Operator: no new slots on a backing node, and never release it automatically.
    #[command(after_help = "Example:
  slotpool hold bn-01J... --reason \"disk check\"   (undo with `slotpool run bn-01J...`)")]
    Hold(operator_cmds::OrderArgs),
    /// Operator: no new slots; release the backing node as soon as it is empty.
    Drain(operator_cmds::OrderArgs),
    /// Operator: undo hold or drain.
    Run(operator_cmds::OrderArgs),
    /// Operator: terminate a backing node now; its nodes fail with the reason.
    Kill(operator_cmds::OrderArgs),
    /// Operator: who is in a slot now: its user's processes and open SSH logins, as the
    /// slot's agent counts them.
    #[command(after_help = "Examples:
  slotpool occupants bn-01J... 2
  slotpool occupants bn-01J... 2 --output json")]
    Occupants(operator_cmds::OccupantsArgs),
    /// Operator: revoke every credential of a client, an operator or a static host's
    /// agent issued until now; the NATS server refuses them and closes their connections.
    /// Mint a new one (`slotpool nats-setup mint`) to let the user back in.
    #[command(after_help = "Example:
  slotpool revoke --role operator --name bob --reason \"left the team\"")]
    Revoke(operator_cmds::RevokeArgs),
    /// Operator: the newest lines of a backing node's agent log, asked through a launcher.
    #[command(after_help = "Example:
  slotpool logs bn-01J... --lines 50")]
    Logs(operator_cmds::LogsArgs),
    /// Print the HTTP API token of the bus credentials given with --creds: `slotpool serve
    /// --http` shows its bearer what the bus shows that user.
    #[command(after_help = "Example:
  slotpool http-token --creds /etc/slotpool/nats/creds/client-ci.creds --out ci.token
  curl -H \"Authorization: Bearer $(cat ci.token)\" http://127.0.0.1:9464/api/v1/requests")]
    HttpToken {
        /// Write it to this file (mode 0600) instead of standard output.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Cancel a waiting request.
    Cancel {
        #[arg(add = complete::request())]
        request: String,
        #[arg(long, value_enum, default_value_t)]
        output: Output,
    },
    /// List nodes, backing nodes, requests, recent events or providers' last errors.
    #[command(after_help = "Examples:
  slotpool list                                     the nodes in use
  slotpool list backing --pool main --state ready
  slotpool list requests --label small              waiting or holding nodes now
  slotpool list requests --finished --limit 20      the newest 20, finished ones too
  slotpool list events --limit 20
  slotpool list providers")]
    List {
        /// What to list (default: nodes, the slots in use).
        #[arg(value_enum, default_value_t)]
        what: client_cmds::ListWhat,
        #[command(flatten)]
        filter: client_cmds::ListFilter,
        #[arg(long, value_enum, default_value_t)]
        output: Output,
    },
    /// Write a new installation's nats-server configuration (authentication on) and the
    /// credentials of its launchers, operators, clients and static agents.
    NatsSetup(nats_setup::NatsSetupArgs),
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Provider tools.
    Provider {
        #[command(subcommand)]
        command: ProviderCommand,
    },
    /// Run everything locally: a NATS server, a launcher, local agents and some load.
    #[command(after_help = "Examples:
  slotpool demo                            with the console on a terminal, until you quit it
  slotpool demo --no-console --duration 60 --jobs 10")]
    Demo(demo::DemoArgs),
    /// Replay a day of jobs through the launcher's decisions, with a simulated clock and
    /// provider, and report what it cost and how long jobs waited.
    #[command(after_help = "Examples:
  slotpool simulate examples/traces/day-peak6.csv
  slotpool simulate --generate 20 --seed 3 --compare --svg day.svg
  slotpool simulate generate --peak 2 --seed 1 > day.csv
  slotpool simulate my-history.jsonl --config /etc/slotpool/pool.yaml --output json")]
    Simulate(simulate::SimulateArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell). It asks
    /// `slotpool` as you type, which completes live backing nodes, nodes, requests and
    /// labels from the bus the environment points at (SLOTPOOL_NATS_URL, ...).
    #[command(after_help = "Examples:
  slotpool completions bash > ~/.local/share/bash-completion/completions/slotpool
  slotpool completions zsh > ~/.zfunc/_slotpool
The packages install them for bash, zsh and fish.")]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the manual pages (slotpool.1 and one per command) into a directory.
    #[command(after_help = "Example:
  slotpool man ~/.local/share/man/man1 && man slotpool-request
The packages install them.")]
    Man {
        /// Where to write them.
        dir: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum ProviderCommand {
    /// Drive an exec provider's create, list and delete as the launcher does and say
    /// what breaks the contract (docs/providers.md). It creates a real machine and
    /// deletes what it made.
    #[command(after_help = "Examples:
  slotpool provider check --backing-label large-node -- \\
      slotpool-provider-ec2 --config /etc/slotpool/ec2.yaml
  slotpool provider check --backing-label vm -- /usr/local/bin/pool-vm")]
    Check(provider_check::CheckArgs),
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a launcher config file without starting anything.
    #[command(after_help = "Example:
  slotpool config validate /etc/slotpool/pool.yaml")]
    Validate { file: PathBuf },
}

/// The exit statuses of `slotpool`, written once: the code returns these, and every
/// `--help` and manual page lists them.
pub mod exit {
    /// A request waited for (`request --wait`) ended without nodes: failed, canceled or
    /// reclaimed.
    pub const REQUEST_ENDED: u8 = 2;
    /// `release`: some nodes were not found (already released?).
    pub const NOT_FOUND: u8 = 3;
    /// Stopped by a second interrupt; `exec`: stopped by Ctrl-C or SIGTERM.
    pub const INTERRUPTED: u8 = 130;
    /// `exec`: the command ran past its `--timeout` and was killed (as timeout(1)).
    pub const EXEC_TIMED_OUT: u8 = 124;
    /// `exec`: no node in time (the request failed, timed out or was canceled).
    pub const EXEC_NO_NODE: u8 = 201;
    /// `exec`: the node was lost while the command ran (failed, reclaimed, released).
    pub const EXEC_NODE_LOST: u8 = 202;
    /// `exec`: the node's agent did not answer.
    pub const EXEC_AGENT_GONE: u8 = 203;
    /// `exec`: not authorised: the node is not this client's, or does not exist.
    pub const EXEC_NOT_AUTHORISED: u8 = 204;
    /// `exec`: the bus or the launchers could not be reached.
    pub const EXEC_BUS: u8 = 205;

    /// Every status and its meaning.
    pub const ALL: [(u8, &str); 11] = [
        (0, "success"),
        (1, "an error (the message on stderr says which), or a kill not confirmed"),
        (
            REQUEST_ENDED,
            "a usage error; or the request `request --wait` waited for failed, was canceled or reclaimed",
        ),
        (NOT_FOUND, "`release`: some nodes were not found (already released?)"),
        (INTERRUPTED, "stopped by a second Ctrl-C; `exec`: stopped by Ctrl-C or SIGTERM"),
        (
            EXEC_TIMED_OUT,
            "`exec`: the command ran past --timeout and was killed",
        ),
        (
            EXEC_NO_NODE,
            "`exec`: no node in time (the request failed, timed out or was canceled)",
        ),
        (
            EXEC_NODE_LOST,
            "`exec`: the node was lost while the command ran",
        ),
        (EXEC_AGENT_GONE, "`exec`: the node's agent did not answer"),
        (
            EXEC_NOT_AUTHORISED,
            "`exec`: not authorised: the node is not this client's or does not exist",
        ),
        (
            EXEC_BUS,
            "`exec`: the bus or the launchers could not be reached",
        ),
    ];
}

/// The command tree as `slotpool` runs it: [`Cli`]'s, with the exit statuses at the end
/// of every command's help.
pub fn command() -> clap::Command {
    fn with_exit(cmd: clap::Command) -> clap::Command {
        let mut text = String::from("Exit status:");
        for (code, meaning) in exit::ALL {
            text.push_str(&format!("\n  {code:<4} {meaning}"));
        }
        let help = match cmd.get_after_help() {
            Some(before) => format!("{before}\n\n{text}"),
            None => text,
        };
        cmd.after_help(help).mut_subcommands(with_exit)
    }
    with_exit(Cli::command())
}

/// Whether the command is a long-running one whose log is its output (`serve`, `demo`),
/// rather than one that prints a result and exits.
pub fn is_daemon(cli: &Cli) -> bool {
    matches!(cli.command, Command::Serve(_) | Command::Demo(_))
}

pub fn init_tracing(cli: &Cli) {
    let default = if is_daemon(cli) { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_new(cli.log.as_deref().unwrap_or(default))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // The demo's log goes to a file while its console shows: no colour escapes there.
    let colour = std::io::stderr().is_terminal() && !matches!(cli.command, Command::Demo(_));
    slotpool_protocol::logging::init(cli.log_format, filter, std::io::stderr, colour);
}

pub async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => serve::serve(&cli.nats, args).await,
        Command::Request(args) => client_cmds::request(&cli.nats, args).await,
        Command::Exec(args) => exec_cmd::exec(&cli.nats, args).await,
        Command::Release {
            nodes,
            reason,
            wait,
            output,
        } => client_cmds::release(&cli.nats, nodes, reason, wait, output).await,
        Command::Hold(args) => operator_cmds::order(&cli.nats, OperatorAction::Hold, args).await,
        Command::Drain(args) => operator_cmds::order(&cli.nats, OperatorAction::Drain, args).await,
        Command::Run(args) => operator_cmds::order(&cli.nats, OperatorAction::Run, args).await,
        Command::Kill(args) => operator_cmds::order(&cli.nats, OperatorAction::Kill, args).await,
        Command::Occupants(args) => operator_cmds::occupants(&cli.nats, args).await,
        Command::Logs(args) => operator_cmds::logs(&cli.nats, args).await,
        Command::Revoke(args) => operator_cmds::revoke(&cli.nats, args).await,
        Command::HttpToken { out } => http_token(&cli.nats, out.as_deref()),
        Command::Cancel { request, output } => {
            client_cmds::cancel(&cli.nats, &request, output).await
        }
        Command::List {
            what,
            filter,
            output,
        } => client_cmds::list(&cli.nats, what, filter, output).await,
        Command::Provider {
            command: ProviderCommand::Check(args),
        } => provider_check::run(args).await,
        Command::Config {
            command: ConfigCommand::Validate { file },
        } => {
            let config = slotpool_config::Config::load(&file)?;
            let labels = config.label_names().join(", ");
            println!(
                "{}: ok ({} provider(s); labels: {labels})",
                file.display(),
                config.providers.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => demo::run_demo(args, &cli.nats).await,
        Command::Completions { shell } => {
            complete::write_script(shell, &mut std::io::stdout())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Man { dir } => {
            write_man_pages(&dir)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::NatsSetup(args) => nats_setup::run(args),
        Command::Simulate(args) => simulate::run(args),
    }
}

/// Writes `slotpool.1` and `slotpool-<command>.1` for each command into `dir`, each with
/// EXIT STATUS, ENVIRONMENT and SEE ALSO sections.
fn write_man_pages(dir: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // `help` has no page of its own (every page is the help): no page names one.
    let mut cmd = Cli::command().disable_help_subcommand(true);
    // Building names every command for its page: `slotpool-config-validate`.
    cmd.build();
    let mut pages = vec![cmd];
    while let Some(page) = pages.pop() {
        pages.extend(
            page.get_subcommands()
                .filter(|c| c.get_name() != "help")
                .cloned(),
        );
        let name = page
            .get_display_name()
            .unwrap_or_else(|| page.get_name())
            .to_string();
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        let extra = man_sections(&page, &name);
        clap_mangen::Man::new(page)
            .render(&mut out)
            .with_context(|| format!("rendering {}", path.display()))?;
        out.extend_from_slice(extra.as_bytes());
        std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The roff of a page's EXIT STATUS, ENVIRONMENT (the variables its options read, its
/// parents' included) and SEE ALSO sections.
fn man_sections(page: &clap::Command, name: &str) -> String {
    let escape = |s: &str| s.replace('\\', "\\\\").replace('-', "\\-");
    let mut out = String::from(".SH \"EXIT STATUS\"\n");
    for (code, meaning) in exit::ALL {
        out.push_str(&format!(".TP\n{code}\n{}\n", escape(meaning)));
    }
    let mut vars: Vec<(String, String)> = page
        .get_arguments()
        .filter_map(|a| {
            let var = a.get_env()?.to_string_lossy().to_string();
            let flag = a.get_long().map(|l| format!("\\-\\-{}", escape(l)))?;
            Some((var, flag))
        })
        .collect();
    vars.sort();
    vars.dedup();
    if !vars.is_empty() {
        out.push_str(".SH ENVIRONMENT\n");
        for (var, flag) in vars {
            out.push_str(&format!(".TP\n\\fB{}\\fR\nas {flag}\n", escape(&var)));
        }
    }
    out.push_str(".SH \"SEE ALSO\"\n");
    let mut see: Vec<String> = Vec::new();
    if name != "slotpool" {
        see.push("\\fBslotpool\\fR(1)".into());
    }
    see.extend(
        page.get_subcommands()
            .map(|c| format!("\\fB{}\\-{}\\fR(1)", escape(name), escape(c.get_name()))),
    );
    if !see.is_empty() {
        out.push_str(&see.join(", "));
        out.push_str("\n.PP\n");
    }
    out.push_str("slotpool\\-console \\-\\-help; the guides in slotpool's docs/: cli.md, configuration.md, operations.md, protocol.md.\n");
    out
}

/// The `slotpool-agent` binary next to the running executable.
pub fn sibling_agent_binary() -> PathBuf {
    sibling_binary("slotpool-agent")
}

pub use slotpool_local_run::sibling_binary;

/// How long `slotpool serve` may take to stop after SIGTERM or Ctrl-C before it exits
/// anyway.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Takes SIGINT and SIGTERM on a thread of its own, so that they are heard even when
/// every worker of the runtime is busy (a task that never yields): the first cancels
/// `shutdown`, and if the process is still there [`STOP_GRACE`] later, or at a second
/// signal, it exits at once (status 1).
pub fn stop_on_signals(shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    use anyhow::Context;
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("taking SIGINT and SIGTERM")?;
    std::thread::Builder::new()
        .name("stop-signals".into())
        .spawn(move || {
            let mut signals = signals.forever();
            if signals.next().is_none() {
                return;
            }
            shutdown.cancel();
            std::thread::spawn(|| {
                std::thread::sleep(STOP_GRACE);
                eprintln!(
                    "still stopping after {}s: exiting now",
                    STOP_GRACE.as_secs()
                );
                std::process::exit(1);
            });
            if signals.next().is_some() {
                eprintln!("second stop signal: exiting now");
                std::process::exit(1);
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// Resolves on the first Ctrl-C or SIGTERM; a second Ctrl-C exits at once.
pub async fn stop_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("signal handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("second interrupt: exiting now");
            std::process::exit(i32::from(exit::INTERRUPTED));
        }
    });
}

/// `slotpool http-token`: the HTTP token of the credentials of `--creds`.
fn http_token(nats: &NatsClientArgs, out: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let path = nats
        .bus
        .creds
        .as_deref()
        .context("give the credentials to derive the token from with --creds FILE")?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let token = slotpool_protocol::auth::http_token::http_token(
        &slotpool_protocol::auth::Credentials::from_text(text),
    )
    .with_context(|| format!("{}", path.display()))?;
    match out {
        Some(out) => {
            slotpool_protocol::auth::write_private(out, format!("{token}\n").as_bytes())?;
            eprintln!("{}: HTTP token (secret, 0600)", out.display());
        }
        None => println!("{token}"),
    }
    Ok(ExitCode::SUCCESS)
}
