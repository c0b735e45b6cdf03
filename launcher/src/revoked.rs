//! What is revoked, as KV says, and what the server was last seen to hold: the plain
//! state the launcher's HTTP API checks tokens against and [`crate::revocation`] keeps
//! the server's account equal to. Imports nothing of the launcher.

use futures::StreamExt;
use slotpool_protocol::auth::Revoker;
use slotpool_protocol::connect::NatsOptions;
use slotpool_protocol::layout;
use slotpool_protocol::model::Revocation;
use slotpool_protocol::store::{Change, Store};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// User keys revoked, each with the time of its revocation (seconds since the epoch): a
/// credential of that key issued at or before that time is refused, as NATS decides.
#[derive(Clone, Debug, Default)]
pub struct Revoked(Arc<RwLock<HashMap<String, u64>>>, Arc<watch::Sender<u64>>);

impl Revoked {
    /// Whether a credential of `key` issued at `issued_at` is revoked.
    pub fn covers(&self, key: &str, issued_at: u64) -> bool {
        let map = self.0.read().unwrap_or_else(|e| e.into_inner());
        map.get(key).is_some_and(|at| *at >= issued_at)
    }

    pub fn insert(&self, key: String, at: u64) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        map.insert(key, at);
        self.1.send_modify(|n| *n += 1);
    }

    pub fn remove(&self, key: &str) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        map.remove(key);
        self.1.send_modify(|n| *n += 1);
    }

    fn replace(&self, fresh: HashMap<String, u64>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        self.1.send_modify(|n| *n += 1);
    }

    /// A receiver that sees every change from now on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.1.subscribe()
    }

    /// Every key revoked, with the time of its revocation.
    pub fn all(&self) -> HashMap<String, u64> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Keeps `revoked` current with the revocations in `leases` until `shutdown`: a watch
/// of their keys, started again (from the current values) whenever it ends.
pub async fn follow(leases: Store, revoked: Revoked, shutdown: CancellationToken) {
    loop {
        match leases.watch_keys(layout::REVOCATION_KEYS).await {
            Ok(changes) => {
                let mut changes = Box::pin(changes);
                // The watch delivers every current value before Synced: what it did not
                // deliver by then is no longer revoked (expired while unwatched).
                let mut fresh: Option<HashMap<String, u64>> = Some(HashMap::new());
                loop {
                    let change = tokio::select! {
                        () = shutdown.cancelled() => return,
                        change = changes.next() => change,
                    };
                    match change {
                        Some(Ok(Change::Put { key, value, .. })) => {
                            match serde_json::from_slice::<Revocation>(&value) {
                                Ok(r) => match &mut fresh {
                                    Some(map) => {
                                        map.insert(r.key, r.revoked_at);
                                    }
                                    None => revoked.insert(r.key, r.revoked_at),
                                },
                                Err(err) => tracing::warn!(key, %err, "unreadable revocation"),
                            }
                        }
                        Some(Ok(Change::Removed { key, .. })) => {
                            let user_key = key.trim_start_matches(layout::REVOCATION_PREFIX);
                            match &mut fresh {
                                Some(map) => {
                                    map.remove(user_key);
                                }
                                None => revoked.remove(user_key),
                            }
                        }
                        Some(Ok(Change::Synced)) => {
                            if let Some(map) = fresh.take() {
                                revoked.replace(map);
                            }
                        }
                        Some(Err(err)) => {
                            tracing::warn!(%err, "watching revocations");
                            break;
                        }
                        None => break,
                    }
                }
            }
            Err(err) => tracing::warn!(%err, "cannot watch revocations"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(REWATCH_PAUSE) => {}
        }
    }
}

/// How long to wait before watching the revocations again after the watch ended.
const REWATCH_PAUSE: Duration = Duration::from_secs(1);

/// A launcher's means of revocation: the installation's revocation keys, and what the
/// server was last seen to hold.
pub struct Desk {
    pub(crate) revoker: Revoker,
    /// The server to push to (its URL and TLS; the revoker brings its own credentials).
    pub(crate) server: NatsOptions,
    /// The revocations the server held at the last look.
    pub(crate) held: watch::Sender<HashMap<String, u64>>,
    /// Wakes the pusher: a revocation was written.
    pub(crate) nudge: Notify,
}

impl Desk {
    pub fn new(revoker: Revoker, server: NatsOptions) -> Desk {
        Desk {
            revoker,
            server,
            held: watch::Sender::new(HashMap::new()),
            nudge: Notify::new(),
        }
    }

    /// Waits until the server holds the revocation of `key` at `at` (or a later one), for
    /// at most `within`; whether it does.
    pub async fn wait_held(&self, key: &str, at: u64, within: Duration) -> bool {
        let mut held = self.held.subscribe();
        self.nudge.notify_one();
        tokio::time::timeout(
            within,
            held.wait_for(|h| h.get(key).is_some_and(|t| *t >= at)),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }
}
