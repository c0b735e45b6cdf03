//! What every launcher task shares: the bus, the config, the providers, the mirror of KV,
//! change signals, and the set of work items this process is driving.

use crate::agent_bus::AgentBus;
use crate::config::Config;
use crate::heartbeat_clock::HeartbeatClock;
use crate::liveness::Liveness;
use crate::mirror_sync::MirrorSync;
use crate::provider::status::{Recorded, StatusBook};
use crate::provider::Provider;
use crate::world::World;
use slotpool_protocol::connect::Bus;
use slotpool_protocol::store::KvError;
use slotpool_protocol::{LauncherId, NodeId, RequestId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The launcher process's shared state.
pub struct Shared {
    pub id: LauncherId,
    /// When this launcher started (Unix ms).
    pub started_at: slotpool_protocol::time::UnixMillis,
    pub bus: Bus,
    pub config: Config,
    pub providers: HashMap<String, Arc<dyn Provider>>,
    /// Each provider's last error, written as the providers' calls fail and succeed.
    pub provider_status: Arc<StatusBook>,
    /// How agents started by providers reach the bus.
    pub agent_bus: AgentBus,
    world: Mutex<World>,
    pub signals: Signals,
    /// Work items this process has a worker for.
    active: Mutex<HashSet<Work>>,
    pub tracker: TaskTracker,
    pub shutdown: CancellationToken,
    /// This launcher's liveness lease, which stands for every request it owns.
    pub liveness: Liveness,
    /// Since when the mirrors are synced over a live connection.
    pub mirror_sync: MirrorSync,
    /// Since when the heartbeats bucket takes heartbeats again after it last could not.
    pub heartbeat_clock: HeartbeatClock,
}

impl Shared {
    pub fn new(
        bus: Bus,
        config: Config,
        providers: HashMap<String, Arc<dyn Provider>>,
        agent_bus: AgentBus,
        mirror_sync: MirrorSync,
        shutdown: CancellationToken,
    ) -> Shared {
        let id = LauncherId::generate();
        let provider_status = Arc::new(StatusBook::new(bus.leases.clone(), id.clone()));
        let providers = providers
            .into_iter()
            .map(|(name, p)| {
                let recorded: Arc<dyn Provider> =
                    Arc::new(Recorded::new(p, provider_status.clone()));
                (name, recorded)
            })
            .collect();
        Shared {
            world: Mutex::new(World::for_config(id.clone(), &config)),
            id,
            started_at: slotpool_protocol::time::now_ms(),
            bus,
            config,
            providers,
            provider_status,
            agent_bus,
            signals: Signals::default(),
            active: Mutex::new(HashSet::new()),
            tracker: TaskTracker::new(),
            liveness: Liveness::new(&shutdown),
            mirror_sync,
            heartbeat_clock: HeartbeatClock::default(),
            shutdown,
        }
    }

    /// Spawns one of the per-message tasks (an API call, a request worker, a release),
    /// tracked for shutdown. The future goes on the heap first: these are several KB
    /// (5.5 KB for a request worker), and tokio moves a spawned future by value more
    /// than once on its way into the task; boxed, each move is a pointer.
    pub fn spawn_task<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(Box::pin(task));
    }

    /// The KV mirror. Hold the guard briefly and never across an await. When the
    /// guard goes, the requests of this launcher that a change made under it lets claim
    /// now are woken ([`World::take_wakes`]).
    pub fn world(&self) -> WorldGuard<'_> {
        WorldGuard {
            world: Some(self.world.lock().unwrap_or_else(|p| p.into_inner())),
            signals: &self.signals,
        }
    }

    /// Marks `work` as driven by this process; false if a worker already drives it.
    pub fn start_work(&self, work: &Work) -> bool {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(work.clone())
    }

    pub fn end_work(&self, work: &Work) {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(work);
    }

    pub fn is_working_on(&self, work: &Work) -> bool {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(work)
    }
}

/// The world's lock ([`Shared::world`]): on its way out it wakes the request workers
/// the changes made under it concern, after letting go of the lock.
pub struct WorldGuard<'a> {
    world: Option<MutexGuard<'a, World>>,
    signals: &'a Signals,
}

impl std::ops::Deref for WorldGuard<'_> {
    type Target = World;
    fn deref(&self) -> &World {
        self.world.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for WorldGuard<'_> {
    fn deref_mut(&mut self) -> &mut World {
        self.world.as_mut().expect("held until dropped")
    }
}

impl Drop for WorldGuard<'_> {
    fn drop(&mut self) {
        let Some(mut world) = self.world.take() else {
            return;
        };
        let wakes = world.take_wakes(slotpool_protocol::time::now_ms());
        drop(world);
        for id in wakes {
            self.signals.bump(&request_topic(&id));
        }
    }
}

/// A work item one worker of this process drives at a time.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Work {
    /// A request's worker.
    Request(RequestId),
    /// The worker of the backing node in a seat (by the seat's key).
    Seat(String),
    /// Finishing the release of a node.
    Release(NodeId),
}

/// What changed in the mirror, as workers wait for it and the supervisor looks at it:
/// a request (or, for a waiting request, a slot it could now claim: [`WorldGuard`]), a
/// seat (its backing node or its agent), a label's capacity or demand (for the
/// supervisor's planner only), or a slot (by its key) marked releasing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Topic {
    Request(RequestId),
    Seat(String),
    Label(String),
    Release(String),
}

/// Change signals by [`Topic`]: a worker subscribes to what it waits for and is woken
/// when the watch applies a change to it.
#[derive(Default)]
pub struct Signals {
    topics: Mutex<HashMap<Topic, watch::Sender<u64>>>,
}

impl Signals {
    pub fn subscribe(&self, topic: &Topic) -> watch::Receiver<u64> {
        let mut topics = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        topics
            .entry(topic.clone())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    pub fn bump(&self, topic: &Topic) {
        let topics = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = topics.get(topic) {
            tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Drops topics nobody listens to any more.
    pub fn prune(&self) {
        self.topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, tx| tx.receiver_count() > 0);
    }
}

pub fn request_topic(id: &RequestId) -> Topic {
    Topic::Request(id.clone())
}
pub fn seat_topic(seat_key: &str) -> Topic {
    Topic::Seat(seat_key.to_string())
}

/// Waits, after `err`, until the bus is back for what failed: a leader answers a write to
/// the bucket `err` names again (anyone's: [`Store::answering_again`]), or every mirror is
/// synced again after the connection or a watch came back, or `at_most` passed.
///
/// [`Store::answering_again`]: slotpool_protocol::store::Store::answering_again
pub async fn bus_back(sh: &Shared, err: &KvError, at_most: std::time::Duration) {
    let mut synced = sh.mirror_sync.subscribe();
    let resynced = async {
        while synced.changed().await.is_ok() {
            if synced.borrow_and_update().is_some() {
                return;
            }
        }
        std::future::pending().await
    };
    let answering = async {
        match sh.bus.store(err.bucket()) {
            Some(store) => store.answering_again(at_most).await,
            None => tokio::time::sleep(at_most).await,
        }
    };
    tokio::select! {
        _ = resynced => {}
        _ = answering => {}
    }
}

/// Waits until any of `rxs` changes, `deadline` passes, or `stop` is cancelled.
pub async fn wait_for_change(
    rxs: &mut [watch::Receiver<u64>],
    deadline: Option<tokio::time::Instant>,
    stop: &CancellationToken,
) {
    let empty = rxs.is_empty();
    let changed = futures::future::select_all(rxs.iter_mut().map(|rx| Box::pin(rx.changed())));
    let sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    if empty {
        tokio::select! { _ = sleep => {}, _ = stop.cancelled() => {} }
        return;
    }
    tokio::select! {
        _ = changed => {}
        _ = sleep => {}
        _ = stop.cancelled() => {}
    }
}
