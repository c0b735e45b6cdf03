//! A randomized request mix for real launchers, as a busy CI system sends one: node sets
//! of one to three labels with counts up to a label's capacity, priorities 0-1000,
//! cancels of requests that waited too long, releases after a hold, from several client
//! tasks under several bus identities.
//!
//! [`Mix::start`] runs the clients until [`Mix::quiesce`]: from then on nobody submits,
//! cancels or releases, and each client keeps what it has (a waiting request, or the
//! nodes it holds), so that a test can ask whether the launchers serve what free
//! capacity can serve ([`progress`]). [`Mix::drain`] then follows every request left to
//! its end, releasing each as it is served. Every API call's answer time is noted
//! ([`Calls`]): the time to answer, beyond what a held-open call asked to wait.
//! What the clients saw goes into a [`Ledger`] for the usual checks.

use crate::chaos::Ledger;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slotpool_protocol::api::{
    CancelRequest, Canceled, ErrorCode, ReleaseNodes, Released, RequestStatus, Submitted,
};
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::layout::subjects::{self, ApiOp};
use slotpool_protocol::model::{NodeRequest, RequestState};
use slotpool_protocol::{NodeId, RequestId, PROTOCOL_VERSION};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The seed of a mix: `$SLOTPOOL_MIX_SEED`, or else a new one. Print it.
pub fn seed() -> u64 {
    match std::env::var("SLOTPOOL_MIX_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("SLOTPOOL_MIX_SEED={text:?} is not a number")),
        Err(_) => rand::rng().random(),
    }
}

/// How long an answer may take before a call is given up on (it then counts as one
/// answered too late, however the test bounds answers).
const GIVE_UP: Duration = Duration::from_secs(10);

/// The longest a status call is held open while a client follows its request.
const FOLLOW_SLICE: Duration = Duration::from_millis(500);

/// What a mix asks for.
#[derive(Clone, Debug)]
pub struct MixSpec {
    /// Each label and how many nodes of it the pools can hold at once.
    pub labels: Vec<(String, u32)>,
    /// Client tasks per identity.
    pub clients_per_identity: usize,
    /// Longest a client waits for a request before it cancels it (each waits a random
    /// time up to this).
    pub patience: Duration,
    /// Longest a client holds the nodes of a fulfilled request before it releases them.
    pub max_hold: Duration,
}

/// Every API call's answer time, by operation.
#[derive(Debug, Default)]
pub struct Calls {
    /// Answer times (beyond a held call's wait) by operation name.
    pub times: BTreeMap<&'static str, Vec<Duration>>,
    /// Calls that got no answer at all, in words.
    pub unanswered: Vec<String>,
}

impl Calls {
    fn note(&mut self, op: &'static str, took: Duration) {
        self.times.entry(op).or_default().push(took);
    }

    /// The slowest answer of any call.
    pub fn slowest(&self) -> Duration {
        self.times
            .values()
            .flatten()
            .copied()
            .max()
            .unwrap_or_default()
    }

    /// Calls answered later than `bound`, by operation, with the slowest.
    pub fn later_than(&self, bound: Duration) -> Vec<String> {
        self.times
            .iter()
            .filter_map(|(op, times)| {
                let late: Vec<&Duration> = times.iter().filter(|t| **t > bound).collect();
                (!late.is_empty()).then(|| {
                    format!(
                        "{} {op} call(s) answered after more than {bound:?} (slowest {:?})",
                        late.len(),
                        late.iter().max().expect("some")
                    )
                })
            })
            .collect()
    }

    /// One line: calls by operation with their p50, p99 and slowest answer.
    pub fn summary(&self) -> String {
        self.times
            .iter()
            .map(|(op, times)| {
                let mut t = times.clone();
                t.sort();
                let at = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
                format!(
                    "{op} {} (p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms)",
                    t.len(),
                    at(0.5).as_secs_f64() * 1e3,
                    at(0.99).as_secs_f64() * 1e3,
                    at(1.0).as_secs_f64() * 1e3
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Counts of what the clients did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub submitted: usize,
    /// Submits refused (a set the pools can never hold at once).
    pub refused: usize,
    pub fulfilled: usize,
    pub canceled: usize,
    pub failed: usize,
}

#[derive(Default)]
struct Shared {
    ledger: Ledger,
    calls: Calls,
    tally: Tally,
    /// What each client kept at [`Mix::quiesce`]: a waiting request, or held nodes.
    left: Vec<Left>,
}

/// What a client kept when the mix was quiesced.
#[derive(Clone)]
enum Left {
    Waiting(Client, RequestId),
    Holding(Client, RequestId, Vec<NodeId>),
}

/// Clients running a mix.
pub struct Mix {
    shared: Arc<Mutex<Shared>>,
    quiet: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Mix {
    /// Starts `spec.clients_per_identity` clients on each of `identities`, choosing with
    /// `seed`.
    pub fn start(identities: &[Client], spec: &MixSpec, seed: u64) -> Mix {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let quiet = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for (i, client) in identities.iter().enumerate() {
            for n in 0..spec.clients_per_identity {
                let worker = Worker {
                    client: client.clone(),
                    spec: spec.clone(),
                    shared: shared.clone(),
                    quiet: quiet.clone(),
                    rng: StdRng::seed_from_u64(
                        seed.wrapping_add((i * spec.clients_per_identity + n) as u64),
                    ),
                };
                tasks.push(tokio::spawn(worker.run()));
            }
        }
        Mix {
            shared,
            quiet,
            tasks,
        }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().expect("mix lock")
    }

    /// What the clients did so far.
    pub fn tally(&self) -> Tally {
        self.shared().tally
    }

    /// Stops the clients: each keeps what it has (a waiting request, held nodes) and
    /// returns. Returns how many requests were left waiting and how many holding.
    pub async fn quiesce(&mut self) -> (usize, usize) {
        self.quiet.store(true, Ordering::SeqCst);
        for task in self.tasks.drain(..) {
            task.await.expect("a mix client panicked");
        }
        let shared = self.shared();
        let waiting = shared
            .left
            .iter()
            .filter(|l| matches!(l, Left::Waiting(..)))
            .count();
        (waiting, shared.left.len() - waiting)
    }

    /// After [`Mix::quiesce`]: releases every node held, then follows each request left
    /// waiting to its end, releasing it once served, for up to `within`. Returns the
    /// requests not ended by then.
    pub async fn drain(&self, within: Duration) -> Vec<RequestId> {
        let left = std::mem::take(&mut self.shared().left);
        let deadline = Instant::now() + within;
        let mut waiting = Vec::new();
        for l in left {
            match l {
                Left::Holding(client, id, nodes) => {
                    self.release(&client, &id, nodes).await;
                }
                Left::Waiting(client, id) => waiting.push((client, id)),
            }
        }
        let follows = waiting.into_iter().map(|(client, id)| async move {
            loop {
                if Instant::now() >= deadline {
                    return Some(id);
                }
                match follow(&client, &id, &self.shared).await {
                    Some(r) if r.state == RequestState::Requested => continue,
                    Some(r) => {
                        self.ended(&r);
                        if r.state == RequestState::Fulfilled {
                            self.release(&client, &id, r.nodes.clone()).await;
                        }
                        return None;
                    }
                    None => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        });
        futures::future::join_all(follows)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    fn ended(&self, r: &NodeRequest) {
        let mut shared = self.shared();
        shared.ledger.ended(r, Instant::now());
        count_end(&mut shared.tally, r.state);
    }

    async fn release(&self, client: &Client, id: &RequestId, nodes: Vec<NodeId>) {
        self.shared().ledger.releasing(id, Instant::now());
        release(client, id, nodes, &self.shared).await;
    }

    /// The calls' answer times and what the clients saw; the mix is over.
    pub fn finish(self) -> (Calls, Ledger) {
        let shared = Arc::try_unwrap(self.shared)
            .unwrap_or_else(|_| panic!("mix clients still running"))
            .into_inner()
            .expect("mix lock");
        (shared.calls, shared.ledger)
    }
}

fn count_end(tally: &mut Tally, state: RequestState) {
    match state {
        RequestState::Fulfilled => tally.fulfilled += 1,
        RequestState::Canceled => tally.canceled += 1,
        _ => tally.failed += 1,
    }
}

/// Sends `msg` as `op` of `client`'s API and notes how long the answer took beyond
/// `held` (the wait the call asked the launcher to hold it for).
async fn call<Q: serde::Serialize, R: serde::de::DeserializeOwned>(
    client: &Client,
    op: ApiOp,
    msg: &Q,
    held: Duration,
    shared: &Mutex<Shared>,
) -> Result<R, BusError> {
    let subject = subjects::api(client.name(), op);
    let started = Instant::now();
    let answer = client.bus().call(&subject, msg, held + GIVE_UP).await;
    let took = started.elapsed().saturating_sub(held);
    let mut shared = shared.lock().expect("mix lock");
    match &answer {
        Ok(_) | Err(BusError::Api(_)) => shared.calls.note(op.as_str(), took),
        Err(err) => shared
            .calls
            .unanswered
            .push(format!("{subject}: {err} after {took:?}")),
    }
    answer
}

/// The request's record, held open up to [`FOLLOW_SLICE`] until it is final; `None`
/// when the call got no answer.
async fn follow(client: &Client, id: &RequestId, shared: &Mutex<Shared>) -> Option<NodeRequest> {
    let msg = RequestStatus {
        v: PROTOCOL_VERSION,
        request_id: id.clone(),
        wait_ms: FOLLOW_SLICE.as_millis() as u64,
    };
    // A held call is answered when the request ends or its wait is over: only what
    // comes after that counts as the time to answer.
    call(client, ApiOp::Status, &msg, FOLLOW_SLICE, shared)
        .await
        .ok()
}

async fn release(client: &Client, id: &RequestId, nodes: Vec<NodeId>, shared: &Mutex<Shared>) {
    let msg = ReleaseNodes {
        v: PROTOCOL_VERSION,
        nodes,
    };
    let released: Result<Released, BusError> =
        call(client, ApiOp::Release, &msg, Duration::ZERO, shared).await;
    if let Err(err) = released {
        shared
            .lock()
            .expect("mix lock")
            .ledger
            .gave_up
            .push((id.clone(), format!("release of {id}: {err}")));
    }
}

struct Worker {
    client: Client,
    spec: MixSpec,
    shared: Arc<Mutex<Shared>>,
    quiet: Arc<AtomicBool>,
    rng: StdRng,
}

impl Worker {
    fn note(&self, f: impl FnOnce(&mut Shared)) {
        f(&mut self.shared.lock().expect("mix lock"))
    }

    fn quiet(&self) -> bool {
        self.quiet.load(Ordering::SeqCst)
    }

    /// One to three distinct labels, each with a count up to its capacity (small
    /// counts more often than large ones), as the labels of a submit.
    fn node_set(&mut self) -> Vec<String> {
        let kinds = self.rng.random_range(1..=self.spec.labels.len().min(3));
        let mut picked: Vec<usize> = (0..self.spec.labels.len()).collect();
        for i in 0..kinds {
            let j = self.rng.random_range(i..picked.len());
            picked.swap(i, j);
        }
        let mut labels = Vec::new();
        for &i in &picked[..kinds] {
            let (label, capacity) = &self.spec.labels[i];
            // A quarter of the sets take up to the whole label; the rest a few nodes.
            let most = if self.rng.random_bool(0.25) {
                *capacity
            } else {
                (*capacity).min(2)
            };
            let count = self.rng.random_range(1..=most.max(1));
            labels.extend(std::iter::repeat_n(label.clone(), count as usize));
        }
        labels
    }

    async fn run(mut self) {
        while !self.quiet() {
            let mut sub = submission(self.node_set(), "mix");
            let id = RequestId::generate();
            sub.id = Some(id.clone());
            sub.priority = Some(self.rng.random_range(0..=1000));
            self.note(|s| {
                s.ledger.submitted(&id);
                s.tally.submitted += 1;
            });
            let submitted: Result<Submitted, BusError> = call(
                &self.client,
                ApiOp::Submit,
                &sub,
                Duration::ZERO,
                &self.shared,
            )
            .await;
            match submitted {
                Ok(_) => {}
                Err(BusError::Api(err)) if err.code == ErrorCode::BadRequest => {
                    self.note(|s| s.tally.refused += 1);
                    continue;
                }
                Err(err) => {
                    self.note(|s| {
                        s.ledger
                            .gave_up
                            .push((id.clone(), format!("submit: {err}")))
                    });
                    continue;
                }
            }
            let patience = self.spec.patience.mul_f64(self.rng.random::<f64>());
            let Some(r) = self.wait(&id, patience).await else {
                return;
            };
            if r.state != RequestState::Fulfilled {
                self.note(|s| {
                    s.ledger.ended(&r, Instant::now());
                    count_end(&mut s.tally, r.state);
                });
                continue;
            }
            self.note(|s| {
                s.ledger.ended(&r, Instant::now());
                count_end(&mut s.tally, r.state);
            });
            let hold = self.spec.max_hold.mul_f64(self.rng.random::<f64>());
            let until = Instant::now() + hold;
            while Instant::now() < until && !self.quiet() {
                tokio::time::sleep(Duration::from_millis(20).min(hold)).await;
            }
            if self.quiet() {
                let left = Left::Holding(self.client.clone(), id.clone(), r.nodes.clone());
                self.note(|s| s.left.push(left));
                return;
            }
            self.note(|s| s.ledger.releasing(&id, Instant::now()));
            release(&self.client, &id, r.nodes.clone(), &self.shared).await;
        }
    }

    /// Follows request `id` until it ends or `patience` passes, then cancels it. The
    /// request as it ended (a cancel that came too late leaves it fulfilled); `None`
    /// when the mix was quiesced meanwhile (the request is left waiting).
    async fn wait(&mut self, id: &RequestId, patience: Duration) -> Option<NodeRequest> {
        let give_up = Instant::now() + patience;
        loop {
            if self.quiet() {
                let left = Left::Waiting(self.client.clone(), id.clone());
                self.note(|s| s.left.push(left));
                return None;
            }
            match follow(&self.client, id, &self.shared).await {
                Some(r) if r.state != RequestState::Requested => return Some(r),
                _ if Instant::now() < give_up => continue,
                _ => {}
            }
            let msg = CancelRequest {
                v: PROTOCOL_VERSION,
                request_id: id.clone(),
            };
            let canceled: Result<Canceled, BusError> = call(
                &self.client,
                ApiOp::Cancel,
                &msg,
                Duration::ZERO,
                &self.shared,
            )
            .await;
            if canceled.is_err() {
                continue;
            }
            // The record as the cancel left it (fulfilled, if it came too late).
            loop {
                if let Some(r) = follow(&self.client, id, &self.shared).await {
                    if r.state != RequestState::Requested {
                        return Some(r);
                    }
                }
            }
        }
    }
}

/// Whether the launchers leave a request waiting that the free slots could serve in the
/// queue's order, judged from KV by `reader` (a launcher's or operator's client) with
/// the queue's reference rule: the reason, or `None`.
pub async fn progress(reader: &Client) -> Result<Option<String>, BusError> {
    let requests = reader.list_requests().await?;
    let nodes = reader.list_nodes().await?;
    let backing = reader.list_backing().await?;
    let requests: Vec<&NodeRequest> = requests.iter().collect();
    let nodes: Vec<_> = nodes.iter().collect();
    let backing: Vec<_> = backing.iter().collect();
    Ok(slotpool_launcher::request::reference::servable_yet_waiting(
        &requests,
        &nodes,
        &backing,
        slotpool_protocol::time::now_ms(),
    ))
}

/// CPU time (user + system) process `pid` has used so far, from `/proc/<pid>/stat`.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime 14 and stime 15 (1-based).
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let ticks = rustix::param::clock_ticks_per_second();
    Some(Duration::from_secs_f64(
        (utime + stime) as f64 / ticks as f64,
    ))
}
