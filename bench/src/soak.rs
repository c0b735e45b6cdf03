//! The soak: many allocations and releases at full speed on the real path (the request
//! records keep their production TTL, the launcher keeps its production mirror), with
//! the launcher's resident memory read every tenth of the way. A launcher whose memory
//! keeps something per request served shows here as a rising line.

use super::phases::{allocate, release};
use super::procs;
use anyhow::Context;
use serde::Serialize;
use slotpool_protocol::client::{Client, RequestWatcher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Clone, Debug, Serialize)]
pub struct Soak {
    pub clients: usize,
    pub allocations: usize,
    pub seconds: f64,
    pub allocations_per_sec: f64,
    /// The launcher's RSS before the first allocation.
    pub rss_start_mb: f64,
    /// After every tenth of the allocations, the last at the end.
    pub samples: Vec<SoakSample>,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct SoakSample {
    /// Allocations (each with its release) done so far.
    pub served: usize,
    pub seconds: f64,
    pub rss_mb: f64,
}

impl Soak {
    /// RSS at the end, in MB.
    pub fn rss_end_mb(&self) -> f64 {
        self.samples.last().map_or(self.rss_start_mb, |s| s.rss_mb)
    }

    /// Growth per 1,000 requests served between the first and the last sample: the
    /// first tenth pays for the allocator's and the runtime's warm-up.
    pub fn kb_per_1000(&self) -> f64 {
        match (self.samples.first(), self.samples.last()) {
            (Some(a), Some(b)) if b.served > a.served => {
                (b.rss_mb - a.rss_mb) * 1024.0 * 1000.0 / (b.served - a.served) as f64
            }
            _ => 0.0,
        }
    }
}

fn rss_mb(pid: u32) -> f64 {
    procs::rss_kb(pid).map_or(0.0, |kb| kb as f64 / 1024.0)
}

/// `n` allocations of `label`, each released at once, by `clients` concurrent clients;
/// the RSS of process `launcher` after every `n / 10`.
pub async fn soak(
    client: &Client,
    watcher: &Arc<RequestWatcher>,
    label: &str,
    clients: usize,
    n: usize,
    launcher: u32,
) -> anyhow::Result<Soak> {
    let every = (n / 10).max(1);
    let rss_start_mb = rss_mb(launcher);
    let start = Instant::now();
    let taken = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (client, watcher, label) = (client.clone(), watcher.clone(), label.to_string());
            let (taken, served, samples) = (taken.clone(), served.clone(), samples.clone());
            tokio::spawn(async move {
                while taken.fetch_add(1, Ordering::Relaxed) < n {
                    let nodes = allocate(&watcher, &label).await?;
                    release(&client, nodes).await?;
                    let done = served.fetch_add(1, Ordering::Relaxed) + 1;
                    if done % every == 0 || done == n {
                        let sample = SoakSample {
                            served: done,
                            seconds: start.elapsed().as_secs_f64(),
                            rss_mb: rss_mb(launcher),
                        };
                        eprintln!(
                            "slotpool-bench: soak {done}/{n}: launcher RSS {:.1} MB",
                            sample.rss_mb
                        );
                        samples.lock().expect("not poisoned").push(sample);
                    }
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await.context("soak client")??;
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut samples = std::mem::take(&mut *samples.lock().expect("not poisoned"));
    samples.sort_by_key(|s| s.served);
    samples.dedup_by_key(|s| s.served);
    Ok(Soak {
        clients,
        allocations: n,
        seconds,
        allocations_per_sec: n as f64 / seconds,
        rss_start_mb,
        samples,
    })
}

/// The soak's lines of the report's table.
pub fn print(s: &Soak) {
    println!(
        "soak: {} allocations + releases in {:.0} s ({:.0}/s, {} clients); launcher RSS {:.1} MB at start, {:.1} MB at the end, {:+.1} KB per 1,000 served after the first tenth",
        s.allocations,
        s.seconds,
        s.allocations_per_sec,
        s.clients,
        s.rss_start_mb,
        s.rss_end_mb(),
        s.kb_per_1000()
    );
    let line: Vec<String> = s
        .samples
        .iter()
        .map(|x| format!("{}: {:.1}", x.served, x.rss_mb))
        .collect();
    println!(
        "soak: launcher RSS (MB) by requests served: {}",
        line.join(", ")
    );
}
