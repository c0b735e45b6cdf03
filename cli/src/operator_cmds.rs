//! Operator subcommands: hold, drain, run and kill a backing node; release a node with a
//! reason. Each goes to the launchers' admin API and is recorded in the event log. And
//! `occupants`, who is in a slot, and `logs`, a backing node's agent log tail: questions,
//! recorded nowhere.

use super::output::{age, print_table, state, time};
use super::{NatsClientArgs, Output};
use anyhow::{bail, Context};
use clap::Args;
use slotpool_protocol::client::Client;
use slotpool_protocol::model::OperatorAction;
use slotpool_protocol::text::printable;
use slotpool_protocol::{BackingId, NodeId};
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct OrderArgs {
    /// The backing node (`bn-...`, see `slotpool list backing`).
    #[arg(add = super::complete::backing())]
    pub backing: String,
    /// Why (recorded with the order and shown to operators and requestors).
    #[arg(long)]
    pub reason: Option<String>,
    /// Do not ask for confirmation (kill only).
    #[arg(long, short = 'y')]
    pub yes: bool,
    #[arg(long, value_enum, default_value_t)]
    pub output: Output,
}

#[derive(Debug, Args)]
pub struct OccupantsArgs {
    /// The backing node (`bn-...`, see `slotpool list backing`).
    #[arg(add = super::complete::backing())]
    pub backing: String,
    /// The slot's number on that node (0, 1, ...; `slotpool list nodes` shows each
    /// node's).
    pub slot: u32,
    #[arg(long, value_enum, default_value_t)]
    pub output: Output,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The backing node (`bn-...`, see `slotpool list backing`).
    #[arg(add = super::complete::backing())]
    pub backing: String,
    /// How many of the newest lines (the agent keeps and sends at most 200).
    #[arg(long, short = 'n', default_value_t = 50)]
    pub lines: u32,
    #[arg(long, value_enum, default_value_t)]
    pub output: Output,
}

async fn connect(nats: &NatsClientArgs) -> anyhow::Result<Client> {
    Client::connect(&nats.options("slotpool-operator"))
        .await
        .with_context(|| format!("connecting to NATS at {}", nats.bus.url))
}

/// Asks on the terminal; refuses without a terminal (pass `--yes` in scripts).
fn confirm(question: &str) -> anyhow::Result<bool> {
    if !std::io::stdin().is_terminal() {
        bail!("{question}: not confirmed (no terminal to ask on); pass --yes");
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush().ok();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

pub async fn order(
    nats: &NatsClientArgs,
    action: OperatorAction,
    args: OrderArgs,
) -> anyhow::Result<ExitCode> {
    let id = BackingId::parse(&args.backing)?;
    if action == OperatorAction::Kill
        && !args.yes
        && !confirm(&format!("kill {id}? Its nodes fail and it is deleted now"))?
    {
        eprintln!("not killed");
        return Ok(ExitCode::from(1));
    }
    let client = connect(nats).await?;
    let taken = client.order(action, id, args.reason).await?;
    match args.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&taken)?),
        Output::Table => println!(
            "{} ({}, {}): {}",
            taken.backing_id,
            state(&taken.state),
            state(&taken.idle),
            taken.message
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints the newest lines of a backing node's agent log, oldest first. A line's control
/// characters are shown escaped, whatever the agent sent: a slot's tenant can put text
/// of its own into the agent's log.
pub async fn logs(nats: &NatsClientArgs, args: LogsArgs) -> anyhow::Result<ExitCode> {
    let id = BackingId::parse(&args.backing)?;
    let client = connect(nats).await?;
    let tail = client
        .log_tail(&id, args.lines)
        .await
        .with_context(|| format!("asking the agent of {id} for its log"))?;
    let lines: Vec<String> = tail
        .lines
        .iter()
        .map(|l| printable(l).into_owned())
        .collect();
    let mut out = std::io::stdout().lock();
    let written = match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&lines)?),
        Output::Table => lines.iter().try_for_each(|l| writeln!(out, "{l}")),
    };
    match written.and_then(|()| out.flush()) {
        // The reader had enough (`slotpool logs … | head`).
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        other => other.map(|()| ExitCode::SUCCESS).context("writing the log"),
    }
}

/// Releases nodes as an operator (with a reason, recorded in the event log).
pub async fn release_with_reason(
    client: &Client,
    ids: Vec<NodeId>,
    reason: String,
) -> anyhow::Result<slotpool_protocol::api::Released> {
    let mut all = slotpool_protocol::api::Released::default();
    for id in ids {
        let r = client.release_node(id, Some(reason.clone())).await?;
        all.released.extend(r.released);
        all.not_found.extend(r.not_found);
    }
    Ok(all)
}

/// `slotpool revoke`'s arguments.
#[derive(Debug, clap::Args)]
pub struct RevokeArgs {
    /// The role of the user whose credentials are revoked.
    #[arg(long, value_enum)]
    pub role: super::nats_setup::RoleArg,
    /// Its name (a static host's agent: its backing id).
    #[arg(long)]
    pub name: String,
    /// Why (recorded in the event log).
    #[arg(long)]
    pub reason: Option<String>,
}

/// Revokes every credential of one user issued until now: the launcher records it and
/// answers once the NATS server refuses them (and has closed their connections).
pub async fn revoke(nats: &NatsClientArgs, args: RevokeArgs) -> anyhow::Result<ExitCode> {
    let user = slotpool_protocol::auth::BusUser::new(args.role.into(), &args.name)?;
    let client = connect(nats).await?;
    let taken = client
        .revoke(&user, args.reason)
        .await
        .with_context(|| format!("revoking the credentials of {user}"))?;
    println!(
        "revoked every credential of {user} issued until {} (key {}); open connections closed",
        time(taken.revoked_at * 1000),
        taken.key
    );
    Ok(ExitCode::SUCCESS)
}

/// Who is in a slot: the launcher asks the backing node's agent, as the console's slot
/// pane does.
pub async fn occupants(nats: &NatsClientArgs, args: OccupantsArgs) -> anyhow::Result<ExitCode> {
    let id = BackingId::parse(&args.backing)?;
    let client = connect(nats).await?;
    let slot = args.slot;
    let occupants = client
        .slot_occupants(&id, slot)
        .await
        .with_context(|| format!("asking who is in slot {slot} of {id}"))?;
    match args.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&occupants)?),
        Output::Table => {
            let (processes, logins) = (occupants.processes, occupants.logins.len());
            println!(
                "slot {slot} of {id}: {processes} process{}, {logins} SSH login{}",
                if processes == 1 { "" } else { "es" },
                if logins == 1 { "" } else { "s" },
            );
            if logins > 0 {
                let rows: Vec<Vec<String>> = (occupants.logins.iter())
                    .map(|l| vec![l.user.clone(), l.from.clone(), time(l.since), age(l.since)])
                    .collect();
                println!();
                print_table(&["USER", "FROM", "SINCE", "AGE"], &rows);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
