//! The measurements, one function per figure of the report.

use super::procs::{self, LauncherProcess, Usage};
use super::scrape::Messages;
use super::sim_agents::{self, SimSpec};
use super::stats::{Samples, Summary};
use anyhow::{bail, Context};
use futures::StreamExt;
use serde::Serialize;
use slotpool_protocol::client::{submission, Client, RequestWatcher};
use slotpool_protocol::connect::{Bus, BusError, NatsOptions};
use slotpool_protocol::layout;
use slotpool_protocol::model::{
    secret_digest, BackingNode, BackingState, IdleBehaviour, Instance, RequestState,
};
use slotpool_protocol::store::{BucketSpec, Change};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, NodeId, PROTOCOL_VERSION};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long the launcher may take to serve its first request after it starts.
const FIRST_SERVE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one allocation may take before the benchmark gives up.
const ALLOCATION_TIMEOUT: Duration = Duration::from_secs(120);

/// A bucket of its own for the floor, so the launcher's mirror never sees its keys.
const FLOOR_BUCKET: BucketSpec = BucketSpec {
    name: "slotpool_bench_floor",
    history: 1,
    per_key_ttl: false,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
    discard_old: false,
};

/// Options for an anonymous bus without TLS at `url`.
pub fn anonymous(url: &str, name: &str) -> NatsOptions {
    NatsOptions {
        url: url.to_string(),
        name: name.to_string(),
        ..Default::default()
    }
}

pub async fn connect(opts: &NatsOptions) -> anyhow::Result<Bus> {
    Bus::connect(opts)
        .await
        .with_context(|| format!("connecting to {} as {}", opts.url, opts.name))
}

// ---- floor ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Floor {
    /// get + create + CAS update of one key, one after the other.
    pub chain: Summary,
    pub get: Summary,
    pub create: Summary,
    pub update: Summary,
}

/// The raw KV chain an allocation is shaped like, on the benchmark's own connection.
pub async fn floor(bus: &Bus, n: usize) -> anyhow::Result<Floor> {
    let store = bus.open_bucket(FLOOR_BUCKET).await?;
    // About the size of a slot record.
    let value = serde_json::json!({ "v": 1, "state": "preparing", "pad": "x".repeat(300) });
    let (mut chain, mut get, mut create, mut update) = (
        Samples::default(),
        Samples::default(),
        Samples::default(),
        Samples::default(),
    );
    let run = format!("{:x}", now_ms());
    for i in 0..n + n / 10 {
        let key = format!("k-{run}-{i}");
        let t0 = Instant::now();
        let absent = store.get::<serde_json::Value>(&key).await?;
        let t1 = Instant::now();
        let rev = store.create(&key, &value, None).await?;
        let t2 = Instant::now();
        store.update(&key, &value, rev, None).await?;
        let t3 = Instant::now();
        anyhow::ensure!(absent.is_none(), "floor key {key} already existed");
        // The first tenth warms the connection and the server up.
        if i >= n / 10 {
            chain.push(t3 - t0);
            get.push(t1 - t0);
            create.push(t2 - t1);
            update.push(t3 - t2);
        }
    }
    Ok(Floor {
        chain: chain.summary(),
        get: get.summary(),
        create: create.summary(),
        update: update.summary(),
    })
}

// ---- allocations -----------------------------------------------------------------------

/// Requests one node of `label` and waits until the request is fulfilled.
pub async fn allocate(watcher: &RequestWatcher, label: &str) -> anyhow::Result<Vec<NodeId>> {
    let sub = submission(vec![label.to_string()], "slotpool-bench");
    let done = tokio::time::timeout(ALLOCATION_TIMEOUT, watcher.submit_and_wait(&sub))
        .await
        .with_context(|| format!("no allocation of {label} within {ALLOCATION_TIMEOUT:?}"))??;
    if done.state != RequestState::Fulfilled {
        bail!("request {} {:?}: {}", done.id, done.state, done.status);
    }
    Ok(done.nodes)
}

/// Releases nodes, failing unless every one was released.
pub async fn release(client: &Client, nodes: Vec<NodeId>) -> anyhow::Result<()> {
    let released = client.release(nodes).await?;
    if !released.not_found.is_empty() {
        bail!("release found no nodes {:?}", released.not_found);
    }
    Ok(())
}

/// Waits until a launcher answers, then returns how long the first allocation took from
/// `since` (the launcher's start).
pub async fn first_served(
    client: &Client,
    watcher: &RequestWatcher,
    label: &str,
    since: Instant,
) -> anyhow::Result<Duration> {
    let deadline = since + FIRST_SERVE_TIMEOUT;
    loop {
        let sub = submission(vec![label.to_string()], "slotpool-bench");
        match watcher.submit_and_wait(&sub).await {
            Err(BusError::NoResponders { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(err) => return Err(err.into()),
            Ok(done) if done.state == RequestState::Fulfilled => {
                let took = since.elapsed();
                release(client, done.nodes).await?;
                return Ok(took);
            }
            Ok(done) => bail!("first request {:?}: {}", done.state, done.status),
        }
    }
}

/// Holds `n` nodes of `label` at once and gives them back: backing nodes for that many
/// slots are launched and ready afterwards.
pub async fn prewarm(
    client: &Client,
    watcher: &Arc<RequestWatcher>,
    label: &str,
    n: usize,
) -> anyhow::Result<()> {
    let all = futures::future::join_all((0..n).map(|_| allocate(watcher, label))).await;
    let mut nodes = Vec::new();
    for got in all {
        nodes.extend(got?);
    }
    for chunk in nodes.chunks(slotpool_protocol::api::MAX_LABELS_PER_REQUEST) {
        release(client, chunk.to_vec()).await?;
    }
    Ok(())
}

#[derive(Clone, Debug, Serialize)]
pub struct Warm {
    /// Submit until the client sees the request fulfilled.
    pub allocation: Summary,
    /// The release call's round trip (acknowledged once the node is marked releasing).
    pub release: Summary,
    /// Allocations made, the unmeasured warm-up ones included.
    pub cycles: usize,
    /// NATS messages per allocation and release over all `cycles` (from `/varz`).
    pub messages: Option<Messages>,
    /// Measured taking turns ([`taking_turns`]): the allocations' p50 of each block, in
    /// the order the blocks ran (empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub block_p50_ms: Vec<f64>,
}

/// Sequential warm allocations, each node released before the next request.
pub async fn warm(
    client: &Client,
    watcher: &RequestWatcher,
    label: &str,
    n: usize,
) -> anyhow::Result<Warm> {
    warm_cycles(client, watcher, label, n / 10).await?;
    let (alloc, rel) = warm_cycles(client, watcher, label, n).await?;
    Ok(Warm {
        allocation: alloc.summary(),
        release: rel.summary(),
        cycles: n + n / 10,
        messages: None,
        block_p50_ms: Vec::new(),
    })
}

/// `n` sequential warm allocations and releases: the allocations' times and the
/// releases'.
async fn warm_cycles(
    client: &Client,
    watcher: &RequestWatcher,
    label: &str,
    n: usize,
) -> anyhow::Result<(Samples, Samples)> {
    let (mut alloc, mut rel) = (Samples::default(), Samples::default());
    for _ in 0..n {
        let t0 = Instant::now();
        let nodes = allocate(watcher, label).await?;
        let t1 = Instant::now();
        release(client, nodes).await?;
        alloc.push(t1 - t0);
        rel.push(t1.elapsed());
    }
    Ok((alloc, rel))
}

/// Whose turn `turn` is in [`taking_turns`]: 0 (a) or 1 (b), in the order a b b a.
fn turn_side(turn: usize) -> usize {
    (turn % 2) ^ ((turn / 2) % 2)
}

/// How many blocks of sequential allocations each bus runs in [`taking_turns`].
pub const TURNS: usize = 8;

/// The sequential warm allocations of two buses, `n` each, taking turns in [`TURNS`]
/// blocks in the order a b b a a b b a (after `n / 10` unmeasured on each): whatever
/// else the host does meanwhile, and whatever the loads before left it to finish, falls
/// on both alike. `a` and `b` are each a bus's client and watcher.
pub async fn taking_turns(
    a: (&Client, &RequestWatcher),
    b: (&Client, &RequestWatcher),
    label: &str,
    n: usize,
) -> anyhow::Result<(Warm, Warm)> {
    let sides = [a, b];
    let mut samples: [(Samples, Samples, Vec<f64>); 2] = Default::default();
    for (client, watcher) in sides {
        warm_cycles(client, watcher, label, n / 10).await?;
    }
    let block = n.div_ceil(TURNS);
    for turn in 0..2 * TURNS {
        let side = turn_side(turn);
        let (client, watcher) = sides[side];
        let left = n - samples[side].0.len();
        if left == 0 {
            continue;
        }
        let (alloc, rel) = warm_cycles(client, watcher, label, block.min(left)).await?;
        samples[side].2.push(alloc.summary().p50_ms);
        samples[side].0.extend(alloc);
        samples[side].1.extend(rel);
    }
    let [a, b] = samples.map(|(alloc, rel, blocks)| Warm {
        allocation: alloc.summary(),
        release: rel.summary(),
        cycles: n + n / 10,
        messages: None,
        block_p50_ms: blocks,
    });
    Ok((a, b))
}

/// How the ratio of `b`'s p50 over `a`'s spreads over the blocks of [`taking_turns`]:
/// block k of one bus ran right before or right after block k of the other (a b b a), so
/// each pair's ratio is measured in the same few seconds of the host. `None` without
/// blocks.
pub fn block_ratios(a: &Warm, b: &Warm) -> Option<Spread> {
    let mut ratios: Vec<f64> = a
        .block_p50_ms
        .iter()
        .zip(&b.block_p50_ms)
        .filter(|(x, _)| **x > 0.0)
        .map(|(x, y)| y / x)
        .collect();
    ratios.sort_by(|x, y| x.total_cmp(y));
    let n = ratios.len();
    let median = match n {
        0 => return None,
        _ if n % 2 == 1 => ratios[n / 2],
        _ => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
    };
    Some(Spread {
        pairs: n,
        min: ratios[0],
        median,
        max: ratios[n - 1],
    })
}

/// The least, middle and greatest of a ratio measured once per pair of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub pairs: usize,
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

/// Release to reusable: a node of `label`, whose pool is one backing node of one slot,
/// released and asked for again at once, `n` times after one unmeasured cycle (which
/// launches the backing node). Each figure runs from the start of the release call to
/// the client seeing the next request fulfilled on that same slot: the agent's release
/// (kill, wipe, check), its warm-up of the slot again and the warm prepare, as a job
/// waiting for a busy pool sees them.
pub async fn release_to_reusable(
    client: &Client,
    watcher: &RequestWatcher,
    label: &str,
    n: usize,
) -> anyhow::Result<Summary> {
    let mut samples = Samples::default();
    let mut nodes = allocate(watcher, label).await?;
    for i in 0..=n {
        let t0 = Instant::now();
        release(client, nodes).await?;
        nodes = allocate(watcher, label).await?;
        if i > 0 {
            samples.push(t0.elapsed());
        }
    }
    release(client, nodes).await?;
    Ok(samples.summary())
}

#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    pub clients: usize,
    pub seconds: f64,
    pub allocations: usize,
    pub allocations_per_sec: f64,
    pub allocation: Summary,
    pub release: Summary,
    /// CPU time per allocation (and its release) of each process involved.
    pub cpu: Vec<procs::RoleCpu>,
    /// The sum of `cpu`: every process's CPU time per allocation and release.
    pub cpu_ms_per_allocation: f64,
    /// NATS messages per allocation and release (from `/varz`).
    pub messages: Option<Messages>,
    /// Share of the machine's CPU time the hypervisor took during the load (steal).
    pub stolen_percent: Option<f64>,
}

impl Throughput {
    /// Figure `f` of this load over its mean in `before` and `after`, two runs of the
    /// load it is compared with, just before and just after it: a host whose other load
    /// changes during the run moves both sides alike.
    pub fn over_mean(
        &self,
        f: fn(&Throughput) -> f64,
        before: &Throughput,
        after: &Throughput,
    ) -> f64 {
        f(self) / ((f(before) + f(after)) / 2.0)
    }
}

/// Concurrent clients, one per entry of `clients` (each on its own connection), each
/// requesting a node and releasing it, for `duration`.
pub async fn throughput(
    clients: &[Client],
    label: &str,
    duration: Duration,
) -> anyhow::Result<Throughput> {
    let start = Instant::now();
    let end = start + duration;
    let tasks: Vec<_> = clients
        .iter()
        .map(|client| {
            let (client, label) = (client.clone(), label.to_string());
            tokio::spawn(async move {
                let watcher = client.watcher().await?;
                let (mut alloc, mut rel) = (Samples::default(), Samples::default());
                while Instant::now() < end {
                    let t0 = Instant::now();
                    let nodes = allocate(&watcher, &label).await?;
                    let t1 = Instant::now();
                    release(&client, nodes).await?;
                    alloc.push(t1 - t0);
                    rel.push(t1.elapsed());
                }
                anyhow::Ok((alloc, rel))
            })
        })
        .collect();
    let (mut alloc, mut rel) = (Samples::default(), Samples::default());
    for t in tasks {
        let (a, r) = t.await.context("throughput client")??;
        alloc.extend(a);
        rel.extend(r);
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(Throughput {
        clients: clients.len(),
        seconds,
        allocations: alloc.len(),
        allocations_per_sec: alloc.len() as f64 / seconds,
        allocation: alloc.summary(),
        release: rel.summary(),
        cpu: Vec::new(),
        cpu_ms_per_allocation: 0.0,
        messages: None,
        stolen_percent: None,
    })
}

#[derive(Clone, Debug, Serialize)]
pub struct ColdAndRelease {
    /// Submit until fulfilled, with a new backing node launched for it.
    pub cold_allocation: Summary,
    pub grace_time_secs: u64,
    /// Last slot returned → backing node released (seat deleted), minus the grace-time.
    pub release_late: Summary,
    /// Releases that came before the grace-time ran out (must be 0).
    pub early: usize,
    pub distinct_backing_nodes: usize,
    /// The slowest cold allocations, slowest first, to find in the logs.
    pub slowest: Vec<ColdSample>,
}

/// One cold allocation: how long it took, which backing node served it, and when.
#[derive(Clone, Debug, Serialize)]
pub struct ColdSample {
    pub ms: f64,
    pub backing_id: String,
    /// Submission time, ms since the Unix epoch.
    pub submitted_at_ms: slotpool_protocol::time::UnixMillis,
}

/// How many of the slowest cold allocations the report names.
const SLOWEST_NAMED: usize = 3;

/// Cold allocations on a pool of one single-slot backing node with the given
/// grace-time: allocate (launches a node), release, wait for the node to be released.
pub async fn cold_and_release(
    bus: &Bus,
    client: &Client,
    watcher: &RequestWatcher,
    label: &str,
    seat_key: &str,
    grace: Duration,
    n: usize,
) -> anyhow::Result<ColdAndRelease> {
    let mut changes = Box::pin(bus.backing.watch_new(seat_key).await?);
    let (mut cold, mut late) = (Samples::default(), Samples::default());
    let mut early = 0;
    let mut backing_ids = std::collections::HashSet::new();
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let (t0, submitted_at_ms) = (Instant::now(), now_ms());
        let nodes = allocate(watcher, label).await?;
        let took = t0.elapsed();
        cold.push(took);
        let backing = nodes.first().and_then(|n| n.slot()).map(|(b, _)| b);
        samples.push(ColdSample {
            ms: took.as_secs_f64() * 1000.0,
            backing_id: backing.as_ref().map(|b| b.to_string()).unwrap_or_default(),
            submitted_at_ms,
        });
        if let Some(backing) = backing {
            backing_ids.insert(backing);
        }
        // The slot is freed after the release call has begun (the wipe may follow its
        // reply): lateness counts from its end (the wipe counts as late, never
        // flatters), "early" from its start (never accuses wrongly).
        let releasing = Instant::now();
        release(client, nodes).await?;
        let returned = Instant::now();
        let gone_by = grace + Duration::from_secs(60);
        loop {
            let change = tokio::time::timeout(gone_by, changes.next())
                .await
                .with_context(|| {
                    format!(
                        "backing node {seat_key} not released within {gone_by:?} of its last slot"
                    )
                })?
                .context("backing watch ended")??;
            if let Change::Removed { .. } = change {
                break;
            }
        }
        if releasing.elapsed() < grace {
            early += 1;
        }
        let late_ms = returned.elapsed().as_secs_f64() * 1000.0 - grace.as_secs_f64() * 1000.0;
        late.push_ms(late_ms);
    }
    Ok(ColdAndRelease {
        cold_allocation: cold.summary(),
        grace_time_secs: grace.as_secs(),
        release_late: late.summary(),
        early,
        distinct_backing_nodes: backing_ids.len(),
        slowest: {
            samples.sort_by(|a, b| b.ms.total_cmp(&a.ms));
            samples.truncate(SLOWEST_NAMED);
            samples
        },
    })
}

// ---- one real agent ----------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Agent {
    pub slots: u32,
    pub idle: Usage,
}

/// Starts a real `slotpool-agent` with 8 slots and measures it while idle.
pub async fn agent(
    bus: &Bus,
    url: &str,
    dir: &Path,
    isolation: &str,
    window: Duration,
) -> anyhow::Result<Agent> {
    let binary = slotpool_local_run::sibling_binary("slotpool-agent");
    let id = BackingId::parse("bn-bench-agent").expect("valid id");
    let work_dir = dir.join("idle-agent");
    std::fs::create_dir_all(&work_dir)?;
    let log = std::fs::File::create(dir.join("idle-agent.log"))?;
    let slots = 8;
    let mut child = tokio::process::Command::new(&binary)
        .arg("--nats")
        .arg(url)
        .arg("--backing-id")
        .arg(id.as_str())
        .arg("--work-dir")
        .arg(&work_dir)
        .arg("--slots")
        .arg(slots.to_string())
        // As the warm agents: no /proc hiding processes, a host-wide mount the agent
        // would leave behind.
        .args([
            "--isolation",
            isolation,
            "--remove-slots-on-stop",
            "--hide-processes",
            "off",
        ])
        .env("SLOTPOOL_AGENT_SECRET", "bench-agent-secret")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let pid = child.id().context("agent pid")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while bus
        .agents
        .get::<serde_json::Value>(id.as_str())
        .await?
        .is_none()
    {
        if Instant::now() > deadline {
            bail!("the agent did not heartbeat within 30s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let start-up work settle before measuring.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = procs::usage_over(pid, window).await;
    slotpool_local_run::stop_child(&mut child).await;
    Ok(Agent { slots, idle: idle? })
}

// ---- scale -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Scale {
    pub backing_nodes: usize,
    pub slots: usize,
    pub heartbeat_interval_ms: u64,
    /// Launcher start (KV already holding every backing node) → first request fulfilled.
    pub start_to_first_served_secs: f64,
    /// Launcher killed (SIGKILL) and started again → first request fulfilled.
    pub restart_after_kill_to_first_served_secs: f64,
    pub idle: Usage,
    /// Lease writes per second seen on the bus while the launcher is idle.
    pub idle_lease_writes_per_sec: f64,
    pub allocation: Summary,
}

pub struct ScaleSettings {
    pub backing: usize,
    pub slots: u32,
    pub heartbeat: Duration,
    pub settle: Duration,
    pub idle_window: Duration,
    pub allocations: usize,
}

const SCALE_LABEL: &str = "scale";

/// The launcher over `s.backing` simulated backing nodes on its own nats-server.
pub async fn scale(url: &str, dir: &Path, s: &ScaleSettings) -> anyhow::Result<Scale> {
    let bus = connect(&anonymous(url, "slotpool-bench")).await?;
    let agents_bus = connect(&anonymous(url, "slotpool-bench-agents")).await?;
    let client = Client::from_bus(bus.clone());
    let watcher = client.watcher().await?;

    let secret = "bench-simulated-secret";
    let secret_file = dir.join("sim-secret");
    std::fs::write(&secret_file, secret)?;
    let ids: Vec<BackingId> = (0..s.backing)
        .map(|i| BackingId::parse(&format!("bn-sim-{i:05}")).expect("valid id"))
        .collect();
    let config = dir.join("scale.yaml");
    std::fs::write(&config, scale_config(&ids, &secret_file, s.slots))?;

    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    let spec = SimSpec {
        ids: ids.clone(),
        secret_sha256: secret_digest(secret),
        slots: s.slots,
        interval: s.heartbeat,
        ttl: Duration::from_secs((s.heartbeat.as_secs() * 3).max(6)),
    };
    sim_agents::start(agents_bus, spec, &tracker, stop.clone()).await?;
    seed_backing(&bus, &ids, secret, s.slots).await?;

    let result = async {
        let log = dir.join("scale-launcher.log");
        let started = Instant::now();
        let mut launcher = LauncherProcess::spawn(&config, url, procs::ANONYMOUS_BUS, &log)?;
        let first = launcher
            .while_alive(first_served(&client, &watcher, SCALE_LABEL, started))
            .await?;
        tokio::time::sleep(s.settle).await;
        launcher.check_alive()?;

        let leases = bus.leases.watch_new(">").await?;
        let lease_writes = Arc::new(AtomicU64::new(0));
        let counting = {
            let lease_writes = lease_writes.clone();
            tokio::spawn(async move {
                let mut leases = Box::pin(leases);
                while let Some(Ok(change)) = leases.next().await {
                    if let Change::Put { .. } = change {
                        lease_writes.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let window_start = Instant::now();
        let idle = procs::usage_over(launcher.pid, s.idle_window).await?;
        counting.abort();
        let lease_rate =
            lease_writes.load(Ordering::Relaxed) as f64 / window_start.elapsed().as_secs_f64();

        let mut alloc = Samples::default();
        for _ in 0..s.allocations {
            let t0 = Instant::now();
            let nodes = allocate(&watcher, SCALE_LABEL).await?;
            alloc.push(t0.elapsed());
            release(&client, nodes).await?;
        }
        launcher.check_alive()?;
        launcher.crash().await;

        let log = dir.join("scale-launcher-restarted.log");
        let restarted = Instant::now();
        let mut launcher = LauncherProcess::spawn(&config, url, procs::ANONYMOUS_BUS, &log)?;
        let again = launcher
            .while_alive(first_served(&client, &watcher, SCALE_LABEL, restarted))
            .await?;
        launcher.crash().await;
        anyhow::Ok(Scale {
            backing_nodes: s.backing,
            slots: s.backing * s.slots as usize,
            heartbeat_interval_ms: s.heartbeat.as_millis() as u64,
            start_to_first_served_secs: first.as_secs_f64(),
            restart_after_kill_to_first_served_secs: again.as_secs_f64(),
            idle,
            idle_lease_writes_per_sec: lease_rate,
            allocation: alloc.summary(),
        })
    }
    .await;
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    result
}

/// The pool and seat of the `i`th simulated backing node: pools of at most
/// `max-servers`' bound, `main-0`, `main-1`, ...
fn sim_seat(i: usize) -> (String, u32) {
    let per_pool = slotpool_config::MAX_SERVERS as usize;
    (format!("main-{}", i / per_pool), (i % per_pool) as u32)
}

/// The simulated host address of the `i`th simulated backing node.
fn sim_host(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255)
}

fn scale_config(ids: &[BackingId], secret_file: &Path, slots: u32) -> String {
    let mut hosts = String::new();
    let mut pools: Vec<(String, usize)> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let (pool, _) = sim_seat(i);
        hosts.push_str(&format!(
            "        - {{name: {id}, host: {}, pool: {pool}, secret-file: {}}}\n",
            sim_host(i),
            secret_file.display()
        ));
        match pools.last_mut() {
            Some((name, n)) if *name == pool => *n += 1,
            _ => pools.push((pool, 1)),
        }
    }
    let pools: String = pools
        .iter()
        .map(|(name, n)| {
            format!(
                "      - name: {name}\n        max-servers: {n}\n        labels:\n          - name: {SCALE_LABEL}\n            backing-label: sim-vm\n            max-parallel-jobs: {slots}\n            grace-time: 86400\n"
            )
        })
        .collect();
    format!(
        "launcher:\n  lease-ttl: 10\nproviders:\n  - name: sim\n    driver: static\n    static:\n      hosts:\n{hosts}    pools:\n{pools}"
    )
}

/// Writes every backing node as a launcher would have left it: ready, its agent up.
async fn seed_backing(
    bus: &Bus,
    ids: &[BackingId],
    secret: &str,
    slots: u32,
) -> anyhow::Result<()> {
    let now = now_ms();
    let digest = secret_digest(secret);
    for (chunk_no, chunk) in ids.chunks(512).enumerate() {
        let writes = chunk.iter().enumerate().map(|(j, id)| {
            let (pool, seat) = sim_seat(chunk_no * 512 + j);
            let host = sim_host(chunk_no * 512 + j);
            let record = BackingNode {
                v: PROTOCOL_VERSION,
                id: id.clone(),
                provider: "sim".into(),
                pool: pool.clone(),
                seat,
                label: SCALE_LABEL.into(),
                backing_label: "sim-vm".into(),
                slots,
                state: BackingState::Ready,
                idle: IdleBehaviour::Run,
                instance: Some(Instance {
                    id: id.to_string(),
                    host,
                    data: serde_json::Value::Null,
                }),
                secret_sha256: digest.clone(),
                created_at: now,
                launched_at: Some(now),
                ready_at: Some(now),
                idle_since: Some(now),
                attempts: 1,
                out_of_capacity: false,
                create_queued: false,
                uses: 0,
                failure: None,
                attributes: Default::default(),
                order: None,
                interruption: None,
                updated_at: now,
            };
            let key = layout::seat_key("sim", &pool, seat);
            async move { bus.backing.create(&key, &record, None).await }
        });
        for written in futures::future::join_all(writes).await {
            written.context("seeding backing nodes")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_go_a_b_b_a_and_each_side_has_as_many() {
        let order: String = (0..2 * TURNS).map(|t| ["a", "b"][turn_side(t)]).collect();
        assert_eq!(order, "abbaabbaabbaabba");
        // Each side takes over from the other as often as the other takes over from it.
        let firsts = |side| {
            (1..2 * TURNS)
                .filter(|&t| turn_side(t) == side && turn_side(t - 1) != side)
                .count()
        };
        assert_eq!(firsts(0), firsts(1));
    }

    fn blocks(p50s: &[f64]) -> Warm {
        Warm {
            allocation: Summary::default(),
            release: Summary::default(),
            cycles: 0,
            messages: None,
            block_p50_ms: p50s.to_vec(),
        }
    }

    #[test]
    fn block_ratios_pair_blocks_in_order_and_skip_an_empty_one() {
        let a = blocks(&[1.0, 2.0, 1.0, 0.0]);
        let b = blocks(&[1.1, 2.4, 1.3, 0.5, 9.0]);
        let spread = block_ratios(&a, &b).unwrap();
        assert_eq!(
            spread.pairs, 3,
            "the block of no samples and the unpaired one left out"
        );
        assert!((spread.min - 1.1).abs() < 1e-12, "{spread:?}");
        assert!((spread.median - 1.2).abs() < 1e-12, "{spread:?}");
        assert!((spread.max - 1.3).abs() < 1e-12, "{spread:?}");
        let even = block_ratios(&blocks(&[1.0, 1.0]), &blocks(&[1.0, 2.0])).unwrap();
        assert!((even.median - 1.5).abs() < 1e-12, "{even:?}");
        assert_eq!(block_ratios(&blocks(&[]), &b), None);
    }
}
