//! Which node holds which slot, and the rules for preparing and releasing them.
//!
//! [`SlotTable`] is the pure bookkeeping (unit tested without a file system); [`Slots`]
//! applies its decisions through a [`SlotIsolation`]. Guarantees:
//! - prepare is idempotent for the same node (the same workspace comes back untouched);
//!   a slot held by another node is refused, naming the holder;
//! - release is idempotent and tolerates a slot never prepared (leftovers are wiped);
//!   a release naming a node that does not hold the slot leaves the holder alone, since
//!   nothing of the named node can remain there (preparing the holder wiped it).
//!
//! - once closed ([`Slots::close`]), new prepares are refused until [`Slots::open`];
//!   closing waits for prepares already running, so its list of prepared slots is final.
//! - a release that cannot clean its slot marks the slot **dirty**: a file
//!   `<work-dir>/dirty/<slot>` holding the reason. A dirty slot is reported in the
//!   heartbeat and refuses every prepare until an operator has looked at the machine and
//!   deleted the file; a later release that does clean the slot still leaves the file.
//!
//! - a free slot is **warm** or **cold**. Warm-up ([`SlotIsolation::warm`]: with user
//!   isolation the user, the cgroup and the empty workspace) runs in the background at
//!   start-up for every free slot that is neither warm nor dirty
//!   ([`Slots::warm_free_slots`]) and after every release that verified the slot clean,
//!   so a prepare of a warm slot only adds the key, the limits and the state. A prepare of
//!   a cold slot (warm-up failed or not reached yet) takes the full path, wiping
//!   leftovers first; so does a prepare whose warm path fails. Dirty slots are never
//!   warmed.
//!
//! Operations on one slot (prepare, release, warm-up) are serialised by a per-slot lock:
//! a prepare that arrives while its slot is warming waits for the warm-up, and a release
//! hands its lock straight to the warm-up that follows it, so nothing runs on the slot
//! between the clean check and the warm-up. ([`crate::commands`] also queues commands
//! per slot, so they are answered in order.) The closed flag is kept in memory only: a
//! restarted agent is open again.
//!
//! - releases and warm-ups run at a lower scheduling priority ([`BACKGROUND_NICE`],
//!   [`Background`]) than prepares: on a busy host the prepare of a warm slot, which a
//!   job is waiting for, gets the CPU before other slots' wipes and warm-ups.

use crate::isolation::Limits;
use crate::isolation::{FoundSlot, IsolationError, SlotIsolation};
use crate::step_clock::StepClock;
use slotpool_protocol::api::SlotOccupants;
use slotpool_protocol::model::{SlotReport, DIRTY_REASON_MAX_CHARS};
use slotpool_protocol::NodeId;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// Why a slot operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("slot {slot} does not exist: this node has {slots} slots (0 to {})", .slots.saturating_sub(1))]
    OutOfRange { slot: u32, slots: u32 },
    #[error("slot {slot} is held by node {holder}; cannot prepare it for node {wanted}")]
    Held {
        slot: u32,
        holder: NodeId,
        wanted: NodeId,
    },
    #[error("slot {slot} not prepared: this agent is closed to new slots")]
    Closed { slot: u32 },
    #[error("slot {slot} is dirty (it could not be cleaned: {reason}); an operator must check it and remove {marker}")]
    Dirty {
        slot: u32,
        reason: String,
        marker: PathBuf,
    },
    #[error("slot {slot}: {error}")]
    Isolation { slot: u32, error: IsolationError },
    #[error("slot {slot}: {action} task failed: {message}")]
    Task {
        slot: u32,
        action: &'static str,
        message: String,
    },
    /// A release that could not clean its slot: the slot is now dirty.
    #[error("{cause}; the slot is now dirty")]
    Unclean { slot: u32, cause: Box<SlotError> },
}

/// What a prepare has to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PreparePlan {
    /// The node already holds the slot: return its workspace as it is.
    Reuse,
    /// The slot is free and warm: hand it to the node (key, limits, state).
    FromWarm,
    /// The slot is free and cold: wipe it and build it for the node (the full path).
    Create,
}

/// What a release has to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleasePlan {
    /// Wipe the slot (held by this node, or by nobody).
    Destroy,
    /// Another node holds the slot: leave it alone.
    KeepHolder(NodeId),
}

/// The prepared and the warm slots of this node. Plain data.
#[derive(Clone, Debug)]
pub struct SlotTable {
    slots: u32,
    held: BTreeMap<u32, NodeId>,
    /// Free slots that are warm; never a held slot.
    warm: BTreeSet<u32>,
    closed: bool,
}

impl SlotTable {
    /// An empty table (every slot free and cold) for a node with `slots` slots.
    pub fn new(slots: u32) -> SlotTable {
        SlotTable {
            slots,
            held: BTreeMap::new(),
            warm: BTreeSet::new(),
            closed: false,
        }
    }

    /// Whether `slot` is one of this node's slots.
    pub fn check(&self, slot: u32) -> Result<(), SlotError> {
        if slot < self.slots {
            Ok(())
        } else {
            Err(SlotError::OutOfRange {
                slot,
                slots: self.slots,
            })
        }
    }

    /// Rebuilds the table from slots found on disk; slots out of range are logged and left
    /// out (they were prepared or warmed when the node had more slots).
    pub fn restore(&mut self, found: Vec<FoundSlot>) {
        for FoundSlot { slot, node_id } in found {
            match (self.check(slot), node_id) {
                (Ok(()), Some(node_id)) => self.mark_prepared(slot, node_id),
                (Ok(()), None) => self.mark_warm(slot),
                (Err(err), node_id) => {
                    tracing::warn!(slot, ?node_id, %err, "ignoring slot found on disk")
                }
            }
        }
    }

    pub fn plan_prepare(&self, slot: u32, node_id: &NodeId) -> Result<PreparePlan, SlotError> {
        self.check(slot)?;
        match self.held.get(&slot) {
            None if self.closed => Err(SlotError::Closed { slot }),
            None if self.warm.contains(&slot) => Ok(PreparePlan::FromWarm),
            None => Ok(PreparePlan::Create),
            Some(holder) if holder == node_id => Ok(PreparePlan::Reuse),
            Some(holder) => Err(SlotError::Held {
                slot,
                holder: holder.clone(),
                wanted: node_id.clone(),
            }),
        }
    }

    pub fn plan_release(&self, slot: u32, node_id: &NodeId) -> Result<ReleasePlan, SlotError> {
        self.check(slot)?;
        match self.held.get(&slot) {
            Some(holder) if holder != node_id => Ok(ReleasePlan::KeepHolder(holder.clone())),
            _ => Ok(ReleasePlan::Destroy),
        }
    }

    /// Whether `slot` should be warmed now: one of ours, free, cold and not `dirty`.
    pub fn plan_warm(&self, slot: u32, dirty: bool) -> bool {
        self.check(slot).is_ok()
            && !dirty
            && !self.held.contains_key(&slot)
            && !self.warm.contains(&slot)
    }

    pub fn mark_prepared(&mut self, slot: u32, node_id: NodeId) {
        self.warm.remove(&slot);
        self.held.insert(slot, node_id);
    }

    /// The slot was wiped (or a wipe was attempted): free and cold.
    pub fn mark_released(&mut self, slot: u32) {
        self.held.remove(&slot);
        self.warm.remove(&slot);
    }

    /// The free slot was warmed.
    pub fn mark_warm(&mut self, slot: u32) {
        if !self.held.contains_key(&slot) {
            self.warm.insert(slot);
        }
    }

    /// The slot's warm state cannot be trusted any more: the next prepare takes the full path.
    pub fn mark_cold(&mut self, slot: u32) {
        self.warm.remove(&slot);
    }

    /// The warm slot indexes, in order.
    pub fn warm(&self) -> Vec<u32> {
        self.warm.iter().copied().collect()
    }

    /// Refuses (`true`) or accepts again (`false`) new prepares.
    pub fn set_closed(&mut self, closed: bool) {
        self.closed = closed;
    }

    /// The prepared slot indexes, in order.
    pub fn prepared(&self) -> Vec<u32> {
        self.held.keys().copied().collect()
    }

    /// The prepared slots, by slot index, as the heartbeat reports them.
    pub fn reports(&self) -> Vec<SlotReport> {
        self.held
            .iter()
            .map(|(&slot, node_id)| SlotReport {
                slot,
                node_id: node_id.clone(),
            })
            .collect()
    }
}

/// What a release did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The slot's workspace is gone.
    Wiped,
    /// Another node holds the slot; it was left alone.
    HeldByOther(NodeId),
}

/// A prepared slot: where it is and whose it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedSlot {
    pub workspace: PathBuf,
    /// The slot's Unix user, with user isolation.
    pub username: Option<String>,
}

/// The slot table and the isolation that carries out its decisions.
#[derive(Clone)]
pub struct Slots {
    table: Arc<Mutex<SlotTable>>,
    isolation: Arc<dyn SlotIsolation>,
    /// Where dirty-slot markers live (`None`: slots are never marked dirty).
    dirty_dir: Option<PathBuf>,
    /// Held shared by each prepare and exclusively by close/open, so closing waits for
    /// the prepares already running.
    gate: Arc<tokio::sync::RwLock<()>>,
    /// One lock per slot, held by each prepare, release and warm-up of that slot.
    locks: Arc<[Arc<tokio::sync::Mutex<()>>]>,
    /// The warm-ups running in the background.
    warming: TaskTracker,
    /// Limits a prepare gets for what its label leaves unset (see
    /// [`crate::isolation::default_limits`]).
    default_limits: Limits,
}

impl Slots {
    /// Rebuilds the table from what `isolation` finds on disk.
    pub async fn recover(
        isolation: Arc<dyn SlotIsolation>,
        slots: u32,
    ) -> Result<Slots, IsolationError> {
        let found = {
            let isolation = isolation.clone();
            tokio::task::spawn_blocking(move || isolation.recover())
                .await
                .map_err(|err| IsolationError {
                    action: "scanning",
                    path: PathBuf::from("slots"),
                    error: std::io::Error::other(err.to_string()),
                })??
        };
        let mut table = SlotTable::new(slots);
        table.restore(found);
        Ok(Slots {
            table: Arc::new(Mutex::new(table)),
            isolation,
            dirty_dir: None,
            gate: Arc::new(tokio::sync::RwLock::new(())),
            locks: (0..slots)
                .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                .collect(),
            warming: TaskTracker::new(),
            default_limits: Limits::default(),
        })
    }

    /// Gives every prepare `defaults` for the limits its label leaves unset.
    pub fn with_default_limits(mut self, defaults: Limits) -> Slots {
        self.default_limits = defaults;
        self
    }

    /// Keeps dirty-slot markers in `dir` (created if missing).
    pub fn with_dirty_dir(mut self, dir: PathBuf) -> Result<Slots, IsolationError> {
        std::fs::create_dir_all(&dir).map_err(IsolationError::new("creating", &dir))?;
        self.dirty_dir = Some(dir);
        Ok(self)
    }

    fn dirty_marker(&self, slot: u32) -> Option<PathBuf> {
        self.dirty_dir.as_ref().map(|d| d.join(slot.to_string()))
    }

    /// Why `slot` is dirty, if it is.
    fn dirty_reason(&self, slot: u32) -> Option<(String, PathBuf)> {
        let marker = self.dirty_marker(slot)?;
        match std::fs::read_to_string(&marker) {
            Ok(reason) => Some((reason.trim().to_string(), marker)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => Some((format!("unreadable marker: {e}"), marker)),
        }
    }

    /// The dirty slots, in order.
    pub fn dirty_slots(&self) -> Vec<u32> {
        let Some(dir) = &self.dirty_dir else {
            return Vec::new();
        };
        let mut slots: Vec<u32> = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        slots.sort_unstable();
        slots
    }

    /// Why each dirty slot is dirty, cut to what a heartbeat carries.
    pub fn dirty_reasons(&self) -> BTreeMap<u32, String> {
        self.dirty_slots()
            .into_iter()
            .filter_map(|slot| {
                let (reason, _) = self.dirty_reason(slot)?;
                Some((slot, reason.chars().take(DIRTY_REASON_MAX_CHARS).collect()))
            })
            .collect()
    }

    fn mark_dirty(&self, slot: u32, reason: &str) {
        let Some(marker) = self.dirty_marker(slot) else {
            return;
        };
        if let Err(err) = std::fs::write(&marker, format!("{reason}\n")) {
            tracing::error!(slot, marker = %marker.display(), %err, "cannot write dirty-slot marker");
        }
    }

    /// How many slots this node has.
    pub fn count(&self) -> u32 {
        self.table().slots
    }

    /// The isolation in use.
    /// Who is in slot `slot` now (see [`SlotIsolation::occupants`]); reads `/proc`, so
    /// run it off the async workers.
    pub async fn occupants(&self, slot: u32) -> Result<SlotOccupants, SlotError> {
        self.check(slot)?;
        let isolation = self.isolation().clone();
        Ok(
            tokio::task::spawn_blocking(move || isolation.occupants(slot))
                .await
                .unwrap_or_default(),
        )
    }

    pub fn isolation(&self) -> &Arc<dyn SlotIsolation> {
        &self.isolation
    }

    fn table(&self) -> std::sync::MutexGuard<'_, SlotTable> {
        // The table is plain data updated in single statements: a poisoned lock still
        // holds a consistent table.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `slot` is one of this node's slots.
    pub fn check(&self, slot: u32) -> Result<(), SlotError> {
        self.table().check(slot)
    }

    /// The prepared slots.
    pub fn reports(&self) -> Vec<SlotReport> {
        self.table().reports()
    }

    /// The free slots that are warm.
    pub fn warm_slots(&self) -> Vec<u32> {
        self.table().warm()
    }

    /// Takes the lock of `slot` (checked to be one of ours).
    async fn lock(&self, slot: u32) -> Result<tokio::sync::OwnedMutexGuard<()>, SlotError> {
        self.check(slot)?;
        Ok(self.locks[slot as usize].clone().lock_owned().await)
    }

    /// Warms, in the background and one at a time in slot order, every free slot that is
    /// neither warm nor dirty (at start-up). Leftovers of a slot are wiped first.
    pub fn warm_free_slots(&self) {
        let slots = self.clone();
        self.warming.spawn(
            async move {
                for slot in 0..slots.locks.len() as u32 {
                    let Ok(lock) = slots.lock(slot).await else {
                        return;
                    };
                    slots.warm_locked(slot, lock, false).await;
                }
            }
            .in_current_span(),
        );
    }

    /// Warms `slot` while holding its `lock`; `clean` when a release just verified it.
    async fn warm_locked(&self, slot: u32, lock: tokio::sync::OwnedMutexGuard<()>, clean: bool) {
        let dirty = self.dirty_reason(slot).is_some();
        if !self.table().plan_warm(slot, dirty) {
            return;
        }
        let isolation = self.isolation.clone();
        // A quick warm-up runs on the event loop, whose priority stays.
        let background = !self.isolation.quick_setup();
        let result = if clean {
            self.setup(slot, "warm-up", move || {
                let _background = background.then(Background::enter);
                isolation.warm_after_destroy(slot)
            })
            .await
        } else {
            blocking(slot, "warm-up", move || {
                let _background = Background::enter();
                isolation.destroy(slot)?;
                isolation.warm(slot)
            })
            .await
        };
        match result {
            Ok(()) => {
                self.table().mark_warm(slot);
                tracing::debug!(slot, "slot warm");
            }
            Err(err) => tracing::warn!(
                slot,
                %err,
                "cannot warm slot; its next prepare takes the full path"
            ),
        }
        drop(lock);
    }

    /// Runs a set-up call (a warm-up, a warm prepare): on the event loop when the
    /// isolation's set-up is quick, else on a blocking thread.
    async fn setup<T: Send + 'static>(
        &self,
        slot: u32,
        action: &'static str,
        f: impl FnOnce() -> Result<T, IsolationError> + Send + 'static,
    ) -> Result<T, SlotError> {
        if self.isolation.quick_setup() {
            // A panic is this slot's failure, never the lane's or the agent's.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(result) => result.map_err(|error| SlotError::Isolation { slot, error }),
                Err(panic) => Err(SlotError::Task {
                    slot,
                    action,
                    message: panic_message(panic.as_ref()),
                }),
            }
        } else {
            blocking(slot, action, f).await
        }
    }

    /// Waits for the warm-ups running now (shutdown, tests).
    pub async fn warm_ups_done(&self) {
        self.warming.close();
        self.warming.wait().await;
        self.warming.reopen();
    }

    /// Name of the isolation in use, for logs.
    pub fn isolation_name(&self) -> &'static str {
        self.isolation.name()
    }

    /// Makes `slot` ready for `node_id` and returns its workspace and user. Waits for a
    /// warm-up of the slot that is running. Limits `limits` leaves unset are the
    /// defaults'.
    pub async fn prepare(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<String>,
        limits: Limits,
    ) -> Result<PreparedSlot, SlotError> {
        let limits = crate::isolation::default_limits::with_defaults(limits, &self.default_limits);
        let mut clock = StepClock::start();
        let _running = self.gate.read().await;
        let _slot = self.lock(slot).await?;
        // A prepare of a slot being released or warmed waits here.
        clock.lap("slot_lock");
        let plan = self.table().plan_prepare(slot, node_id)?;
        if plan == PreparePlan::Reuse {
            return Ok(PreparedSlot {
                workspace: self.isolation.workspace(slot),
                username: self.isolation.username(slot),
            });
        }
        if let Some((reason, marker)) = self.dirty_reason(slot) {
            return Err(SlotError::Dirty {
                slot,
                reason,
                marker,
            });
        }
        if plan == PreparePlan::FromWarm {
            let isolation = self.isolation.clone();
            let (node, key) = (node_id.clone(), ssh_public_key.clone());
            let warm = self
                .setup(slot, "prepare", move || {
                    isolation.prepare_warm(slot, &node, key.as_deref(), &limits)
                })
                .await;
            clock.lap("prepare_warm");
            match warm {
                Ok(workspace) => {
                    clock.log(slot, "prepare");
                    return Ok(self.prepared(slot, node_id, workspace));
                }
                Err(err) => {
                    tracing::warn!(slot, %err, "warm slot could not be prepared; taking the full path");
                    self.table().mark_cold(slot);
                }
            }
        }
        let isolation = self.isolation.clone();
        let node = node_id.clone();
        let workspace = blocking(slot, "prepare", move || {
            isolation.create(slot, &node, ssh_public_key.as_deref(), &limits)
        })
        .await?;
        clock.lap("create");
        clock.log(slot, "prepare");
        Ok(self.prepared(slot, node_id, workspace))
    }

    fn prepared(&self, slot: u32, node_id: &NodeId, workspace: PathBuf) -> PreparedSlot {
        self.table().mark_prepared(slot, node_id.clone());
        PreparedSlot {
            workspace,
            username: self.isolation.username(slot),
        }
    }

    /// Refuses new prepares from now on, once the prepares running have finished; returns
    /// the prepared slots.
    pub async fn close(&self) -> Vec<u32> {
        self.set_closed(true).await
    }

    /// Accepts prepares again; returns the prepared slots.
    pub async fn open(&self) -> Vec<u32> {
        self.set_closed(false).await
    }

    async fn set_closed(&self, closed: bool) -> Vec<u32> {
        let _alone = self.gate.write().await;
        let mut table = self.table();
        table.set_closed(closed);
        table.prepared()
    }

    /// Wipes `slot` unless another node holds it; once it is verified clean, warms it
    /// again in the background (the slot's lock passes straight to the warm-up). A slot
    /// that cannot be cleaned is marked dirty and the error is [`SlotError::Unclean`].
    pub async fn release(&self, slot: u32, node_id: &NodeId) -> Result<ReleaseOutcome, SlotError> {
        let mut clock = StepClock::start();
        let lock = self.lock(slot).await?;
        clock.lap("slot_lock");
        match self.table().plan_release(slot, node_id)? {
            ReleasePlan::KeepHolder(holder) => return Ok(ReleaseOutcome::HeldByOther(holder)),
            ReleasePlan::Destroy => {}
        }
        let isolation = self.isolation.clone();
        let result = blocking(slot, "release", move || {
            let _background = Background::enter();
            isolation.release(slot)
        })
        .await;
        clock.lap("clean");
        clock.log(slot, "release_reply");
        self.table().mark_released(slot);
        if let Err(err) = result {
            tracing::error!(slot, %err, "slot could not be cleaned: marking it dirty");
            crate::metrics::wipe_failed();
            self.mark_dirty(slot, &err.to_string());
            return Err(SlotError::Unclean {
                slot,
                cause: Box::new(err),
            });
        }
        let slots = self.clone();
        self.warming
            .spawn(async move { slots.warm_locked(slot, lock, true).await }.in_current_span());
        Ok(ReleaseOutcome::Wiped)
    }
}

/// The nice value releases and warm-ups run at (prepares run at the agent's own, 0 by
/// default): a thread at nice 10 gets about a tenth of the CPU time of one at 0 when
/// both want it, and all of it when nothing else does.
pub const BACKGROUND_NICE: i32 = 10;

/// Runs the calling thread at [`BACKGROUND_NICE`] until dropped; the processes it starts
/// meanwhile inherit it. Only as root (with `CAP_SYS_NICE`): the thread is one of the
/// blocking pool, which also runs prepares, and nobody else could raise it back.
pub struct Background {
    thread: rustix::process::Pid,
    before: i32,
}

impl Background {
    /// Lowers the thread's priority; `None` when it was not lowered (not root, or
    /// already at [`BACKGROUND_NICE`] or lower).
    pub fn enter() -> Option<Background> {
        if !rustix::process::geteuid().is_root() {
            return None;
        }
        let thread = rustix::thread::gettid();
        let before = rustix::process::getpriority_process(Some(thread)).ok()?;
        if before >= BACKGROUND_NICE {
            return None;
        }
        rustix::process::setpriority_process(Some(thread), BACKGROUND_NICE).ok()?;
        Some(Background { thread, before })
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Err(err) = rustix::process::setpriority_process(Some(self.thread), self.before) {
            tracing::warn!(%err, nice = self.before, "cannot restore a thread's priority");
        }
    }
}

/// What a caught panic said.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    format!("panicked: {text}")
}

/// Runs an isolation call off the async runtime. A panic in it (a `JoinError`) is this
/// slot's failure: a release that panics leaves its slot dirty with the panic's message.
async fn blocking<T: Send + 'static>(
    slot: u32,
    action: &'static str,
    f: impl FnOnce() -> Result<T, IsolationError> + Send + 'static,
) -> Result<T, SlotError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|err| SlotError::Task {
            slot,
            action,
            message: match err.try_into_panic() {
                Ok(panic) => panic_message(panic.as_ref()),
                Err(err) => err.to_string(),
            },
        })?
        .map_err(|error| SlotError::Isolation { slot, error })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::WorkspaceOnly;

    const L: Limits = Limits {
        cpu_millis: None,
        memory_bytes: None,
        pids: None,
        disk_bytes: None,
    };

    fn node(s: &str) -> NodeId {
        NodeId::parse(s).unwrap()
    }

    #[test]
    fn table_rules() {
        let mut t = SlotTable::new(4);
        let (a, b) = (node("node-a"), node("node-b"));
        assert_eq!(t.plan_prepare(0, &a).unwrap(), PreparePlan::Create);
        t.mark_prepared(0, a.clone());
        assert_eq!(t.plan_prepare(0, &a).unwrap(), PreparePlan::Reuse);
        let err = t.plan_prepare(0, &b).unwrap_err().to_string();
        assert_eq!(
            err,
            "slot 0 is held by node node-a; cannot prepare it for node node-b"
        );
        assert_eq!(
            t.plan_release(0, &b).unwrap(),
            ReleasePlan::KeepHolder(a.clone())
        );
        assert_eq!(t.plan_release(0, &a).unwrap(), ReleasePlan::Destroy);
        assert_eq!(t.plan_release(2, &a).unwrap(), ReleasePlan::Destroy);
        let err = t.plan_prepare(4, &a).unwrap_err().to_string();
        assert_eq!(err, "slot 4 does not exist: this node has 4 slots (0 to 3)");
        assert!(t.plan_release(9, &a).is_err());
        t.mark_released(0);
        assert!(t.reports().is_empty());
    }

    #[test]
    fn closed_table_refuses_new_nodes_only() {
        let mut t = SlotTable::new(4);
        let (a, b) = (node("node-a"), node("node-b"));
        t.mark_prepared(1, a.clone());
        t.set_closed(true);
        assert_eq!(t.prepared(), vec![1]);
        assert_eq!(t.plan_prepare(1, &a).unwrap(), PreparePlan::Reuse);
        assert_eq!(
            t.plan_prepare(2, &b).unwrap_err().to_string(),
            "slot 2 not prepared: this agent is closed to new slots"
        );
        assert_eq!(t.plan_release(1, &a).unwrap(), ReleasePlan::Destroy);
        t.set_closed(false);
        assert_eq!(t.plan_prepare(2, &b).unwrap(), PreparePlan::Create);
    }

    #[test]
    fn restore_keeps_slots_in_range_in_order() {
        let mut t = SlotTable::new(2);
        t.restore(vec![
            FoundSlot::prepared(1, node("node-b")),
            FoundSlot::prepared(5, node("node-x")),
            FoundSlot::prepared(0, node("node-a")),
            FoundSlot::warm(7),
        ]);
        assert!(t.warm().is_empty());
        let slots: Vec<_> = t
            .reports()
            .into_iter()
            .map(|r| (r.slot, r.node_id))
            .collect();
        assert_eq!(slots, vec![(0, node("node-a")), (1, node("node-b"))]);
    }

    #[tokio::test]
    async fn prepare_and_release_through_the_workspace_isolation() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(WorkspaceOnly::new(work.path()).unwrap());
        let slots = Slots::recover(iso.clone(), 2).await.unwrap();
        let a = node("node-a");
        let ws = slots.prepare(1, &a, None, L).await.unwrap().workspace;
        // The heartbeat's template names the workspace the prepare returned.
        let names = slots.isolation().slot_names();
        assert_eq!(names.workspace_of(1), ws.display().to_string());
        assert_eq!(names.username_of(1), None);
        std::fs::write(ws.join("job-output"), "keep me").unwrap();
        // Re-preparing for the same node keeps the workspace as it is.
        assert_eq!(slots.prepare(1, &a, None, L).await.unwrap().workspace, ws);
        assert!(ws.join("job-output").exists());
        assert!(matches!(
            slots.prepare(1, &node("node-b"), None, L).await,
            Err(SlotError::Held { .. })
        ));

        // A restarted agent sees the same slots.
        let again = Slots::recover(iso, 2).await.unwrap();
        assert_eq!(again.reports(), slots.reports());

        assert_eq!(
            slots.release(1, &node("node-b")).await.unwrap(),
            ReleaseOutcome::HeldByOther(a.clone())
        );
        assert!(ws.join("job-output").exists());
        assert_eq!(slots.release(1, &a).await.unwrap(), ReleaseOutcome::Wiped);
        assert!(!ws.join("job-output").exists());
        assert_eq!(slots.release(1, &a).await.unwrap(), ReleaseOutcome::Wiped);
        assert!(slots.reports().is_empty());

        slots.prepare(0, &a, None, L).await.unwrap();
        assert_eq!(slots.close().await, vec![0]);
        assert!(matches!(
            slots.prepare(1, &node("node-c"), None, L).await,
            Err(SlotError::Closed { slot: 1 })
        ));
        assert_eq!(slots.open().await, vec![0]);
        slots.prepare(1, &node("node-c"), None, L).await.unwrap();
    }

    /// Mode `none` run off the event loop, noting the nice value each call ran at.
    struct NiceProbe {
        inner: WorkspaceOnly,
        seen: Mutex<Vec<(&'static str, i32)>>,
    }

    impl NiceProbe {
        fn note(&self, call: &'static str) {
            let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()));
            self.seen.lock().unwrap().push((call, nice.unwrap()));
        }
    }

    impl SlotIsolation for NiceProbe {
        fn name(&self) -> &'static str {
            "nice-probe"
        }
        fn workspace(&self, slot: u32) -> PathBuf {
            self.inner.workspace(slot)
        }
        fn slot_names(&self) -> slotpool_protocol::model::SlotNames {
            self.inner.slot_names()
        }
        fn warm(&self, slot: u32) -> Result<(), IsolationError> {
            self.note("warm");
            self.inner.warm(slot)
        }
        fn prepare_warm(
            &self,
            slot: u32,
            node_id: &NodeId,
            key: Option<&str>,
            limits: &Limits,
        ) -> Result<PathBuf, IsolationError> {
            self.note("prepare");
            self.inner.prepare_warm(slot, node_id, key, limits)
        }
        fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
            self.note("destroy");
            self.inner.destroy(slot)
        }
        fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError> {
            self.inner.recover()
        }
    }

    /// Releases and warm-ups run at [`BACKGROUND_NICE`], prepares at the agent's own
    /// priority, on the same pool of threads: the priority is lowered for the call only.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn releases_and_warm_ups_run_at_a_lower_priority_than_prepares() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let work = tempfile::tempdir().unwrap();
        let probe = Arc::new(NiceProbe {
            inner: WorkspaceOnly::new(work.path()).unwrap(),
            seen: Mutex::new(Vec::new()),
        });
        let slots = Slots::recover(probe.clone(), 1).await.unwrap();
        let own = rustix::process::getpriority_process(None).unwrap();
        assert!(own < BACKGROUND_NICE, "the test runs at nice {own}");
        slots.warm_free_slots();
        slots.warm_ups_done().await;
        let a = node("node-a");
        for _ in 0..3 {
            slots.prepare(0, &a, None, L).await.unwrap();
            assert_eq!(slots.release(0, &a).await.unwrap(), ReleaseOutcome::Wiped);
            slots.warm_ups_done().await;
        }
        let seen = probe.seen.lock().unwrap().clone();
        eprintln!("calls and their nice values: {seen:?}");
        assert_eq!(seen.len(), 2 + 3 * 3, "{seen:?}");
        for (call, nice) in &seen {
            let want = if *call == "prepare" {
                own
            } else {
                BACKGROUND_NICE
            };
            assert_eq!(*nice, want, "{call} ran at nice {nice}: {seen:?}");
        }
    }

    /// Mode `none` with a destroy of its own (failing, panicking), to see what a slot
    /// that cannot be wiped becomes.
    struct BadDestroy {
        inner: WorkspaceOnly,
        destroy: fn(&WorkspaceOnly, u32) -> Result<(), IsolationError>,
    }

    /// Destroy always fails: a process survived.
    fn unwipeable(work: &std::path::Path) -> BadDestroy {
        BadDestroy {
            inner: WorkspaceOnly::new(work).unwrap(),
            destroy: |iso, slot| {
                Err(IsolationError::new("killing", &iso.workspace(slot))(
                    std::io::Error::other("a process survived"),
                ))
            },
        }
    }

    /// Destroy of slot 1 panics.
    fn panicking(work: &std::path::Path) -> BadDestroy {
        BadDestroy {
            inner: WorkspaceOnly::new(work).unwrap(),
            destroy: |iso, slot| {
                assert_ne!(slot, 1, "slot 1 cannot be destroyed");
                iso.destroy(slot)
            },
        }
    }

    impl SlotIsolation for BadDestroy {
        fn name(&self) -> &'static str {
            "bad-destroy"
        }
        fn workspace(&self, slot: u32) -> PathBuf {
            self.inner.workspace(slot)
        }
        fn slot_names(&self) -> slotpool_protocol::model::SlotNames {
            self.inner.slot_names()
        }
        fn create(
            &self,
            slot: u32,
            node_id: &NodeId,
            key: Option<&str>,
            limits: &Limits,
        ) -> Result<PathBuf, IsolationError> {
            self.inner.create(slot, node_id, key, limits)
        }
        fn warm(&self, slot: u32) -> Result<(), IsolationError> {
            self.inner.warm(slot)
        }
        fn prepare_warm(
            &self,
            slot: u32,
            node_id: &NodeId,
            key: Option<&str>,
            limits: &Limits,
        ) -> Result<PathBuf, IsolationError> {
            self.inner.prepare_warm(slot, node_id, key, limits)
        }
        fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
            (self.destroy)(&self.inner, slot)
        }
        fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError> {
            self.inner.recover()
        }
    }

    #[tokio::test]
    async fn a_slot_that_cannot_be_cleaned_is_dirty_until_an_operator_acts() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(unwipeable(work.path()));
        let slots = Slots::recover(iso, 2)
            .await
            .unwrap()
            .with_dirty_dir(work.path().join("dirty"))
            .unwrap();
        let a = node("node-a");
        slots.prepare(1, &a, None, L).await.unwrap();
        let err = slots.release(1, &a).await.unwrap_err();
        assert!(
            matches!(err, SlotError::Unclean { slot: 1, .. })
                && err
                    .to_string()
                    .ends_with("a process survived; the slot is now dirty"),
            "{err}"
        );
        assert_eq!(slots.dirty_slots(), vec![1]);
        let reasons = slots.dirty_reasons();
        assert!(
            reasons[&1].contains("a process survived"),
            "the heartbeat says why: {reasons:?}"
        );
        slots.warm_free_slots();
        slots.warm_ups_done().await;
        assert!(
            !slots.warm_slots().contains(&1),
            "a dirty slot is never warmed"
        );
        let err = slots
            .prepare(1, &node("node-b"), None, L)
            .await
            .unwrap_err();
        assert!(
            matches!(err, SlotError::Dirty { slot: 1, .. })
                && err.to_string().contains("a process survived"),
            "{err}"
        );
        slots.prepare(0, &node("node-b"), None, L).await.unwrap();
        std::fs::remove_file(work.path().join("dirty/1")).unwrap();
        assert!(slots.dirty_slots().is_empty());
        slots.prepare(1, &node("node-c"), None, L).await.unwrap();
    }

    #[tokio::test]
    async fn a_panic_in_a_release_leaves_only_that_slot_dirty() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(panicking(work.path()));
        let slots = Slots::recover(iso, 2)
            .await
            .unwrap()
            .with_dirty_dir(work.path().join("dirty"))
            .unwrap();
        let (a, b) = (node("node-a"), node("node-b"));
        slots.prepare(0, &a, None, L).await.unwrap();
        let err = slots.release(1, &a).await.unwrap_err();
        assert!(
            matches!(err, SlotError::Unclean { slot: 1, .. })
                && err.to_string().contains("panicked: assertion")
                && err.to_string().contains("slot 1 cannot be destroyed"),
            "{err}"
        );
        assert_eq!(slots.dirty_slots(), vec![1]);
        let reason = std::fs::read_to_string(work.path().join("dirty/1")).unwrap();
        assert!(reason.contains("slot 1 cannot be destroyed"), "{reason}");
        // The other slot goes on working.
        slots.release(0, &a).await.unwrap();
        slots.prepare(0, &b, None, L).await.unwrap();
        slots.release(0, &b).await.unwrap();
        assert_eq!(slots.dirty_slots(), vec![1]);
    }

    #[test]
    fn warm_and_cold_slots() {
        let mut t = SlotTable::new(4);
        let a = node("node-a");
        t.restore(vec![FoundSlot::warm(1), FoundSlot::prepared(2, a.clone())]);
        assert_eq!(t.warm(), vec![1]);
        assert_eq!(t.plan_prepare(1, &a).unwrap(), PreparePlan::FromWarm);
        assert_eq!(t.plan_prepare(0, &a).unwrap(), PreparePlan::Create);
        // Only free, cold, clean slots of ours are warmed.
        assert!(t.plan_warm(0, false));
        assert!(!t.plan_warm(0, true), "dirty");
        assert!(!t.plan_warm(1, false), "already warm");
        assert!(!t.plan_warm(2, false), "held");
        assert!(!t.plan_warm(4, false), "not ours");
        // Preparing uses up the warm state; a held slot is never marked warm.
        t.mark_prepared(1, a.clone());
        assert!(t.warm().is_empty());
        t.mark_warm(1);
        assert!(t.warm().is_empty());
        // A release leaves the slot cold until warmed again.
        t.mark_released(1);
        assert_eq!(t.plan_prepare(1, &a).unwrap(), PreparePlan::Create);
        t.mark_warm(1);
        assert_eq!(t.plan_prepare(1, &a).unwrap(), PreparePlan::FromWarm);
        t.mark_cold(1);
        assert_eq!(t.plan_prepare(1, &a).unwrap(), PreparePlan::Create);
        // Closed: a warm slot is refused like any free one.
        t.mark_warm(3);
        t.set_closed(true);
        assert!(matches!(
            t.plan_prepare(3, &a),
            Err(SlotError::Closed { slot: 3 })
        ));
    }

    /// A workspace isolation that records its calls and can be made to fail.
    #[derive(Default)]
    struct Recording {
        inner: Option<WorkspaceOnly>,
        calls: Mutex<Vec<String>>,
        fail_warm: std::sync::atomic::AtomicBool,
        fail_prepare_warm: std::sync::atomic::AtomicBool,
        warm_pause: Option<std::time::Duration>,
    }

    impl Recording {
        fn new(work: &std::path::Path) -> Recording {
            Recording {
                inner: Some(WorkspaceOnly::new(work).unwrap()),
                ..Recording::default()
            }
        }
        fn iso(&self) -> &WorkspaceOnly {
            self.inner.as_ref().unwrap()
        }
        fn record(&self, call: &str, slot: u32) {
            self.calls.lock().unwrap().push(format!("{call} {slot}"));
        }
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.calls.lock().unwrap())
        }
    }

    fn failed(what: &str) -> IsolationError {
        IsolationError::new("testing", std::path::Path::new(what))(std::io::Error::other(
            "made to fail",
        ))
    }

    impl SlotIsolation for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }
        fn workspace(&self, slot: u32) -> PathBuf {
            self.iso().workspace(slot)
        }
        fn slot_names(&self) -> slotpool_protocol::model::SlotNames {
            self.iso().slot_names()
        }
        fn create(
            &self,
            slot: u32,
            node_id: &NodeId,
            key: Option<&str>,
            limits: &Limits,
        ) -> Result<PathBuf, IsolationError> {
            self.record("create", slot);
            self.iso().create(slot, node_id, key, limits)
        }
        fn warm(&self, slot: u32) -> Result<(), IsolationError> {
            self.record("warm", slot);
            if let Some(pause) = self.warm_pause {
                std::thread::sleep(pause);
            }
            if self.fail_warm.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(failed("warm"));
            }
            self.iso().warm(slot)
        }
        fn prepare_warm(
            &self,
            slot: u32,
            node_id: &NodeId,
            key: Option<&str>,
            limits: &Limits,
        ) -> Result<PathBuf, IsolationError> {
            self.record("prepare_warm", slot);
            if self
                .fail_prepare_warm
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                return Err(failed("prepare_warm"));
            }
            self.iso().prepare_warm(slot, node_id, key, limits)
        }
        fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
            self.record("destroy", slot);
            self.iso().destroy(slot)
        }
        fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError> {
            self.iso().recover()
        }
    }

    #[tokio::test]
    async fn free_slots_are_warmed_at_start_and_after_release() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(Recording::new(work.path()));
        let a = node("node-a");
        // A slot prepared before a restart stays prepared and is not warmed.
        iso.iso().create(1, &a, None, &L).unwrap();
        let slots = Slots::recover(iso.clone(), 3).await.unwrap();
        slots.warm_free_slots();
        slots.warm_ups_done().await;
        assert_eq!(slots.warm_slots(), vec![0, 2]);
        assert_eq!(
            iso.take(),
            ["destroy 0", "warm 0", "destroy 2", "warm 2"],
            "cold slots are wiped before warm-up"
        );
        // A restarted agent finds its warm slots on disk.
        let again = Slots::recover(iso.clone(), 3).await.unwrap();
        assert_eq!(again.warm_slots(), vec![0, 2]);

        // Preparing a warm slot takes only the warm path.
        let ws = slots
            .prepare(0, &a, Some("ssh-ed25519 K".into()), L)
            .await
            .unwrap();
        assert_eq!(iso.take(), ["prepare_warm 0"]);
        std::fs::write(ws.workspace.join("job-output"), "of job 1").unwrap();
        // Release wipes, then warms again without wiping twice.
        slots.release(0, &a).await.unwrap();
        slots.warm_ups_done().await;
        assert_eq!(iso.take(), ["destroy 0", "warm 0"]);
        assert_eq!(slots.warm_slots(), vec![0, 2]);
        assert!(crate::isolation::is_empty_dir(&ws.workspace));
        let b = node("node-b");
        slots.prepare(0, &b, None, L).await.unwrap();
        assert!(
            crate::isolation::is_empty_dir(&ws.workspace),
            "nothing of the previous job"
        );
        // A restarted agent sees who holds the slot now.
        let again = Slots::recover(iso.clone(), 3).await.unwrap();
        assert_eq!(again.reports(), slots.reports());
        assert_eq!(again.warm_slots(), vec![2]);
    }

    #[tokio::test]
    async fn a_prepare_right_after_a_release_waits_for_the_warm_up() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(Recording {
            warm_pause: Some(std::time::Duration::from_millis(200)),
            ..Recording::new(work.path())
        });
        let slots = Slots::recover(iso.clone(), 1).await.unwrap();
        let (a, b) = (node("node-a"), node("node-b"));
        slots.prepare(0, &a, None, L).await.unwrap();
        slots.release(0, &a).await.unwrap();
        slots.prepare(0, &b, None, L).await.unwrap();
        assert_eq!(
            iso.take(),
            ["create 0", "destroy 0", "warm 0", "prepare_warm 0"]
        );
    }

    #[tokio::test]
    async fn cold_slots_take_the_full_path() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(Recording::new(work.path()));
        let slots = Slots::recover(iso.clone(), 2).await.unwrap();
        let a = node("node-a");
        // Warm-up fails: the slot stays cold and the prepare does everything.
        iso.fail_warm
            .store(true, std::sync::atomic::Ordering::SeqCst);
        slots.warm_free_slots();
        slots.warm_ups_done().await;
        assert!(slots.warm_slots().is_empty());
        iso.take();
        slots.prepare(0, &a, None, L).await.unwrap();
        assert_eq!(iso.take(), ["create 0"]);
        // The warm path fails: the prepare falls back to the full path.
        iso.fail_warm
            .store(false, std::sync::atomic::Ordering::SeqCst);
        slots.warm_free_slots();
        slots.warm_ups_done().await;
        assert_eq!(slots.warm_slots(), vec![1]);
        iso.take();
        iso.fail_prepare_warm
            .store(true, std::sync::atomic::Ordering::SeqCst);
        slots.prepare(1, &a, None, L).await.unwrap();
        assert_eq!(iso.take(), ["prepare_warm 1", "create 1"]);
        assert_eq!(slots.reports().len(), 2);
    }
}
