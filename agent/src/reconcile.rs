//! At start-up, the slots a restarted agent finds prepared on disk are checked against
//! the slots bucket: a slot whose node is gone from its key (the launcher released it
//! while the agent was down, and skipped the agent since it was not there) is released
//! by the agent itself, so a job's processes and files do not wait for a release that
//! will never come.
//!
//! The decision is [`stale`], a pure function; [`reconcile`] reads each prepared slot's
//! key (the agent's credential may read its own backing node's slot keys and no others;
//! see `slotpool_protocol::auth::permissions`) and releases the stale ones through
//! [`Slots::release`], so a release that cannot clean its slot leaves it dirty as any
//! other. It runs before the agent subscribes to commands and sends its first heartbeat,
//! so no launcher acts on the slot meanwhile. A slot whose key cannot be read stays
//! prepared: only a node the bucket says is gone is released.

use crate::slots::Slots;
use futures::future::join_all;
use slotpool_protocol::layout;
use slotpool_protocol::model::Node;
use slotpool_protocol::store::Store;
use slotpool_protocol::{BackingId, NodeId};
use std::time::Duration;

/// Longest wait for one slot key.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a slot prepared for `held` is to be released, given what its key holds:
/// `Ok(None)` for no node, `Err` when it could not be read.
pub fn stale(held: &NodeId, in_bucket: &Result<Option<NodeId>, String>) -> bool {
    match in_bucket {
        Ok(None) => true,
        Ok(Some(node)) => node != held,
        Err(_) => false,
    }
}

/// The node under `key`, read within [`READ_TIMEOUT`].
async fn node_in(bucket: &Store, key: String) -> Result<Option<NodeId>, String> {
    match tokio::time::timeout(READ_TIMEOUT, bucket.get::<Node>(&key)).await {
        Ok(Ok(node)) => Ok(node.map(|n| n.value.id)),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {READ_TIMEOUT:?}")),
    }
}

/// Releases every prepared slot whose node the slots bucket no longer holds; returns the
/// slots released. Keys are read, and stale slots released, concurrently.
pub async fn reconcile(slots: &Slots, bucket: &Store, backing: &BackingId) -> Vec<u32> {
    let reports = slots.reports();
    let reads = join_all(
        reports
            .iter()
            .map(|r| node_in(bucket, layout::slot_key(backing, r.slot))),
    )
    .await;
    let mut stale_slots = Vec::new();
    for (report, in_bucket) in reports.into_iter().zip(reads) {
        let (slot, held) = (report.slot, report.node_id);
        match &in_bucket {
            Err(err) => {
                tracing::warn!(slot, node_id = %held, %err, "cannot read the slot's key; keeping the slot prepared")
            }
            Ok(now) if stale(&held, &in_bucket) => {
                tracing::info!(slot, node_id = %held, in_bucket = ?now, "the slot's node is gone: releasing the slot");
                stale_slots.push((slot, held));
            }
            Ok(_) => {}
        }
    }
    let releases = join_all(
        stale_slots
            .into_iter()
            .map(|(slot, held)| async move { (slot, slots.release(slot, &held).await) }),
    )
    .await;
    releases
        .into_iter()
        .filter_map(|(slot, result)| match result {
            Ok(_) => Some(slot),
            Err(err) => {
                tracing::error!(slot, %err, "cannot release the slot of a node that is gone");
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_node_the_bucket_no_longer_holds_is_stale() {
        let a = NodeId::parse("node-a").unwrap();
        let b = NodeId::parse("node-b").unwrap();
        assert!(stale(&a, &Ok(None)));
        assert!(stale(&a, &Ok(Some(b))));
        assert!(!stale(&a, &Ok(Some(a.clone()))));
        assert!(!stale(&a, &Err("timed out".into())));
    }
}
