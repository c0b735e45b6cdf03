//! `slotpool serve --http ADDR`: the launcher's HTTP listener, off unless asked for.
//!
//! Routes: `/metrics` (Prometheus text format, [`metrics`]), `/healthz` (the process is
//! up), `/readyz` (connected to NATS with every mirror synced) and the read-only JSON
//! API under `/api/v1/` ([`api`]), with `/api/v1/stream`, a WebSocket of every change
//! ([`stream`]). A listener on a non-loopback address needs a bearer
//! token (`--http-token-file`); with one, every route but the two probes asks for it.
//!
//! Served with hyper's HTTP/1 connection handling directly: a few read-only routes do
//! not need a framework's router or middleware.

pub mod api;
pub mod metrics;
pub mod stream;

use crate::shared::Shared;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::TcpListener;

/// What prometheus-client writes: the OpenMetrics text format, which Prometheus reads.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "refusing to serve HTTP on {0}: it is not a loopback address, and anyone who \
         reaches it would read the pool; give --http-token-file with a bearer token \
         (or listen on 127.0.0.1 / [::1])"
    )]
    Exposed(SocketAddr),
    #[error("reading the HTTP token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the HTTP token file {0} is empty")]
    EmptyToken(PathBuf),
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A bound listener and the token its clients must show, ready for [`serve`].
pub struct HttpListener {
    listener: TcpListener,
    token: Option<String>,
}

impl HttpListener {
    /// Checks the address against the token and binds it: before the launcher starts,
    /// so a refused or taken address stops `slotpool serve` at once.
    pub async fn bind(addr: SocketAddr, token_file: Option<&Path>) -> Result<Self, HttpError> {
        let token = token_file.map(read_token).transpose()?;
        if token.is_none() && !addr.ip().is_loopback() {
            return Err(HttpError::Exposed(addr));
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        Ok(HttpListener { listener, token })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

fn read_token(path: &Path) -> Result<String, HttpError> {
    let text = std::fs::read_to_string(path).map_err(|source| HttpError::TokenFile {
        path: path.to_path_buf(),
        source,
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(HttpError::EmptyToken(path.to_path_buf()));
    }
    Ok(token.to_string())
}

/// Serves `http` until the launcher shuts down; connections open then are finished
/// gracefully (a request in flight is answered, then the connection closes).
pub async fn serve(shared: Arc<Shared>, http: HttpListener) {
    if let Ok(addr) = http.local_addr() {
        tracing::info!("http listening on {addr}");
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
        shared.tracker.spawn(async move {
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
        });
    }
}

struct State {
    registry: prometheus_client::registry::Registry,
    token: Option<String>,
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
    fn not_ready(&self) -> Option<&'static str> {
        if !self.shared.bus.is_connected() {
            Some("not connected to NATS")
        } else if self.shared.mirror_sync.since().is_none() {
            Some("mirrors of KV not synced")
        } else {
            None
        }
    }

    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        req.headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same(given.trim().as_bytes(), token.as_bytes()))
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

/// Compares in time independent of where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn plain(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body.to_string())));
    *res.status_mut() = status;
    res
}
