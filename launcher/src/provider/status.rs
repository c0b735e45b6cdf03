//! Each provider's last error as a record of its own ([`ProviderStatus`] in the leases
//! bucket, [`layout::provider_status_key`]), for operators: [`Recorded`] wraps a provider and tells the [`StatusBook`] the
//! outcome of every call; the book writes the record only when it changes (each failure
//! counts one more in a row; the first success that answers the failure deletes it,
//! [`clears`]), so calls that keep succeeding cost no write.
//!
//! The book knows the bucket's current records from a watch ([`StatusBook::watch`]),
//! so a success in this launcher clears a failure another launcher recorded. Several
//! launchers write the record; a conflict is read again and written over: last writer
//! wins, as befits a status record that decides nothing.

use super::CAPACITY_BACKOFF;
use super::{FixedIdentity, LaunchSpec, Launched, ListedInstance, Provider, ProviderError};
use futures::StreamExt;
use slotpool_protocol::layout;
use slotpool_protocol::model::{Instance, ProviderCall, ProviderStatus};
use slotpool_protocol::store::{Change, KvError, Store, Versioned};
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::{LauncherId, PROTOCOL_VERSION};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Writes tried before giving up on one outcome (each after a conflict).
const WRITE_ATTEMPTS: u32 = 3;
const REWATCH_PAUSE: Duration = Duration::from_secs(1);

/// Whether a call that succeeded clears a record whose last failure was `failed`: a
/// success of the same call does, and so does a launch (the provider works); a `list`
/// that works says nothing about a failing `launch`. Pure.
pub fn clears(failed: ProviderCall, succeeded: ProviderCall) -> bool {
    failed == succeeded || succeeded == ProviderCall::Launch
}

/// The record after a failed call, given the one before it. Pure.
pub fn after_failure(
    before: Option<&ProviderStatus>,
    provider: &str,
    call: ProviderCall,
    err: &ProviderError,
    launcher: &LauncherId,
    now: UnixMillis,
) -> ProviderStatus {
    let mut error = err.to_string();
    if error.len() > ProviderStatus::MAX_ERROR {
        let mut cut = ProviderStatus::MAX_ERROR;
        while !error.is_char_boundary(cut) {
            cut -= 1;
        }
        error.truncate(cut);
    }
    let capacity = call == ProviderCall::Launch && matches!(err, ProviderError::Capacity { .. });
    ProviderStatus {
        v: PROTOCOL_VERSION,
        provider: provider.to_string(),
        error,
        call,
        at: now,
        failures: before.map_or(0, |b| b.failures).saturating_add(1),
        capacity_until: capacity.then(|| now + CAPACITY_BACKOFF.as_millis() as u64),
        launcher: launcher.clone(),
    }
}

/// The providers' status records as this launcher last saw them (by provider name), and
/// the writes to them.
pub struct StatusBook {
    /// The leases bucket.
    store: Store,
    launcher: LauncherId,
    known: Mutex<HashMap<String, Versioned<ProviderStatus>>>,
}

impl StatusBook {
    pub fn new(store: Store, launcher: LauncherId) -> StatusBook {
        StatusBook {
            store,
            launcher,
            known: Mutex::new(HashMap::new()),
        }
    }

    fn known(&self, provider: &str) -> Option<Versioned<ProviderStatus>> {
        self.known
            .lock()
            .expect("status book")
            .get(provider)
            .cloned()
    }

    fn set(&self, provider: &str, record: Option<Versioned<ProviderStatus>>) {
        let mut known = self.known.lock().expect("status book");
        match record {
            Some(r) => known.insert(provider.to_string(), r),
            None => known.remove(provider),
        };
    }

    /// Keeps the book current from the bucket until `shutdown`.
    pub async fn watch(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            match self.store.watch_keys(layout::PROVIDER_STATUS_KEYS).await {
                Ok(changes) => {
                    let mut changes = Box::pin(changes);
                    loop {
                        let change = tokio::select! {
                            c = changes.next() => c,
                            _ = shutdown.cancelled() => return,
                        };
                        match change {
                            Some(Ok(Change::Put {
                                key,
                                revision,
                                value,
                            })) => match Change::decode::<ProviderStatus>(
                                self.store.bucket(),
                                &key,
                                revision,
                                &value,
                            ) {
                                Ok(record) => {
                                    self.set(&record.value.provider.clone(), Some(record))
                                }
                                Err(err) => {
                                    tracing::warn!(%err, "ignoring an unreadable provider status")
                                }
                            },
                            Some(Ok(Change::Removed { key, .. })) => {
                                if let Some(provider) =
                                    key.strip_prefix(layout::PROVIDER_STATUS_PREFIX)
                                {
                                    self.set(provider, None);
                                }
                            }
                            Some(Ok(Change::Synced)) => {}
                            Some(Err(err)) => {
                                tracing::debug!(%err, "provider status watch failed");
                                break;
                            }
                            None => break,
                        }
                    }
                }
                Err(err) => tracing::debug!(%err, "cannot watch provider statuses"),
            }
            tokio::select! {
                _ = tokio::time::sleep(REWATCH_PAUSE) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Records a failed call: one more failure in a row.
    pub async fn failed(&self, provider: &str, call: ProviderCall, err: &ProviderError) {
        for _ in 0..WRITE_ATTEMPTS {
            let before = self.known(provider);
            let record = after_failure(
                before.as_ref().map(|b| &b.value),
                provider,
                call,
                err,
                &self.launcher,
                now_ms(),
            );
            let key = layout::provider_status_key(provider);
            let written = match &before {
                Some(b) => self.store.update(&key, &record, b.revision, None).await,
                None => self.store.create(&key, &record, None).await,
            };
            match written {
                Ok(revision) => {
                    self.set(
                        provider,
                        Some(Versioned {
                            key,
                            revision,
                            value: record,
                        }),
                    );
                    return;
                }
                Err(KvError::Conflict { .. }) => self.reread(provider).await,
                Err(err) => {
                    tracing::warn!(%err, provider, "cannot record the provider's error");
                    return;
                }
            }
        }
    }

    /// Records a call that succeeded: the provider's last error is cleared when this
    /// success answers it ([`clears`]).
    pub async fn succeeded(&self, provider: &str, call: ProviderCall) {
        for _ in 0..WRITE_ATTEMPTS {
            let Some(before) = self.known(provider) else {
                return;
            };
            if !clears(before.value.call, call) {
                return;
            }
            match self.store.delete(&before.key, before.revision).await {
                Ok(_) => {
                    self.set(provider, None);
                    return;
                }
                Err(KvError::Conflict { .. }) => self.reread(provider).await,
                Err(err) => {
                    tracing::warn!(%err, provider, "cannot clear the provider's error");
                    return;
                }
            }
        }
    }

    async fn reread(&self, provider: &str) {
        let key = layout::provider_status_key(provider);
        match self.store.get::<ProviderStatus>(&key).await {
            Ok(record) => self.set(provider, record),
            Err(err) => tracing::debug!(%err, provider, "cannot read the provider's status"),
        }
    }
}

/// A provider whose calls' outcomes go to a [`StatusBook`].
pub struct Recorded {
    inner: Arc<dyn Provider>,
    book: Arc<StatusBook>,
}

impl Recorded {
    pub fn new(inner: Arc<dyn Provider>, book: Arc<StatusBook>) -> Recorded {
        Recorded { inner, book }
    }

    async fn noted<T>(
        &self,
        call: ProviderCall,
        result: Result<T, ProviderError>,
    ) -> Result<T, ProviderError> {
        match &result {
            Ok(_) => self.book.succeeded(self.inner.name(), call).await,
            Err(err) => self.book.failed(self.inner.name(), call, err).await,
        }
        result
    }
}

#[async_trait::async_trait]
impl Provider for Recorded {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn fixed_identity(&self, pool: &str, seat: u32) -> Option<FixedIdentity> {
        self.inner.fixed_identity(pool, seat)
    }

    fn creates_machines(&self) -> bool {
        self.inner.creates_machines()
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError> {
        let result = self.inner.launch(spec).await;
        self.noted(ProviderCall::Launch, result).await
    }

    async fn delete(&self, instance: &Instance) -> Result<(), ProviderError> {
        let result = self.inner.delete(instance).await;
        self.noted(ProviderCall::Delete, result).await
    }

    async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
        let result = self.inner.list().await;
        self.noted(ProviderCall::List, result).await
    }

    async fn console(&self, instance: &Instance) -> Result<Option<String>, ProviderError> {
        self.inner.console(instance).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(message: &str) -> ProviderError {
        ProviderError::Failed {
            provider: "cloud".into(),
            message: message.into(),
        }
    }

    #[test]
    fn failures_count_up_and_a_capacity_refusal_says_until_when() {
        let me = LauncherId::generate();
        let first = after_failure(
            None,
            "cloud",
            ProviderCall::List,
            &failed("boom"),
            &me,
            1000,
        );
        assert_eq!(first.failures, 1);
        assert_eq!(first.error, "cloud: boom");
        assert_eq!(first.capacity_until, None);
        let capacity = ProviderError::Capacity {
            provider: "cloud".into(),
            message: "quota".into(),
        };
        let second = after_failure(
            Some(&first),
            "cloud",
            ProviderCall::Launch,
            &capacity,
            &me,
            2000,
        );
        assert_eq!(second.failures, 2);
        assert_eq!(second.call, ProviderCall::Launch);
        assert_eq!(
            second.capacity_until,
            Some(2000 + CAPACITY_BACKOFF.as_millis() as u64)
        );
    }

    #[test]
    fn a_list_that_works_leaves_a_launch_error_and_a_launch_that_works_clears_all() {
        use ProviderCall::*;
        assert!(!clears(Launch, List));
        assert!(!clears(Launch, Delete));
        assert!(clears(Launch, Launch));
        assert!(clears(List, List));
        assert!(clears(Delete, Launch));
        assert!(!clears(Delete, List));
    }

    #[test]
    fn a_long_error_is_cut_on_a_character_boundary() {
        let me = LauncherId::generate();
        let long = "é".repeat(ProviderStatus::MAX_ERROR);
        let r = after_failure(None, "cloud", ProviderCall::Launch, &failed(&long), &me, 0);
        assert!(r.error.len() <= ProviderStatus::MAX_ERROR);
        assert!(r.error.len() > ProviderStatus::MAX_ERROR - 2);
    }
}
