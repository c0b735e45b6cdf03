//! Spot interruptions. On an EC2 spot instance the instance metadata service (IMDSv2)
//! announces about two minutes ahead that the instance is taken back:
//! `/latest/meta-data/spot/instance-action` answers 404 until then, and then
//! `{"action": "terminate", "time": "2026-11-26T17:40:00Z"}`. With `--spot-notice-url`
//! (the EC2 provider sets it for spot sizes) the agent asks every [`POLL_INTERVAL`];
//! once told, it closes itself to new slots and says so in every heartbeat
//! (`interruption`): launchers stop placing on the node, fail the nodes on its slots and
//! take its seat again at once.
//!
//! Why a poll: the metadata service has no push, no long poll and no event stream; the
//! notice is a file that appears. Asking every 5 s is what AWS advises: it uses at most
//! 5 s of the two minutes' notice, and costs one HTTP exchange on the machine itself
//! (two when the session token is renewed, every six hours).

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::{Method, Request, StatusCode};
use slotpool_protocol::model::{Interruption, InterruptionAction};
use slotpool_protocol::time::now_ms;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the notice is asked for.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Longest wait for one answer of the metadata service.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Lifetime asked for an IMDSv2 session token; it is renewed a minute before its end.
const TOKEN_TTL: Duration = Duration::from_secs(6 * 3600);
/// The longest answer read from the metadata service (a notice is under 100 bytes).
const MAX_ANSWER: usize = 4096;
const NOTICE_PATH: &str = "/latest/meta-data/spot/instance-action";
const TOKEN_PATH: &str = "/latest/api/token";

/// Why the notice could not be read.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum NoticeError {
    #[error("--spot-notice-url {0:?}: expected http://HOST[:PORT]")]
    Url(String),
    #[error("asking the instance metadata service at {addr}: {why}")]
    Call { addr: String, why: String },
    #[error("the instance metadata service answered {status} to {path}")]
    Status { path: &'static str, status: u16 },
    #[error("reading the spot notice {body:?}: {why}")]
    Notice { body: String, why: String },
}

/// `host:port` of an `http://` base URL (port 80 unless given).
pub fn address_of(url: &str) -> Result<String, NoticeError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| NoticeError::Url(url.to_string()))?;
    let host = rest.trim_end_matches('/');
    if host.is_empty() || host.contains('/') || host.contains('@') {
        return Err(NoticeError::Url(url.to_string()));
    }
    let has_port = match host.rsplit_once(':') {
        Some((h, p)) => !h.ends_with(':') && !p.contains(']'),
        None => false,
    };
    Ok(if has_port {
        host.to_string()
    } else {
        format!("{host}:80")
    })
}

/// Reads a notice's body: the action and its time (RFC 3339), noticed at `now`.
pub fn parse_notice(body: &[u8], now: u64) -> Result<Interruption, NoticeError> {
    #[derive(serde::Deserialize)]
    struct Raw {
        action: String,
        #[serde(default)]
        time: Option<String>,
    }
    let bad = |why: String| NoticeError::Notice {
        body: String::from_utf8_lossy(body).chars().take(200).collect(),
        why,
    };
    let raw: Raw = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
    let at = match raw.time {
        None => None,
        Some(t) => Some(
            humantime::parse_rfc3339_weak(&t)
                .map_err(|e| bad(e.to_string()))?
                .duration_since(std::time::UNIX_EPOCH)
                .map_err(|e| bad(e.to_string()))?
                .as_millis() as u64,
        ),
    };
    let action = match raw.action.as_str() {
        "terminate" => InterruptionAction::Terminate,
        "stop" => InterruptionAction::Stop,
        "hibernate" => InterruptionAction::Hibernate,
        other => {
            tracing::warn!(
                action = other,
                "a spot notice with an action this agent does not know"
            );
            InterruptionAction::Other
        }
    };
    Ok(Interruption {
        action,
        at,
        noticed_at: now,
    })
}

/// One HTTP/1.1 exchange with the metadata service.
async fn call(addr: &str, req: Request<Empty<Bytes>>) -> Result<(StatusCode, Bytes), String> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(conn);
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        conn.abort();
        Ok((status, body))
    };
    tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {CALL_TIMEOUT:?}"))?
}

/// The metadata service of one instance, with its IMDSv2 session token.
pub struct Imds {
    addr: String,
    token: Option<(String, tokio::time::Instant)>,
}

impl Imds {
    /// The service at `addr` (`host:port`, from [`address_of`]).
    pub fn at(addr: &str) -> Imds {
        Imds {
            addr: addr.to_string(),
            token: None,
        }
    }

    fn failed(&self, why: String) -> NoticeError {
        NoticeError::Call {
            addr: self.addr.clone(),
            why,
        }
    }

    async fn token(&mut self) -> Result<String, NoticeError> {
        let now = tokio::time::Instant::now();
        if let Some((token, until)) = &self.token {
            if now < *until {
                return Ok(token.clone());
            }
        }
        let req = Request::builder()
            .method(Method::PUT)
            .uri(TOKEN_PATH)
            .header("host", &self.addr)
            .header(
                "x-aws-ec2-metadata-token-ttl-seconds",
                TOKEN_TTL.as_secs().to_string(),
            )
            .body(Empty::new())
            .expect("a valid request");
        let (status, body) = call(&self.addr, req).await.map_err(|w| self.failed(w))?;
        if status != StatusCode::OK {
            return Err(NoticeError::Status {
                path: TOKEN_PATH,
                status: status.as_u16(),
            });
        }
        let token = String::from_utf8_lossy(&body).trim().to_string();
        self.token = Some((token.clone(), now + TOKEN_TTL - Duration::from_secs(60)));
        Ok(token)
    }

    /// The interruption notice, if the instance has one.
    pub async fn notice(&mut self) -> Result<Option<Interruption>, NoticeError> {
        let token = self.token().await?;
        let req = Request::builder()
            .uri(NOTICE_PATH)
            .header("host", &self.addr)
            .header("x-aws-ec2-metadata-token", token)
            .body(Empty::new())
            .expect("a valid request");
        let (status, body) = call(&self.addr, req).await.map_err(|w| self.failed(w))?;
        match status {
            StatusCode::OK => parse_notice(&body, now_ms()).map(Some),
            StatusCode::NOT_FOUND => Ok(None),
            StatusCode::UNAUTHORIZED => {
                // The token expired early (the service restarted): a new one next time.
                self.token = None;
                Err(NoticeError::Status {
                    path: NOTICE_PATH,
                    status: 401,
                })
            }
            other => Err(NoticeError::Status {
                path: NOTICE_PATH,
                status: other.as_u16(),
            }),
        }
    }
}

/// Asks `imds` for the notice every [`POLL_INTERVAL`] until there is one (returned) or
/// `shutdown` (`None`). Failures are logged when they start and when they end.
pub async fn watch(mut imds: Imds, shutdown: CancellationToken) -> Option<Interruption> {
    let mut failing = false;
    loop {
        let asked = tokio::select! {
            () = shutdown.cancelled() => return None,
            asked = imds.notice() => asked,
        };
        match asked {
            Ok(Some(found)) => {
                tracing::warn!(action = found.action.as_str(), at = ?found.at, "spot interruption notice: the instance is being taken back");
                // The notice stands until the end: nothing more to watch for.
                return Some(found);
            }
            Ok(None) if failing => {
                failing = false;
                tracing::info!("the instance metadata service answers again");
            }
            Ok(None) => {}
            Err(err) if !failing => {
                failing = true;
                tracing::warn!(%err, "cannot read the spot interruption notice; asking again");
            }
            Err(err) => tracing::debug!(%err, "still cannot read the spot interruption notice"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_comes_from_an_http_url() {
        assert_eq!(
            address_of("http://169.254.169.254").unwrap(),
            "169.254.169.254:80"
        );
        assert_eq!(
            address_of("http://127.0.0.1:8080/").unwrap(),
            "127.0.0.1:8080"
        );
        assert_eq!(
            address_of("http://[fd00:ec2::254]").unwrap(),
            "[fd00:ec2::254]:80"
        );
        assert_eq!(address_of("http://[::1]:81").unwrap(), "[::1]:81");
        for bad in ["https://x", "169.254.169.254", "http://", "http://h/path"] {
            assert!(address_of(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_notice_gives_its_action_and_time() {
        let n = parse_notice(
            br#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#,
            7,
        )
        .unwrap();
        assert_eq!(n.action, InterruptionAction::Terminate);
        assert_eq!(n.at, Some(1_505_722_920_000));
        assert_eq!(n.noticed_at, 7);
        let n = parse_notice(br#"{"action": "stop"}"#, 7).unwrap();
        assert_eq!((n.action, n.at), (InterruptionAction::Stop, None));
        let n = parse_notice(br#"{"action": "melt", "time": "2017-09-18T08:22:00Z"}"#, 7).unwrap();
        assert_eq!(
            n.action,
            InterruptionAction::Other,
            "taken back all the same"
        );
        let err = parse_notice(b"<html>", 7).unwrap_err().to_string();
        assert!(
            err.starts_with("reading the spot notice \"<html>\""),
            "{err}"
        );
        let err = parse_notice(br#"{"action": "stop", "time": "soon"}"#, 7).unwrap_err();
        assert!(matches!(err, NoticeError::Notice { .. }), "{err}");
    }
}
