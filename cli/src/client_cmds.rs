//! Client subcommands: request, release, cancel, list.

use super::output::{age, print, state, time};
use super::{NatsClientArgs, Output};
use anyhow::Context;
use clap::{Args, ValueEnum};
use slotpool_protocol::api::{ApiError, ErrorCode};
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::model::{Node, NodeRequest, RequestState};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{NodeId, RequestId};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How long `release --wait` waits for the slots to be wiped and free.
const RELEASE_WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Args)]
pub struct RequestArgs {
    /// Label of the nodes wanted; repeat for a mixed node set (`--label small --label big`).
    #[arg(long = "label", required = true, add = super::complete::label())]
    pub labels: Vec<String>,
    /// How many nodes of each label.
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// Wait until the request is fulfilled (or fails), showing its progress.
    #[arg(long)]
    pub wait: bool,
    /// Who is asking (shown to operators).
    #[arg(long, env = "SLOTPOOL_REQUESTOR", default_value = "slotpool-cli")]
    pub requestor: String,
    /// Lower is served first.
    #[arg(long)]
    pub priority: Option<i32>,
    /// Fail the request if it is not fulfilled within this many seconds.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// An SSH public key file to install for the nodes' users.
    #[arg(long, env = "SLOTPOOL_SSH_KEY", value_name = "FILE")]
    pub ssh_key: Option<PathBuf>,
    /// Hold the nodes only while this command runs: ask for a keep-alive of SECS
    /// seconds, wait for the nodes (implies --wait), print them, then stay in the
    /// foreground renewing the keep-alive every SECS/3 seconds. Ctrl-C or SIGTERM
    /// releases the nodes; if the command is killed, they are reclaimed SECS seconds
    /// after its last renewal.
    #[arg(long, value_name = "SECS")]
    pub keep_alive: Option<u64>,
    #[arg(long, value_enum, default_value_t)]
    pub output: Output,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum ListWhat {
    #[default]
    Nodes,
    Backing,
    Requests,
    Events,
    /// Each provider whose last call failed: the error, which call, since when, how many
    /// in a row, and its capacity back-off.
    Providers,
}

async fn connect(nats: &NatsClientArgs) -> anyhow::Result<Client> {
    Client::connect(&nats.options("slotpool-cli"))
        .await
        .with_context(|| format!("connecting to NATS at {}", nats.bus.url))
}

pub async fn request(nats: &NatsClientArgs, args: RequestArgs) -> anyhow::Result<ExitCode> {
    let client = connect(nats).await?;
    let labels: Vec<String> = args
        .labels
        .iter()
        .flat_map(|l| std::iter::repeat_n(l.clone(), args.count as usize))
        .collect();
    let mut sub = submission(labels, args.requestor);
    sub.priority = args.priority;
    sub.timeout_secs = args.timeout;
    sub.keep_alive_secs = args.keep_alive;
    if let Some(path) = &args.ssh_key {
        let key = std::fs::read_to_string(path)
            .with_context(|| format!("reading SSH public key {}", path.display()))?;
        sub.ssh_public_key = Some(key.trim().to_string());
    }
    let started = Instant::now();
    let id = client.submit(&sub).await?;
    let renewing = async {
        match args.keep_alive {
            Some(secs) => keep_renewing(&client, &id, secs).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(renewing);
    if !args.wait && args.keep_alive.is_none() {
        match args.output {
            Output::Json => println!("{}", serde_json::json!({ "request_id": id })),
            Output::Table => println!("{id}"),
        }
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("request {id} submitted");
    let mut last = String::new();
    let waiting = client.wait(&id, |r| {
        if r.status != last {
            eprintln!("[{:>6.2}s] {}", started.elapsed().as_secs_f64(), r.status);
            last = r.status.clone();
        }
    });
    let done = tokio::select! {
        done = waiting => done?,
        err = &mut renewing => return Err(err),
    };
    let took = started.elapsed();
    match done.state {
        RequestState::Fulfilled => {
            let nodes = fetch_nodes(&client, &done.nodes).await?;
            eprintln!("fulfilled in {:.1} ms", took.as_secs_f64() * 1000.0);
            if let Some(w) = &done.waiting {
                let end = done.fulfilled_at.unwrap_or(done.updated_at);
                eprintln!("waited for: {}", w.summary(end));
            }
            print_nodes(args.output, &nodes);
            std::io::stdout().flush().ok();
            for n in &nodes {
                if let Some(login) = login_line(n) {
                    eprintln!("{}: {login}", n.id);
                }
            }
            if args.keep_alive.is_none() {
                return Ok(ExitCode::SUCCESS);
            }
            eprintln!("keeping request {id} alive; Ctrl-C or SIGTERM releases its nodes");
            tokio::select! {
                err = &mut renewing => Err(err),
                _ = super::stop_signal() => {
                    client.release(done.nodes.clone()).await?;
                    eprintln!("released {} node(s)", done.nodes.len());
                    Ok(ExitCode::SUCCESS)
                }
            }
        }
        _ => {
            if let Output::Json = args.output {
                println!("{}", serde_json::to_string_pretty(&done)?);
            }
            eprintln!(
                "request {id} {}: {}",
                state(&done.state),
                done.failure.as_deref().unwrap_or(&done.status)
            );
            if let Some(w) = &done.waiting {
                eprintln!("waited for: {}", w.summary(done.updated_at));
            }
            Ok(ExitCode::from(super::exit::REQUEST_ENDED))
        }
    }
}

/// Renews request `id`'s keep-alive of `secs` seconds every third of it, until it
/// cannot: returns why (the request ended, or no launcher answered for a whole period).
async fn keep_renewing(client: &Client, id: &RequestId, secs: u64) -> anyhow::Error {
    let period = Duration::from_secs(secs);
    let mut last_ok = Instant::now();
    loop {
        tokio::time::sleep(period / 3).await;
        match client.keep_alive(id).await {
            Ok(_) => last_ok = Instant::now(),
            // The request is over, or not this client's: renewing again changes nothing.
            Err(err @ BusError::Api(ApiError { code, .. })) if code != ErrorCode::Internal => {
                return anyhow::Error::new(err).context(format!("keeping request {id} alive"))
            }
            Err(err) if last_ok.elapsed() >= period => {
                return anyhow::Error::new(err).context(format!(
                    "keeping request {id} alive: no renewal for {secs}s; its nodes are reclaimed"
                ))
            }
            Err(err) => tracing::warn!(%err, "keep-alive renewal failed; trying again"),
        }
    }
}

/// How to log in to `n`: `ssh -p PORT USER@HOST`, when it has a user and a port.
fn login_line(n: &Node) -> Option<String> {
    let user = n.login.username.as_deref()?;
    let port = n.login.port?;
    Some(format!("ssh -p {port} {user}@{}", n.host))
}

async fn fetch_nodes(client: &Client, ids: &[NodeId]) -> anyhow::Result<Vec<Node>> {
    Ok(client.nodes(ids).await?)
}

fn print_nodes(output: Output, nodes: &[Node]) {
    let rows = nodes
        .iter()
        .map(|n| {
            vec![
                n.id.to_string(),
                n.label.clone(),
                state(&n.state),
                n.backing_id.to_string(),
                n.slot.to_string(),
                n.host.clone(),
                n.workspace.clone().unwrap_or_default(),
                n.requestor.clone(),
                age(n.allocated_at),
            ]
        })
        .collect();
    print(
        output,
        &nodes,
        &[
            "NODE",
            "LABEL",
            "STATE",
            "BACKING",
            "SLOT",
            "HOST",
            "WORKSPACE",
            "REQUESTOR",
            "AGE",
        ],
        rows,
    );
}

pub async fn release(
    nats: &NatsClientArgs,
    nodes: Vec<String>,
    reason: Option<String>,
    wait: bool,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let ids = nodes
        .iter()
        .map(|n| NodeId::parse(n))
        .collect::<Result<Vec<_>, _>>()?;
    let client = connect(nats).await?;
    let operator = reason.is_some();
    let released = match reason {
        Some(reason) => super::operator_cmds::release_with_reason(&client, ids, reason).await?,
        None => client.release(ids).await?,
    };
    if wait {
        // An operator's release may be of any client's nodes: it waits on the slots
        // bucket, which operators may read; a client asks the launchers about its own.
        let done = async {
            if operator {
                client.watch_released(&released.released).await
            } else {
                client.wait_released(&released.released).await
            }
        };
        tokio::time::timeout(RELEASE_WAIT, done)
            .await
            .with_context(|| {
                format!("the released slots were not wiped and free within {RELEASE_WAIT:?}")
            })??;
    }
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&released)?),
        Output::Table => {
            for n in &released.released {
                println!("released {n}");
            }
            for n in &released.not_found {
                println!("not found {n} (already released?)");
            }
        }
    }
    Ok(if released.not_found.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(super::exit::NOT_FOUND)
    })
}

pub async fn cancel(
    nats: &NatsClientArgs,
    request: &str,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let id = RequestId::parse(request)?;
    let client = connect(nats).await?;
    let canceled = client.cancel(id).await?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&canceled)?),
        Output::Table => println!("{} {}", canceled.request_id, state(&canceled.state)),
    }
    Ok(ExitCode::SUCCESS)
}

/// What `slotpool list` keeps: each filter given must match.
#[derive(Debug, Default, Args)]
pub struct ListFilter {
    /// Only of this label (nodes, backing nodes, requests).
    #[arg(long, add = super::complete::label())]
    pub label: Option<String>,
    /// Only in this state, as the STATE column says it (`ready`, `failed`, `requested`…).
    #[arg(long)]
    pub state: Option<String>,
    /// Only of this pool, `POOL` or `PROVIDER/POOL` (backing nodes, and the nodes on them).
    #[arg(long, value_name = "POOL")]
    pub pool: Option<String>,
    /// Only of this client, the bus user who asked (nodes, requests).
    #[arg(long)]
    pub client: Option<String>,
    /// Requests: also the finished ones (failed, canceled, reclaimed, or whose nodes were
    /// all returned), kept an hour. Without it, requests waiting or holding nodes now.
    #[arg(long)]
    pub finished: bool,
    /// At most N rows: the newest requests and events, the first nodes and backing nodes.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
}

impl ListFilter {
    /// Refuses a filter that does not apply to `what`.
    fn check(&self, what: ListWhat) -> anyhow::Result<()> {
        let applies = |flag: &str, given: bool, to: &[ListWhat]| {
            if given && !to.contains(&what) {
                let name = what.to_possible_value().expect("no variant is skipped");
                anyhow::bail!("{flag} does not apply to `list {}`", name.get_name());
            }
            Ok(())
        };
        use ListWhat::*;
        applies("--label", self.label.is_some(), &[Nodes, Backing, Requests])?;
        applies("--state", self.state.is_some(), &[Nodes, Backing, Requests])?;
        applies("--pool", self.pool.is_some(), &[Nodes, Backing])?;
        applies("--client", self.client.is_some(), &[Nodes, Requests])?;
        applies("--finished", self.finished, &[Requests])?;
        Ok(())
    }

    fn label(&self, label: &str) -> bool {
        self.label.as_deref().is_none_or(|l| l == label)
    }

    fn state<S: serde::Serialize>(&self, s: &S) -> bool {
        self.state
            .as_deref()
            .is_none_or(|want| state(s).eq_ignore_ascii_case(want))
    }

    fn client(&self, client: Option<&slotpool_protocol::UserName>) -> bool {
        self.client
            .as_deref()
            .is_none_or(|c| client.is_some_and(|have| have.as_str() == c))
    }

    fn pool(&self, provider: &str, pool: &str) -> bool {
        self.pool
            .as_deref()
            .is_none_or(|want| match want.split_once('/') {
                Some((p, name)) => p == provider && name == pool,
                None => want == pool,
            })
    }

    /// The first `limit` of `items` (all without one).
    fn first<T>(&self, items: &mut Vec<T>) {
        if let Some(n) = self.limit {
            items.truncate(n);
        }
    }

    /// The last `limit` of `items`, oldest first (all without one).
    fn newest<T>(&self, items: &mut Vec<T>) {
        if let Some(n) = self.limit {
            let drop = items.len().saturating_sub(n);
            items.drain(..drop);
        }
    }
}

/// Whether a request is over: ended, or fulfilled with every node returned.
fn finished(r: &NodeRequest) -> bool {
    match r.state {
        RequestState::Requested => false,
        RequestState::Fulfilled => r.nodes_released_at.is_some(),
        _ => true,
    }
}

pub async fn list(
    nats: &NatsClientArgs,
    what: ListWhat,
    filter: ListFilter,
    output: Output,
) -> anyhow::Result<ExitCode> {
    filter.check(what)?;
    let client = connect(nats).await?;
    match what {
        ListWhat::Nodes => {
            let mut nodes = client.list_nodes().await?;
            if filter.pool.is_some() {
                let backing = client.list_backing().await?;
                nodes.retain(|n| {
                    backing
                        .iter()
                        .any(|b| b.id == n.backing_id && filter.pool(&b.provider, &b.pool))
                });
            }
            nodes.retain(|n| {
                filter.label(&n.label) && filter.state(&n.state) && filter.client(n.client.as_ref())
            });
            nodes.sort_by(|a, b| (&a.backing_id, a.slot).cmp(&(&b.backing_id, b.slot)));
            filter.first(&mut nodes);
            print_nodes(output, &nodes);
        }
        ListWhat::Backing => {
            let mut backing = client.list_backing().await?;
            backing.retain(|b| {
                filter.label(&b.label)
                    && filter.state(&b.state)
                    && filter.pool(&b.provider, &b.pool)
            });
            backing.sort_by(|a, b| {
                (&a.provider, &a.pool, a.seat).cmp(&(&b.provider, &b.pool, b.seat))
            });
            filter.first(&mut backing);
            let used = used_slots(&client.list_nodes().await?);
            let rows = backing
                .iter()
                .map(|b| {
                    vec![
                        b.id.to_string(),
                        format!("{}/{}", b.provider, b.pool),
                        b.label.clone(),
                        state(&b.state),
                        state(&b.idle),
                        format!("{}/{}", used.get(&b.id).copied().unwrap_or(0), b.slots),
                        b.instance
                            .as_ref()
                            .map(|i| i.host.clone())
                            .unwrap_or_default(),
                        age(b.created_at),
                        backing_reason(b),
                    ]
                })
                .collect();
            print(
                output,
                &backing,
                &[
                    "BACKING", "POOL", "LABEL", "STATE", "MODE", "SLOTS", "HOST", "AGE", "REASON",
                ],
                rows,
            );
        }
        ListWhat::Providers => {
            let mut providers = client.list_providers().await?;
            providers.sort_by(|a, b| a.provider.cmp(&b.provider));
            let rows = providers
                .iter()
                .map(|p| {
                    vec![
                        p.provider.clone(),
                        state(&p.call),
                        p.failures.to_string(),
                        age(p.at),
                        p.capacity_until
                            .filter(|until| *until > now_ms())
                            .map(|until| format!("until {}", time(until)))
                            .unwrap_or_default(),
                        p.error.clone(),
                    ]
                })
                .collect();
            print(
                output,
                &providers,
                &["PROVIDER", "CALL", "FAILURES", "SINCE", "BACK-OFF", "ERROR"],
                rows,
            );
        }
        ListWhat::Events => {
            let mut events = client.list_events().await?;
            filter.newest(&mut events);
            let rows = events
                .iter()
                .map(|e| {
                    let backing = e
                        .backing_id
                        .clone()
                        .or_else(|| e.node_id.as_ref().and_then(|n| n.slot()).map(|(b, _)| b));
                    vec![
                        time(e.at),
                        age(e.at),
                        state(&e.kind),
                        e.actor.clone(),
                        backing.map(|b| b.to_string()).unwrap_or_default(),
                        e.message.clone(),
                    ]
                })
                .collect();
            print(
                output,
                &events,
                &["TIME", "AGE", "KIND", "ACTOR", "BACKING", "EVENT"],
                rows,
            );
        }
        ListWhat::Requests => {
            let mut requests: Vec<NodeRequest> = client.list_requests().await?;
            requests.retain(|r| {
                (filter.finished || !finished(r))
                    && r.labels.iter().any(|l| filter.label(l))
                    && filter.state(&r.state)
                    && filter.client(r.client.as_ref())
            });
            requests.sort_by_key(|r| r.created_at);
            filter.newest(&mut requests);
            let rows = requests
                .iter()
                .map(|r| {
                    vec![
                        r.id.to_string(),
                        r.labels.join(","),
                        state(&r.state),
                        r.priority.to_string(),
                        r.requestor.clone(),
                        age(r.created_at),
                        r.status.clone(),
                    ]
                })
                .collect();
            print(
                output,
                &requests,
                &[
                    "REQUEST",
                    "LABELS",
                    "STATE",
                    "PRIO",
                    "REQUESTOR",
                    "AGE",
                    "STATUS",
                ],
                rows,
            );
        }
    }
    std::io::stdout().flush().ok();
    Ok(ExitCode::SUCCESS)
}

/// Why a backing node is as it is: its failure, else the operator's order standing on it
/// ("hold by alice: kernel update").
fn backing_reason(b: &slotpool_protocol::model::BackingNode) -> String {
    match (&b.failure, &b.order) {
        (Some(failure), _) => failure.clone(),
        (None, Some(order)) => {
            let mut s = format!("{} by {}", state(&order.action), order.actor);
            if let Some(reason) = &order.reason {
                s.push_str(": ");
                s.push_str(reason);
            }
            s
        }
        (None, None) => String::new(),
    }
}

fn used_slots(nodes: &[Node]) -> std::collections::HashMap<slotpool_protocol::BackingId, u32> {
    let mut m = std::collections::HashMap::new();
    for n in nodes {
        *m.entry(n.backing_id.clone()).or_insert(0) += 1;
    }
    m
}
