//! The slotpool launcher: takes node requests, allocates slots on backing nodes, asks
//! providers for backing nodes when slots run out and releases idle ones.
//!
//! All state is in NATS JetStream KV; this process keeps only a mirror of it
//! ([`world::World`]) and the set of work items it holds leases on. `run` is the whole
//! daemon; the `slotpool` binary (the `cli` crate) only parses arguments.

pub(crate) mod admin;
pub mod agent_bus;
/// The pool configuration (its own crate, shared with the console).
pub(crate) use slotpool_config as config;
pub(crate) mod api;
pub mod backing;
pub(crate) mod events;
pub(crate) mod exec_api;
pub(crate) mod heartbeat_clock;
pub mod http;
pub(crate) mod inbound;
pub(crate) mod lease;
pub(crate) mod liveness;
pub(crate) mod metrics;
pub(crate) mod mirror_sync;
pub(crate) mod nodes;
pub mod provider;
pub(crate) mod release;
pub mod request;
pub mod revocation;
pub mod revoked;
pub(crate) mod shared;
pub(crate) mod status;
pub(crate) mod watch;
pub mod world;

use crate::config::Config;
use crate::shared::Shared;
use crate::watch::{Dirty, Mirror};
use slotpool_protocol::connect::Bus;
use slotpool_protocol::model::BackingState;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How often every work item is looked at again, to catch anything a watch missed.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(15);

/// Everything `run` needs besides the connection.
pub struct LauncherDeps {
    /// How the agents this launcher's providers start reach the bus.
    pub agent_bus: agent_bus::AgentBus,
    /// The `slotpool-agent` binary the local provider runs by default.
    pub agent_binary: PathBuf,
    /// Whether the local provider's agents outlive this launcher (they do, but for the
    /// demo's).
    pub local_agents: provider::local::AgentLifetime,
    /// Where to serve `/metrics` and the probes (`--http`), bound already.
    pub http: Option<http::HttpListener>,
}

#[derive(Debug, thiserror::Error)]
pub enum LauncherError {
    #[error("provider {name}: {source}")]
    Provider {
        name: String,
        source: provider::ProviderError,
    },
    #[error(transparent)]
    Bus(#[from] slotpool_protocol::connect::BusError),
    #[error("starting the http listener's thread: {0}")]
    Http(std::io::Error),
}

/// Runs the launcher until `shutdown` is cancelled; returns once its tasks have ended and
/// its leases are released.
pub async fn run(
    config: Config,
    bus: Bus,
    deps: LauncherDeps,
    shutdown: CancellationToken,
) -> Result<(), LauncherError> {
    let mut providers = HashMap::new();
    // Local agents keep their slots off this launcher's HTTP port.
    let guard_ports: Vec<u16> = deps
        .http
        .as_ref()
        .and_then(|h| h.local_addr().ok())
        .map(|a| a.port())
        .into_iter()
        .collect();
    for p in &config.providers {
        let built = provider::build(
            p,
            &deps.agent_binary,
            deps.local_agents,
            &deps.agent_bus.local_tls,
            &guard_ports,
        )
        .map_err(|source| LauncherError::Provider {
            name: p.name.clone(),
            source,
        })?;
        providers.insert(p.name.clone(), built);
    }
    let shared = Arc::new(Shared::new(
        bus,
        config,
        providers,
        deps.agent_bus,
        mirror_sync::MirrorSync::new(Mirror::ALL.len()),
        shutdown.clone(),
    ));
    tracing::info!(launcher = %shared.id, "launcher starting");

    shared
        .tracker
        .spawn(shared.provider_status.clone().watch(shutdown.clone()));
    let http = match deps.http {
        Some(listener) => Some(http::spawn(shared.clone(), listener).map_err(LauncherError::Http)?),
        None => None,
    };
    if let Some(desk) = shared.agent_bus.revocation().cloned() {
        shared.tracker.spawn(revocation::push(shared.clone(), desk));
    }

    let (dirty_tx, dirty_rx) = mpsc::unbounded_channel();
    let mut synced = Vec::new();
    for mirror in Mirror::ALL {
        let (tx, rx) = tokio::sync::oneshot::channel();
        synced.push(rx);
        shared
            .tracker
            .spawn(watch::run(shared.clone(), mirror, dirty_tx.clone(), tx));
    }
    for rx in synced {
        tokio::select! {
            _ = rx => {}
            _ = shutdown.cancelled() => break,
        }
    }
    let (requests, backing, slots) = {
        let world = shared.world();
        (world.requests.len(), world.backing.len(), world.slots.len())
    };
    tracing::info!(requests, backing, slots, "state loaded");
    // The liveness lease stands for every request this launcher owns: it exists before
    // the first request is accepted.
    let liveness = lease::take_liveness(&shared)
        .await
        .map_err(slotpool_protocol::connect::BusError::from)?;
    shared
        .tracker
        .spawn(lease::keep_alive(shared.clone(), liveness));
    backing::leak::spawn(&shared);
    let api = {
        let sh = shared.clone();
        shared.tracker.spawn(async move { api::serve(sh).await })
    };
    // The supervisor runs on the runtime's workers: `run` may be polled outside them
    // (`block_on`), and waking that thread for every change the watches report would
    // cost a futex call and a context switch each time.
    let plans = Arc::new(PlanQueue::default());
    {
        let (sh, plans) = (shared.clone(), plans.clone());
        shared
            .tracker
            .spawn(async move { plan_labels(&sh, &plans).await });
    }
    let supervisor = {
        let sh = shared.clone();
        tokio::spawn(async move { supervise(&sh, dirty_rx, &plans).await })
    };
    if let Err(err) = supervisor.await {
        if err.is_panic() {
            std::panic::resume_unwind(err.into_panic());
        }
    }
    shared.tracker.close();
    shared.tracker.wait().await;
    if let Some(http) = http {
        let _ = tokio::task::spawn_blocking(move || http.join()).await;
    }
    api.await.ok().transpose()?;
    tracing::info!("launcher stopped");
    Ok(())
}

/// Looks at every work item the watches mark dirty (and all of them now and then) and
/// starts a worker for those nobody drives; labels go to the planner's task ([`plan_labels`]),
/// so the supervisor never waits for the planner's writes.
async fn supervise(
    shared: &Arc<Shared>,
    mut dirty: mpsc::UnboundedReceiver<Dirty>,
    plans: &PlanQueue,
) {
    let mut resync = tokio::time::interval(RESYNC_INTERVAL);
    let mut timers = KeyTimers::default();
    // Slots seen marked releasing, by key: looked at again once their release should be
    // done ([`release::finish_left_behind`]).
    let mut releases = KeyTimers::default();
    let mut synced = shared.mirror_sync.subscribe();
    loop {
        let mut batch: HashSet<Dirty> = HashSet::new();
        let next_timer = [timers.next(), releases.next()]
            .into_iter()
            .flatten()
            .min()
            .map(|at| tokio::time::Instant::now() + slotpool_protocol::time::until(at));
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = resync.tick() => {
                batch.extend(everything(shared));
                release::sweep_left_behind(shared);
            }
            d = dirty.recv() => match d { Some(d) => { batch.insert(d); }, None => return },
            Ok(()) = synced.changed() => {
                if synced.borrow_and_update().is_some() {
                    // Back on the bus: what waited for it (a missing heartbeat's grace)
                    // is decided again, by the workers and by the supervisor.
                    wake_seats(shared);
                    batch.extend(everything(shared));
                }
            }
            _ = sleep_until(next_timer) => {
                let now = slotpool_protocol::time::now_ms();
                batch.extend(timers.take_due(now).into_iter().map(Dirty::Seat));
                for key in releases.take_due(now) {
                    release::finish_left_behind(shared, &key);
                }
            }
        }
        let started = std::time::Instant::now();
        stall_for_tests();
        while let Ok(d) = dirty.try_recv() {
            batch.insert(d);
        }
        let mut labels = Vec::new();
        // Labels with a min-ready whose nodes changed.
        let mut warm = Vec::new();
        for d in batch {
            match d {
                Dirty::Label(l) => labels.push(l),
                Dirty::Release(key) => {
                    let at = slotpool_protocol::time::now_ms()
                        + release::retry_pause(0).as_millis() as u64;
                    releases.schedule(key, at);
                }
                Dirty::Request(id) => {
                    if request::wants_driver(shared, &id) {
                        request::spawn(shared, id);
                    }
                }
                Dirty::Seat(seat) => {
                    if let Some(label) = warm_label(shared, &seat) {
                        // A claim may have taken a slot kept ready, a release or a new
                        // node may let an idle one go: plan the label, look at its
                        // empty nodes.
                        labels.push(label.clone());
                        warm.push(label);
                    }
                    look_at_seat(shared, &mut timers, seat);
                }
            }
        }
        warm.sort();
        warm.dedup();
        // Empty nodes kept for their label's queue: looked at again once it keeps
        // them no longer.
        for seat in no_longer_kept(shared) {
            shared.signals.bump(&shared::seat_topic(&seat));
            look_at_seat(shared, &mut timers, seat);
        }
        for label in warm {
            for seat in empty_seats(shared, &label) {
                shared.signals.bump(&shared::seat_topic(&seat));
                look_at_seat(shared, &mut timers, seat);
            }
        }
        plans.ask(labels);
        shared.signals.prune();
        metrics::pass_done(started.elapsed(), slotpool_protocol::time::now_ms());
    }
}

/// Debug builds only, for the tests of what a stalled launcher shows: while the file
/// named by `SLOTPOOL_TEST_STALL_FILE` exists, the supervisor blocks the thread it runs
/// on, as a task that never yields would.
fn stall_for_tests() {
    #[cfg(debug_assertions)]
    if let Some(path) = std::env::var_os("SLOTPOOL_TEST_STALL_FILE") {
        while std::path::Path::new(&path).exists() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The labels waiting for the planner's task: one entry per label, however often it is
/// asked for (so at most as many as the configuration names), and the task's wake-up.
#[derive(Default)]
struct PlanQueue {
    labels: std::sync::Mutex<BTreeSet<String>>,
    wake: tokio::sync::Notify,
}

impl PlanQueue {
    fn ask(&self, labels: Vec<String>) {
        if labels.is_empty() {
            return;
        }
        self.labels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(labels);
        self.wake.notify_one();
    }

    fn take(&self) -> BTreeSet<String> {
        std::mem::take(&mut *self.labels.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The planner's task: plans each label asked for ([`backing::planner::plan`]), one at a
/// time (labels sharing a pool would otherwise race for its seats), and starts a backing
/// worker on each seat taken. A label with unmet demand and a seat resting is planned
/// again when the rest ends.
async fn plan_labels(shared: &Arc<Shared>, plans: &PlanQueue) {
    let mut rests = KeyTimers::default();
    loop {
        let next_rest = rests
            .next()
            .map(|at| tokio::time::Instant::now() + slotpool_protocol::time::until(at));
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = plans.wake.notified() => {}
            _ = sleep_until(next_rest) => {}
        }
        let mut labels = plans.take();
        labels.extend(rests.take_due(slotpool_protocol::time::now_ms()));
        for label in labels {
            for seat in backing::planner::plan(shared, &label).await {
                backing::spawn(shared, seat);
            }
            match backing::planner::rest_ends_at(shared, &label) {
                Some(at) => rests.schedule(label, at),
                None => rests.cancel(&label),
            }
        }
    }
}

/// Starts a worker for the backing node at `seat` if nobody drives it and a step is due,
/// or sets the supervisor's timer for when one will be.
fn look_at_seat(shared: &Arc<Shared>, timers: &mut KeyTimers, seat: String) {
    let free = {
        let world = shared.world();
        world.backing.contains_key(&seat)
            && world
                .lease(&slotpool_protocol::layout::backing_lease_key(&seat))
                .is_none()
    };
    if free {
        match backing::due(shared, &seat) {
            backing::Due::Now => backing::spawn(shared, seat),
            backing::Due::At(at) => timers.schedule(seat, at),
            backing::Due::Never => timers.cancel(&seat),
        }
    }
}

/// The label of the backing node at `seat`, when that label keeps slots ready
/// (`min-ready`, `warm-window`): a change of one of its nodes matters to the planner and to the others.
fn warm_label(shared: &Shared, seat: &str) -> Option<String> {
    let world = shared.world();
    let label = &world.backing.get(seat)?.value.label;
    (shared.config.min_ready(label) > 0 || shared.config.warm(label).is_some())
        .then(|| label.clone())
}

/// The seats kept for the queue (`World::kept_for_queue`) that it keeps no longer: their
/// label's queue is empty, or the queue, walked in its order, leaves their slots
/// (`World::kept_for`: a request ahead is short of the seats they hold).
fn no_longer_kept(shared: &Shared) -> Vec<String> {
    let mut world = shared.world();
    if world.kept_for_queue.is_empty() {
        return Vec::new();
    }
    let shares = world.seat_shares();
    let mut gone = Vec::new();
    for seats in world.kept_for_queue.values() {
        for seat in seats {
            let kept = world
                .backing
                .get(seat)
                .is_some_and(|b| world.kept_by(&b.value, &shares) > 0);
            if !kept {
                gone.push(seat.clone());
            }
        }
    }
    for seats in world.kept_for_queue.values_mut() {
        seats.retain(|s| !gone.contains(s));
    }
    world.kept_for_queue.retain(|_, seats| !seats.is_empty());
    gone
}

/// The ready, empty backing nodes of `label`: those kept for its min-ready, which may
/// be released once other nodes hold enough free slots.
fn empty_seats(shared: &Shared, label: &str) -> Vec<String> {
    let world = shared.world();
    world
        .backing
        .values()
        .filter(|b| b.value.label == label && b.value.state == BackingState::Ready)
        .filter(|b| world.used_count(&b.value.id) == 0)
        .map(|b| b.key.clone())
        .collect()
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Times at which the supervisor looks at something again, by key: a backing node
/// nobody drives with a step due (grace-time or max-age running out, a failed node to
/// forget), a slot seen releasing that should be free, a label waiting for a failed
/// seat's rest to end.
#[derive(Default)]
struct KeyTimers {
    by_seat: HashMap<String, u64>,
    queue: BTreeSet<(u64, String)>,
}

impl KeyTimers {
    fn schedule(&mut self, seat: String, at: u64) {
        if let Some(old) = self.by_seat.insert(seat.clone(), at) {
            self.queue.remove(&(old, seat.clone()));
        }
        self.queue.insert((at, seat));
    }

    fn cancel(&mut self, seat: &str) {
        if let Some(old) = self.by_seat.remove(seat) {
            self.queue.remove(&(old, seat.to_string()));
        }
    }

    fn next(&self) -> Option<u64> {
        self.queue.first().map(|(at, _)| *at)
    }

    fn take_due(&mut self, now: u64) -> Vec<String> {
        let mut due = Vec::new();
        while self.queue.first().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, seat)) = self.queue.pop_first() {
                self.by_seat.remove(&seat);
                due.push(seat);
            }
        }
        due
    }
}

/// Wakes the worker of every backing node.
fn wake_seats(shared: &Shared) {
    let seats: Vec<String> = shared.world().backing.keys().cloned().collect();
    for seat in seats {
        shared.signals.bump(&shared::seat_topic(&seat));
    }
}

fn everything(shared: &Shared) -> Vec<Dirty> {
    let world = shared.world();
    let mut all: Vec<Dirty> = world
        .open_requests
        .iter()
        .chain(world.held_requests.iter())
        .cloned()
        .map(Dirty::Request)
        .collect();
    all.extend(world.backing.keys().cloned().map(Dirty::Seat));
    all.extend(
        shared
            .config
            .label_names()
            .into_iter()
            .map(|l| Dirty::Label(l.to_string())),
    );
    all
}
