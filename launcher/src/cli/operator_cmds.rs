//! Operator subcommands: hold, drain, run and kill a backing node; release a node with a
//! reason. Each goes to the launchers' admin API and is recorded in the event log.

use super::output::state;
use super::{NatsArgs, Output};
use anyhow::{bail, Context};
use clap::Args;
use slotpool_protocol::client::Client;
use slotpool_protocol::model::OperatorAction;
use slotpool_protocol::{BackingId, NodeId};
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct OrderArgs {
    /// The backing node (`bn-...`, see `slotpool list backing`).
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

async fn connect(nats: &NatsArgs) -> anyhow::Result<Client> {
    Client::connect(&nats.options("slotpool-operator"))
        .await
        .with_context(|| format!("connecting to NATS at {}", nats.url))
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
    nats: &NatsArgs,
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
    let taken = client.order(action, id, local_actor(), args.reason).await?;
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

/// Releases nodes as an operator (with a reason, recorded in the event log).
pub async fn release_with_reason(
    client: &Client,
    ids: Vec<NodeId>,
    reason: String,
) -> anyhow::Result<slotpool_protocol::api::Released> {
    let actor = local_actor();
    let mut all = slotpool_protocol::api::Released::default();
    for id in ids {
        let r = client
            .release_node(id, actor.clone(), Some(reason.clone()))
            .await?;
        all.released.extend(r.released);
        all.not_found.extend(r.not_found);
    }
    Ok(all)
}

/// Who runs this command, `login@host`, sent with an order. Launchers record the
/// operator's bus user name instead (the one its credentials carry); this only fills the
/// message's `actor` field. The login comes from `USER` or `LOGNAME`, else from the
/// password database (under tmux, cron or `env -i` neither variable may be set).
fn local_actor() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(login_name)
        .unwrap_or_else(|| "unknown".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    }
}

/// This process's user name from the password database.
fn login_name() -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 4096];
    // SAFETY: zeroed passwd is a valid out-parameter for getpwuid_r.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives the use of `pwd`'s
    // string pointers below.
    let rc = unsafe {
        libc::getpwuid_r(
            libc::getuid(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: on success pw_name points at a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned()).filter(|n| !n.is_empty())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_login_name_comes_from_the_password_database() {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
        let expected = passwd
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == uid.to_string())
            .map(|f| f[0].to_string());
        assert_eq!(super::login_name(), expected);
    }
}
