//! Reading a launcher's `--http` listener: where it listens (from its log), one GET,
//! and `/metrics` parsed with a Prometheus text-format parser.

use prometheus_parse::{Sample, Scrape, Value};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The address a launcher's log says it serves HTTP on (`http listening on ADDR`).
pub fn http_addr_in(log: &str) -> Option<SocketAddr> {
    log.lines()
        .find_map(|l| l.split("http listening on ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|a| a.parse().ok())
}

/// One GET with an optional bearer token: the status and the body.
pub async fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let (head, body) = response.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (status, body.to_string())
}

/// `/metrics`, parsed (an agent's, which asks no token on loopback).
pub async fn scrape(addr: SocketAddr) -> Scrape {
    scrape_as(addr, None).await
}

/// `/metrics` with a bearer token (a launcher's), parsed.
pub async fn scrape_as(addr: SocketAddr, token: Option<&str>) -> Scrape {
    let (status, body) = get(addr, "/metrics", token).await;
    assert_eq!(status, 200, "{body}");
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text format")
}

/// The samples of `metric` whose labels include every pair of `labels`.
pub fn samples<'a>(scrape: &'a Scrape, metric: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .collect()
}

/// The sum of those samples (a histogram's: its count).
pub fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    samples(scrape, metric, labels)
        .iter()
        .map(|s| match &s.value {
            Value::Gauge(v) | Value::Counter(v) | Value::Untyped(v) => *v,
            Value::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than.is_infinite())
                .map_or(0.0, |b| b.count),
            Value::Summary(_) => panic!("{metric}: no summaries here"),
        })
        .sum()
}
