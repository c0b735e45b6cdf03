//! Typed, revision-checked access to one KV bucket.
//!
//! Every write here is conditional unless its name says otherwise: `create` succeeds only
//! when the key is absent (or deleted), `update` and `delete` only at the expected revision.
//! TTL writes go through JetStream publish headers because async-nats has no TTL-preserving
//! CAS (see the notes on `create` and `update`). Errors are [`KvError`]; callers never see
//! async-nats types.

pub use crate::layout::BucketSpec;
use crate::refusals::{has_token, Refusal, Refusals};
use async_nats::header::{HeaderMap, HeaderValue};
use async_nats::jetstream::{
    self, consumer, kv,
    stream::{DirectGetErrorKind, LastRawMessageErrorKind},
};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde::{de::DeserializeOwned, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Writes this process had refused for a changed revision ([`KvError::Conflict`]).
static CONFLICTS: AtomicU64 = AtomicU64::new(0);

/// How many writes of this process were refused because the record had changed since
/// it was read (its `/metrics` counts them).
pub fn conflicts() -> u64 {
    CONFLICTS.load(Ordering::Relaxed)
}

/// Writes of this process sent again because no server took them, or read back
/// after a timeout.
static RETRIES: AtomicU64 = AtomicU64::new(0);

/// How many writes of this process were sent again while no server took them (a
/// clustered bucket electing its leader) or read back after they timed out (its
/// `/metrics` counts them).
pub fn retries() -> u64 {
    RETRIES.load(Ordering::Relaxed)
}

mod watch;

const EXPECTED_LAST_SUBJECT_SEQUENCE: &str = "Nats-Expected-Last-Subject-Sequence";
const MESSAGE_TTL: &str = "Nats-TTL";
const KV_OPERATION: &str = "KV-Operation";
const MARKER_REASON: &str = "Nats-Marker-Reason";

/// How long a write is retried while no server takes it or answers it (a bucket without
/// a leader in a JetStream cluster, a few seconds after its leader died); a time-out is
/// retried only for a compare-and-set, after reading back that it did not land.
const LEADERLESS_PATIENCE: Duration = Duration::from_secs(10);

/// How many times a timed-out write's key is read back before the write is given up as
/// not (yet) landed (pauses of 50, 150, 450 ms between).
const READ_BACKS: usize = 4;

/// What went wrong with a KV operation, in slotpool's terms.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A conditional write lost: the key exists (create) or moved on (update/delete).
    #[error("conflict writing {bucket}/{key}: it was changed by someone else")]
    Conflict { bucket: String, key: String },
    /// The key is not there.
    #[error("{bucket}/{key} not found")]
    NotFound { bucket: String, key: String },
    /// The server did not answer in time; the write may or may not have happened.
    #[error("timed out on {bucket}/{key}; re-read before retrying")]
    Timeout { bucket: String, key: String },
    /// The value under the key is not what we expect.
    #[error("cannot decode {bucket}/{key}: {source}")]
    Decode {
        bucket: String,
        key: String,
        source: serde_json::Error,
    },
    /// The server refused this user the subject the operation needs: its role may not
    /// read or write this bucket (or key).
    #[error("not permitted: {user} may not {what} {} (the NATS server refused {subject}; see the permissions of each role in docs/protocol.md)", place(.bucket, .key))]
    NotPermitted {
        user: String,
        what: &'static str,
        bucket: String,
        key: String,
        subject: String,
    },
    /// The connection or the server failed.
    #[error("kv {bucket}/{key}: {message}")]
    Transport {
        bucket: String,
        key: String,
        message: String,
    },
}

/// A bucket's key as errors name it: `bucket/key`, or the bucket alone for all its keys.
fn place(bucket: &str, key: &str) -> String {
    match key {
        ">" => bucket.to_string(),
        key => format!("{bucket}/{key}"),
    }
}

impl KvError {
    pub fn is_conflict(&self) -> bool {
        matches!(self, KvError::Conflict { .. })
    }

    /// The bucket the failed operation was on.
    pub fn bucket(&self) -> &str {
        match self {
            KvError::Conflict { bucket, .. }
            | KvError::NotFound { bucket, .. }
            | KvError::Timeout { bucket, .. }
            | KvError::Decode { bucket, .. }
            | KvError::NotPermitted { bucket, .. }
            | KvError::Transport { bucket, .. } => bucket,
        }
    }
}

/// A decoded value with the revision it was read at.
#[derive(Clone, Debug, PartialEq)]
pub struct Versioned<T> {
    pub key: String,
    pub revision: u64,
    pub value: T,
}

/// One change seen by a watch.
#[derive(Clone, Debug)]
pub enum Change {
    /// The key holds a new value (raw JSON; decode with [`Change::decode`]).
    Put {
        key: String,
        revision: u64,
        value: Bytes,
    },
    /// The key was deleted, purged or expired.
    Removed { key: String, revision: u64 },
    /// Every value that existed when the watch started has been delivered.
    Synced,
}

/// A change with the server's time of the write that made it (`None` for
/// [`Change::Synced`]): what judges a record's age, never a clock inside the record.
#[derive(Clone, Debug)]
pub struct Timed {
    pub change: Change,
    pub written_at: Option<crate::time::UnixMillis>,
}

/// Where a bucket lives in a JetStream cluster ([`Store::placement`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The server that orders the bucket's writes, if one is elected.
    pub leader: Option<String>,
    /// The servers with a copy that is up to date, the leader first.
    pub current: Vec<String>,
    /// Since when the leader leads (the server's clock), when the server says.
    pub leader_since: Option<crate::time::UnixMillis>,
}

/// One KV bucket.
#[derive(Clone)]
pub struct Store {
    js: jetstream::Context,
    kv: kv::Store,
    bucket: &'static str,
    /// The server's refusals of this connection's subjects (`None`: a launcher's, which
    /// may use every subject, delete consumers included).
    refusals: Option<Refusals>,
    /// Whether the bucket takes writes, as this connection's last write found.
    answering: Arc<Answering>,
}

/// Whether a bucket takes writes, shared by the clones of one [`Store`]: a write that
/// found no leader (the bucket electing one) or timed out marks it failing, and the
/// next that a leader answers (it lands, or conflicts) marks it answering again and
/// wakes whoever waits for that ([`Store::answering_again`]). The wake-up is shared by
/// the buckets of one connection ([`Store::with_recoveries_of`]).
struct Answering {
    failing: AtomicBool,
    back: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Answering {
    fn new() -> Arc<Answering> {
        Arc::new(Answering {
            failing: AtomicBool::new(false),
            back: Arc::new(tokio::sync::watch::channel(0).0),
        })
    }

    fn failed(&self) {
        self.failing.store(true, Ordering::Release);
    }

    fn answered(&self) {
        if self.failing.swap(false, Ordering::AcqRel) {
            self.back.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// [`Store::answering_again`].
    async fn again(&self, at_most: Duration) {
        let mut back = self.back.subscribe();
        let _ = tokio::time::timeout(at_most, back.changed()).await;
    }
}

fn transport(bucket: &str, key: &str, err: impl std::fmt::Display) -> KvError {
    KvError::Transport {
        bucket: bucket.to_string(),
        key: key.to_string(),
        message: err.to_string(),
    }
}

impl Store {
    /// Opens the bucket, creating it with `replicas` copies (one per server of a
    /// JetStream cluster) when absent. An existing bucket is opened as it is: compare
    /// [`Store::replicas`] to see whether it was made with another count.
    pub async fn open(
        js: &jetstream::Context,
        spec: BucketSpec,
        replicas: usize,
    ) -> Result<Store, KvError> {
        let kv = match js.get_key_value(spec.name).await {
            Ok(kv) => kv,
            Err(_) => match js
                .create_key_value(kv::Config {
                    bucket: spec.name.to_string(),
                    history: spec.history,
                    max_value_size: spec.max_value_size,
                    storage: jetstream::stream::StorageType::File,
                    limit_markers: spec.per_key_ttl.then_some(Duration::from_secs(1)),
                    max_age: Duration::from_secs(spec.max_age_secs),
                    max_bytes: spec.max_bytes,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
            {
                Ok(kv) => kv,
                // Another process may have created it in between: use theirs.
                Err(create_err) => js.get_key_value(spec.name).await.map_err(|_| {
                    transport(spec.name, "", format!("creating bucket: {create_err}"))
                })?,
            },
        };
        Ok(Store {
            js: js.clone(),
            kv,
            bucket: spec.name,
            refusals: None,
            answering: Answering::new(),
        })
    }

    /// The same bucket, whose operations end with [`KvError::NotPermitted`] as soon as
    /// the server refuses a subject they need ([`Refusals`]; `None` for a launcher).
    pub fn with_refusals(self, refusals: Option<Refusals>) -> Store {
        Store { refusals, ..self }
    }

    /// The same bucket, whose recoveries ([`Store::recoveries`]) are `other`'s: a leader
    /// elected for one bucket is most often one server's death, which moved the leaders
    /// of the others it led too, and the consumers of their watches.
    pub fn with_recoveries_of(self, other: &Store) -> Store {
        Store {
            answering: Arc::new(Answering {
                failing: AtomicBool::new(false),
                back: other.answering.back.clone(),
            }),
            ..self
        }
    }

    /// Runs `op` on `key`, ended with [`KvError::NotPermitted`] when the server refuses
    /// this connection a subject of this bucket: the key's own (`$KV.<bucket>.<key>`, a
    /// write) or one of JetStream's API naming the bucket's stream (a read or a watch).
    /// A refused `CONSUMER.DELETE` is no refusal of `op`'s (see [`Store::list_keys`]).
    async fn guard<T>(
        &self,
        what: &'static str,
        key: &str,
        op: impl Future<Output = Result<T, KvError>>,
    ) -> Result<T, KvError> {
        // Boxed: a launcher's call (no refusals) pays an allocation, never a stack frame
        // the size of two copies of `op` (debug builds overflowed a worker's stack).
        let op = Box::pin(op);
        let Some(refusals) = self.refusals.as_ref() else {
            return op.await;
        };
        let stream = format!("KV_{}", self.bucket);
        let own = self.subject(key);
        let concerns = |r: &Refusal| {
            !r.subscribe
                && (r.subject == own
                    || (r.subject.starts_with("$JS.API.")
                        && !r.subject.starts_with("$JS.API.CONSUMER.DELETE.")
                        && has_token(&r.subject, &stream)))
        };
        match refusals.guard(concerns, op).await {
            Ok(out) => out,
            Err(refused) => Err(KvError::NotPermitted {
                user: refusals.user().to_string(),
                what,
                bucket: self.bucket.to_string(),
                key: key.to_string(),
                subject: refused.subject,
            }),
        }
    }

    /// Opens an existing bucket only (for read-mostly clients), with a clear error when absent.
    pub async fn existing(js: &jetstream::Context, name: &'static str) -> Result<Store, KvError> {
        let kv = js.get_key_value(name).await.map_err(|err| {
            transport(
                name,
                "",
                format!("bucket missing (has a launcher ever run here?): {err}"),
            )
        })?;
        Ok(Store {
            js: js.clone(),
            kv,
            bucket: name,
            refusals: None,
            answering: Answering::new(),
        })
    }

    /// Waits until a leader answers a write to this bucket, or to one sharing its
    /// recoveries ([`Store::with_recoveries_of`]), after one on this connection failed
    /// (found no leader while the bucket elected one, or timed out), or for `at_most`. Whoever met a failing bucket waits here
    /// rather than for a blind pause: the first write a leader answers again, anyone's,
    /// wakes them all, and `at_most` lets them try again themselves when nobody writes.
    pub async fn answering_again(&self, at_most: Duration) {
        self.answering.again(at_most).await
    }

    /// Changes each time a leader answers a write to this bucket, or to one sharing its
    /// recoveries, after one on this connection failed ([`Store::answering_again`]): in a
    /// cluster, a leader was elected meanwhile, and a watch's consumer may have died with
    /// the old one.
    pub fn recoveries(&self) -> tokio::sync::watch::Receiver<u64> {
        self.answering.back.subscribe()
    }

    pub fn bucket(&self) -> &'static str {
        self.bucket
    }

    /// How many copies of the bucket the servers keep, as read when it was opened.
    pub fn replicas(&self) -> usize {
        self.kv.stream.cached_info().config.num_replicas
    }

    /// Whether the bucket, as read when it was opened, drops its oldest values when full.
    pub fn discards_old(&self) -> bool {
        self.kv.stream.cached_info().config.discard == jetstream::stream::DiscardPolicy::Old
    }

    /// Makes a full bucket drop its oldest values (`discard: old`) when `spec` says so
    /// and the bucket does not yet: a KV bucket is created refusing new writes when full.
    /// Done by launchers, the only role that may edit streams.
    pub async fn apply_discard(&mut self, spec: BucketSpec) -> Result<(), KvError> {
        if !spec.discard_old || self.discards_old() {
            return Ok(());
        }
        let mut config = self.kv.stream.cached_info().config.clone();
        config.discard = jetstream::stream::DiscardPolicy::Old;
        self.js
            .update_stream(&config)
            .await
            .map_err(|err| transport(self.bucket, "", format!("setting discard: old: {err}")))?;
        self.kv = self
            .js
            .get_key_value(self.bucket)
            .await
            .map_err(|err| transport(self.bucket, "", format!("reopening: {err}")))?;
        Ok(())
    }

    fn subject(&self, key: &str) -> String {
        format!("$KV.{}.{}", self.bucket, key)
    }

    fn conflict(&self, key: &str) -> KvError {
        CONFLICTS.fetch_add(1, Ordering::Relaxed);
        KvError::Conflict {
            bucket: self.bucket.to_string(),
            key: key.to_string(),
        }
    }

    /// Reads and decodes `key`; `None` when absent or deleted.
    pub async fn get<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<Versioned<T>>, KvError> {
        match self.entry(key).await? {
            Some((revision, Some(bytes))) => Ok(Some(self.decode(key, revision, &bytes)?)),
            _ => Ok(None),
        }
    }

    /// Whether the bucket holds any entry for `key`, a tombstone or an expiry marker
    /// included.
    pub async fn has_entry(&self, key: &str) -> Result<bool, KvError> {
        Ok(self.entry(key).await?.is_some())
    }

    /// The value of `key` undecoded, with its revision; `None` when absent or deleted.
    pub async fn get_bytes(&self, key: &str) -> Result<Option<(u64, Bytes)>, KvError> {
        Ok(self
            .entry(key)
            .await?
            .and_then(|(revision, value)| Some((revision, value?))))
    }

    /// Reads and decodes `key` as the bucket's leader holds it; `None` when absent or
    /// deleted. [`Store::get`] is a direct get, which any replica may answer, one that
    /// lags behind after a leader change included; this asks the stream's leader (one
    /// more hop), for the few reads a stale answer would make a wrong decision of: a
    /// launcher's lease that a lagging replica has let expire, say.
    pub async fn get_from_leader<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<Versioned<T>>, KvError> {
        let read = async {
            let subject = self.subject(key);
            match asked_again(|| self.kv.stream.get_last_raw_message_by_subject(&subject)).await {
                Ok(message) => Ok(Some(message)),
                Err(err) if matches!(err.kind(), LastRawMessageErrorKind::NoMessageFound) => {
                    Ok(None)
                }
                Err(err) => Err(transport(self.bucket, key, format!("leader read: {err}"))),
            }
        };
        let Some(message) = self.guard("read", key, read).await? else {
            return Ok(None);
        };
        let headers = &message.headers;
        let put = headers
            .get("KV-Operation")
            .is_none_or(|op| op.as_str() == "PUT")
            && headers.get("Nats-Marker-Reason").is_none();
        if !put {
            return Ok(None);
        }
        self.decode(key, message.sequence, &message.payload)
            .map(Some)
    }

    /// The raw latest entry: its revision and value (`None` value for a tombstone/marker).
    async fn entry(&self, key: &str) -> Result<Option<(u64, Option<Bytes>)>, KvError> {
        self.guard("read", key, self.read_entry(key)).await
    }

    async fn read_entry(&self, key: &str) -> Result<Option<(u64, Option<Bytes>)>, KvError> {
        match asked_again(|| self.kv.entry(key)).await {
            Ok(Some(e)) => Ok(Some((
                e.revision,
                matches!(e.operation, kv::Operation::Put).then_some(e.value),
            ))),
            Ok(None) => Ok(None),
            Err(err) => {
                if err
                    .to_string()
                    .contains(&DirectGetErrorKind::TimedOut.to_string())
                {
                    Err(KvError::Timeout {
                        bucket: self.bucket.to_string(),
                        key: key.to_string(),
                    })
                } else {
                    Err(transport(self.bucket, key, err))
                }
            }
        }
    }

    fn decode<T: DeserializeOwned>(
        &self,
        key: &str,
        revision: u64,
        bytes: &[u8],
    ) -> Result<Versioned<T>, KvError> {
        serde_json::from_slice(bytes)
            .map(|value| Versioned {
                key: key.to_string(),
                revision,
                value,
            })
            .map_err(|source| KvError::Decode {
                bucket: self.bucket.to_string(),
                key: key.to_string(),
                source,
            })
    }

    /// Writes `value` under `key` only if the key's last revision is `expected` (0 = never
    /// written), with an optional per-key TTL (whole seconds, at least 1).
    async fn publish(
        &self,
        key: &str,
        payload: Bytes,
        expected: Option<u64>,
        ttl: Option<Duration>,
        op: Option<&str>,
    ) -> Result<u64, KvError> {
        self.guard(
            "write",
            key,
            self.publish_unguarded(key, payload, expected, ttl, op),
        )
        .await
    }

    async fn publish_unguarded(
        &self,
        key: &str,
        payload: Bytes,
        expected: Option<u64>,
        ttl: Option<Duration>,
        op: Option<&str>,
    ) -> Result<u64, KvError> {
        // While a cluster elects the bucket's leader, nothing takes the write: it is sent
        // again, for a while.
        let give_up = tokio::time::Instant::now() + LEADERLESS_PATIENCE;
        self.publish_unguarded_until(key, payload, expected, ttl, op, give_up)
            .await
    }

    async fn publish_unguarded_until(
        &self,
        key: &str,
        payload: Bytes,
        expected: Option<u64>,
        ttl: Option<Duration>,
        op: Option<&str>,
        give_up: tokio::time::Instant,
    ) -> Result<u64, KvError> {
        let mut headers = HeaderMap::new();
        if let Some(rev) = expected {
            headers.insert(EXPECTED_LAST_SUBJECT_SEQUENCE, HeaderValue::from(rev));
        }
        if let Some(ttl) = ttl {
            headers.insert(MESSAGE_TTL, HeaderValue::from(ttl.as_secs().max(1)));
        }
        if let Some(op) = op {
            headers.insert(KV_OPERATION, op);
        }
        // "No responders": it was not written, so it is sent again.
        let mut pause = Duration::from_millis(50);
        let written = loop {
            let attempt = async {
                self.js
                    .publish_with_headers(self.subject(key), headers.clone(), payload.clone())
                    .await?
                    .await
            };
            match attempt.await {
                Err(err)
                    if err.kind() == jetstream::context::PublishErrorKind::StreamNotFound
                        && tokio::time::Instant::now() + pause < give_up =>
                {
                    RETRIES.fetch_add(1, Ordering::Relaxed);
                    self.answering.failed();
                    // Sent again once another write lands, or after the pause.
                    self.answering_again(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                other => break other,
            }
        };
        match written.map_err(|err| self.publish_error(key, err)) {
            Ok(ack) => {
                self.answering.answered();
                Ok(ack.sequence)
            }
            // A leader answered it.
            Err(err @ KvError::Conflict { .. }) => {
                self.answering.answered();
                Err(err)
            }
            Err(KvError::Timeout { .. }) => {
                self.answering.failed();
                RETRIES.fetch_add(1, Ordering::Relaxed);
                match self.landed(key, &payload, expected, op).await {
                    Ok(revision) => {
                        self.answering.answered();
                        Ok(revision)
                    }
                    // A compare-and-set that did not land, or could not be read back while
                    // the bucket elects its leader, is sent again: the revision it expects
                    // makes a second landing impossible, and the read-back after its
                    // time-out finds the first one's.
                    Err(KvError::Timeout { .. })
                        if expected.is_some() && tokio::time::Instant::now() < give_up =>
                    {
                        Box::pin(
                            self.publish_unguarded_until(key, payload, expected, ttl, op, give_up),
                        )
                        .await
                    }
                    other => other,
                }
            }
            // Only the want of a leader marks the bucket failing: a write refused for
            // what it is (too large, say) says nothing of whether the bucket answers.
            Err(err) => Err(err),
        }
    }

    /// After a write timed out: whether it committed after all. The key is read back,
    /// and a last entry that is exactly what was written, past the revision the write
    /// expected, is taken as the write's own (so a caller never retries a compare-and-set
    /// that already landed, and loses to itself). While the key still shows the revision
    /// the write expected, the write may be on its way in the server: it is read again a
    /// few times. Anything else is still a timeout: the caller re-reads and decides.
    async fn landed(
        &self,
        key: &str,
        payload: &Bytes,
        expected: Option<u64>,
        op: Option<&str>,
    ) -> Result<u64, KvError> {
        let timeout = || KvError::Timeout {
            bucket: self.bucket.to_string(),
            key: key.to_string(),
        };
        let mut pause = Duration::from_millis(50);
        for _ in 0..READ_BACKS {
            let Ok(entry) = self.entry(key).await else {
                return Err(timeout());
            };
            let revision = entry.as_ref().map_or(0, |(revision, _)| *revision);
            let ours = match (op, entry.map(|(_, value)| value)) {
                (Some(_), Some(None)) => true,
                (None, Some(Some(value))) => value == *payload,
                _ => false,
            };
            if ours && revision > expected.unwrap_or(0) {
                tracing::debug!(
                    bucket = self.bucket,
                    key,
                    revision,
                    "a timed-out write had landed"
                );
                return Ok(revision);
            }
            if expected.is_some_and(|e| revision != e) {
                break;
            }
            tokio::time::sleep(pause).await;
            pause *= 3;
        }
        Err(timeout())
    }

    fn publish_error(&self, key: &str, err: jetstream::context::PublishError) -> KvError {
        use jetstream::context::PublishErrorKind as K;
        match err.kind() {
            K::WrongLastSequence => self.conflict(key),
            K::TimedOut => KvError::Timeout {
                bucket: self.bucket.to_string(),
                key: key.to_string(),
            },
            // The same conflict can surface as a generic API error: 10071 (wrong last
            // sequence) or, during a leader change, 10164.
            _ if is_conflict_code(&err.to_string()) => self.conflict(key),
            _ => transport(self.bucket, key, err),
        }
    }

    fn encode<T: Serialize>(value: &T) -> Bytes {
        Bytes::from(serde_json::to_vec(value).expect("slotpool records always serialize"))
    }

    /// Creates `key` only if it is absent (never written, deleted or expired). Unlike
    /// async-nats' `create_with_ttl`, the TTL is kept when the key has a tombstone.
    pub async fn create<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        ttl: Option<Duration>,
    ) -> Result<u64, KvError> {
        self.create_over(key, value, ttl, None).await
    }

    /// [`Store::create`], given the revision of the tombstone the key is believed to
    /// have (from a watch or from one's own delete): the create is then one round trip
    /// instead of three (write, read the tombstone, write again). A wrong guess costs only
    /// the usual path.
    pub async fn create_over<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        ttl: Option<Duration>,
        tombstone: Option<u64>,
    ) -> Result<u64, KvError> {
        let payload = Self::encode(value);
        if let Some(rev) = tombstone {
            match self
                .publish(key, payload.clone(), Some(rev), ttl, None)
                .await
            {
                Err(KvError::Conflict { .. }) => {}
                other => return other,
            }
        }
        match self.publish(key, payload.clone(), Some(0), ttl, None).await {
            Err(KvError::Conflict { .. }) => match self.entry(key).await? {
                Some((rev, None)) => self.publish(key, payload, Some(rev), ttl, None).await,
                _ => Err(self.conflict(key)),
            },
            other => other,
        }
    }

    /// Replaces `key` only if its revision is still `revision`. With `ttl`, the key
    /// expires unless written again in time (a TTL-less update makes it permanent).
    pub async fn update<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: u64,
        ttl: Option<Duration>,
    ) -> Result<u64, KvError> {
        self.publish(key, Self::encode(value), Some(revision), ttl, None)
            .await
    }

    /// Unconditional write: only for records with a single writer (an agent's own heartbeat).
    pub async fn put<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        ttl: Option<Duration>,
    ) -> Result<u64, KvError> {
        self.publish(key, Self::encode(value), None, ttl, None)
            .await
    }

    /// Deletes `key` only if its revision is still `revision`; returns the revision of
    /// the tombstone (see [`Store::create_over`]).
    pub async fn delete(&self, key: &str, revision: u64) -> Result<u64, KvError> {
        self.publish(key, Bytes::new(), Some(revision), None, Some("DEL"))
            .await
    }

    /// Every current value in the bucket, decoded; undecodable values are returned as errors
    /// in place so one bad record cannot hide the others. In key order. A watch up to its
    /// [`Change::Synced`], which has every key (see [`Store::watch`]).
    pub async fn list<T: DeserializeOwned>(
        &self,
    ) -> Result<Vec<Result<Versioned<T>, KvError>>, KvError> {
        self.list_keys(">").await
    }

    /// [`Store::list`] of the keys matching `filter` (NATS subject syntax).
    pub async fn list_keys<T: DeserializeOwned>(
        &self,
        filter: &str,
    ) -> Result<Vec<Result<Versioned<T>, KvError>>, KvError> {
        self.guard("read", filter, self.read_all(filter)).await
    }

    async fn read_all<T: DeserializeOwned>(
        &self,
        filter: &str,
    ) -> Result<Vec<Result<Versioned<T>, KvError>>, KvError> {
        let mut out = BTreeMap::new();
        let (name, reader) = self
            .open_reader(filter, consumer::DeliverPolicy::LastPerSubject)
            .await?;
        let mut changes = Box::pin(reader.into_stream());
        let result = loop {
            match changes.next().await {
                Some(Ok(Change::Put {
                    key,
                    revision,
                    value,
                })) => {
                    let decoded = self.decode(&key, revision, &value);
                    out.insert(key, decoded);
                }
                Some(Ok(Change::Removed { key, .. })) => {
                    out.remove(&key);
                }
                Some(Ok(Change::Synced)) => break Ok(()),
                Some(Err(err)) => break Err(err),
                None => {
                    break Err(transport(
                        self.bucket,
                        filter,
                        "watch ended before the initial values were read",
                    ))
                }
            }
        };
        drop(changes);
        // The server drops an ephemeral consumer that nobody listens to after a while
        // (30 s for the client library's watches). A launcher deletes its own at once,
        // without waiting for the answer; other roles may not delete consumers (they
        // could end a launcher's watches) and do not ask: the server would refuse it.
        if self.refusals.is_none() {
            let stream = self.kv.stream.clone();
            tokio::spawn(async move {
                let _ = stream.delete_consumer(&name).await;
            });
        }
        result.map(|()| out.into_values().collect())
    }

    /// Whether watch consumer `name` has nothing more to deliver than the `received`
    /// messages it has delivered.
    async fn delivered_all(&self, name: &str, received: u64) -> Result<bool, KvError> {
        let info = self
            .kv
            .stream
            .consumer_info(name)
            .await
            .map_err(|err| transport(self.bucket, ">", format!("reading watch info: {err}")))?;
        Ok(info.num_pending == 0 && info.delivered.consumer_sequence <= received)
    }

    /// Where the bucket lives in a JetStream cluster, read now: which server leads it
    /// (orders its writes), since when, and which hold a current copy. `None` on a single
    /// server.
    pub async fn placement(&self) -> Result<Option<Placement>, KvError> {
        let info = self.info().await?;
        Ok(info.cluster.as_ref().map(|c| {
            let mut current: Vec<String> = c.leader.iter().cloned().collect();
            current.extend(
                c.replicas
                    .iter()
                    .filter(|p| p.current && !p.offline)
                    .map(|p| p.name.clone()),
            );
            Placement {
                leader: c.leader.clone(),
                current,
                leader_since: c
                    .leader_since
                    .and_then(|t| u64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()),
            }
        }))
    }

    /// The bucket's stream as the server describes it now.
    async fn info(&self) -> Result<jetstream::stream::Info, KvError> {
        asked_again(|| {
            let mut stream = self.kv.stream.clone();
            async move { stream.info().await.cloned() }
        })
        .await
        .map_err(|err| transport(self.bucket, ">", format!("reading bucket info: {err}")))
    }

    /// The revision of the last write to the bucket.
    async fn last_revision(&self) -> Result<u64, KvError> {
        Ok(self.info().await?.state.last_sequence)
    }

    /// The revisions the bucket still holds: the oldest and the newest (the newest is the
    /// last write's, 0 for a bucket never written; with nothing held the oldest is one past
    /// it). Revisions between them may be gone too: superseded values of a key.
    pub async fn held_revisions(&self) -> Result<(u64, u64), KvError> {
        let state = self.info().await?.state;
        Ok((state.first_sequence, state.last_sequence))
    }

    /// Every change with a revision above `after` that the bucket still holds (0: all),
    /// in revision order, then each new one as it happens; never [`Change::Synced`]. Read
    /// by pulling batches: what the reader has not taken yet waits on the server, so a
    /// slow reader costs this process one batch, however far behind it falls.
    pub async fn changes_after(
        &self,
        after: u64,
    ) -> Result<impl Stream<Item = Result<Change, KvError>> + Send + 'static, KvError> {
        let bucket = self.bucket;
        let deliver_policy = match after {
            0 => consumer::DeliverPolicy::All,
            after => consumer::DeliverPolicy::ByStartSequence {
                start_sequence: after + 1,
            },
        };
        let config = consumer::pull::OrderedConfig {
            description: Some("slotpool change stream".to_string()),
            filter_subject: format!("$KV.{bucket}.>"),
            replay_policy: consumer::ReplayPolicy::Instant,
            deliver_policy,
            ..Default::default()
        };
        let create = async {
            asked_again(|| self.kv.stream.create_consumer(config.clone()))
                .await
                .map_err(|err| transport(bucket, ">", format!("creating a reader: {err}")))?
                .messages()
                .await
                .map_err(|err| transport(bucket, ">", format!("starting a reader: {err}")))
        };
        let messages = self.guard("read", ">", create).await?;
        let prefix = format!("$KV.{bucket}.");
        Ok(messages.map(move |message| {
            let message =
                message.map_err(|err| transport(bucket, ">", format!("reading: {err}")))?;
            let revision = message
                .info()
                .map_err(|err| transport(bucket, ">", format!("reading metadata: {err}")))?
                .stream_sequence;
            let key = message
                .subject
                .as_str()
                .strip_prefix(&prefix)
                .unwrap_or_default()
                .to_string();
            Ok(if is_removal(message.headers.as_ref()) {
                Change::Removed { key, revision }
            } else {
                Change::Put {
                    key,
                    revision,
                    value: message.payload.clone(),
                }
            })
        }))
    }

    /// The current value of every key, then [`Change::Synced`], then every change as it
    /// happens. The stream ends only when the connection is closed for good.
    ///
    /// At [`Change::Synced`] every key has been delivered, even one rewritten while the
    /// watch started (see `store/watch.rs`); a watch that cannot catch up within 2 s
    /// gives an error item, then [`Change::Synced`] where it is.
    pub async fn watch(
        &self,
    ) -> Result<impl Stream<Item = Result<Change, KvError>> + Send + 'static, KvError> {
        self.watch_keys(">").await
    }

    /// [`Store::watch`], each change with the server's time of its write.
    pub async fn watch_timed(
        &self,
    ) -> Result<impl Stream<Item = Result<Timed, KvError>> + Send + 'static, KvError> {
        Ok(self
            .open_reader(">", consumer::DeliverPolicy::LastPerSubject)
            .await?
            .1
            .into_timed_stream())
    }

    /// Like [`Store::watch`], for the keys matching `filter` (a key, or a pattern with
    /// `*` and `>` tokens). Unless `filter` is `>`, [`Change::Synced`] comes when the
    /// server has nothing more pending, and a key rewritten while the watch started can
    /// come just after it.
    pub async fn watch_keys(
        &self,
        filter: &str,
    ) -> Result<impl Stream<Item = Result<Change, KvError>> + Send + 'static, KvError> {
        Ok(self
            .open_watch(filter, consumer::DeliverPolicy::LastPerSubject)
            .await?
            .1)
    }

    /// Every change to the keys matching `filter` from now on, without the current
    /// values: [`Change::Synced`] first, then each change as it happens. For a watcher
    /// that only cares about what happens after it started (the benchmark's waits on
    /// seats and leases).
    pub async fn watch_new(
        &self,
        filter: &str,
    ) -> Result<impl Stream<Item = Result<Change, KvError>> + Send + 'static, KvError> {
        Ok(self
            .open_watch(filter, consumer::DeliverPolicy::New)
            .await?
            .1)
    }

    /// For log-like buckets whose keys are written once (events): the last `limit`
    /// values written, then [`Change::Synced`], then every new one.
    pub async fn watch_recent(
        &self,
        limit: u64,
    ) -> Result<impl Stream<Item = Result<Change, KvError>> + Send + 'static, KvError> {
        let last = self.last_revision().await?;
        let start_sequence = last.saturating_add(1).saturating_sub(limit).max(1);
        Ok(self
            .open_watch(
                ">",
                consumer::DeliverPolicy::ByStartSequence { start_sequence },
            )
            .await?
            .1)
    }

    /// A watch and the name of its consumer.
    async fn open_watch(
        &self,
        filter: &str,
        deliver_policy: consumer::DeliverPolicy,
    ) -> Result<
        (
            String,
            impl Stream<Item = Result<Change, KvError>> + Send + 'static,
        ),
        KvError,
    > {
        let (name, reader) = self.open_reader(filter, deliver_policy).await?;
        Ok((name, reader.into_stream()))
    }

    /// A watch's reader and the name of its consumer.
    async fn open_reader(
        &self,
        filter: &str,
        deliver_policy: consumer::DeliverPolicy,
    ) -> Result<(String, watch::Reader), KvError> {
        self.guard("read", filter, self.create_reader(filter, deliver_policy))
            .await
    }

    async fn create_reader(
        &self,
        filter: &str,
        deliver_policy: consumer::DeliverPolicy,
    ) -> Result<(String, watch::Reader), KvError> {
        let bucket = self.bucket;
        let config = consumer::push::OrderedConfig {
            deliver_subject: self.js.client().new_inbox(),
            description: Some("slotpool watch".to_string()),
            filter_subject: format!("$KV.{bucket}.{filter}"),
            replay_policy: consumer::ReplayPolicy::Instant,
            deliver_policy,
            ..Default::default()
        };
        let consumer = asked_again(|| self.kv.stream.create_consumer(config.clone()))
            .await
            .map_err(|err| transport(bucket, ">", format!("creating watch: {err}")))?;
        let synced = consumer.cached_info().num_pending == 0;
        let name = consumer.cached_info().name.clone();
        let messages = consumer
            .messages()
            .await
            .map_err(|err| transport(bucket, ">", format!("starting watch: {err}")))?;
        let reader =
            watch::Reader::new(self.clone(), name.clone(), messages, filter == ">", synced);
        Ok((name, reader))
    }
}

/// Whether `err`, or an error it comes from, is a JetStream API request that met no
/// responders: no server took it, so nothing was read or done.
fn unanswered(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        let no_responders = e
            .downcast_ref::<jetstream::context::RequestError>()
            .is_some_and(|e| e.kind() == jetstream::context::RequestErrorKind::NoResponders)
            || e.downcast_ref::<async_nats::RequestError>()
                .is_some_and(|e| e.kind() == async_nats::RequestErrorKind::NoResponders)
            || e.downcast_ref::<jetstream::stream::DirectGetError>()
                .is_some_and(|e| {
                    matches!(e.kind(), DirectGetErrorKind::ErrorResponse(code, _)
                        if code == async_nats::StatusCode::NO_RESPONDERS)
                });
        if no_responders {
            return true;
        }
        next = e.source();
    }
    false
}

/// Asks a JetStream API read (`ask`) again while it meets no responders, for up to
/// [`LEADERLESS_PATIENCE`], as a write is sent again. nats-server answers so while a
/// cluster elects the stream's leader, and, on one server too, for the moment it applies
/// an update of the account's JWT (each push of revoked credentials): it takes the
/// account's import of the JetStream API away and puts it back. A watch, a list or a
/// read of a key started then would otherwise fail for nothing.
async fn asked_again<T, E, Fut>(mut ask: impl FnMut() -> Fut) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
    E: std::error::Error + 'static,
{
    let give_up = tokio::time::Instant::now() + LEADERLESS_PATIENCE;
    let mut pause = Duration::from_millis(10);
    loop {
        match ask().await {
            Err(err) if unanswered(&err) && tokio::time::Instant::now() + pause < give_up => {
                RETRIES.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            other => return other,
        }
    }
}

/// Whether an error text carries a JetStream error code meaning "the revision moved".
fn is_conflict_code(text: &str) -> bool {
    ["10071", "10164"].iter().any(|code| text.contains(code))
}

fn is_removal(headers: Option<&HeaderMap>) -> bool {
    let Some(headers) = headers else { return false };
    headers
        .get(KV_OPERATION)
        .is_some_and(|op| op.as_str() == "DEL" || op.as_str() == "PURGE")
        || headers.get(MARKER_REASON).is_some()
}

impl Change {
    /// Decodes a `Put`'s value.
    pub fn decode<T: DeserializeOwned>(
        bucket: &str,
        key: &str,
        revision: u64,
        value: &[u8],
    ) -> Result<Versioned<T>, KvError> {
        serde_json::from_slice(value)
            .map(|value| Versioned {
                key: key.to_string(),
                revision,
                value,
            })
            .map_err(|source| KvError::Decode {
                bucket: bucket.to_string(),
                key: key.to_string(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whoever waits after a failed write is woken by the first write a leader answers
    /// again, not after its pause; a write that lands while none failed wakes nobody.
    #[tokio::test(start_paused = true)]
    async fn the_first_write_answered_after_a_failure_wakes_the_waiters() {
        let answering = Answering::new();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let answering = answering.clone();
                tokio::spawn(async move {
                    let started = tokio::time::Instant::now();
                    answering.again(Duration::from_secs(60)).await;
                    started.elapsed()
                })
            })
            .collect();
        tokio::task::yield_now().await;
        // Answered while nothing failed: no news.
        answering.answered();
        tokio::time::sleep(Duration::from_secs(1)).await;
        answering.failed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        answering.answered();
        for waiter in waiters {
            assert_eq!(waiter.await.unwrap(), Duration::from_secs(2));
        }
        // Nobody waits for an answer that came before.
        let started = tokio::time::Instant::now();
        answering.again(Duration::from_millis(300)).await;
        assert_eq!(started.elapsed(), Duration::from_millis(300));
    }
}
