//! A request load for failure tests, and what such tests check afterwards.
//!
//! [`Load`] runs clients that each submit a request (with an id of their own, so a
//! submit retried after a lost reply is the same request), wait until it ends, hold its
//! nodes a moment and release them, over and over, riding out a bus or a launcher that
//! is away. Everything they see goes into a [`Ledger`], which then says what went wrong:
//! a request that never ended or ended twice, a slot handed to two requests at once.
//! [`leaked_agents`] and [`live_failures`] look at the machines.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slotpool_protocol::api::ErrorCode;
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::model::{BackingNode, Event, NodeRequest, RequestState};
use slotpool_protocol::{BackingId, NodeId, RequestId};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long one request may take from submit to its end before the client gives it up
/// as lost.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(90);

/// How long a client keeps retrying a submit or a release the bus does not answer.
const CALL_DEADLINE: Duration = Duration::from_secs(60);

/// Pause between retries of a call the bus did not answer.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The seed of a test's random choices: `$SLOTPOOL_CHAOS_SEED`, or else a new one. Print
/// it, so a failing run can be repeated.
pub fn seed() -> u64 {
    match std::env::var("SLOTPOOL_CHAOS_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("SLOTPOOL_CHAOS_SEED={text:?} is not a number")),
        Err(_) => rand::rng().random(),
    }
}

/// One node a client held: its slot, from when the client saw it until it asked for
/// its release.
#[derive(Clone, Debug)]
pub struct Hold {
    pub node: NodeId,
    pub slot: (BackingId, u32),
    pub request: RequestId,
    pub from: Instant,
    pub to: Option<Instant>,
    /// `from` and `to` on the wall clock (microseconds since the epoch), read at the
    /// same moments: what other processes' logs are compared with, on the clock they
    /// date their lines by, whatever it did meanwhile.
    pub from_unix_us: u64,
    pub to_unix_us: Option<u64>,
}

/// The wall clock now, in microseconds since the epoch.
pub fn unix_us_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as u64
}

/// What the clients of a [`Load`] saw.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Every request a client submitted, with the end states it saw (one, if all goes
    /// well).
    ends: BTreeMap<RequestId, Vec<RequestState>>,
    holds: Vec<Hold>,
    /// When each fulfilment was seen.
    fulfilled_at: Vec<Instant>,
    /// Calls given up on: the request and what went wrong.
    pub(crate) gave_up: Vec<(RequestId, String)>,
    /// Each wait a client went through: a request from its submit to the end it saw, a
    /// release from its call to its answer.
    waits: Vec<Wait>,
}

/// One wait of a client: from its start to its answer (`None`: none yet).
#[derive(Debug, Clone)]
struct Wait {
    what: String,
    from: Instant,
    to: Option<Instant>,
}

/// What a test concludes from a [`Ledger`] and the final records.
#[derive(Debug, Default)]
pub struct Verdict {
    pub requests: usize,
    pub fulfilled: usize,
    /// Each broken promise, in words.
    pub violations: Vec<String>,
}

impl Ledger {
    pub(crate) fn submitted(&mut self, id: &RequestId) {
        self.ends.entry(id.clone()).or_default();
    }

    pub(crate) fn ended(&mut self, req: &NodeRequest, now: Instant) {
        self.ends.entry(req.id.clone()).or_default().push(req.state);
        if req.state == RequestState::Fulfilled {
            self.fulfilled_at.push(now);
            let wall = unix_us_now();
            for node in &req.nodes {
                if let Some(slot) = node.slot() {
                    self.holds.push(Hold {
                        node: node.clone(),
                        slot,
                        request: req.id.clone(),
                        from: now,
                        to: None,
                        from_unix_us: wall,
                        to_unix_us: None,
                    });
                }
            }
        }
    }

    pub(crate) fn releasing(&mut self, request: &RequestId, now: Instant) {
        let wall = unix_us_now();
        for hold in self.holds.iter_mut().filter(|h| &h.request == request) {
            hold.to.get_or_insert(now);
            hold.to_unix_us.get_or_insert(wall);
        }
    }

    pub(crate) fn wait_started(&mut self, what: String, from: Instant) -> usize {
        self.waits.push(Wait {
            what,
            from,
            to: None,
        });
        self.waits.len() - 1
    }

    pub(crate) fn wait_ended(&mut self, wait: usize, to: Instant) {
        self.waits[wait].to = Some(to);
    }

    /// How long each wait in flight at `at` (started before it, not answered by then)
    /// went on after `at`, with what it waited for; one still unanswered counts until
    /// `now`.
    pub fn stalls_across(&self, at: Instant, now: Instant) -> Vec<(Duration, String)> {
        self.waits
            .iter()
            .filter(|w| w.from <= at && w.to.is_none_or(|to| to >= at))
            .map(|w| (w.to.unwrap_or(now) - at, w.what.clone()))
            .collect()
    }

    /// Whether every wait in flight at `at` has been answered.
    pub fn answered_across(&self, at: Instant) -> bool {
        self.waits
            .iter()
            .filter(|w| w.from <= at)
            .all(|w| w.to.is_some())
    }

    /// Every node a client held, in the order the clients saw them.
    pub fn holds(&self) -> &[Hold] {
        &self.holds
    }

    /// How long after `at` the first fulfilment came (`None`: none came).
    pub fn stall_after(&self, at: Instant) -> Option<Duration> {
        self.fulfilled_at
            .iter()
            .filter(|t| **t >= at)
            .min()
            .map(|t| *t - at)
    }

    /// The longest time between `from` and `to` with no fulfilment.
    pub fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let mut times: Vec<Instant> = self
            .fulfilled_at
            .iter()
            .copied()
            .filter(|t| *t >= from && *t <= to)
            .collect();
        times.sort();
        let mut last = from;
        let mut longest = Duration::ZERO;
        for t in times.into_iter().chain([to]) {
            longest = longest.max(t - last);
            last = t;
        }
        longest
    }

    /// Checks what the clients saw against the requests as the bus holds them at the
    /// end (`last`, every request of the load's client): every request ended exactly
    /// once and still is in that end state; no slot was held by two requests at once.
    pub fn verdict(&self, last: &[NodeRequest]) -> Verdict {
        let mut v = Verdict {
            requests: self.ends.len(),
            ..Verdict::default()
        };
        let last: HashMap<&RequestId, &NodeRequest> = last.iter().map(|r| (&r.id, r)).collect();
        for (id, ends) in &self.ends {
            match ends.as_slice() {
                // Said by the client that gave up on it.
                [] => {}
                [end] => {
                    if *end == RequestState::Fulfilled {
                        v.fulfilled += 1;
                    }
                    match last.get(id) {
                        Some(r) if r.state != *end => v.violations.push(format!(
                            "request {id} ended {end:?}, and is {:?} now",
                            r.state
                        )),
                        Some(_) => {}
                        None => v
                            .violations
                            .push(format!("request {id} ended {end:?} but has no record")),
                    }
                }
                many => v
                    .violations
                    .push(format!("request {id} ended more than once: {many:?}")),
            }
        }
        for (id, what) in &self.gave_up {
            let now = last.get(id).map_or("no record".to_string(), |r| {
                format!("{:?} owned by {:?} ({})", r.state, r.owner, r.status)
            });
            v.violations.push(format!("{what}; the request now: {now}"));
        }
        let mut by_slot: HashMap<&(BackingId, u32), Vec<&Hold>> = HashMap::new();
        for hold in &self.holds {
            by_slot.entry(&hold.slot).or_default().push(hold);
        }
        for (slot, mut holds) in by_slot {
            holds.sort_by_key(|h| h.from);
            for pair in holds.windows(2) {
                // The first holder asked for the release before the second saw the slot,
                // whenever slotpool keeps its promise; so an overlap is never a race of
                // the clients' own clocks.
                let first_end = pair[0].to;
                if first_end.is_none_or(|end| end > pair[1].from) {
                    v.violations.push(format!(
                        "slot {}.{} held by {} and {} at once",
                        slot.0, slot.1, pair[0].request, pair[1].request
                    ));
                }
            }
        }
        v
    }
}

/// Clients submitting, holding and releasing requests until stopped.
pub struct Load {
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// Starts `clients` clients on `client`'s connection, each asking for one of
    /// `labels` at a time (chosen with `seed`), holding it 0–`max_hold` and releasing it.
    pub fn start(
        client: &Client,
        clients: usize,
        labels: &[&str],
        max_hold: Duration,
        seed: u64,
    ) -> Load {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let labels: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        let tasks = (0..clients)
            .map(|n| {
                let worker = Worker {
                    client: client.clone(),
                    ledger: ledger.clone(),
                    stop: stop.clone(),
                    labels: labels.clone(),
                    max_hold,
                    rng: StdRng::seed_from_u64(seed.wrapping_add(n as u64)),
                };
                tokio::spawn(worker.run())
            })
            .collect();
        Load {
            ledger,
            stop,
            tasks,
        }
    }

    /// The ledger so far.
    pub fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().expect("ledger lock")
    }

    /// How many fulfilments the clients have seen.
    pub fn fulfilments(&self) -> usize {
        self.ledger().fulfilled_at.len()
    }

    /// Stops the clients after their current request (ended and released) and returns
    /// what they saw.
    pub async fn finish(self) -> Ledger {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await.expect("a load client panicked");
        }
        Arc::try_unwrap(self.ledger)
            .expect("clients are done")
            .into_inner()
            .expect("ledger lock")
    }
}

struct Worker {
    client: Client,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    labels: Vec<String>,
    max_hold: Duration,
    rng: StdRng,
}

impl Worker {
    fn note(&self, f: impl FnOnce(&mut Ledger)) {
        f(&mut self.ledger.lock().expect("ledger lock"))
    }

    fn start_wait(&self, what: String) -> usize {
        let mut ledger = self.ledger.lock().expect("ledger lock");
        ledger.wait_started(what, Instant::now())
    }

    async fn run(mut self) {
        while !self.stop.load(Ordering::SeqCst) {
            let label = self.labels[self.rng.random_range(0..self.labels.len())].clone();
            let mut sub = submission(vec![label], "load");
            let id = RequestId::generate();
            sub.id = Some(id.clone());
            self.note(|l| l.submitted(&id));
            let wait = self.start_wait(format!("request {id}"));
            let submitted = retry(&format!("submit {id}"), || self.client.submit(&sub)).await;
            if let Err(err) = submitted {
                self.note(|l| {
                    l.wait_ended(wait, Instant::now());
                    l.gave_up.push((id.clone(), err))
                });
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
            let ended = tokio::time::timeout(REQUEST_DEADLINE, self.wait_end(&id)).await;
            let Ok(req) = ended else {
                self.note(|l| {
                    l.wait_ended(wait, Instant::now());
                    l.gave_up.push((
                        id.clone(),
                        format!("request {id} not ended within {REQUEST_DEADLINE:?}"),
                    ))
                });
                continue;
            };
            self.note(|l| {
                let now = Instant::now();
                l.wait_ended(wait, now);
                l.ended(&req, now)
            });
            if req.state != RequestState::Fulfilled {
                continue;
            }
            let hold = self.max_hold.mul_f64(self.rng.random::<f64>());
            tokio::time::sleep(hold).await;
            self.note(|l| l.releasing(&id, Instant::now()));
            let nodes: Vec<NodeId> = req.nodes.clone();
            let wait = self.start_wait(format!("the release of {id}"));
            let released = retry(&format!("release the nodes of {id}"), || {
                self.client.release(nodes.clone())
            })
            .await;
            self.note(|l| l.wait_ended(wait, Instant::now()));
            if let Err(err) = released {
                self.note(|l| l.gave_up.push((id.clone(), err)));
            }
        }
    }

    /// The request once it has ended, asking again whenever the bus was away.
    async fn wait_end(&self, id: &RequestId) -> NodeRequest {
        loop {
            match self.client.wait(id, |_| {}).await {
                Ok(req) => return req,
                Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
            }
        }
    }
}

/// Calls `call` until it gets an answer (a refusal is an answer), for up to
/// [`CALL_DEADLINE`]; the error says what was given up on, or that the launcher answered
/// `internal` (a bus it could not write to should be waited out, not passed on).
async fn retry<T, F, Fut>(what: &str, mut call: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BusError>>,
{
    let deadline = Instant::now() + CALL_DEADLINE;
    loop {
        match tokio::time::timeout_at(deadline, call()).await {
            Ok(Err(BusError::Api(err))) if err.code == ErrorCode::Internal => {
                return Err(format!("{what}: the launcher answered {err}"))
            }
            Ok(Ok(_)) | Ok(Err(BusError::Api(_))) => return Ok(()),
            Ok(Err(err)) if Instant::now() >= deadline => {
                return Err(format!("gave up on {what}: {err}"))
            }
            Ok(Err(_)) => tokio::time::sleep(RETRY_PAUSE).await,
            Err(_) => return Err(format!("gave up on {what}: no answer in {CALL_DEADLINE:?}")),
        }
    }
}

/// The running agents under a local provider's `work_dir` (`<backing id>/agent.pid`
/// naming a live process whose command line carries the backing id), by backing id.
pub fn running_agents(work_dir: &Path) -> BTreeMap<String, i32> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(work_dir) else {
        return out;
    };
    for e in entries.flatten() {
        let id = e.file_name().to_string_lossy().to_string();
        let Ok(text) = std::fs::read_to_string(e.path().join("agent.pid")) else {
            continue;
        };
        let Ok(pid) = text.trim().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !zombie && String::from_utf8_lossy(&cmdline).contains(&id) {
            out.insert(id, pid);
        }
    }
    out
}

/// The agents running under `work_dir` that no backing record owns: leaked machines.
pub fn leaked_agents(work_dir: &Path, backing: &[BackingNode]) -> Vec<String> {
    let owned: HashSet<&str> = backing.iter().map(|b| b.id.as_str()).collect();
    running_agents(work_dir)
        .into_keys()
        .filter(|id| !owned.contains(id.as_str()))
        .collect()
}

/// The failures in `events` of backing nodes that had been ready (their agent reported
/// in) and whose agent the test did not kill (`killed`: backing ids), each with its
/// event's message: live backing nodes failed. (A launch that failed before its agent
/// reported in is not one; an agent it left running is a leak, see [`leaked_agents`].)
pub fn live_failures(events: &[Event], killed: &HashSet<String>) -> Vec<String> {
    let ready: HashSet<&str> = events
        .iter()
        .filter(|e| e.message.starts_with("ready:"))
        .filter_map(|e| Some(e.backing_id.as_ref()?.as_str()))
        .collect();
    events
        .iter()
        .filter(|e| e.message.starts_with("failed:"))
        .filter_map(|e| {
            let id = e.backing_id.as_ref()?.as_str();
            (ready.contains(id) && !killed.contains(id)).then(|| format!("{id} {}", e.message))
        })
        .collect()
}

/// The middle value of `values` (`None` when empty).
pub fn median(values: &[Duration]) -> Option<Duration> {
    let mut sorted = values.to_vec();
    sorted.sort();
    sorted.get(sorted.len() / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(request: &RequestId, from: Instant, to: Option<Instant>) -> Hold {
        Hold {
            node: NodeId::for_slot(&BackingId::parse("bn-a").unwrap(), 0),
            slot: (BackingId::parse("bn-a").unwrap(), 0),
            request: request.clone(),
            from,
            to,
            from_unix_us: 0,
            to_unix_us: None,
        }
    }

    #[test]
    fn a_slot_held_by_two_requests_at_once_is_a_violation() {
        let (a, b) = (RequestId::generate(), RequestId::generate());
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let one_after_another = Ledger {
            holds: vec![hold(&a, t, Some(t + s)), hold(&b, t + 2 * s, None)],
            ..Ledger::default()
        };
        assert!(one_after_another.verdict(&[]).violations.is_empty());
        let overlapping = Ledger {
            holds: vec![
                hold(&a, t, Some(t + 2 * s)),
                hold(&b, t + s, Some(t + 3 * s)),
            ],
            ..Ledger::default()
        };
        let v = overlapping.verdict(&[]).violations;
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("held by"), "{v:?}");
    }

    #[test]
    fn a_request_that_ended_twice_is_a_violation() {
        let a = RequestId::generate();
        let mut ledger = Ledger::default();
        ledger.ends.insert(
            a.clone(),
            vec![RequestState::Fulfilled, RequestState::Failed],
        );
        let v = ledger.verdict(&[]).violations;
        assert!(v[0].contains("ended more than once"), "{v:?}");
    }

    #[test]
    fn the_longest_gap_counts_the_edges() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let ledger = Ledger {
            fulfilled_at: vec![t + s, t + 4 * s],
            ..Ledger::default()
        };
        assert_eq!(ledger.longest_gap(t, t + 5 * s), 3 * s);
        assert_eq!(ledger.stall_after(t + 2 * s), Some(2 * s));
        assert_eq!(ledger.stall_after(t + 5 * s), None);
    }
}
