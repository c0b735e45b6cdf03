//! A loopback proxy in front of an EC2 API server (moto) that does what EC2 and the
//! network do and moto does not: it loses the answer to a request the server carried out,
//! and answers for the server with EC2's errors (capacity, quotas, throttling, spot).
//! Every request that passes is recorded with its action and parameters.
//!
//! Faults are given per action (`RunInstances`, `TerminateInstances`, ...): a queue of
//! faults for its next requests ([`Ec2Proxy::fail_next`]) and a share of its answers to
//! lose at random with a seed ([`Ec2Proxy::lose_answers`]).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// What the proxy does to one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// Sends the request on, waits for the server's answer, then closes the client's
    /// connection without answering: the server carried the request out, the client
    /// never hears of it.
    LoseAnswer,
    /// Sends the request on and never answers (until the proxy stops): the client waits
    /// for an answer that does not come, as when it is killed mid-call.
    Stall,
    /// Answers with an EC2 error instead of the server; the server never sees the request.
    Error {
        status: u16,
        code: String,
        message: String,
    },
}

impl Fault {
    /// EC2's answer when a zone has no capacity for the instance type.
    pub fn insufficient_capacity() -> Fault {
        Fault::error(
            500,
            "InsufficientInstanceCapacity",
            "We currently do not have sufficient capacity in the Availability Zone you requested.",
        )
    }
    /// EC2's answer when the account's instance quota is reached.
    pub fn instance_limit() -> Fault {
        Fault::error(
            400,
            "InstanceLimitExceeded",
            "You have requested more instances than your current instance limit allows.",
        )
    }
    /// EC2's throttling.
    pub fn throttled() -> Fault {
        Fault::error(503, "RequestLimitExceeded", "Request limit exceeded.")
    }
    /// EC2's answer when the spot quota is reached.
    pub fn spot_limit() -> Fault {
        Fault::error(
            400,
            "MaxSpotInstanceCountExceeded",
            "Max spot instance count exceeded",
        )
    }
    pub fn error(status: u16, code: &str, message: &str) -> Fault {
        Fault::Error {
            status,
            code: code.into(),
            message: message.into(),
        }
    }
}

/// A request that reached the proxy.
#[derive(Clone, Debug)]
pub struct Seen {
    pub action: String,
    /// The form parameters, in order (`ClientToken`, `TagSpecification.1.Tag.1.Key`, ...).
    pub params: Vec<(String, String)>,
    pub fault: Option<Fault>,
}

impl Seen {
    /// The first value of parameter `name`.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Faults {
    queued: HashMap<String, VecDeque<Fault>>,
    random: HashMap<String, (f64, rand::rngs::StdRng)>,
    seen: Vec<Seen>,
}

impl Faults {
    fn pick(&mut self, action: &str) -> Option<Fault> {
        if let Some(f) = self.queued.get_mut(action).and_then(VecDeque::pop_front) {
            return Some(f);
        }
        let (share, rng) = self.random.get_mut(action)?;
        (rng.random::<f64>() < *share).then_some(Fault::LoseAnswer)
    }
}

/// The proxy; stops on drop.
pub struct Ec2Proxy {
    addr: SocketAddr,
    faults: Arc<Mutex<Faults>>,
    stop: CancellationToken,
}

impl Ec2Proxy {
    /// A proxy on a free loopback port in front of the server at `upstream` (host:port).
    pub async fn start(upstream: SocketAddr) -> Ec2Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the proxy");
        let addr = listener.local_addr().unwrap();
        let faults = Arc::new(Mutex::new(Faults::default()));
        let stop = CancellationToken::new();
        let (f, s) = (faults.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = s.cancelled() => return,
                    conn = listener.accept() => conn,
                };
                let Ok((stream, _)) = conn else { continue };
                let (f, s) = (f.clone(), s.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let f = f.clone();
                        async move { relay(req, upstream, f).await }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    tokio::select! {
                        _ = s.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        Ec2Proxy { addr, faults, stop }
    }

    /// The endpoint URL to point an EC2 client at.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next `count` requests of `action` get `fault`.
    pub fn fail_next(&self, action: &str, count: usize, fault: Fault) {
        let mut f = self.faults.lock().unwrap();
        let q = f.queued.entry(action.to_string()).or_default();
        q.extend(std::iter::repeat_n(fault, count));
    }

    /// From now on, each answer to `action` is lost with probability `share` (a seeded,
    /// repeatable draw).
    pub fn lose_answers(&self, action: &str, share: f64, seed: u64) {
        self.faults.lock().unwrap().random.insert(
            action.to_string(),
            (share, rand::rngs::StdRng::seed_from_u64(seed)),
        );
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.faults.lock().unwrap().seen.clone()
    }

    /// The requests of `action` so far.
    pub fn seen_of(&self, action: &str) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.action == action)
            .collect()
    }
}

impl Drop for Ec2Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Why the proxy answers nothing: hyper drops the connection when the service fails.
#[derive(Debug)]
struct NoAnswer(String);

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NoAnswer {}

fn no_answer(err: impl std::fmt::Display) -> NoAnswer {
    NoAnswer(err.to_string())
}

async fn relay(
    req: Request<Incoming>,
    upstream: SocketAddr,
    faults: Arc<Mutex<Faults>>,
) -> Result<Response<Full<Bytes>>, NoAnswer> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(no_answer)?.to_bytes();
    let params: Vec<(String, String)> = form_urlencoded::parse(&body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let action = params
        .iter()
        .find(|(k, _)| k == "Action")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let fault = {
        let mut f = faults.lock().unwrap();
        let fault = f.pick(&action);
        f.seen.push(Seen {
            action: action.clone(),
            params,
            fault: fault.clone(),
        });
        fault
    };
    if let Some(Fault::Error {
        status,
        code,
        message,
    }) = &fault
    {
        let xml = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code>\
             <Message>{message}</Message></Error></Errors><RequestID>slotpool-test-proxy</RequestID></Response>"
        );
        return Response::builder()
            .status(*status)
            .header("content-type", "text/xml;charset=UTF-8")
            .body(Full::new(Bytes::from(xml)))
            .map_err(no_answer);
    }
    let (status, headers, answer) = forward(&parts, &body, upstream).await.map_err(no_answer)?;
    match fault {
        Some(Fault::LoseAnswer) => return Err(no_answer("answer lost on purpose")),
        Some(Fault::Stall) => std::future::pending::<()>().await,
        _ => {}
    }
    let mut out = Response::builder().status(status);
    for (k, v) in headers {
        if ![
            "connection",
            "content-length",
            "transfer-encoding",
            "keep-alive",
        ]
        .contains(&k.to_ascii_lowercase().as_str())
        {
            out = out.header(k, v);
        }
    }
    out.body(Full::new(answer)).map_err(no_answer)
}

/// Sends the request to the server on a connection of its own (`Connection: close`) and
/// reads the whole answer.
async fn forward(
    parts: &hyper::http::request::Parts,
    body: &Bytes,
    upstream: SocketAddr,
) -> Result<(u16, Vec<(String, Vec<u8>)>, Bytes), NoAnswer> {
    let mut head = format!(
        "{} {} HTTP/1.1\r\nhost: {upstream}\r\n",
        parts.method,
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    for (k, v) in &parts.headers {
        let name = k.as_str();
        if [
            "host",
            "connection",
            "content-length",
            "transfer-encoding",
            "keep-alive",
            "expect",
        ]
        .contains(&name)
        {
            continue;
        }
        head.push_str(&format!("{name}: {}\r\n", v.to_str().unwrap_or_default()));
    }
    head.push_str(&format!(
        "content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    ));
    let mut stream = TcpStream::connect(upstream).await.map_err(no_answer)?;
    stream.write_all(head.as_bytes()).await.map_err(no_answer)?;
    stream.write_all(body).await.map_err(no_answer)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.map_err(no_answer)?;
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(len) = resp.parse(&raw).map_err(no_answer)? else {
        return Err(no_answer("the server's answer ended within its head"));
    };
    let status = resp.code.unwrap_or(500);
    let headers = resp
        .headers
        .iter()
        .map(|h| (h.name.to_string(), h.value.to_vec()))
        .collect();
    Ok((status, headers, Bytes::copy_from_slice(&raw[len..])))
}
