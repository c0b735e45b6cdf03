//! `slotpool-agent --metrics ADDR`: this agent's Prometheus metrics over HTTP, off by
//! default.
//!
//! A listener on an address that is not loopback needs a bearer token
//! (`--metrics-token-file`), as the launcher's does; with one, `/metrics` asks for it.
//! Served with hyper's HTTP/1 connection handling directly, as the launcher's listener,
//! and bounded the same way ([`slotpool_protocol::listener`]): at most
//! `--metrics-max-connections` at once (when full, the oldest idle one is closed to make
//! room), [`HEADER_READ_TIMEOUT`] for a request's head and
//! between requests, [`IDLE_TIMEOUT`] without a byte moving, a pause after an accept
//! error. Slot users cannot reach it at all (the bus guard rejects their connections to
//! its port, [`crate::bus_guard`]).
//!
//! Every series is per agent (one backing node): slots by state, read from the slot
//! table when scraped; prepare and release durations; wipe failures; heartbeat writes.

use crate::metrics::METRICS;
use crate::slots::Slots;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use slotpool_protocol::bearer::{self, BearerError, BearerToken};
use slotpool_protocol::listener::{Bounds, Gate};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The default of `--metrics-max-connections`: a few scrapers, with room to spare.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// How long a client may take to send a request's head, and how long a kept-alive
/// connection may wait for its next request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may go without a byte read or written before it is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// What prometheus-client writes: the OpenMetrics text format, which Prometheus reads.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The registry `/metrics` encodes.
fn registry(slots: Slots) -> Registry {
    let m = &*METRICS;
    let mut registry = Registry::with_prefix("slotpool_agent");
    registry.register(
        "prepare_seconds",
        "Time to prepare a slot for a node, from the command to its answer.",
        m.prepare_seconds.clone(),
    );
    registry.register(
        "release_seconds",
        "Time to release a slot (stop its processes, wipe it), from the command to its answer.",
        m.release_seconds.clone(),
    );
    registry.register(
        "wipe_failures",
        "Releases that could not clean their slot, leaving it dirty.",
        m.wipe_failures.clone(),
    );
    for outcome in ["written", "failed"] {
        let _ = m.heartbeats.get_or_create(&[("outcome", outcome)]);
    }
    registry.register(
        "heartbeats",
        "Heartbeat writes to KV by outcome: written, failed.",
        m.heartbeats.clone(),
    );
    registry.register_collector(Box::new(SlotCollector(slots)));
    registry
}

/// Slots by state, read from the slot table when scraped.
struct SlotCollector(Slots);

impl std::fmt::Debug for SlotCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("slot collector")
    }
}

impl prometheus_client::collector::Collector for SlotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let slots = &self.0;
        let used = slots.reports().len();
        let dirty = slots.dirty_slots().len();
        let warm = slots.warm_slots().len();
        let free = (slots.count() as usize).saturating_sub(used + dirty);
        let mut family = encoder.encode_descriptor(
            "slots",
            "Slots by state: used (prepared for a node), free, dirty (could not be cleaned), warm (free and set up ahead).",
            None,
            MetricType::Gauge,
        )?;
        for (state, n) in [
            ("used", used),
            ("free", free),
            ("dirty", dirty),
            ("warm", warm),
        ] {
            ConstGauge::new(n as i64).encode(family.encode_family(&[("state", state)])?)?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error(
        "refusing to serve metrics on {0}: it is not a loopback address; give \
         --metrics-token-file with a bearer token (or listen on 127.0.0.1 / [::1])"
    )]
    Exposed(SocketAddr),
    #[error(transparent)]
    Token(#[from] BearerError),
    #[error("listening on {addr} for metrics: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Where and how to serve `/metrics`: the flags, plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsSettings {
    pub addr: SocketAddr,
    pub token_file: Option<PathBuf>,
    pub max_connections: usize,
}

/// A bound metrics listener, the token its clients must show and its gate.
pub struct MetricsListener {
    listener: TcpListener,
    token: Option<BearerToken>,
    gate: Gate,
}

impl MetricsListener {
    /// Checks the address against the token and binds it.
    pub async fn bind(settings: &MetricsSettings) -> Result<Self, MetricsError> {
        let addr = settings.addr;
        let token = settings
            .token_file
            .as_deref()
            .map(BearerToken::read)
            .transpose()?;
        if token.is_none() && !bearer::may_serve_without_token(addr, false) {
            return Err(MetricsError::Exposed(addr));
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| MetricsError::Bind { addr, source })?;
        let gate = Gate::new(
            "metrics",
            Bounds {
                max_connections: settings.max_connections,
                idle: IDLE_TIMEOUT,
            },
        );
        Ok(MetricsListener {
            listener,
            token,
            gate,
        })
    }

    /// The port it listens on (for the bus guard).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// Serves `/metrics` until `shutdown`.
pub async fn serve(listener: MetricsListener, slots: Slots, shutdown: CancellationToken) {
    if let Ok(addr) = listener.listener.local_addr() {
        tracing::info!("metrics listening on {addr}");
    }
    let state = Arc::new(State {
        registry: registry(slots),
        token: listener.token,
    });
    let connections = tokio_util::task::TaskTracker::new();
    let gate = listener.gate;
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    gate.accept_failed(&err).await;
                    continue;
                }
            },
        };
        let Some(admitted) = gate.admit() else {
            continue;
        };
        let state = state.clone();
        let shutdown = shutdown.clone();
        let (stream, idle) = gate.watch(stream);
        connections.spawn(async move {
            // Answered at once (no await), so never closed to make room mid-answer.
            let closed = admitted.closed();
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(state.answer(&req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let result = tokio::select! {
                result = conn.as_mut() => result,
                () = idle.expired() => {
                    tracing::debug!("metrics connection idle for {IDLE_TIMEOUT:?}: closed");
                    return;
                }
                () = closed => {
                    tracing::debug!("metrics connection closed to make room for a newer one");
                    return;
                }
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(err) = result {
                tracing::debug!(%err, "metrics connection ended");
            }
            drop(admitted);
        });
    }
    connections.close();
    connections.wait().await;
}

struct State {
    registry: Registry,
    token: Option<BearerToken>,
}

impl State {
    fn answer(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
            return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        }
        if req.uri().path() != "/metrics" {
            return plain(StatusCode::NOT_FOUND, "not found\n");
        }
        let authorization = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if self
            .token
            .as_ref()
            .is_some_and(|t| !t.accepts(authorization))
        {
            let mut res = plain(StatusCode::UNAUTHORIZED, "bearer token required\n");
            res.headers_mut().insert(
                hyper::header::WWW_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Bearer"),
            );
            return res;
        }
        let mut text = String::new();
        match prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            Ok(()) => {
                let mut res = Response::new(Full::new(Bytes::from(text)));
                res.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(CONTENT_TYPE),
                );
                res
            }
            Err(_) => plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n"),
        }
    }
}

fn plain(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body.to_string())));
    *res.status_mut() = status;
    res
}
