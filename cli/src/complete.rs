//! Completions of live names: when the shell completes a backing node, a node, a request
//! or a label, `slotpool` is asked (`COMPLETE=<shell> slotpool -- …`, which the script of
//! `slotpool completions SHELL` sets up) and reads them from the bus, with the NATS options
//! of the environment (`SLOTPOOL_NATS_URL`, `SLOTPOOL_NATS_CREDS`, …: what the demo's env
//! file or a site's profile sets). A bus that does not answer within a second, or a
//! credential that may not read the buckets, completes nothing.

use clap::{FromArgMatches, Parser};
use clap_complete::engine::{ArgValueCompleter, CompletionCandidate};
use slotpool_protocol::client::Client;
use std::ffi::OsStr;
use std::time::Duration;

/// How long a completion may wait for the bus.
const ASK_LIMIT: Duration = Duration::from_secs(1);

/// The NATS options alone, read from the environment.
#[derive(Parser)]
struct FromEnv {
    #[command(flatten)]
    nats: super::NatsClientArgs,
}

/// Asks the bus with `list`, then keeps the names starting with what is typed.
fn names<F, Fut>(current: &OsStr, list: F) -> Vec<CompletionCandidate>
where
    F: FnOnce(Client) -> Fut,
    Fut: std::future::Future<Output = Vec<(String, String)>>,
{
    let typed = current.to_string_lossy().to_string();
    let Ok(matches) = FromEnv::command_for_env().try_get_matches_from(["slotpool"]) else {
        return Vec::new();
    };
    let Ok(args) = FromEnv::from_arg_matches(&matches) else {
        return Vec::new();
    };
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return Vec::new();
    };
    let found = runtime.block_on(async {
        let ask = async {
            let client = Client::connect(&args.nats.options("slotpool-complete"))
                .await
                .ok()?;
            Some(list(client).await)
        };
        tokio::time::timeout(ASK_LIMIT, ask).await.ok().flatten()
    });
    let mut found = found.unwrap_or_default();
    found.sort();
    found.dedup_by(|a, b| a.0 == b.0);
    found
        .into_iter()
        .filter(|(name, _)| name.starts_with(&typed))
        .map(|(name, help)| CompletionCandidate::new(name).help(Some(help.into())))
        .collect()
}

impl FromEnv {
    fn command_for_env() -> clap::Command {
        use clap::CommandFactory;
        FromEnv::command()
    }
}

/// Backing nodes: id, with label and state.
pub fn backing() -> ArgValueCompleter {
    ArgValueCompleter::new(|current: &OsStr| {
        names(current, |c: Client| async move {
            c.list_backing()
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|b| (b.id.to_string(), format!("{} {:?}", b.label, b.state)))
                .collect()
        })
    })
}

/// Nodes in use: id, with label and requestor.
pub fn node() -> ArgValueCompleter {
    ArgValueCompleter::new(|current: &OsStr| {
        names(current, |c: Client| async move {
            c.list_nodes()
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|n| (n.id.to_string(), format!("{} {}", n.label, n.requestor)))
                .collect()
        })
    })
}

/// Requests still waiting: id, with labels.
pub fn request() -> ArgValueCompleter {
    ArgValueCompleter::new(|current: &OsStr| {
        names(current, |c: Client| async move {
            c.list_requests()
                .await
                .unwrap_or_default()
                .into_iter()
                .filter(|r| !r.state.is_final())
                .map(|r| (r.id.to_string(), r.labels.join(",")))
                .collect()
        })
    })
}

/// Labels of the pool's backing nodes and requests.
pub fn label() -> ArgValueCompleter {
    ArgValueCompleter::new(|current: &OsStr| {
        names(current, |c: Client| async move {
            let mut labels: Vec<(String, String)> = c
                .list_backing()
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|b| (b.label, "label".to_string()))
                .collect();
            labels.extend(
                c.list_requests()
                    .await
                    .unwrap_or_default()
                    .into_iter()
                    .flat_map(|r| r.labels)
                    .map(|l| (l, "label".to_string())),
            );
            labels
        })
    })
}

/// Writes the script that has `shell` ask `slotpool` for completions.
pub fn write_script(
    shell: clap_complete::Shell,
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    let name = shell.to_string();
    let shells = clap_complete::env::Shells::builtins();
    let completer = shells
        .completer(&name)
        .ok_or_else(|| std::io::Error::other(format!("no completion script for {name}")))?;
    completer.write_registration("COMPLETE", "slotpool", "slotpool", "slotpool", out)
}
