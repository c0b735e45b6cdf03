//! A JetStream watch consumer's messages as [`Change`]s, with a [`Change::Synced`] that
//! comes only once every key's value as of the sync has been delivered.
//!
//! The server marks the end of a watch's initial values by a message with nothing
//! pending after it. That is not enough for a whole bucket: a key rewritten while the
//! watch starts loses its old value before it is delivered, and its new value can come
//! just after that marker, so a watcher acting on the sync would miss the key. A
//! whole-bucket watch therefore reads on from the marker to the bucket's last revision as
//! of then, or until the server says the watch has nothing more to deliver (the last
//! write's value can be gone: an expired key). A watch of some keys only (a pattern)
//! cannot tell its keys' last revision from the bucket's and syncs at the marker.

use super::{is_removal, transport, Change, KvError, Store, Timed};
use async_nats::jetstream;
use futures::{Stream, StreamExt};
use std::collections::VecDeque;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// How long a catching-up watch waits for its next message before it asks the server
/// whether anything is left to deliver.
const CATCH_UP_CHECK: Duration = Duration::from_millis(50);
/// How long a watch may take to catch up before it fails.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(2);

type Messages = Pin<
    Box<
        dyn Stream<Item = Result<jetstream::Message, jetstream::consumer::push::OrderedError>>
            + Send,
    >,
>;

/// How far a watch is with the values present when it started.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// Delivering them.
    Initial,
    /// The server had nothing more pending; reading on to `until`, the bucket's last
    /// revision at that point.
    CatchingUp { until: u64, since: Instant },
    /// [`Change::Synced`] is out.
    Done,
}

/// The state of one watch's stream of changes.
pub(super) struct Reader {
    store: Store,
    /// The consumer's name, to ask the server what it has left to deliver.
    consumer: String,
    /// `$KV.<bucket>.`, stripped from subjects to give keys.
    prefix: String,
    messages: Messages,
    /// Whether to catch up to the bucket's last revision before the sync.
    whole_bucket: bool,
    load: Load,
    /// Messages received from the consumer.
    received: u64,
    /// Changes ready to hand out (a change, then possibly the sync).
    ready: VecDeque<Result<Timed, KvError>>,
}

impl Reader {
    /// `synced`: the consumer had nothing pending when it was created.
    pub(super) fn new(
        store: Store,
        consumer: String,
        messages: jetstream::consumer::push::Ordered,
        whole_bucket: bool,
        synced: bool,
    ) -> Reader {
        let mut reader = Reader {
            prefix: format!("$KV.{}.", store.bucket),
            store,
            consumer,
            messages: Box::pin(messages),
            whole_bucket,
            load: Load::Initial,
            received: 0,
            ready: VecDeque::new(),
        };
        if synced {
            reader.sync();
        }
        reader
    }

    pub(super) fn into_stream(self) -> impl Stream<Item = Result<Change, KvError>> + Send {
        self.into_timed_stream()
            .map(|item| item.map(|timed| timed.change))
    }

    pub(super) fn into_timed_stream(self) -> impl Stream<Item = Result<Timed, KvError>> + Send {
        futures::stream::unfold(self, |mut reader| async move {
            let item = reader.next().await?;
            Some((item, reader))
        })
    }

    fn sync(&mut self) {
        self.load = Load::Done;
        self.ready.push_back(Ok(Timed {
            change: Change::Synced,
            written_at: None,
        }));
    }

    fn fail(&mut self, message: String) {
        self.ready
            .push_back(Err(transport(self.store.bucket, ">", message)));
    }

    async fn next(&mut self) -> Option<Result<Timed, KvError>> {
        loop {
            if let Some(item) = self.ready.pop_front() {
                return Some(item);
            }
            let message = match self.load {
                Load::CatchingUp { until, since } => {
                    match tokio::time::timeout(CATCH_UP_CHECK, self.messages.next()).await {
                        Ok(message) => message,
                        Err(_) => {
                            self.check_caught_up(until, since).await;
                            continue;
                        }
                    }
                }
                Load::Initial | Load::Done => self.messages.next().await,
            };
            match message? {
                Ok(message) => self.receive(&message).await,
                Err(err) => self.fail(format!("watch: {err}")),
            }
        }
    }

    async fn receive(&mut self, message: &jetstream::Message) {
        self.received += 1;
        let (revision, pending, written_at) = match message.info() {
            Ok(info) => (
                info.stream_sequence,
                info.pending,
                u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).ok(),
            ),
            Err(err) => return self.fail(format!("watch metadata: {err}")),
        };
        let key = message
            .subject
            .as_str()
            .strip_prefix(&self.prefix)
            .unwrap_or_default()
            .to_string();
        let change = if is_removal(message.headers.as_ref()) {
            Change::Removed { key, revision }
        } else {
            Change::Put {
                key,
                revision,
                value: message.payload.clone(),
            }
        };
        self.ready.push_back(Ok(Timed { change, written_at }));
        match self.load {
            Load::Initial if pending == 0 && !self.whole_bucket => self.sync(),
            Load::Initial if pending == 0 => match self.store.last_revision().await {
                Ok(last) if revision >= last => self.sync(),
                Ok(last) => {
                    self.load = Load::CatchingUp {
                        until: last,
                        since: Instant::now(),
                    }
                }
                Err(err) => self.ready.push_back(Err(err)),
            },
            Load::CatchingUp { until, .. } if revision >= until => self.sync(),
            Load::Initial | Load::CatchingUp { .. } | Load::Done => {}
        }
    }

    /// No message came for a while: the write the watch reads on to may be gone. A watch
    /// that cannot catch up in time reports it once, then syncs where it is (a reader
    /// that goes on after an error, such as the console, is not left without a sync).
    async fn check_caught_up(&mut self, until: u64, since: Instant) {
        match self
            .store
            .delivered_all(&self.consumer, self.received)
            .await
        {
            Ok(true) => self.sync(),
            Ok(false) | Err(_) if since.elapsed() >= CATCH_UP_LIMIT => {
                self.fail(format!(
                    "the watch did not reach revision {until} within {CATCH_UP_LIMIT:?}"
                ));
                self.sync();
            }
            Ok(false) | Err(_) => {}
        }
    }
}
