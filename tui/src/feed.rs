//! One task per bucket turns KV watch changes into [`Msg::Feed`] batches on the console's
//! channel. The values are decoded here, off the drawing task.
//!
//! A watch starts with every current value and then [`Change::Synced`]; the first batch
//! of a (re)started watch is preceded by [`Change::Restarted`], so the state can drop
//! whatever the new watch does not deliver again. A watch is restarted when it ends or
//! fails, and when the NATS connection comes back after a loss.

use crate::mirror::{Bucket, Change, Record, EVENT_HISTORY};
use crate::state::Msg;
use futures::StreamExt;
use slotpool_protocol::connect::{Bus, Link};
use slotpool_protocol::layout;
use slotpool_protocol::store::{self, Store};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Most changes sent in one batch.
const BATCH: usize = 2048;
/// Pause before restarting a watch that failed.
const RETRY_AFTER: Duration = Duration::from_millis(500);

/// Starts one feed per [`Bucket`].
pub fn spawn_feeds(
    bus: &Bus,
    link: watch::Receiver<Link>,
    tx: mpsc::Sender<Msg>,
    stop: CancellationToken,
    tracker: &TaskTracker,
) {
    for bucket in Bucket::ALL {
        let store = match bucket {
            Bucket::Backing => bus.backing.clone(),
            Bucket::Slots => bus.slots.clone(),
            Bucket::Requests => bus.requests.clone(),
            Bucket::Agents => bus.agents.clone(),
            Bucket::Events => bus.events.clone(),
            // The providers' status records are in the leases bucket.
            Bucket::Providers => bus.leases.clone(),
            // So are the launchers' liveness leases.
            Bucket::Launchers => bus.leases.clone(),
        };
        tracker.spawn(feed(bucket, store, link.clone(), tx.clone(), stop.clone()));
    }
}

/// Decodes one watch change; an undecodable record becomes a `Failed` change.
pub fn decode(bucket: Bucket, change: store::Change) -> Change {
    match change {
        store::Change::Put { key, value, .. } => {
            let record = match bucket {
                Bucket::Backing => serde_json_decode(&value).map(Record::Backing),
                Bucket::Slots => serde_json_decode(&value).map(Record::Slot),
                Bucket::Requests => serde_json_decode(&value).map(Record::Request),
                Bucket::Agents => serde_json_decode(&value).map(Record::Agent),
                Bucket::Events => serde_json_decode(&value).map(Record::Event),
                Bucket::Providers => serde_json_decode(&value).map(Record::Provider),
                Bucket::Launchers => serde_json_decode(&value).map(Record::Launcher),
            };
            match record {
                Ok(record) => Change::Put { key, record },
                Err(err) => Change::Failed {
                    bucket,
                    error: format!("cannot decode {key}: {err}"),
                },
            }
        }
        store::Change::Removed { key, .. } => Change::Removed { bucket, key },
        store::Change::Synced => Change::Synced(bucket),
    }
}

fn serde_json_decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<Box<T>, String> {
    store::Change::decode::<T>("", "", 0, bytes)
        .map(|v| Box::new(v.value))
        .map_err(|err| match err {
            store::KvError::Decode { source, .. } => source.to_string(),
            other => other.to_string(),
        })
}

async fn feed(
    bucket: Bucket,
    store: Store,
    mut link: watch::Receiver<Link>,
    tx: mpsc::Sender<Msg>,
    stop: CancellationToken,
) {
    loop {
        let opened = match bucket {
            Bucket::Events => store
                .watch_recent(EVENT_HISTORY as u64)
                .await
                .map(|w| w.boxed()),
            Bucket::Providers => store
                .watch_keys(layout::PROVIDER_STATUS_KEYS)
                .await
                .map(|w| w.boxed()),
            Bucket::Launchers => store
                .watch_keys(layout::LAUNCHER_LEASE_KEYS)
                .await
                .map(|w| w.boxed()),
            _ => store.watch().await.map(|w| w.boxed()),
        };
        let mut changes = match opened {
            Ok(w) => w.ready_chunks(BATCH),
            Err(err) => {
                let failed = Change::Failed {
                    bucket,
                    error: err.to_string(),
                };
                if tx.send(Msg::Feed(vec![failed])).await.is_err() {
                    return;
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(RETRY_AFTER) => continue,
                }
            }
        };
        let mut first = true;
        let mut lost = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = link.changed() => {
                    if changed.is_err() {
                        // The connection is gone for good; keep serving what the watch has.
                        link = watch::channel(Link::Up).1;
                        continue;
                    }
                    match *link.borrow_and_update() {
                        Link::Down => lost = true,
                        // Back after a loss: watch again, then reconcile on Synced.
                        Link::Up if lost => break,
                        Link::Up => {}
                    }
                }
                batch = changes.next() => {
                    let Some(batch) = batch else { break };
                    let mut out = Vec::with_capacity(batch.len() + 1);
                    if first {
                        out.push(Change::Restarted(bucket));
                        first = false;
                    }
                    for change in batch {
                        out.push(match change {
                            Ok(c) => decode(bucket, c),
                            Err(err) => Change::Failed { bucket, error: err.to_string() },
                        });
                    }
                    if tx.send(Msg::Feed(out)).await.is_err() {
                        return;
                    }
                }
            }
        }
        tracing::debug!(?bucket, "restarting watch");
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(if lost { Duration::ZERO } else { RETRY_AFTER }) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn watch_changes_decode_into_records() {
        let b = crate::fixtures::backing(0, slotpool_protocol::model::BackingState::Ready, 2);
        let put = store::Change::Put {
            key: "cloud.main.0".into(),
            revision: 3,
            value: Bytes::from(serde_json::to_vec(&b).unwrap()),
        };
        match decode(Bucket::Backing, put) {
            Change::Put {
                key,
                record: Record::Backing(got),
            } => assert_eq!((key.as_str(), *got), ("cloud.main.0", b)),
            other => panic!("{other:?}"),
        }
        let bad = store::Change::Put {
            key: "cloud.main.1".into(),
            revision: 4,
            value: Bytes::from_static(b"{\"v\":1}"),
        };
        assert!(matches!(
            decode(Bucket::Backing, bad),
            Change::Failed { bucket: Bucket::Backing, error } if error.contains("cloud.main.1")
        ));
        assert!(matches!(
            decode(
                Bucket::Slots,
                store::Change::Removed {
                    key: "bn-1.0".into(),
                    revision: 5
                }
            ),
            Change::Removed { bucket: Bucket::Slots, key } if key == "bn-1.0"
        ));
        assert!(matches!(
            decode(Bucket::Events, store::Change::Synced),
            Change::Synced(Bucket::Events)
        ));
    }
}
