//! `slotpool serve --http ADDR`: the launcher's HTTP listener, off unless asked for.
//!
//! Routes: `/metrics` (Prometheus text format, [`metrics`]), `/healthz` (the process is
//! up), `/readyz` (connected to NATS with every mirror synced) and the read-only JSON
//! API under `/api/v1/` ([`api`]), with `/api/v1/stream`, a WebSocket of every change
//! ([`stream`]). Every route but the two probes asks who is calling and shows each
//! caller what the bus would ([`auth`]); a listener on a non-loopback address needs TLS
//! client certificates or tokens. With `--http-tls-cert` and `--http-tls-key` the
//! listener speaks HTTPS only ([`tls`]).
//!
//! Served with hyper's HTTP/1 connection handling directly: a few read-only routes do
//! not need a framework's router or middleware. The listener is bounded
//! ([`slotpool_protocol::listener`]): at most `--http-max-connections` at once (when
//! full, the oldest connection not being answered is closed to make room; a change
//! stream counts as being answered, and at most half the connections may be streams or
//! exec sockets),
//! [`HEADER_READ_TIMEOUT`] for a request's head (and between two requests on one
//! connection), [`IDLE_TIMEOUT`] without a byte moving, and accept errors pause the loop
//! instead of spinning.

pub(crate) mod api;
pub(crate) mod auth;
// Public for its message types, which tests/tests/docs.rs decodes docs/http.md's examples with.
pub mod exec;
pub(crate) mod metrics;
// Public for its message type, which tests/tests/docs.rs decodes docs/http.md's examples with.
pub mod stream;
pub mod tls;

use crate::revoked::Revoked;
use crate::shared::Shared;
use auth::{Caller, Denied};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use slotpool_protocol::auth::http_token::TokenVerifier;
use slotpool_protocol::auth::Credentials;
use slotpool_protocol::bearer::{self, BearerError, BearerToken};
use slotpool_protocol::listener::{Admitted, Bounds, Gate};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// Every answer's body: whole, or streamed (a file read out of a node).
type Body = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// What prometheus-client writes: the OpenMetrics text format, which Prometheus reads.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// How long a client may take over its TLS handshake before the connection is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's head, and how long a kept-alive
/// connection may wait for its next request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may go without a byte read or written before it is closed (a
/// client that stops reading its answer, say). A change stream pings every 20 s.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The default of `--http-max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "refusing to serve HTTP on {0}: it is not a loopback address, and anyone who \
         reaches it would read the pool; give --http-token-file with a bearer token, \
         or --http-client-ca to require client certificates (or listen on 127.0.0.1 / [::1])"
    )]
    Exposed(SocketAddr),
    #[error(
        "refusing to serve HTTP on {0} with no way to tell its callers apart: on an \
         anonymous bus there are no credentials to derive tokens from; give \
         --http-token-file, or --http-client-ca, or --http-no-auth to let everyone who \
         reaches it read every request and node"
    )]
    NoAuth(SocketAddr),
    #[error(
        "refusing --http-no-auth on {0}: it is not a loopback address; give tokens or \
         client certificates instead"
    )]
    OpenExposed(SocketAddr),
    #[error("the launcher's credentials cannot check HTTP tokens: {0}")]
    Verifier(slotpool_protocol::auth::AuthError),
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

/// How `slotpool serve --http` is to listen: the flags, plain data.
#[derive(Clone, Debug)]
pub struct HttpSettings {
    pub addr: SocketAddr,
    pub token_file: Option<std::path::PathBuf>,
    pub tls: Option<tls::TlsFiles>,
    pub max_connections: usize,
    /// The launcher's own bus credentials: tokens derived from credentials of the same
    /// issuer are accepted (none on an anonymous bus).
    pub creds: Option<std::path::PathBuf>,
    /// `--http-no-auth`: everyone who reaches the listener reads everything.
    pub no_auth: bool,
}

/// A bound listener, how it tells its callers apart and its TLS set-up, ready for
/// [`serve`].
pub struct HttpListener {
    listener: TcpListener,
    auth: auth::HttpAuth,
    tls: Option<TlsAcceptor>,
    gate: Gate,
}

impl HttpListener {
    /// Checks the address against the token and client certificates, reads the TLS
    /// files and binds the address: before the launcher starts, so a refused set-up or a
    /// taken address stops `slotpool serve` at once.
    pub async fn bind(settings: &HttpSettings) -> Result<Self, HttpError> {
        let addr = settings.addr;
        let token = settings
            .token_file
            .as_deref()
            .map(BearerToken::read)
            .transpose()?;
        let client_certs = settings.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        let verifier = match &settings.creds {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| {
                    HttpError::Verifier(slotpool_protocol::auth::AuthError::Io {
                        path: path.clone(),
                        source,
                    })
                })?;
                Some(
                    TokenVerifier::of(&Credentials::from_text(text))
                        .map_err(HttpError::Verifier)?,
                )
            }
            None => None,
        };
        if settings.no_auth {
            if !addr.ip().is_loopback() {
                return Err(HttpError::OpenExposed(addr));
            }
            tracing::warn!(
                "HTTP WITHOUT AUTHORISATION (--http-no-auth): every local user (a CI job in \
                 a slot on this host, say) who reaches {addr} reads every request and node, \
                 with other clients' SSH keys"
            );
        } else if token.is_none() && verifier.is_none() && !client_certs {
            return Err(HttpError::NoAuth(addr));
        }
        if token.is_none()
            && verifier.is_none()
            && !bearer::may_serve_without_token(addr, client_certs)
        {
            return Err(HttpError::Exposed(addr));
        }
        let tls = settings.tls.as_ref().map(tls::acceptor).transpose()?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        Ok(HttpListener {
            listener,
            auth: auth::HttpAuth {
                open: settings.no_auth,
                static_token: token,
                verifier,
                client_certificates: client_certs,
                revoked: Revoked::default(),
            },
            tls,
            gate: Gate::new(
                "http",
                Bounds {
                    max_connections: settings.max_connections,
                    idle: IDLE_TIMEOUT,
                },
            ),
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
    let (auth, tls, gate) = (http.auth, http.tls, http.gate);
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
                            auth,
                            tls,
                            gate,
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
    let max_streams = (http.gate.bounds().max_connections / 2).max(1);
    shared.tracker.spawn(crate::revoked::follow(
        shared.bus.leases.clone(),
        http.auth.revoked.clone(),
        shared.shutdown.clone(),
    ));
    let state = Arc::new(State {
        registry: metrics::registry(shared.clone()),
        auth: http.auth,
        shared: shared.clone(),
        streams: Arc::new(tokio::sync::Semaphore::new(max_streams)),
        max_streams,
    });
    let gate = http.gate;
    loop {
        let (stream, peer) = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = http.listener.accept() => match accepted {
                Ok(accepted) => accepted,
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
        let shutdown = shared.shutdown.clone();
        let tls = http.tls.clone();
        let (stream, idle) = gate.watch(stream);
        let conn = Connection {
            peer,
            admitted: Arc::new(admitted),
            idle: idle.expired(),
        };
        shared.tracker.spawn(async move {
            let Some(tls) = tls else {
                return serve_connection(state, stream, conn, shutdown).await;
            };
            let handshake = tokio::select! {
                _ = shutdown.cancelled() => return,
                done = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)) => done,
            };
            match handshake {
                Ok(Ok(stream)) => serve_connection(state, stream, conn, shutdown).await,
                Ok(Err(err)) => tracing::debug!(%err, %peer, "https: handshake failed"),
                Err(_) => {
                    tracing::debug!(%peer, "https: no handshake within {TLS_HANDSHAKE_TIMEOUT:?}")
                }
            }
        });
    }
}

/// One accepted connection: who, its place at the gate (held until the connection and
/// any change stream it was upgraded to end), and when it has been idle too long.
struct Connection<F> {
    peer: SocketAddr,
    admitted: Arc<Admitted>,
    idle: F,
}

/// Answers requests on one connection, plain or TLS, until the client or the launcher
/// ends it, or it idles past [`IDLE_TIMEOUT`].
async fn serve_connection<S, F>(
    state: Arc<State>,
    stream: S,
    conn: Connection<F>,
    shutdown: tokio_util::sync::CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: std::future::Future<Output = ()>,
{
    let Connection {
        peer,
        admitted,
        idle,
    } = conn;
    let closed = admitted.closed();
    let service = hyper::service::service_fn(move |req| {
        let state = state.clone();
        let admitted = admitted.clone();
        async move {
            let _busy = admitted.busy();
            Ok::<_, std::convert::Infallible>(state.answer(req, admitted.clone()).await)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    tokio::pin!(idle);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = &mut idle => {
            tracing::debug!(%peer, "http connection idle for {IDLE_TIMEOUT:?}: closed");
            return;
        }
        () = closed => {
            tracing::debug!(%peer, "http connection closed to make room for a newer one");
            return;
        }
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
    auth: auth::HttpAuth,
    shared: Arc<Shared>,
    /// Places of long-lived sockets: change streams and exec sockets.
    streams: Arc<tokio::sync::Semaphore>,
    max_streams: usize,
}

impl State {
    async fn answer(&self, req: Request<Incoming>, admitted: Arc<Admitted>) -> Response<Body> {
        let put_file = req.method() == hyper::Method::PUT
            && node_route(req.uri().path()).is_some_and(|(_, r)| r == "file");
        if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD && !put_file {
            return plain(
                StatusCode::METHOD_NOT_ALLOWED,
                "only GET (and PUT of a node's file)\n",
            );
        }
        match req.uri().path() {
            "/healthz" => plain(StatusCode::OK, "ok\n"),
            "/readyz" => match self.not_ready() {
                None => plain(StatusCode::OK, "ready\n"),
                Some(why) => plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{why}\n")),
            },
            _ => {
                let authorization = req
                    .headers()
                    .get(hyper::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                match self.auth.caller(authorization, unix_now()) {
                    Ok(caller) => self.answer_caller(req, caller, admitted).await,
                    Err(Denied::Unauthorized(why)) => {
                        let mut res = plain(StatusCode::UNAUTHORIZED, &format!("{why}\n"));
                        res.headers_mut().insert(
                            hyper::header::WWW_AUTHENTICATE,
                            hyper::header::HeaderValue::from_static("Bearer"),
                        );
                        res
                    }
                    Err(Denied::Forbidden(why)) => {
                        plain(StatusCode::FORBIDDEN, &format!("{why}\n"))
                    }
                }
            }
        }
    }

    /// Answers a request of `caller` on a route that needs one.
    async fn answer_caller(
        &self,
        req: Request<Incoming>,
        caller: Caller,
        admitted: Arc<Admitted>,
    ) -> Response<Body> {
        if let Some((node, route)) = node_route(req.uri().path()) {
            if route == "exec" || route == "file" {
                let node = node.to_string();
                let route = route.to_string();
                return self.run_in_node(req, caller, &node, &route, admitted).await;
            }
        }
        match req.uri().path() {
            "/api/v1/stream" => self.open_stream(req, caller, admitted).await,
            path if path.starts_with("/api/v1/") => {
                let route = &path["/api/v1/".len()..];
                match api::answer(&self.shared, &caller, route, req.uri().query()).await {
                    api::Answer::Json(body) => {
                        let mut res = Response::new(full(body));
                        res.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static("application/json"),
                        );
                        res
                    }
                    api::Answer::BadRequest(why) => {
                        plain(StatusCode::BAD_REQUEST, &format!("{why}\n"))
                    }
                    api::Answer::Forbidden(why) => {
                        plain(StatusCode::FORBIDDEN, &format!("{why}\n"))
                    }
                    api::Answer::NotFound => plain(StatusCode::NOT_FOUND, "not found\n"),
                    api::Answer::Unavailable(why) => {
                        plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{why}\n"))
                    }
                }
            }
            "/metrics" if caller != Caller::Everything => plain(
                StatusCode::FORBIDDEN,
                "the pool's metrics are for operators\n",
            ),
            "/metrics" => {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &self.registry) {
                    Ok(()) => {
                        let mut res = Response::new(full(text));
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
    async fn open_stream(
        &self,
        mut req: Request<Incoming>,
        caller: Caller,
        admitted: Arc<Admitted>,
    ) -> Response<Body> {
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
        let params = match params.for_caller(caller) {
            Ok(params) => params,
            Err(why) => return plain(StatusCode::FORBIDDEN, &format!("{why}\n")),
        };
        // Streams are never closed to make room, so they may fill half the listener.
        let Ok(stream_place) = self.streams.clone().try_acquire_owned() else {
            return plain(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!(
                    "{} change streams are open, as many as this launcher serves; try again later\n",
                    self.max_streams
                ),
            );
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
            // The stream keeps its connection's place at the gate, as one being
            // answered, until it ends.
            let _busy = admitted.busy();
            let _places = (admitted, stream_place);
            match upgrade.await {
                Ok(upgraded) => stream::run(upgraded, opened, shutdown).await,
                Err(err) => tracing::debug!(%err, "change stream: the upgrade failed"),
            }
        });
        switching_protocols(&accept)
    }

    /// `/api/v1/nodes/{id}/exec` and `/api/v1/nodes/{id}/file` ([`exec`]): for a
    /// client's own node only, checked again by the execute channel itself.
    async fn run_in_node(
        &self,
        mut req: Request<Incoming>,
        caller: Caller,
        node: &str,
        route: &str,
        admitted: Arc<Admitted>,
    ) -> Response<Body> {
        let Caller::Client(client) = caller else {
            return plain(
                StatusCode::FORBIDDEN,
                "commands run in a client's own nodes: use that client's token\n",
            );
        };
        let node = match slotpool_protocol::NodeId::parse(node) {
            Ok(node) => node,
            Err(e) => return plain(StatusCode::BAD_REQUEST, &format!("node {node:?}: {e}\n")),
        };
        if route == "exec" {
            let Some(accept) = websocket_accept(&req) else {
                return plain(
                    StatusCode::UPGRADE_REQUIRED,
                    "a WebSocket handshake is required\n",
                );
            };
            // Refused before the upgrade when the node is not the caller's ready node.
            match crate::nodes::record(&self.shared, &node).await {
                Ok(Some(n)) if n.client.as_ref() == Some(&client) => {}
                Ok(Some(_)) => {
                    return plain(
                        StatusCode::FORBIDDEN,
                        &format!("node {node} belongs to another client\n"),
                    )
                }
                Ok(None) => return plain(StatusCode::NOT_FOUND, &format!("no node {node}\n")),
                Err(e) => return plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{e}\n")),
            }
            // Like change streams, exec sockets are never closed to make room, so they
            // share the half of the listener streams may fill.
            let Ok(socket_place) = self.streams.clone().try_acquire_owned() else {
                return plain(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!(
                        "{} change streams and exec sockets are open, as many as this launcher serves; try again later\n",
                        self.max_streams
                    ),
                );
            };
            let upgrade = hyper::upgrade::on(&mut req);
            let shared = self.shared.clone();
            let shutdown = self.shared.shutdown.clone();
            self.shared.tracker.spawn(async move {
                let _busy = admitted.busy();
                let _places = (admitted, socket_place);
                match upgrade.await {
                    Ok(upgraded) => {
                        exec::run_websocket(shared, client, node, upgraded, shutdown).await
                    }
                    Err(err) => tracing::debug!(%err, "exec: the upgrade failed"),
                }
            });
            return switching_protocols(&accept);
        }
        let path = form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
            .find(|(k, _)| k == "path")
            .map(|(_, v)| v.into_owned());
        let Some(path) = path.filter(|p| !p.is_empty() && !p.contains('\0')) else {
            return plain(
                StatusCode::BAD_REQUEST,
                "give the file as ?path=P (relative to the workspace)\n",
            );
        };
        if req.method() == hyper::Method::PUT {
            let body = req.into_body();
            return match exec::put_file(&self.shared, &client, node, &path, body).await {
                Ok(()) => {
                    let mut res = Response::new(full(Bytes::new()));
                    *res.status_mut() = StatusCode::NO_CONTENT;
                    res
                }
                Err((status, why)) => plain(status, &format!("{why}\n")),
            };
        }
        match exec::get_file(&self.shared, &client, node, &path).await {
            Ok(mut chunks) => {
                let stream = futures::stream::poll_fn(move |cx| chunks.poll_recv(cx));
                let mut res = Response::new(http_body_util::StreamBody::new(stream).boxed());
                res.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/octet-stream"),
                );
                res
            }
            Err((status, why)) => plain(status, &format!("{why}\n")),
        }
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
}

/// The answer to a WebSocket handshake whose key gave `accept`.
fn switching_protocols(accept: &str) -> Response<Body> {
    let mut res = Response::new(full(Bytes::new()));
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
    if let Ok(accept) = hyper::header::HeaderValue::from_str(accept) {
        headers.insert(hyper::header::SEC_WEBSOCKET_ACCEPT, accept);
    }
    res
}

/// `/api/v1/nodes/{id}/{route}`: the node and the route.
fn node_route(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/api/v1/nodes/")?;
    let (node, route) = rest.split_once('/')?;
    (!node.is_empty() && !route.contains('/')).then_some((node, route))
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

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn plain(status: StatusCode, body: &str) -> Response<Body> {
    let mut res = Response::new(full(body.to_string()));
    *res.status_mut() = status;
    res
}

#[cfg(test)]
mod tests {
    /// docs/http.md states the listener's limits; they are the code's.
    #[test]
    fn the_documented_limits_are_the_codes() {
        let doc = include_str!("../../../docs/http.md");
        for stated in [
            format!(
                "`--http-max-connections` connections at once (default **{}**)",
                super::DEFAULT_MAX_CONNECTIONS
            ),
            format!(
                "within **{} s** of the connection",
                super::HEADER_READ_TIMEOUT.as_secs()
            ),
            format!(
                "moves no byte for **{} s** is closed",
                super::IDLE_TIMEOUT.as_secs()
            ),
            format!(
                "pings an open exec socket every {} s",
                super::exec::PING_EVERY.as_secs()
            ),
            format!(
                "stdin (at most {} KiB each",
                slotpool_protocol::exec::MAX_CHUNK_BYTES / 1024
            ),
            format!(
                "pauses the listener for {} ms and is logged at most once every {} s",
                slotpool_protocol::listener::ACCEPT_PAUSE.as_millis(),
                slotpool_protocol::listener::WARN_EVERY.as_secs()
            ),
        ] {
            assert!(
                doc.split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
                    .contains(&stated),
                "docs/http.md does not say {stated:?}"
            );
        }
    }
}
