//! `slotpool exec`: a job in one command. Requests a node held by a keep-alive tied to
//! this process (or uses one already held), runs the command in it through the execute
//! channel (docs/protocol.md, "Execute"), streams its output, releases the node and exits
//! with the command's status, or with one of slotpool's own statuses ([`super::exit`])
//! when the infrastructure failed, so CI can retry those and not the job's own failures.

use super::exit;
use super::terminal_text::{escape, TerminalText};
use super::NatsClientArgs;
use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use slotpool_protocol::api::{ApiError, ErrorCode};
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::exec::{
    output_of, ExecExit, ExecRequest, ExecStarted, IN_ACK, IN_SIGNAL, IN_STDIN, MAX_CHUNK_BYTES,
    OUT_EXIT, OUT_STDERR, OUT_STDIN_ACK, OUT_STDOUT, STDIN_WINDOW,
};
use slotpool_protocol::layout::subjects::{self, ApiOp};
use slotpool_protocol::model::RequestState;
use slotpool_protocol::{NodeId, PROTOCOL_VERSION};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The keep-alive of a node `exec` requested: it is reclaimed this long after the
/// process died without releasing it.
const KEEP_ALIVE_SECS: u64 = 30;
/// How long a stop (Ctrl-C, SIGTERM) waits for the command to end after SIGTERM before
/// it is killed; the node's release kills what is left anyway.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long the start of the command may take.
const START_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Label of the node to request (held only while this command runs).
    #[arg(long, required_unless_present = "node", conflicts_with = "node", add = super::complete::label())]
    pub label: Option<String>,
    /// How many nodes of the label; the command runs in the first, and finds all of
    /// them in `SLOTPOOL_NODES` (node ids) and `SLOTPOOL_HOSTS`, space-separated.
    #[arg(long, default_value_t = 1, requires = "label")]
    pub count: u32,
    /// Run in a node this client already holds (kept after the command).
    #[arg(long, add = super::complete::node())]
    pub node: Option<String>,
    /// An environment variable for the command; repeatable.
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Kill the command after this long (`90s`, `10m`, `1h`); it then exits 124.
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration)]
    pub timeout: Option<Duration>,
    /// How long to wait for a node before giving up (exit 201).
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration)]
    pub wait: Option<Duration>,
    /// Lower is served first.
    #[arg(long, requires = "label")]
    pub priority: Option<i32>,
    /// Who is asking (shown to operators).
    #[arg(long, env = "SLOTPOOL_REQUESTOR", default_value = "slotpool-exec")]
    pub requestor: String,
    /// Copy local file SRC to DST in the node (relative to its workspace) before the
    /// command runs; repeatable. Parent directories are made.
    #[arg(long, value_name = "SRC:DST", value_parser = parse_pair)]
    pub copy: Vec<(String, String)>,
    /// Fetch SRC in the node (relative to its workspace) to local file DST after the
    /// command ran, whether or not it succeeded; repeatable.
    #[arg(long, value_name = "SRC:DST", value_parser = parse_pair)]
    pub fetch: Vec<(String, String)>,
    /// Pass the command's output to a terminal as it is, escape sequences and all. By
    /// default, output going to a terminal keeps only text and colour, and shows other
    /// controls visibly (`^[`): the command may be anyone's. Output to a pipe or a file
    /// is always passed byte for byte.
    #[arg(long)]
    pub raw: bool,
    /// The command and its arguments (no shell unless you name one).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_string(), b.to_string())),
        _ => Err(format!("{s:?} is not SRC:DST")),
    }
}

/// Where a run's stdin comes from and its stdout goes, and which of stdout and stderr
/// are filtered for a terminal ([`TerminalText`]).
struct Streams {
    stdin: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
    stdout: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    stdout_filter: Option<TerminalText>,
    stderr_filter: Option<TerminalText>,
}

impl Streams {
    /// This process's own: filtered where they are terminals, unless `raw`.
    fn terminal(raw: bool) -> Streams {
        use std::io::IsTerminal;
        let filter = |is_terminal: bool| (is_terminal && !raw).then(TerminalText::default);
        Streams {
            stdin: Box::new(tokio::io::stdin()),
            stdout: Box::new(tokio::io::stdout()),
            stdout_filter: filter(std::io::stdout().is_terminal()),
            stderr_filter: filter(std::io::stderr().is_terminal()),
        }
    }

    /// Bytes moved between `stdin` and `stdout` as they are (a file copied in or out).
    fn bytes(
        stdin: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
        stdout: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    ) -> Streams {
        use std::io::IsTerminal;
        Streams {
            stdin,
            stdout,
            stdout_filter: None,
            stderr_filter: std::io::stderr().is_terminal().then(TerminalText::default),
        }
    }
}

/// A job: files to copy in, the command, files to fetch out (`SRC:DST` pairs), and
/// whether its output goes to a terminal unfiltered.
struct Job {
    command: Vec<String>,
    copies: Vec<(String, String)>,
    fetches: Vec<(String, String)>,
    raw: bool,
}

/// Copies in, runs the command, fetches out: the status to exit with.
async fn copy_run_fetch(
    client: &Client,
    node: &NodeId,
    job: Job,
    env: BTreeMap<String, String>,
    timeout: Option<Duration>,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<ExitCode, Infra> {
    let Job {
        command,
        copies,
        fetches,
        raw,
    } = job;
    for (src, dst) in copies {
        let file = tokio::fs::File::open(&src)
            .await
            .map_err(|e| infra(1, anyhow::anyhow!("--copy {src}: {e}")))?;
        let argv = slotpool_protocol::exec::copy_in_argv(&dst);
        let streams = Streams::bytes(Box::new(file), Box::new(tokio::io::sink()));
        let status = run_in(client, node, argv, env.clone(), None, streams, stop).await?;
        if status != 0 {
            eprintln!("slotpool exec: --copy {src}:{dst} failed with status {status}");
            return Ok(ExitCode::from(status));
        }
    }
    let mut status = run_in(
        client,
        node,
        command,
        env.clone(),
        timeout,
        Streams::terminal(raw),
        stop,
    )
    .await?;
    for (src, dst) in fetches {
        let file = tokio::fs::File::create(&dst)
            .await
            .map_err(|e| infra(1, anyhow::anyhow!("--fetch {dst}: {e}")))?;
        let streams = Streams::bytes(Box::new(tokio::io::empty()), Box::new(file));
        let argv = slotpool_protocol::exec::copy_out_argv(&src);
        let fetched = run_in(client, node, argv, env.clone(), None, streams, stop).await?;
        if fetched != 0 {
            eprintln!("slotpool exec: --fetch {src}:{dst} failed with status {fetched}");
            if status == 0 {
                status = fetched;
            }
        }
    }
    Ok(ExitCode::from(status))
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not K=V")),
    }
}

/// A failure of slotpool (not of the command), with the status that says which.
#[derive(Debug)]
struct Infra {
    status: u8,
    error: anyhow::Error,
}

fn infra(status: u8, error: impl Into<anyhow::Error>) -> Infra {
    Infra {
        status,
        error: error.into(),
    }
}

/// The status for a refused or failed bus call.
fn status_of(err: &BusError) -> u8 {
    match err {
        BusError::Api(ApiError { code, .. }) => match code {
            ErrorCode::Forbidden | ErrorCode::NotFound => exit::EXEC_NOT_AUTHORISED,
            ErrorCode::Ended => exit::EXEC_NODE_LOST,
            ErrorCode::Unavailable => exit::EXEC_AGENT_GONE,
            _ => exit::EXEC_BUS,
        },
        BusError::NotPermitted { .. } => exit::EXEC_NOT_AUTHORISED,
        _ => exit::EXEC_BUS,
    }
}

pub async fn exec(nats: &NatsClientArgs, args: ExecArgs) -> anyhow::Result<ExitCode> {
    match run(nats, args).await {
        Ok(code) => Ok(code),
        Err(Infra { status, error }) => {
            // The error may quote the node (the agent's words, a path the job named).
            eprintln!("slotpool exec: {}", escape(&format!("{error:#}")));
            Ok(ExitCode::from(status))
        }
    }
}

async fn run(nats: &NatsClientArgs, args: ExecArgs) -> Result<ExitCode, Infra> {
    let client = Client::connect(&nats.options("slotpool-exec"))
        .await
        .with_context(|| format!("connecting to NATS at {}", nats.bus.url))
        .map_err(|e| infra(exit::EXEC_BUS, e))?;
    let stop = super::stop_signal();
    tokio::pin!(stop);
    let mut env: BTreeMap<String, String> = args.env.into_iter().collect();
    let (node, held) = match (&args.node, &args.label) {
        (Some(node), _) => {
            let id = NodeId::parse(node)
                .map_err(|e| infra(exit::EXEC_NOT_AUTHORISED, anyhow::anyhow!("{node}: {e}")))?;
            (id, None)
        }
        (None, Some(label)) => {
            let labels = vec![label.clone(); args.count.max(1) as usize];
            let mut sub = submission(labels, args.requestor.clone());
            sub.priority = args.priority;
            sub.timeout_secs = args.wait.map(|d| d.as_secs().max(1));
            sub.keep_alive_secs = Some(KEEP_ALIVE_SECS);
            let id = client
                .submit(&sub)
                .await
                .map_err(|e| infra(status_of(&e), e))?;
            let done = tokio::select! {
                done = client.wait(&id, |_| {}) => done.map_err(|e| infra(exit::EXEC_BUS, e))?,
                () = &mut stop => {
                    let _ = client.cancel(id.clone()).await;
                    return Err(infra(exit::INTERRUPTED, anyhow::anyhow!("interrupted while waiting for a node; request {id} canceled")));
                }
            };
            if done.state != RequestState::Fulfilled {
                let why = done.failure.as_deref().unwrap_or(&done.status).to_string();
                return Err(infra(
                    exit::EXEC_NO_NODE,
                    anyhow::anyhow!("request {id} got no node: {why}"),
                ));
            }
            let nodes = client
                .nodes(&done.nodes)
                .await
                .map_err(|e| infra(exit::EXEC_BUS, e))?;
            let ids: Vec<String> = nodes.iter().map(|n| n.id.to_string()).collect();
            let hosts: Vec<String> = nodes.iter().map(|n| n.host.clone()).collect();
            env.entry("SLOTPOOL_NODES".into()).or_insert(ids.join(" "));
            env.entry("SLOTPOOL_HOSTS".into())
                .or_insert(hosts.join(" "));
            (done.nodes[0].clone(), Some((id, done.nodes)))
        }
        (None, None) => unreachable!("clap requires --label or --node"),
    };
    let renewing = async {
        match &held {
            Some((id, _)) => loop {
                tokio::time::sleep(Duration::from_secs(KEEP_ALIVE_SECS / 3)).await;
                match client.keep_alive(id).await {
                    Ok(_) => {}
                    Err(e @ BusError::Api(_)) => return e,
                    Err(err) => tracing::warn!(%err, "keep-alive renewal failed; trying again"),
                }
            },
            None => std::future::pending().await,
        }
    };
    let ran = tokio::select! {
        ran = copy_run_fetch(&client, &node, Job { command: args.command, copies: args.copy, fetches: args.fetch, raw: args.raw }, env, args.timeout, &mut stop) => ran,
        err = renewing => Err(infra(exit::EXEC_NODE_LOST, anyhow::Error::new(err).context("the node's keep-alive ended"))),
    };
    if let Some((_, nodes)) = held {
        if let Err(err) = client.release(nodes).await {
            eprintln!("slotpool exec: releasing the node: {err}");
        }
    }
    ran
}

/// Runs the command in `node` and streams it; returns the status to exit with.
async fn run_in(
    client: &Client,
    node: &NodeId,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    timeout: Option<Duration>,
    streams: Streams,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<u8, Infra> {
    let Streams {
        stdin,
        stdout,
        mut stdout_filter,
        mut stderr_filter,
    } = streams;
    let mut filtered = Vec::new();
    let bus = client.bus();
    let request = ExecRequest {
        v: PROTOCOL_VERSION,
        node_id: node.clone(),
        argv,
        env,
        timeout_secs: timeout.map(|d| d.as_secs().max(1)),
        session: ulid::Ulid::new().to_string(),
        inbox: bus.user().inbox_prefix(),
        window: None,
    };
    // Output from the agent of the node's backing node, and from no other.
    let output = output_of(&request).ok_or_else(|| {
        infra(
            exit::EXEC_NOT_AUTHORISED,
            anyhow::anyhow!("no node {node}: the id names no slot"),
        )
    })?;
    let mut messages = Box::pin(
        bus.serve(&format!("{output}.>"), None)
            .await
            .map_err(|e| infra(exit::EXEC_BUS, e))?,
    );
    let started: ExecStarted = bus
        .call(
            &subjects::api(client.name(), ApiOp::Exec),
            &request,
            START_TIMEOUT,
        )
        .await
        .map_err(|e| {
            infra(
                status_of(&e),
                anyhow::Error::new(e).context(format!("running in node {node}")),
            )
        })?;
    let input = started.input;
    // Stdin: read in chunks, at most STDIN_WINDOW unacknowledged by the agent.
    let (stdin_acked_tx, mut stdin_acked) = tokio::sync::watch::channel(0u64);
    let stdin_task = tokio::spawn({
        let bus = bus.clone();
        let subject = format!("{input}.{IN_STDIN}");
        async move {
            let mut stdin = stdin;
            let mut buf = vec![0u8; MAX_CHUNK_BYTES];
            let mut sent = 0u64;
            loop {
                if stdin_acked
                    .wait_for(|acked| sent - *acked < STDIN_WINDOW)
                    .await
                    .is_err()
                {
                    return;
                }
                let n = stdin.read(&mut buf).await.unwrap_or(0);
                let _ = bus
                    .publish_raw(subject.clone(), Bytes::copy_from_slice(&buf[..n]))
                    .await;
                if n == 0 {
                    return;
                }
                sent += 1;
            }
        }
    });
    let ack_subject = format!("{input}.{IN_ACK}");
    let signal_subject = format!("{input}.{IN_SIGNAL}");
    let mut stdout = stdout;
    let mut stderr = tokio::io::stderr();
    let mut received = 0u64;
    // The node's loss, as the launchers see it happen (releasing, failed, gone).
    let lost = async {
        match client.wait_not_ready(node).await {
            Ok(()) => {}
            Err(err) => {
                // An older launcher: the agent's exit message still ends the run.
                tracing::warn!(%err, "cannot follow the node's state");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::pin!(lost);
    let mut stopping: Option<tokio::time::Instant> = None;
    let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
    let exit = loop {
        tokio::select! {
            msg = messages.next() => {
                let Some(msg) = msg else {
                    break Err(infra(exit::EXEC_BUS, anyhow::anyhow!("the bus connection closed")));
                };
                let kind = msg.subject.rsplit('.').next().unwrap_or_default();
                match kind {
                    OUT_STDOUT | OUT_STDERR => {
                        let (out, filter): (&mut (dyn tokio::io::AsyncWrite + Unpin + Send), _) = if kind == OUT_STDOUT {
                            (&mut stdout, &mut stdout_filter)
                        } else {
                            (&mut stderr, &mut stderr_filter)
                        };
                        let bytes = match filter {
                            Some(filter) => {
                                filtered.clear();
                                filter.push(&msg.payload, &mut filtered);
                                &filtered[..]
                            }
                            None => &msg.payload[..],
                        };
                        let written = out.write_all(bytes).await.and(out.flush().await);
                        if written.is_err() {
                            // Nobody reads our output any more: stop the command.
                            let _ = bus.publish_raw(signal_subject.clone(), Bytes::from_static(b"TERM")).await;
                        }
                        received += 1;
                        let _ = bus.publish_raw(ack_subject.clone(), received.to_string().into()).await;
                    }
                    OUT_STDIN_ACK => {
                        if let Some(n) = std::str::from_utf8(&msg.payload).ok().and_then(|s| s.parse().ok()) {
                            let _ = stdin_acked_tx.send(n);
                        }
                    }
                    OUT_EXIT => {
                        let exit: ExecExit = serde_json::from_slice(&msg.payload).unwrap_or_else(|e| ExecExit {
                            error: Some(format!("unreadable exit message: {e}")),
                            ..ExecExit::default()
                        });
                        break Ok(exit);
                    }
                    _ => {}
                }
            }
            () = &mut lost => {
                break Err(infra(exit::EXEC_NODE_LOST, anyhow::anyhow!("node {node} was lost while the command ran")));
            }
            () = &mut *stop, if stopping.is_none() => {
                eprintln!("slotpool exec: stopping the command");
                let _ = bus.publish_raw(signal_subject.clone(), Bytes::from_static(b"TERM")).await;
                stopping = Some(tokio::time::Instant::now() + STOP_GRACE);
            }
            () = tokio::time::sleep_until(stopping.unwrap_or(far)), if stopping.is_some() => {
                let _ = bus.publish_raw(signal_subject.clone(), Bytes::from_static(b"KILL")).await;
                break Err(infra(exit::INTERRUPTED, anyhow::anyhow!("interrupted; the command did not stop in {STOP_GRACE:?}")));
            }
        }
    };
    stdin_task.abort();
    for (filter, out) in [
        (
            stdout_filter,
            &mut stdout as &mut (dyn tokio::io::AsyncWrite + Unpin + Send),
        ),
        (stderr_filter, &mut stderr),
    ] {
        if let Some(mut filter) = filter {
            filtered.clear();
            filter.finish(&mut filtered);
            let _ = out.write_all(&filtered).await;
            let _ = out.flush().await;
        }
    }
    let exit = exit?;
    if stopping.is_some() {
        return Err(infra(exit::INTERRUPTED, anyhow::anyhow!("interrupted")));
    }
    status_of_exit(&exit).map_err(|e| infra(exit::EXEC_NODE_LOST, anyhow::anyhow!(e)))
}

/// The status `exec` exits with for how the command ended: its own status; 124 when it
/// ran past its time limit; 128 + the signal that killed it.
fn status_of_exit(exit: &ExecExit) -> Result<u8, String> {
    if exit.timed_out {
        return Ok(exit::EXEC_TIMED_OUT);
    }
    match (exit.code, exit.signal, &exit.error) {
        (_, _, Some(error)) if exit.code.is_none() => Err(error.clone()),
        (Some(code), _, _) => Ok(code as u8),
        (None, Some(signal), _) => Ok(128u8.saturating_add(signal as u8)),
        (None, None, _) => Err("the command's end is unknown".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses() {
        let code = |c| ExecExit {
            code: Some(c),
            ..ExecExit::default()
        };
        assert_eq!(status_of_exit(&code(0)), Ok(0));
        assert_eq!(status_of_exit(&code(3)), Ok(3));
        let killed = ExecExit {
            signal: Some(9),
            ..ExecExit::default()
        };
        assert_eq!(status_of_exit(&killed), Ok(137));
        let late = ExecExit {
            signal: Some(9),
            timed_out: true,
            ..ExecExit::default()
        };
        assert_eq!(status_of_exit(&late), Ok(124));
        assert!(status_of_exit(&ExecExit::default()).is_err());
    }

    #[test]
    fn env_pairs() {
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("A").is_err());
    }
}
