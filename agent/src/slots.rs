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
//! Callers must not run two operations on the same slot at once ([`crate::commands`]
//! queues them per slot). The closed flag is kept in memory only: a restarted agent is
//! open again.

use crate::isolation::{FoundSlot, IsolationError, SlotIsolation};
use slotpool_protocol::api::SlotLimits;
use slotpool_protocol::model::SlotReport;
use slotpool_protocol::NodeId;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

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
}

/// What a prepare has to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PreparePlan {
    /// The node already holds the slot: return its workspace as it is.
    Reuse,
    /// The slot is free: make it fresh for the node.
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

/// The prepared slots of this node. Plain data.
#[derive(Clone, Debug)]
pub struct SlotTable {
    slots: u32,
    held: BTreeMap<u32, NodeId>,
    closed: bool,
}

impl SlotTable {
    /// An empty table for a node with `slots` slots.
    pub fn new(slots: u32) -> SlotTable {
        SlotTable {
            slots,
            held: BTreeMap::new(),
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
    /// out (they were prepared when the node had more slots).
    pub fn restore(&mut self, found: Vec<FoundSlot>) {
        for FoundSlot { slot, node_id } in found {
            match self.check(slot) {
                Ok(()) => {
                    self.held.insert(slot, node_id);
                }
                Err(err) => tracing::warn!(slot, %node_id, %err, "ignoring prepared slot on disk"),
            }
        }
    }

    pub fn plan_prepare(&self, slot: u32, node_id: &NodeId) -> Result<PreparePlan, SlotError> {
        self.check(slot)?;
        match self.held.get(&slot) {
            None if self.closed => Err(SlotError::Closed { slot }),
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

    pub fn mark_prepared(&mut self, slot: u32, node_id: NodeId) {
        self.held.insert(slot, node_id);
    }

    pub fn mark_released(&mut self, slot: u32) {
        self.held.remove(&slot);
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
        })
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

    fn mark_dirty(&self, slot: u32, reason: &str) {
        let Some(marker) = self.dirty_marker(slot) else {
            return;
        };
        if let Err(err) = std::fs::write(&marker, format!("{reason}\n")) {
            tracing::error!(slot, marker = %marker.display(), %err, "cannot write dirty-slot marker");
        }
    }

    /// The isolation in use.
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

    /// Name of the isolation in use, for logs.
    pub fn isolation_name(&self) -> &'static str {
        self.isolation.name()
    }

    /// Makes `slot` ready for `node_id` and returns its workspace and user.
    pub async fn prepare(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<String>,
        limits: SlotLimits,
    ) -> Result<PreparedSlot, SlotError> {
        let _running = self.gate.read().await;
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
        let isolation = self.isolation.clone();
        let node = node_id.clone();
        let workspace = blocking(slot, "prepare", move || {
            isolation.create(slot, &node, ssh_public_key.as_deref(), &limits)
        })
        .await?;
        self.table().mark_prepared(slot, node_id.clone());
        Ok(PreparedSlot {
            workspace,
            username: self.isolation.username(slot),
        })
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

    /// Wipes `slot` unless another node holds it.
    pub async fn release(&self, slot: u32, node_id: &NodeId) -> Result<ReleaseOutcome, SlotError> {
        match self.table().plan_release(slot, node_id)? {
            ReleasePlan::KeepHolder(holder) => return Ok(ReleaseOutcome::HeldByOther(holder)),
            ReleasePlan::Destroy => {}
        }
        let isolation = self.isolation.clone();
        let result = blocking(slot, "release", move || isolation.destroy(slot)).await;
        self.table().mark_released(slot);
        if let Err(err) = result {
            tracing::error!(slot, %err, "slot could not be cleaned: marking it dirty");
            self.mark_dirty(slot, &err.to_string());
            return Err(err);
        }
        Ok(ReleaseOutcome::Wiped)
    }
}

/// Runs an isolation call off the async runtime.
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
            message: err.to_string(),
        })?
        .map_err(|error| SlotError::Isolation { slot, error })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::WorkspaceOnly;

    const L: SlotLimits = SlotLimits {
        cpu_millis: None,
        memory_bytes: None,
        pids: None,
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
            FoundSlot {
                slot: 1,
                node_id: node("node-b"),
            },
            FoundSlot {
                slot: 5,
                node_id: node("node-x"),
            },
            FoundSlot {
                slot: 0,
                node_id: node("node-a"),
            },
        ]);
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
        assert!(ws.exists());
        assert_eq!(slots.release(1, &a).await.unwrap(), ReleaseOutcome::Wiped);
        assert!(!ws.exists());
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

    /// An isolation whose destroy always fails, to see a slot marked dirty.
    struct Unwipeable(WorkspaceOnly);

    impl SlotIsolation for Unwipeable {
        fn name(&self) -> &'static str {
            "unwipeable"
        }
        fn workspace(&self, slot: u32) -> PathBuf {
            self.0.workspace(slot)
        }
        fn create(
            &self,
            slot: u32,
            node_id: &NodeId,
            key: Option<&str>,
            limits: &SlotLimits,
        ) -> Result<PathBuf, IsolationError> {
            self.0.create(slot, node_id, key, limits)
        }
        fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
            Err(IsolationError::new("killing", &self.0.workspace(slot))(
                std::io::Error::other("a process survived"),
            ))
        }
        fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError> {
            self.0.recover()
        }
    }

    #[tokio::test]
    async fn a_slot_that_cannot_be_cleaned_is_dirty_until_an_operator_acts() {
        let work = tempfile::tempdir().unwrap();
        let iso = Arc::new(Unwipeable(WorkspaceOnly::new(work.path()).unwrap()));
        let slots = Slots::recover(iso, 2)
            .await
            .unwrap()
            .with_dirty_dir(work.path().join("dirty"))
            .unwrap();
        let a = node("node-a");
        slots.prepare(1, &a, None, L).await.unwrap();
        assert!(slots.release(1, &a).await.is_err());
        assert_eq!(slots.dirty_slots(), vec![1]);
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
}
