//! Connecting to NATS, checking the server, opening slotpool's buckets, and plain
//! request-reply helpers. Everything async-nats stays behind this module's types.

use crate::api::{ApiError, Reply};
use crate::auth::{BusUser, Role};
use crate::layout::{self, ALL_BUCKETS};
use crate::refusals::{Refusal, Refusals};
use crate::store::{KvError, Store};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde::{de::DeserializeOwned, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// How to reach NATS (the usual NATS client options). Plain data.
#[derive(Clone, Debug, Default)]
pub struct NatsOptions {
    /// One or more server URLs, comma-separated (`nats://host:4222`, `tls://...`).
    pub url: String,
    /// A `.creds` file (JWT + NKey).
    pub creds: Option<PathBuf>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// CA bundle to trust for TLS.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Connection name shown by the server (`slotpool-launcher`, ...).
    pub name: String,
    /// The bus user name to act as on a bus without slotpool credentials (an anonymous
    /// development bus, or user/password logins). Ignored with `creds`: credentials made
    /// by `slotpool nats-setup` carry their own name, and the server holds a user to it.
    pub act_as: Option<crate::UserName>,
}

/// Why slotpool could not talk to NATS.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("reading credentials file {path}: {source}")]
    Credentials {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--tls-cert and --tls-key go together")]
    TlsPair,
    #[error("nats-server {found} is too old: slotpool needs {}.{}.{} or newer (per-key TTL); install a newer nats-server", .needed.0, .needed.1, .needed.2)]
    ServerTooOld {
        found: String,
        needed: (u64, u64, u64),
    },
    #[error("JetStream is not enabled on the NATS server (start it with -js)")]
    NoJetStream,
    #[error(
        "bucket {bucket} has {found} replica(s), but this launcher is set to {wanted} \
         (kv-replicas): set kv-replicas to {found}, or change the bucket with \
         `nats stream edit KV_{bucket} --replicas {wanted}`"
    )]
    Replicas {
        bucket: String,
        found: usize,
        wanted: usize,
    },
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("{}", no_responders_message(.subject))]
    NoResponders { subject: String },
    #[error("no answer on {subject} within {timeout:?}")]
    Timeout { subject: String, timeout: Duration },
    /// The server refused to let this user publish on the subject: the role does not
    /// allow it (docs/protocol.md, section 12).
    #[error("not permitted: {user} may not publish on {subject} (the NATS server refused it; see the permissions of each role in docs/protocol.md)")]
    NotPermitted { user: String, subject: String },
    #[error("request on {subject} failed: {message}")]
    Request { subject: String, message: String },
    #[error("malformed reply on {subject}: {source}")]
    BadReply {
        subject: String,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("credentials: {0}")]
    Auth(crate::auth::AuthError),
}

fn no_responders_message(subject: &str) -> String {
    match subject.strip_prefix("slotpool.agent.v2.") {
        Some(backing) => format!(
            "no agent answers on {subject}: the agent of backing node {backing} is not running or not connected"
        ),
        None => format!("no launcher answers on {subject}: is `slotpool serve` running?"),
    }
}

/// How long a KV write or read waits for the bucket's answer. A write in flight when
/// the bucket's leader dies gets none; it fails after this and is retried (re-reading
/// first: it may have committed) once the servers have elected another leader, so this
/// bounds what an election costs beyond its own few seconds.
pub const JETSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a launcher ([`Bus::connect_replicated`]) waits at start for JetStream to
/// answer and its buckets to open before it gives up.
pub const STARTUP_PATIENCE: Duration = Duration::from_secs(30);

/// A connection to NATS with slotpool's buckets open.
#[derive(Clone)]
pub struct Bus {
    client: async_nats::Client,
    /// Who this connection is on the bus.
    user: BusUser,
    pub requests: Store,
    pub slots: Store,
    pub backing: Store,
    pub agents: Store,
    pub leases: Store,
    pub events: Store,
    /// Whether the connection is up and how often it came back ([`Bus::link_state`]).
    link_state: tokio::sync::watch::Receiver<LinkState>,
    /// The server's refusals of this connection's subjects, for the calls that made
    /// them; `None` for a launcher, which may use every subject.
    refusals: Option<Refusals>,
}

/// Whether a [`Bus`]'s connection is up, as the NATS client reports it (see
/// [`Bus::connect_watching`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    Up,
    /// Lost; the client is reconnecting on its own.
    Down,
}

/// Whether a [`Bus`]'s connection is up, and how many times it came back after a loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkState {
    pub up: bool,
    pub reconnects: u64,
}

/// A message received on a served subject.
pub struct Incoming {
    /// The subject it was sent to (useful with a wildcard subscription).
    pub subject: String,
    pub payload: Bytes,
    pub reply_to: Option<String>,
}

impl Bus {
    /// Connects, checks the server version and JetStream, and opens (creating if needed)
    /// every slotpool bucket.
    ///
    /// A bucket created here has one replica. Launchers use [`Bus::connect_replicated`].
    pub async fn connect(opts: &NatsOptions) -> Result<Bus, BusError> {
        Bus::connect_with(opts, None, None).await
    }

    /// Like [`Bus::connect`], for a launcher: a bucket it creates gets `replicas` copies
    /// (3 on a three-server JetStream cluster), and an existing bucket with another count
    /// is refused with [`BusError::Replicas`] rather than silently used.
    pub async fn connect_replicated(opts: &NatsOptions, replicas: usize) -> Result<Bus, BusError> {
        Bus::connect_with(opts, None, Some(replicas)).await
    }

    /// Like [`Bus::connect`], and reports every loss and recovery of the connection on
    /// the returned channel (for a display that must say when it is out of date).
    pub async fn connect_watching(
        opts: &NatsOptions,
    ) -> Result<(Bus, tokio::sync::watch::Receiver<Link>), BusError> {
        let (tx, rx) = tokio::sync::watch::channel(Link::Up);
        Ok((Bus::connect_with(opts, Some(tx), None).await?, rx))
    }

    async fn connect_with(
        opts: &NatsOptions,
        link: Option<tokio::sync::watch::Sender<Link>>,
        replicas: Option<usize>,
    ) -> Result<Bus, BusError> {
        let user = bus_user(opts)?;
        let (state_tx, link_state) = tokio::sync::watch::channel(LinkState {
            up: true,
            reconnects: 0,
        });
        let refusals = (user.role != Role::Launcher).then(|| Refusals::new(&user));
        let client = connect_client(opts, &user, link, state_tx, refusals.clone()).await?;
        check_server_version(&client.server_info().version)?;
        let mut js = async_nats::jetstream::new(client.clone());
        js.set_timeout(JETSTREAM_TIMEOUT);
        // A launcher started beside a cluster that is still electing (or a server that
        // just rejoined one) finds JetStream silent for a while: it waits, as it would
        // for a bucket leader later. A client is told at once.
        let patience = if replicas.is_some() {
            STARTUP_PATIENCE
        } else {
            Duration::ZERO
        };
        let deadline = tokio::time::Instant::now() + patience;
        let mut pause = Duration::from_millis(250);
        let stores = loop {
            match open_stores(&js, replicas, &refusals).await {
                Ok(stores) => break stores,
                Err(err)
                    if matches!(err, BusError::NoJetStream | BusError::Kv(_))
                        && tokio::time::Instant::now() + pause < deadline =>
                {
                    tracing::warn!(
                        %err,
                        "JetStream does not answer yet (a cluster electing, or a server \
                         just started?): trying again in {pause:?}"
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(err) => return Err(err),
            }
        };
        let find = |name: &str| {
            stores
                .iter()
                .find(|s| s.bucket() == name)
                .cloned()
                .expect("bucket opened")
        };
        Ok(Bus {
            requests: find(layout::REQUESTS.name),
            slots: find(layout::SLOTS.name),
            backing: find(layout::BACKING.name),
            agents: find(layout::AGENTS.name),
            leases: find(layout::LEASES.name),
            events: find(layout::EVENTS.name),
            client,
            user,
            link_state,
            refusals,
        })
    }

    /// The connection's [`LinkState`], changed at each loss and recovery: a watcher of
    /// KV re-reads what it mirrors after a reconnect, since a removal the server announced
    /// while it was away (an expired key's marker lives about a second) is not delivered
    /// again.
    pub fn link_state(&self) -> tokio::sync::watch::Receiver<LinkState> {
        self.link_state.clone()
    }

    /// Who this connection is on the bus: from its credentials, or `act_as` (default
    /// `anonymous`) on a bus without slotpool credentials.
    pub fn user(&self) -> &BusUser {
        &self.user
    }

    /// slotpool's bucket named `bucket` ([`crate::layout::ALL_BUCKETS`]), as opened here.
    pub fn store(&self, bucket: &str) -> Option<&Store> {
        [
            &self.requests,
            &self.slots,
            &self.backing,
            &self.agents,
            &self.leases,
            &self.events,
        ]
        .into_iter()
        .find(|s| s.bucket() == bucket)
    }

    /// Opens (creating it if absent) a bucket that is not one of slotpool's own, on this
    /// connection: for tools such as the benchmark's KV floor.
    pub async fn open_bucket(&self, spec: crate::store::BucketSpec) -> Result<Store, KvError> {
        let mut js = async_nats::jetstream::new(self.client.clone());
        js.set_timeout(JETSTREAM_TIMEOUT);
        Ok(Store::open(&js, spec, 1)
            .await?
            .with_refusals(self.refusals.clone()))
    }

    /// Sends `msg` to `subject` and decodes the [`Reply`], with a deadline.
    pub async fn call<Q: Serialize, R: DeserializeOwned>(
        &self,
        subject: &str,
        msg: &Q,
        timeout: Duration,
    ) -> Result<R, BusError> {
        let bytes = self
            .call_raw(
                subject,
                Bytes::from(serde_json::to_vec(msg).expect("messages serialize")),
                timeout,
            )
            .await?;
        decode_reply(subject, &bytes)
    }

    /// Sends raw bytes and returns the raw reply.
    pub async fn call_raw(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, BusError> {
        // A reply sent while this connection was away is lost for good (its inbox had
        // no subscription on any server then): once the connection is back, the call
        // ends as a time-out, which every caller already treats as "ask again", rather
        // than waiting out `timeout` for an answer that cannot come.
        let mut link = self.link_state.clone();
        let reconnects = link.borrow_and_update().reconnects;
        let request = self.client.request(subject.to_string(), payload);
        let fut = tokio::time::timeout(timeout, async move {
            tokio::select! {
                answered = request => Ok(answered),
                Ok(_) = link.wait_for(|s| s.up && s.reconnects > reconnects) => Err(()),
            }
        });
        let fut = async move {
            match fut.await {
                Ok(Ok(answered)) => Ok(answered),
                Ok(Err(())) | Err(_) => Err(()),
            }
        };
        let answered = match &self.refusals {
            None => fut.await,
            Some(refusals) => refusals
                .guard(|r: &Refusal| !r.subscribe && r.subject == subject, fut)
                .await
                .map_err(|refused| BusError::NotPermitted {
                    user: self.user.to_string(),
                    subject: refused.subject,
                })?,
        };
        match answered {
            Err(_) => Err(BusError::Timeout {
                subject: subject.to_string(),
                timeout,
            }),
            Ok(Ok(msg)) => Ok(msg.payload),
            Ok(Err(err)) => Err(match err.kind() {
                async_nats::client::RequestErrorKind::NoResponders => BusError::NoResponders {
                    subject: subject.to_string(),
                },
                async_nats::client::RequestErrorKind::TimedOut => BusError::Timeout {
                    subject: subject.to_string(),
                    timeout,
                },
                _ => BusError::Request {
                    subject: subject.to_string(),
                    message: err.to_string(),
                },
            }),
        }
    }

    /// Like [`Bus::call_raw`] for an operation its responders answer alike when it comes
    /// twice: while no answer came, `payload` is sent again after `first_gap`, then after
    /// twice that, and so on, each beside the ones before (whose answers still count),
    /// for up to `timeout` in all. A message or a reply in flight through a server that
    /// dies is lost while this connection stays up; the resend, not `timeout`, bounds
    /// what that costs. The first answer wins; an error other than a time-out ends the
    /// call at once, except "no responders" for a copy sent again while another copy may
    /// still be answered (docs/protocol.md, "Sending a call again"): the first copy's
    /// "no responders" ends it. An attempt that ended early because this connection came
    /// back ([`Bus::call_raw`]) is sent again at once.
    pub async fn call_raw_resending(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
        first_gap: Duration,
    ) -> Result<Bytes, BusError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Each copy borrows the bus: a clone of it is a clone of every bucket's handle,
        // each with its stream's cached description.
        let bus = self;
        let attempt = || {
            let payload = payload.clone();
            async move {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                bus.call_raw(subject, payload, left).await
            }
        };
        let mut pending = futures::stream::FuturesUnordered::new();
        pending.push(attempt());
        // Whether a copy ended without an answer of the server's (a time-out, or this
        // connection coming back): it may have reached a responder whose reply was lost,
        // so a "no responders" heard since says nothing about whether one runs.
        let mut unanswered = false;
        let mut gap = first_gap;
        let mut resend = tokio::time::Instant::now() + gap;
        loop {
            tokio::select! {
                biased;
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(BusError::Timeout { subject: subject.to_string(), timeout })
                }
                Some(answered) = pending.next() => match answered {
                    Err(BusError::Timeout { .. }) => {
                        unanswered = true;
                        if pending.is_empty() && tokio::time::Instant::now() < deadline {
                            pending.push(attempt());
                        }
                    }
                    Err(BusError::NoResponders { .. }) if unanswered || !pending.is_empty() => {
                        // A copy sent again met no subscription on its server: a server
                        // this connection or a responder's just reconnected to may not
                        // know a responder's subscription yet. The earlier copies, or the
                        // next one, may still be answered.
                        tracing::debug!(%subject, "a copy sent again met no responders; listening on");
                    }
                    other => return other,
                },
                _ = tokio::time::sleep_until(resend), if resend < deadline => {
                    tracing::debug!(%subject, waited = ?gap, "no answer yet; sending again");
                    pending.push(attempt());
                    gap *= 2;
                    resend += gap;
                }
            }
        }
    }

    /// [`Bus::call_raw_resending`] with a typed message and reply.
    pub async fn call_resending<Q: Serialize, R: DeserializeOwned>(
        &self,
        subject: &str,
        msg: &Q,
        timeout: Duration,
        first_gap: Duration,
    ) -> Result<R, BusError> {
        let payload = Bytes::from(serde_json::to_vec(msg).expect("messages serialize"));
        let bytes = self
            .call_raw_resending(subject, payload, timeout, first_gap)
            .await?;
        decode_reply(subject, &bytes)
    }

    /// Messages on `subject`; with `queue`, each message goes to one member of the group.
    pub async fn serve(
        &self,
        subject: &str,
        queue: Option<&str>,
    ) -> Result<impl Stream<Item = Incoming> + Send + 'static, BusError> {
        let sub = match queue {
            Some(q) => {
                self.client
                    .queue_subscribe(subject.to_string(), q.to_string())
                    .await
            }
            None => self.client.subscribe(subject.to_string()).await,
        }
        .map_err(|err| BusError::Request {
            subject: subject.to_string(),
            message: format!("subscribe: {err}"),
        })?;
        Ok(sub.map(|m| Incoming {
            subject: m.subject.to_string(),
            payload: m.payload,
            reply_to: m.reply.map(|s| s.to_string()),
        }))
    }

    /// Answers a served message.
    pub async fn respond<T: Serialize>(
        &self,
        reply_to: &str,
        reply: &Reply<T>,
    ) -> Result<(), BusError> {
        let bytes = Bytes::from(serde_json::to_vec(reply).expect("replies serialize"));
        self.client
            .publish(reply_to.to_string(), bytes)
            .await
            .map_err(|err| BusError::Request {
                subject: reply_to.to_string(),
                message: err.to_string(),
            })
    }

    /// Publishes raw bytes (no reply expected); waits while the connection's outgoing
    /// buffer is full, so a fast publisher is held back, not buffered without bound.
    pub async fn publish_raw(&self, subject: String, payload: Bytes) -> Result<(), BusError> {
        self.client
            .publish(subject.clone(), payload)
            .await
            .map_err(|err| BusError::Request {
                subject,
                message: err.to_string(),
            })
    }

    /// Waits until everything published so far is written to the connection's socket.
    /// The server may not have read it yet: see [`Bus::sync`].
    pub async fn flush(&self) -> Result<(), BusError> {
        self.client.flush().await.map_err(|err| BusError::Request {
            subject: "flush".into(),
            message: err.to_string(),
        })
    }

    /// Waits until the server has taken in everything this connection sent before, its
    /// subscriptions included, so that a message another connection publishes from now
    /// on reaches them. A server reads each connection in order but connections side by
    /// side, and [`Bus::flush`] only writes to the socket: a subscription merely flushed
    /// may still be unknown to the server when another connection's message arrives,
    /// which that connection then hears as "no responders". The round trip is a
    /// JetStream account-info request, which every role may send.
    pub async fn sync(&self, timeout: Duration) -> Result<(), BusError> {
        self.call_raw(layout::subjects::JETSTREAM_INFO, Bytes::new(), timeout)
            .await
            .map(drop)
    }

    /// Whether the connection is currently up.
    pub fn is_connected(&self) -> bool {
        matches!(
            self.client.connection_state(),
            async_nats::connection::State::Connected
        )
    }
}

/// Logs what the NATS client reports beside the link going down and up: each can
/// explain a stall seen elsewhere, and none is otherwise visible. A slow consumer means
/// the client dropped messages of one of its subscriptions because its queue was full:
/// a KV watch notices the gap at its next message, or at the server's next idle
/// heartbeat (5 s) when the dropped message was the last, and starts again from the
/// last one it delivered.
fn log_event(event: &async_nats::Event) {
    match event {
        async_nats::Event::SlowConsumer(sid) => tracing::warn!(
            subscription = sid,
            "slow consumer: the NATS client dropped messages of a subscription whose queue was full"
        ),
        async_nats::Event::ServerError(err) if is_watch_cleanup(err) => tracing::debug!(
            %err,
            "the NATS server refused to delete an ended watch's consumer; it expires by itself"
        ),
        async_nats::Event::ServerError(err) => {
            tracing::warn!(%err, "the NATS server reported an error")
        }
        async_nats::Event::ClientError(err) => {
            tracing::warn!(%err, "the NATS client reported an error")
        }
        async_nats::Event::LameDuckMode => {
            tracing::warn!("the NATS server is shutting down (lame duck mode)")
        }
        async_nats::Event::Draining | async_nats::Event::Closed => {
            tracing::debug!(%event, "NATS connection")
        }
        async_nats::Event::Connected | async_nats::Event::Disconnected => {}
    }
}

/// Whether `err` is the server refusing a `CONSUMER.DELETE`: the NATS client deletes a
/// KV watch's ephemeral consumer when the watch ends, and a role that may not delete
/// consumers (an operator, a client, an agent: deleting would let them end a
/// launcher's watches) is refused; the server drops the idle consumer by itself.
fn is_watch_cleanup(err: &async_nats::ServerError) -> bool {
    matches!(err, async_nats::ServerError::Other(text)
        if text.contains("Permissions Violation") && text.contains("$JS.API.CONSUMER.DELETE."))
}

/// The bus user `opts` connect as. With slotpool credentials the name and role are the
/// credentials' own; otherwise `act_as`, as a client.
fn bus_user(opts: &NatsOptions) -> Result<BusUser, BusError> {
    if let Some(path) = &opts.creds {
        return crate::auth::read_user(path).map_err(BusError::Auth);
    }
    let name = opts
        .act_as
        .clone()
        .unwrap_or_else(|| crate::UserName::parse("anonymous").expect("a name token"));
    Ok(BusUser {
        role: Role::Client,
        name,
    })
}

async fn connect_client(
    opts: &NatsOptions,
    user: &BusUser,
    link: Option<tokio::sync::watch::Sender<Link>>,
    state: tokio::sync::watch::Sender<LinkState>,
    refusals: Option<Refusals>,
) -> Result<async_nats::Client, BusError> {
    let mut o = async_nats::ConnectOptions::new()
        // Replies come to this user's own inbox: a user may subscribe to no other's.
        .custom_inbox_prefix(user.inbox_prefix())
        .name(if opts.name.is_empty() {
            "slotpool"
        } else {
            &opts.name
        })
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None::<usize>);
    o = o.event_callback(move |event| {
        let (link, state, refusals) = (link.clone(), state.clone(), refusals.clone());
        async move {
            match event {
                async_nats::Event::Connected => {
                    // The first connection is no reconnect.
                    state.send_if_modified(|s| {
                        let back = !s.up;
                        if back {
                            *s = LinkState {
                                up: true,
                                reconnects: s.reconnects + 1,
                            };
                        }
                        back
                    });
                    if let Some(link) = link {
                        link.send_replace(Link::Up);
                    }
                }
                async_nats::Event::Disconnected => {
                    state.send_if_modified(|s| std::mem::replace(&mut s.up, false));
                    if let Some(link) = link {
                        link.send_replace(Link::Down);
                    }
                }
                async_nats::Event::ServerError(async_nats::ServerError::Other(text))
                    if refusals.is_some() && Refusal::parse(&text).is_some() =>
                {
                    // The call that was refused says so in its error.
                    tracing::debug!(%text, "the NATS server refused a subject");
                    if let (Some(refusals), Some(refusal)) = (&refusals, Refusal::parse(&text)) {
                        refusals.report(refusal);
                    }
                }
                other => log_event(&other),
            }
        }
    });
    if let Some(path) = &opts.creds {
        o = o
            .credentials_file(path)
            .await
            .map_err(|source| BusError::Credentials {
                path: path.clone(),
                source,
            })?;
    }
    if let (Some(u), Some(p)) = (&opts.user, &opts.password) {
        o = o.user_and_password(u.clone(), p.clone());
    }
    if let Some(t) = &opts.token {
        o = o.token(t.clone());
    }
    let o = with_tls(o, opts)?;
    let urls = server_addrs(opts)?;
    o.connect(urls).await.map_err(|err| BusError::Connect {
        url: opts.url.clone(),
        message: err.to_string(),
    })
}

/// `o` with the TLS options of `opts` (a CA to trust, a client certificate).
pub(crate) fn with_tls(
    mut o: async_nats::ConnectOptions,
    opts: &NatsOptions,
) -> Result<async_nats::ConnectOptions, BusError> {
    if let Some(ca) = &opts.tls_ca {
        o = o.add_root_certificates(ca.clone()).require_tls(true);
    }
    match (&opts.tls_cert, &opts.tls_key) {
        (Some(c), Some(k)) => {
            o = o
                .add_client_certificate(c.clone(), k.clone())
                .require_tls(true)
        }
        (None, None) => {}
        _ => return Err(BusError::TlsPair),
    }
    Ok(o)
}

/// The server addresses of `opts`' comma-separated URL.
pub(crate) fn server_addrs(opts: &NatsOptions) -> Result<Vec<async_nats::ServerAddr>, BusError> {
    opts.url
        .split(',')
        .map(|u| u.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|err: std::io::Error| BusError::Connect {
            url: opts.url.clone(),
            message: err.to_string(),
        })
}

/// Parses `major.minor.patch[-suffix]` and refuses servers older than [`crate::MIN_NATS_SERVER`].
pub fn check_server_version(found: &str) -> Result<(), BusError> {
    let needed = crate::MIN_NATS_SERVER;
    let core = found
        .trim_start_matches('v')
        .split(['-', '+'])
        .next()
        .unwrap_or("");
    let mut parts = core.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let v = (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    );
    if v >= needed {
        Ok(())
    } else {
        Err(BusError::ServerTooOld {
            found: found.to_string(),
            needed,
        })
    }
}

/// A responder's reply to a call on `subject`: its value, or its error as [`BusError::Api`].
fn decode_reply<R: DeserializeOwned>(subject: &str, bytes: &[u8]) -> Result<R, BusError> {
    let reply: Reply<R> = serde_json::from_slice(bytes).map_err(|source| BusError::BadReply {
        subject: subject.to_string(),
        source,
    })?;
    Ok(reply.into_result()?)
}

/// Checks that JetStream answers and opens every slotpool bucket (creating it with
/// `replicas` copies when absent; a launcher's existing bucket with another count is
/// refused).
async fn open_stores(
    js: &async_nats::jetstream::Context,
    replicas: Option<usize>,
    refusals: &Option<Refusals>,
) -> Result<Vec<Store>, BusError> {
    if js.query_account().await.is_err() {
        return Err(BusError::NoJetStream);
    }
    let mut stores = Vec::with_capacity(ALL_BUCKETS.len());
    for spec in ALL_BUCKETS {
        let mut store = Store::open(js, spec, replicas.unwrap_or(1))
            .await?
            .with_refusals(refusals.clone());
        if replicas.is_some() {
            store.apply_discard(spec).await?;
        }
        match replicas {
            Some(wanted) if store.replicas() != wanted => {
                return Err(BusError::Replicas {
                    bucket: spec.name.to_string(),
                    found: store.replicas(),
                    wanted,
                })
            }
            _ => {
                // One server's death moves the leaders of every bucket it led: a
                // recovery seen on one is news for all.
                let store = match stores.first() {
                    Some(first) => store.with_recoveries_of(first),
                    None => store,
                };
                stores.push(store)
            }
        }
    }
    Ok(stores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_versions() {
        assert!(check_server_version("2.15.1").is_ok());
        assert!(check_server_version("2.11.0-beta.2").is_ok());
        assert!(check_server_version("v3.0.0").is_ok());
        let err = check_server_version("2.9.10").unwrap_err().to_string();
        assert!(err.contains("2.9.10") && err.contains("2.11.0"), "{err}");
    }

    /// nats-server's default `max_control_line`: a longer CONNECT line is refused.
    const SERVER_CONTROL_LINE: usize = 4096;

    /// The CONNECT line (without its CRLF) that slotpool's connection sends with `creds`,
    /// named `name`, to a listener that plays a nats-server asking for authentication.
    async fn connect_line(creds: &std::path::Path, name: &str) -> String {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let opts = NatsOptions {
            url: format!("nats://{}", listener.local_addr().unwrap()),
            creds: Some(creds.to_path_buf()),
            name: name.into(),
            ..Default::default()
        };
        let client = tokio::spawn(async move { Bus::connect(&opts).await.map(|_| ()) });
        let (socket, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("the client connects")
            .unwrap();
        let mut socket = BufReader::new(socket);
        // A nonce as long as nats-server's (11 bytes, base64): the client signs it.
        socket
            .get_mut()
            .write_all(
                b"INFO {\"server_id\":\"NTEST\",\"server_name\":\"test\",\"version\":\"2.15.1\",\
                  \"proto\":1,\"go\":\"go1.24\",\"host\":\"127.0.0.1\",\"port\":4222,\
                  \"headers\":true,\"max_payload\":1048576,\"auth_required\":true,\
                  \"nonce\":\"pKXBcCmYkgB0pXY\"}\r\n",
            )
            .await
            .unwrap();
        let mut line = String::new();
        tokio::time::timeout(Duration::from_secs(10), socket.read_line(&mut line))
            .await
            .expect("the client sends CONNECT")
            .unwrap();
        client.abort();
        assert!(line.starts_with("CONNECT {"), "{line}");
        line.trim_end().to_string()
    }

    #[test]
    fn only_a_refused_watch_cleanup_is_not_worth_a_warning() {
        let cleanup = async_nats::ServerError::Other(
            "Permissions Violation for Publish to \"$JS.API.CONSUMER.DELETE.KV_slotpool_requests.3LOZ0svs\""
                .into(),
        );
        assert!(is_watch_cleanup(&cleanup));
        let read = async_nats::ServerError::Other(
            "Permissions Violation for Publish to \"$JS.API.STREAM.INFO.KV_slotpool_backing\""
                .into(),
        );
        assert!(!is_watch_cleanup(&read));
        assert!(!is_watch_cleanup(
            &async_nats::ServerError::AuthorizationViolation
        ));
    }

    /// Every role's CONNECT line, as slotpool mints its credential and names its
    /// connection, with a usual name and with the longest name a user may have, stays
    /// under 3/4 of the server's limit: the JWT carries the role's permissions, so a
    /// longer list of subjects would end in connections the server refuses.
    #[tokio::test]
    async fn every_roles_connect_line_stays_well_under_the_servers_limit() {
        use crate::auth::{Installation, Role};
        let margin = SERVER_CONTROL_LINE * 3 / 4;
        let minter = Installation::generate().minter();
        let dir = tempfile::tempdir().unwrap();
        let longest = "n".repeat(crate::ids::MAX_ID_LEN);
        let agent = "bn-01jq3m2f7h8g9k0m1n2p3q4r00";
        // The connection names the programs give (an agent's names its backing node).
        let cases = [
            (Role::Launcher, "launcher-1", "slotpool-launcher"),
            (Role::Operator, "alice", "slotpool-console"),
            (Role::Client, "ci", "slotpool-cli"),
            (Role::Agent, agent, "slotpool-agent-"),
        ];
        let mut sizes = Vec::new();
        for (role, usual, connection) in cases {
            for name in [usual, longest.as_str()] {
                let user = BusUser::new(role, name).unwrap();
                let path = dir.path().join(format!("{role}-{}.creds", name.len()));
                // A launch mints its agent a credential that expires (30 days without
                // max-age); the setup's users have none.
                let expiry = (role == Role::Agent).then(|| Duration::from_secs(30 * 86_400));
                let minted = minter.mint(&user, expiry).unwrap();
                minted.write_private(&path).unwrap();
                let connection = if role == Role::Agent {
                    format!("{connection}{name}")
                } else {
                    connection.to_string()
                };
                let line = connect_line(&path, &connection).await;
                sizes.push((role, name.len(), line.len()));
            }
        }
        for (role, name, size) in &sizes {
            let role = role.as_str();
            eprintln!("{role:<8} named with {name:>3} bytes: CONNECT line of {size} bytes");
        }
        let over: Vec<_> = sizes.iter().filter(|(_, _, size)| *size > margin).collect();
        assert!(
            over.is_empty(),
            "CONNECT lines over {margin} bytes (3/4 of nats-server's {SERVER_CONTROL_LINE}): \
             {over:?}; all: {sizes:?}"
        );
    }

    #[test]
    fn no_responders_names_who_is_missing() {
        let agent = BusError::NoResponders {
            subject: "slotpool.agent.v2.bn-1".into(),
        };
        assert!(
            agent.to_string().contains("agent of backing node bn-1"),
            "{agent}"
        );
        let api = BusError::NoResponders {
            subject: "slotpool.api.v2.ci.submit".into(),
        };
        assert!(api.to_string().contains("slotpool serve"), "{api}");
    }
}
