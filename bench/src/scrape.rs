//! What the benchmark reads over HTTP: nats-server's `/varz` (messages and bytes the
//! server has taken in and sent out, for the messages an allocation costs) and a
//! launcher's `/metrics` (scraped every second, as Prometheus would, for the cost of
//! observability). One plain HTTP/1.0 GET on a fresh connection: the figures are read a
//! few times a run, so a client library would buy nothing.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// How long one GET may take.
const GET_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the scraper reads `/metrics` (Prometheus's usual interval is longer).
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);

/// The body of `GET <base><path>` (`base` like `http://127.0.0.1:8222`), if it answers
/// 200.
pub async fn get(base: &str, path: &str) -> anyhow::Result<String> {
    let addr = base
        .strip_prefix("http://")
        .with_context(|| format!("not an http:// URL: {base}"))?;
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        anyhow::Ok(answer)
    };
    let answer = tokio::time::timeout(GET_TIMEOUT, read)
        .await
        .with_context(|| format!("GET {base}{path}: no answer within {GET_TIMEOUT:?}"))?
        .with_context(|| format!("GET {base}{path}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {base}{path}: no HTTP header"))?;
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        bail!("GET {base}{path}: status {status}");
    }
    Ok(body.to_string())
}

/// nats-server's message counters (`/varz`), since it started.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct Varz {
    in_msgs: u64,
    out_msgs: u64,
    in_bytes: u64,
    out_bytes: u64,
}

impl Varz {
    pub async fn read(monitor: &str) -> anyhow::Result<Varz> {
        let body = get(monitor, "/varz").await?;
        serde_json::from_str(&body).context("reading nats-server's /varz")
    }

    /// The traffic from `self` to `later`, per one of `allocations`.
    pub fn per_allocation(&self, later: &Varz, allocations: usize) -> Messages {
        let per = |after: u64, before: u64| {
            after.saturating_sub(before) as f64 / allocations.max(1) as f64
        };
        Messages {
            allocations,
            in_msgs: per(later.in_msgs, self.in_msgs),
            out_msgs: per(later.out_msgs, self.out_msgs),
            in_bytes: per(later.in_bytes, self.in_bytes),
            out_bytes: per(later.out_bytes, self.out_bytes),
        }
    }
}

/// NATS messages and bytes per allocation and release, as the server counted them
/// (`in`: published to it by every client, launcher and agent; `out`: delivered by it).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Messages {
    /// The allocations (each with its release) the counts are divided by.
    pub allocations: usize,
    pub in_msgs: f64,
    pub out_msgs: f64,
    pub in_bytes: f64,
    pub out_bytes: f64,
}

/// Reads a launcher's `/metrics` every [`SCRAPE_INTERVAL`] until stopped.
pub struct Scraper {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Scrapes>,
}

/// What a [`Scraper`] did.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Scrapes {
    pub scrapes: usize,
    pub failures: usize,
    /// Size of the last `/metrics` answer.
    pub bytes: usize,
}

impl Scraper {
    pub fn start(base: String) -> Scraper {
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut done = Scrapes::default();
                let mut every = tokio::time::interval(SCRAPE_INTERVAL);
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return done,
                        _ = every.tick() => {}
                    }
                    match get(&base, "/metrics").await {
                        Ok(body) => {
                            done.scrapes += 1;
                            done.bytes = body.len();
                        }
                        Err(err) => {
                            done.failures += 1;
                            eprintln!("slotpool-bench: scraping metrics: {err:#}");
                        }
                    }
                }
            }
        });
        Scraper { stop, task }
    }

    pub async fn stop(self) -> Scrapes {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_the_difference_over_the_allocations() {
        let before = Varz {
            in_msgs: 100,
            out_msgs: 200,
            in_bytes: 1_000,
            out_bytes: 2_000,
        };
        let after = Varz {
            in_msgs: 190,
            out_msgs: 340,
            in_bytes: 4_000,
            out_bytes: 8_000,
        };
        let m = before.per_allocation(&after, 10);
        assert_eq!(
            (
                m.allocations,
                m.in_msgs,
                m.out_msgs,
                m.in_bytes,
                m.out_bytes
            ),
            (10, 9.0, 14.0, 300.0, 600.0)
        );
        // A server restarted between the reads counts nothing rather than wrapping.
        assert_eq!(after.per_allocation(&before, 10).in_msgs, 0.0);
    }
}
