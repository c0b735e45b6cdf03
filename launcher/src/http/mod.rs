//! `slotpool serve --http ADDR`: the launcher's HTTP listener, off unless asked for.
//!
//! Routes: `/metrics` (Prometheus text format, [`metrics`]), `/healthz` (the process is
//! up), `/readyz` (connected to NATS with every mirror synced) and the read-only JSON
//! API under `/api/v1/` ([`api`]), with `/api/v1/stream`, a WebSocket of every change
//! ([`stream`]). A listener on a non-loopback address needs a bearer token
//! (`--http-token-file`) or client certificates (`--http-client-ca`); with a token,
//! every route but the two probes asks for it. With `--http-tls-cert` and
//! `--http-tls-key` the listener speaks HTTPS only ([`tls`]).
//!
//! Served with hyper's HTTP/1 connection handling directly: a few read-only routes do
//! not need a framework's router or middleware.

pub(crate) mod api;
pub(crate) mod metrics;
// Public for its message type, which tests/tests/docs.rs decodes docs/http.md's examples with.
pub mod stream;
pub mod tls;

use crate::shared::Shared;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use slotpool_protocol::bearer::{self, BearerError, BearerToken};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// What prometheus-client writes: the OpenMetrics text format, which Prometheus reads.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// How long a client may take over its TLS handshake before the connection is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "refusing to serve HTTP on {0}: it is not a loopback address, and anyone who \
         reaches it would read the pool; give --http-token-file with a bearer token, \
         or --http-client-ca to require client certificates (or listen on 127.0.0.1 / [::1])"
    )]
    Exposed(SocketAddr),
    #[error(transparent)]
    Token(#[from] BearerError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A bound listener, the token its clients must show and its TLS set-up, ready for
/// [`serve`].
pub struct HttpListener {
    listener: TcpListener,
    token: Option<BearerToken>,
    tls: Option<TlsAcceptor>,
}

impl HttpListener {
    /// Checks the address against the token and client certificates, reads the TLS
    /// files and binds the address: before the launcher starts, so a refused set-up or a
    /// taken address stops `slotpool serve` at once.
    pub async fn bind(
        addr: SocketAddr,
        token_file: Option<&Path>,
        tls: Option<&tls::TlsFiles>,
    ) -> Result<Self, HttpError> {
        let token = token_file.map(BearerToken::read).transpose()?;
        let client_certs = tls.is_some_and(|t| t.client_ca.is_some());
        if token.is_none() && !bearer::may_serve_without_token(addr, client_certs) {
            return Err(HttpError::Exposed(addr));
        }
        let tls = tls.map(tls::acceptor).transpose()?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        Ok(HttpListener {
            listener,
            token,
            tls,
        })
    }

    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// Serves `http` on a thread and runtime of its own until the launcher shuts down
/// ([`serve`]): the probes and `/metrics` answer even when every worker of the
/// launcher's runtime is busy, so a stalled launcher says so instead of not answering.
pub fn spawn(
    shared: Arc<Shared>,
    http: HttpListener,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let listener = http.listener.into_std()?;
    let (token, tls) = (http.token, http.tls);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => {
                        let http = HttpListener {
                            listener,
                            token,
                            tls,
                        };
                        serve(shared.clone(), http).await;
                        // The connections' tasks run on this runtime: it is driven until
                        // they and the launcher's other tasks have ended (streams close
                        // with the position to resume from).
                        shared.tracker.wait().await;
                    }
                    Err(err) => tracing::error!(%err, "http: cannot take over the listener"),
                }
            })
        })
}

/// Serves `http` until the launcher shuts down; connections open then are finished
/// gracefully (a request in flight is answered, then the connection closes).
pub(crate) async fn serve(shared: Arc<Shared>, http: HttpListener) {
    if let Ok(addr) = http.local_addr() {
        let scheme = if http.tls.is_some() { "https" } else { "http" };
        tracing::info!("http listening on {addr} ({scheme})");
    }
    let state = Arc::new(State {
        registry: metrics::registry(shared.clone()),
        token: http.token,
        shared: shared.clone(),
    });
    loop {
        let (stream, peer) = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = http.listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(%err, "http: cannot accept a connection");
                    continue;
                }
            },
        };
        let state = state.clone();
        let shutdown = shared.shutdown.clone();
        let tls = http.tls.clone();
        shared.tracker.spawn(async move {
            let Some(tls) = tls else {
                return serve_connection(state, stream, peer, shutdown).await;
            };
            let handshake = tokio::select! {
                _ = shutdown.cancelled() => return,
                done = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)) => done,
            };
            match handshake {
                Ok(Ok(stream)) => serve_connection(state, stream, peer, shutdown).await,
                Ok(Err(err)) => tracing::debug!(%err, %peer, "https: handshake failed"),
                Err(_) => {
                    tracing::debug!(%peer, "https: no handshake within {TLS_HANDSHAKE_TIMEOUT:?}")
                }
            }
        });
    }
}

/// Answers requests on one connection, plain or TLS, until the client or the launcher
/// ends it.
async fn serve_connection<S>(
    state: Arc<State>,
    stream: S,
    peer: SocketAddr,
    shutdown: tokio_util::sync::CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, std::convert::Infallible>(state.answer(req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        _ = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(err) = result {
        tracing::debug!(%err, %peer, "http connection ended");
    }
}

struct State {
    registry: prometheus_client::registry::Registry,
    token: Option<BearerToken>,
    shared: Arc<Shared>,
}

impl State {
    async fn answer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
            return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        }
        match req.uri().path() {
            "/healthz" => plain(StatusCode::OK, "ok\n"),
            "/readyz" => match self.not_ready() {
                None => plain(StatusCode::OK, "ready\n"),
                Some(why) => plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{why}\n")),
            },
            _ if !self.authorized(&req) => {
                let mut res = plain(StatusCode::UNAUTHORIZED, "bearer token required\n");
                res.headers_mut().insert(
                    hyper::header::WWW_AUTHENTICATE,
                    hyper::header::HeaderValue::from_static("Bearer"),
                );
                res
            }
            "/api/v1/stream" => self.open_stream(req).await,
            path if path.starts_with("/api/v1/") => {
                let route = &path["/api/v1/".len()..];
                match api::answer(&self.shared, route, req.uri().query()).await {
                    api::Answer::Json(body) => {
                        let mut res = Response::new(Full::new(Bytes::from(body)));
                        res.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static("application/json"),
                        );
                        res
                    }
                    api::Answer::BadRequest(why) => {
                        plain(StatusCode::BAD_REQUEST, &format!("{why}\n"))
                    }
                    api::Answer::NotFound => plain(StatusCode::NOT_FOUND, "not found\n"),
                    api::Answer::Unavailable(why) => {
                        plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{why}\n"))
                    }
                }
            }
            "/metrics" => {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &self.registry) {
                    Ok(()) => {
                        let mut res = Response::new(Full::new(Bytes::from(text)));
                        res.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static(METRICS_CONTENT_TYPE),
                        );
                        res
                    }
                    Err(_) => plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n"),
                }
            }
            _ => plain(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    /// Answers a WebSocket handshake on `/api/v1/stream` and follows the stream on the
    /// upgraded connection; a bad query or position is refused before the upgrade.
    async fn open_stream(&self, mut req: Request<Incoming>) -> Response<Full<Bytes>> {
        let Some(accept) = websocket_accept(&req) else {
            let mut res = plain(
                StatusCode::UPGRADE_REQUIRED,
                "a WebSocket handshake is required (GET with Upgrade: websocket, \
                 Connection: Upgrade, Sec-WebSocket-Version: 13 and a Sec-WebSocket-Key)\n",
            );
            res.headers_mut().insert(
                hyper::header::UPGRADE,
                hyper::header::HeaderValue::from_static("websocket"),
            );
            return res;
        };
        let params = match stream::parse_query(req.uri().query()) {
            Ok(params) => params,
            Err(why) => return plain(StatusCode::BAD_REQUEST, &format!("{why}\n")),
        };
        let opened = match stream::open(&self.shared, params).await {
            Ok(opened) => opened,
            Err(stream::Refusal::BadRequest(why)) => {
                return plain(StatusCode::BAD_REQUEST, &format!("{why}\n"))
            }
            Err(stream::Refusal::Gone(why)) => return plain(StatusCode::GONE, &format!("{why}\n")),
            Err(stream::Refusal::Unavailable(why)) => {
                return plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{why}\n"))
            }
        };
        let upgrade = hyper::upgrade::on(&mut req);
        let shutdown = self.shared.shutdown.clone();
        self.shared.tracker.spawn(async move {
            match upgrade.await {
                Ok(upgraded) => stream::run(upgraded, opened, shutdown).await,
                Err(err) => tracing::debug!(%err, "change stream: the upgrade failed"),
            }
        });
        let mut res = Response::new(Full::new(Bytes::new()));
        *res.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let headers = res.headers_mut();
        headers.insert(
            hyper::header::UPGRADE,
            hyper::header::HeaderValue::from_static("websocket"),
        );
        headers.insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("Upgrade"),
        );
        if let Ok(accept) = hyper::header::HeaderValue::from_str(&accept) {
            headers.insert(hyper::header::SEC_WEBSOCKET_ACCEPT, accept);
        }
        res
    }

    /// Why this launcher is not ready to serve, if it is not.
    fn not_ready(&self) -> Option<String> {
        let now = slotpool_protocol::time::now_ms();
        let pass_age = crate::metrics::pass_age(now, self.shared.started_at);
        if !self.shared.bus.is_connected() {
            Some("not connected to NATS".into())
        } else if self.shared.mirror_sync.since().is_none() {
            Some("mirrors of KV not synced".into())
        } else if pass_age > self.shared.config.stall_after {
            Some(format!(
                "stalled: the supervisor has not finished a pass for {}s (more than {}s)",
                pass_age.as_secs(),
                self.shared.config.stall_after.as_secs()
            ))
        } else {
            None
        }
    }

    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        token.accepts(
            req.headers()
                .get(hyper::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok()),
        )
    }
}

/// The `Sec-WebSocket-Accept` answering `req`, if it is a WebSocket handshake.
fn websocket_accept(req: &Request<Incoming>) -> Option<String> {
    let header = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
    let has_token = |name, token: &str| {
        header(name).is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    };
    let handshake = req.method() == hyper::Method::GET
        && has_token(hyper::header::UPGRADE, "websocket")
        && has_token(hyper::header::CONNECTION, "upgrade")
        && header(hyper::header::SEC_WEBSOCKET_VERSION) == Some("13");
    let key = header(hyper::header::SEC_WEBSOCKET_KEY).filter(|_| handshake)?;
    Some(tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes()))
}

fn plain(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body.to_string())));
    *res.status_mut() = status;
    res
}
