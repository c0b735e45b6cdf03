//! A loopback stand-in for an EC2 instance's metadata service, as far as the spot
//! interruption notice goes (IMDSv2): `PUT /latest/api/token` hands out a session token
//! (it asks for `X-aws-ec2-metadata-token-ttl-seconds`, as EC2 does), and
//! `GET /latest/meta-data/spot/instance-action` answers 401 without a token it handed
//! out, 404 until the test posts a notice ([`FakeImds::interrupt`]), then the notice's
//! JSON. An agent is pointed at it with `--spot-notice-url`.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct State {
    tokens: Vec<String>,
    notice: Option<String>,
    /// Notice requests answered (with or without a notice).
    asked: u32,
    /// Notice requests refused for a missing or unknown token.
    refused: u32,
}

/// The fake service; stops on drop.
pub struct FakeImds {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
}

impl FakeImds {
    /// A service on a free loopback port.
    pub async fn start() -> FakeImds {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the fake metadata service");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = CancellationToken::new();
        let (st, s) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = s.cancelled() => return,
                    conn = listener.accept() => conn,
                };
                let Ok((stream, _)) = conn else { continue };
                let (st, s) = (st.clone(), s.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, std::convert::Infallible>(answer(&req, &st)) }
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
        FakeImds { addr, state, stop }
    }

    /// The base URL to give the agent (`--spot-notice-url`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// From now on the instance is being taken back: `action` (`terminate`, `stop`,
    /// `hibernate`) at `time` (RFC 3339), as EC2 words the notice.
    pub fn interrupt(&self, action: &str, time: &str) {
        self.state.lock().unwrap().notice =
            Some(serde_json::json!({ "action": action, "time": time }).to_string());
    }

    /// Notice requests answered so far (with a valid token).
    pub fn asked(&self) -> u32 {
        self.state.lock().unwrap().asked
    }

    /// Notice requests refused for want of a valid token.
    pub fn refused(&self) -> u32 {
        self.state.lock().unwrap().refused
    }

    /// Session tokens handed out so far.
    pub fn tokens(&self) -> usize {
        self.state.lock().unwrap().tokens.len()
    }
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn answer(req: &Request<Incoming>, state: &Mutex<State>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body)))
            .expect("a valid response")
    };
    let mut st = state.lock().unwrap();
    match (req.method(), req.uri().path()) {
        (&Method::PUT, "/latest/api/token") => {
            if req
                .headers()
                .get("x-aws-ec2-metadata-token-ttl-seconds")
                .is_none()
            {
                return reply(StatusCode::BAD_REQUEST, String::new());
            }
            let token = format!("token-{}", st.tokens.len());
            st.tokens.push(token.clone());
            reply(StatusCode::OK, token)
        }
        (&Method::GET, "/latest/meta-data/spot/instance-action") => {
            let token = req
                .headers()
                .get("x-aws-ec2-metadata-token")
                .and_then(|t| t.to_str().ok());
            if !token.is_some_and(|t| st.tokens.iter().any(|k| k == t)) {
                st.refused += 1;
                return reply(StatusCode::UNAUTHORIZED, String::new());
            }
            st.asked += 1;
            match &st.notice {
                Some(notice) => reply(StatusCode::OK, notice.clone()),
                None => reply(StatusCode::NOT_FOUND, String::new()),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, String::new()),
    }
}
