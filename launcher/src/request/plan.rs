//! A node request's decisions as a pure function: given the request (what is wanted and
//! what was last written) and what is observed now, [`next`] says the one step to take.
//! Pure: no NATS, no world lock, no clock. The worker (`worker.rs`) observes
//! (`observe.rs`), asks, has the step carried out (`exec.rs`), and looks again; the
//! submit fast path asks the same question of a request it is creating.

use crate::world::SlotRef;
use slotpool_protocol::model::{NodeRequest, NodeState, RequestState, Waiting};
use slotpool_protocol::time::{after, UnixMillis};
use slotpool_protocol::{LauncherId, NodeId};
use std::collections::BTreeMap;
use std::time::Duration;

/// Pause after a refused prepare before trying again, so a broken agent cannot make a
/// worker spin (the backing worker fails the node if its agent is really gone).
pub const PREPARE_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// How long a request waits before its status says what it waits for: a short wait (a
/// slot being wiped, a burst) is not worth a write.
pub const STATUS_DELAY: Duration = Duration::from_millis(250);

/// Who should drive a request, given its owner and whether that owner's liveness lease
/// is there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ownership {
    /// Final: nobody drives it.
    Ended,
    Mine,
    /// Owned by nobody, or by a launcher whose liveness lease is gone: take it over
    /// (a revision-checked write; of two launchers taking it over, one wins).
    TakeOver,
    /// A live launcher drives it.
    Theirs,
}

/// A fulfilled request whose nodes are held with a deadline (a keep-alive or a label's
/// `max-hold-time`) still has a driver: the timer that reclaims them.
pub fn ownership(r: &NodeRequest, me: &LauncherId, owner_alive: bool) -> Ownership {
    match &r.owner {
        _ if r.state.is_final() && r.hold_deadline().is_none() => Ownership::Ended,
        Some(owner) if owner == me => Ownership::Mine,
        Some(_) if owner_alive => Ownership::Theirs,
        _ => Ownership::TakeOver,
    }
}

/// A node claimed for the request, as the mirror has it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSeen {
    pub index: u32,
    pub id: NodeId,
    /// Its slot key.
    pub key: String,
    pub state: NodeState,
    /// Whether this worker had its agent prepare it. A node is claimed `ready` when its
    /// agent says ahead what the prepare will answer, so the record alone does not say
    /// whether the agent prepared it: a worker prepares every node it has not prepared
    /// itself (again, after a takeover: a prepare for the node already holding the slot
    /// changes nothing) before it fulfils the request.
    pub prepared_here: bool,
    /// Whether this launcher began to give it back ([`crate::world::World::give_back`]):
    /// it is given back again, never prepared or handed out.
    pub given_back: bool,
}

/// Why a label has no free slot for the request, for its status line.
#[derive(Clone, Debug, PartialEq)]
pub enum WaitCause {
    /// A backing node for the label is being launched, but its provider is out of
    /// capacity and is asked again every `backoff`.
    OutOfCapacity {
        provider: String,
        backing_label: String,
        failure: Option<String>,
        backoff: Duration,
    },
    /// A backing node of `backing_label` is booting for it.
    Booting { backing_label: String },
    /// A backing node of `backing_label` waits for `provider`'s create limits
    /// (`max-creates-per-second`, `max-concurrent-creates`) before it is launched.
    RateLimited {
        provider: String,
        backing_label: String,
    },
    /// Every pool serving the label is at max-servers.
    PoolsFull,
    /// Its tenant holds its `max-slots`.
    TenantLimit { tenant: String, max_slots: u32 },
    /// There are free slots, but `requests` served before it in the queue's order take
    /// them (a better priority, or a tenant further below its share).
    Behind { requests: u32 },
    /// None of the above: slots are taken.
    Taken,
}

impl WaitCause {
    /// What the record and the metrics call it.
    pub fn kind(&self) -> slotpool_protocol::model::WaitCause {
        use slotpool_protocol::model::WaitCause as Kind;
        match self {
            WaitCause::OutOfCapacity { .. } => Kind::OutOfCapacity,
            WaitCause::Booting { .. } => Kind::Booting,
            WaitCause::RateLimited { .. } => Kind::RateLimited,
            WaitCause::PoolsFull => Kind::PoolsFull,
            WaitCause::TenantLimit { .. } => Kind::TenantLimit,
            WaitCause::Behind { .. } => Kind::Behind,
            WaitCause::Taken => Kind::Taken,
        }
    }
}

/// A label of the request no configured pool serves.
#[derive(Clone, Debug, PartialEq)]
pub struct UnknownLabel {
    pub label: String,
    /// The labels this pool serves.
    pub served: Vec<String>,
}

/// What is known of the request's world now, and what this worker remembers.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The launcher asking.
    pub me: LauncherId,
    /// The nodes claimed for the request.
    pub nodes: Vec<NodeSeen>,
    /// Free slots reserved for this look, by the index of the label they are for (none
    /// for a label a request ahead in the queue waits for).
    pub reserved: BTreeMap<u32, SlotRef>,
    pub unknown: Option<UnknownLabel>,
    /// Why each label without a free slot waits.
    pub causes: BTreeMap<String, WaitCause>,
    /// Labels without a free slot for which a backing node launched after the request
    /// was made failed for good, and nothing else is coming: why it failed.
    pub launch_failures: BTreeMap<String, String>,
    /// When this worker's last prepare was refused (its slot was given back).
    pub refused_at: Option<UnixMillis>,
    /// Since when this worker waits for slots (None: it has not waited yet).
    pub waiting_since: Option<UnixMillis>,
    /// The shortest `max-hold-time` of the pools of the request's nodes (looked up only
    /// when one of its labels has one).
    pub max_hold: Option<Duration>,
}

/// The one step to take next.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestStep {
    /// Another launcher drives the request now: stop driving it.
    Leave,
    /// The request is final: give back the nodes it ended without, and stop.
    Stop { strays: Vec<NodeId> },
    /// Write the request failed with this reason, give back every slot it holds
    /// (`release`), and stop.
    Fail {
        reason: String,
        release: Vec<NodeId>,
    },
    /// Give back these slots (their backing node failed before the request was
    /// fulfilled) and start over for their labels.
    Release(Vec<NodeId>),
    /// Claim the reserved slots, by label index; the labels in `missing` still wait.
    Claim {
        slots: Vec<(u32, SlotRef)>,
        missing: Vec<String>,
    },
    /// Have the agents prepare these claimed nodes (slot keys); a refused prepare gives
    /// its slot back. The labels in `missing` still wait.
    Prepare {
        nodes: Vec<String>,
        missing: Vec<String>,
    },
    /// A prepare was refused: look again at `until`.
    Pause { until: UnixMillis },
    /// Wait for slots of `missing` until something changes or `until` comes; write
    /// `status` first when it says something new.
    Wait {
        missing: Vec<String>,
        until: Option<UnixMillis>,
        status: Option<String>,
        /// With `status`: the record of why it waits, to write with it.
        waiting: Option<Waiting>,
    },
    /// Every label has a prepared node: write the request fulfilled with these nodes,
    /// to be reclaimed at `hold_until` (a label's `max-hold-time`) if they are still held.
    Fulfil {
        nodes: Vec<NodeId>,
        hold_until: Option<UnixMillis>,
    },
    /// The request holds its nodes until `until` (its keep-alive lapses, or its
    /// `hold_until` comes) unless renewed or released before: give back the slots (keys)
    /// it was fulfilled without, and wait for a change of the request or that time.
    Hold {
        strays: Vec<NodeId>,
        until: UnixMillis,
    },
    /// The hold ended (`reason`): write the request reclaimed, then give back its nodes
    /// and the slots it was fulfilled without.
    Reclaim {
        reason: String,
        nodes: Vec<NodeId>,
        strays: Vec<NodeId>,
    },
}

impl RequestStep {
    /// The labels the request still queues for while this step is carried out.
    pub fn missing(&self) -> &[String] {
        match self {
            RequestStep::Claim { missing, .. }
            | RequestStep::Prepare { missing, .. }
            | RequestStep::Wait { missing, .. } => missing,
            _ => &[],
        }
    }
}

fn min_opt(a: Option<UnixMillis>, b: Option<UnixMillis>) -> Option<UnixMillis> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

pub fn next(r: &NodeRequest, obs: &Observed, now: UnixMillis) -> RequestStep {
    if r.owner.as_ref() != Some(&obs.me) {
        return RequestStep::Leave;
    }
    if r.state.is_final() {
        let strays = obs
            .nodes
            .iter()
            .filter(|n| r.state != RequestState::Fulfilled || !r.nodes.contains(&n.id))
            .map(|n| n.id.clone())
            .collect();
        return match r.hold_deadline() {
            Some(until) if now >= until => RequestStep::Reclaim {
                reason: hold_ended(r, until),
                nodes: r.nodes.clone(),
                strays,
            },
            Some(until) => RequestStep::Hold { strays, until },
            None => RequestStep::Stop { strays },
        };
    }
    let fail = |reason: String| RequestStep::Fail {
        reason,
        release: obs.nodes.iter().map(|n| n.id.clone()).collect(),
    };
    if let Some(u) = &obs.unknown {
        return fail(format!(
            "unknown label {:?}; this pool serves: {}",
            u.label,
            u.served.join(", ")
        ));
    }
    let timeout = r.deadline();
    if timeout.is_some_and(|d| now >= d) {
        return fail(format!(
            "timed out after {}s: {}",
            r.timeout_secs.unwrap_or(0),
            r.status
        ));
    }
    if r.alive_until.is_some_and(|at| now >= at) {
        return fail(format!(
            "{} while waiting: {}",
            keep_alive_lapsed(r),
            r.status
        ));
    }
    let deadline = min_opt(timeout, r.alive_until);
    if let Some(until) = obs.refused_at.map(|at| after(at, PREPARE_RETRY_PAUSE)) {
        if now < until {
            return RequestStep::Pause { until };
        }
    }
    let mut to_prepare = Vec::new();
    let mut broken = Vec::new();
    let mut claims = Vec::new();
    let mut missing = Vec::new();
    for (index, label) in r.labels.iter().enumerate() {
        let index = index as u32;
        match node_for(obs, index) {
            // Given back by this launcher: whatever the mirror still says of it, it is
            // never prepared or handed out again.
            Some(n) if n.given_back => broken.push(n.id.clone()),
            Some(n) if n.state == NodeState::Ready && n.prepared_here => {}
            Some(n) if matches!(n.state, NodeState::Ready | NodeState::Preparing) => {
                to_prepare.push(n.key.clone())
            }
            // Its backing node failed (or it is being given back) before the request
            // was fulfilled: start over for its label.
            Some(n) => broken.push(n.id.clone()),
            None => match obs.reserved.get(&index) {
                Some(slot) => claims.push((index, slot.clone())),
                None => missing.push(label.clone()),
            },
        }
    }
    if !broken.is_empty() {
        return RequestStep::Release(broken);
    }
    // A node set that cannot complete holds no slot a smaller request could use: unless
    // a backing node is booting for every label it still misses, it claims nothing (its
    // reservations are given back), gives back what it holds, and queues only for the
    // labels that have no free slot. A single-node request never gets here.
    if !missing.is_empty() && !all_coming(&missing, &obs.causes) {
        if let Some(why) = launch_failure(&missing, obs) {
            return fail(why);
        }
        let held: Vec<NodeId> = obs.nodes.iter().map(|n| n.id.clone()).collect();
        if !held.is_empty() {
            return RequestStep::Release(held);
        }
        claims.clear();
    }
    if !claims.is_empty() {
        return RequestStep::Claim {
            slots: claims,
            missing,
        };
    }
    if !to_prepare.is_empty() {
        return RequestStep::Prepare {
            nodes: to_prepare,
            missing,
        };
    }
    if missing.is_empty() {
        let nodes = (0..r.labels.len() as u32)
            .filter_map(|i| node_for(obs, i).map(|n| n.id.clone()))
            .collect();
        return RequestStep::Fulfil {
            nodes,
            hold_until: obs.max_hold.map(|d| after(now, d)),
        };
    }
    if let Some(why) = launch_failure(&missing, obs) {
        return fail(why);
    }
    let status_at = after(obs.waiting_since.unwrap_or(now), STATUS_DELAY);
    if now < status_at {
        return RequestStep::Wait {
            missing,
            until: min_opt(Some(status_at), deadline),
            status: None,
            waiting: None,
        };
    }
    let status = waiting_status(r, &missing, &obs.causes);
    let cause = obs
        .causes
        .get(&missing[0])
        .unwrap_or(&WaitCause::Taken)
        .kind();
    let waiting = Waiting::next(r.waiting.as_ref(), cause, now);
    let news = status != r.status || r.waiting.as_ref() != Some(&waiting);
    RequestStep::Wait {
        missing,
        until: deadline,
        status: news.then_some(status),
        waiting: news.then_some(waiting),
    }
}

/// Why a label of `missing` cannot be served: a backing node launched for it failed.
fn launch_failure(missing: &[String], obs: &Observed) -> Option<String> {
    missing
        .iter()
        .find_map(|label| obs.launch_failures.get(label))
        .cloned()
}

/// Whether a backing node is booting (or about to, past its provider's create limits)
/// for every label of `missing`: a set waiting for those completes soon, so it may
/// claim (and hold) the rest meanwhile.
fn all_coming(missing: &[String], causes: &BTreeMap<String, WaitCause>) -> bool {
    missing.iter().all(|l| {
        matches!(
            causes.get(l),
            Some(WaitCause::Booting { .. } | WaitCause::RateLimited { .. })
        )
    })
}

/// Why a hold that ended at `until` ended: the keep-alive lapsed, or the label's
/// `max-hold-time` passed (whichever came first).
fn hold_ended(r: &NodeRequest, until: UnixMillis) -> String {
    match (r.alive_until, r.hold_until) {
        (Some(alive), _) if alive == until => keep_alive_lapsed(r),
        // Rounded: the deadline is set from the decision's clock, `fulfilled_at` by the
        // write a moment later, so the two are a few milliseconds under the limit apart.
        _ => format!(
            "max-hold-time reached: held {}s since fulfilled",
            (until.saturating_sub(r.fulfilled_at.unwrap_or(until)) + 500) / 1000
        ),
    }
}

fn keep_alive_lapsed(r: &NodeRequest) -> String {
    format!(
        "keep-alive lapsed: not renewed within {}s",
        r.keep_alive_secs.unwrap_or(0)
    )
}

/// The node that stands for label `index`: one this worker prepared (the lowest id, if
/// several), else the last one seen. Another node claimed for the same index is a stray,
/// released by the sweep of claims left behind.
fn node_for(obs: &Observed, index: u32) -> Option<&NodeSeen> {
    let mut of_index = obs.nodes.iter().filter(|n| n.index == index);
    let prepared = of_index
        .clone()
        .filter(|n| n.state == NodeState::Ready && n.prepared_here && !n.given_back)
        .min_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
    prepared.or_else(|| of_index.next_back())
}

/// One line a human understands, saying what the request waits for.
pub fn waiting_status(
    r: &NodeRequest,
    missing: &[String],
    causes: &BTreeMap<String, WaitCause>,
) -> String {
    let assigned = r.labels.len() - missing.len();
    let progress = format!("({assigned} of {} slots assigned)", r.labels.len());
    let label = &missing[0];
    match causes.get(label).unwrap_or(&WaitCause::Taken) {
        WaitCause::OutOfCapacity {
            provider,
            backing_label,
            failure,
            backoff,
        } => format!(
            "waiting for capacity: provider {provider} is out of capacity for {backing_label} ({}); asking again every {}s {progress}",
            failure.as_deref().unwrap_or("no reason given"),
            backoff.as_secs()
        ),
        WaitCause::Booting { backing_label } => {
            format!("waiting for a backing node of {backing_label} to boot {progress}")
        }
        WaitCause::RateLimited {
            provider,
            backing_label,
        } => format!(
            "waiting for a backing node of {backing_label}: its launch waits for provider {provider}'s create limits {progress}"
        ),
        WaitCause::PoolsFull => format!(
            "waiting for a free slot of {label}: every pool serving it is at max-servers {progress}"
        ),
        WaitCause::TenantLimit { tenant, max_slots } => format!(
            "waiting: tenant {tenant} holds its max-slots of {max_slots} {progress}"
        ),
        WaitCause::Behind { requests } => format!(
            "waiting behind {requests} request(s) served first for the free slots of {label} {progress}"
        ),
        WaitCause::Taken => format!("waiting for a free slot of {label} {progress}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::model::WaitCause as Kind;
    use slotpool_protocol::BackingId;

    const NOW: UnixMillis = 10_000;

    fn me() -> LauncherId {
        LauncherId::parse("launcher-me").unwrap()
    }

    fn request(labels: &[&str]) -> NodeRequest {
        let mut r = crate::world::tests_support::request("req-1", labels);
        r.created_at = 1_000;
        r.updated_at = 1_000;
        r.status = "queued".into();
        r.owner = Some(me());
        r
    }

    fn observed() -> Observed {
        Observed {
            me: me(),
            nodes: vec![],
            reserved: BTreeMap::new(),
            unknown: None,
            causes: BTreeMap::new(),
            launch_failures: BTreeMap::new(),
            refused_at: None,
            waiting_since: None,
            max_hold: None,
        }
    }

    fn slot(n: u32) -> SlotRef {
        SlotRef {
            backing_id: BackingId::parse("bn-1").unwrap(),
            seat_key: "p.main.0".into(),
            slot: n,
        }
    }

    /// Node `n` (in slot `n` of bn-1) for label `index`.
    fn node(index: u32, n: u32, state: NodeState, prepared_here: bool) -> NodeSeen {
        NodeSeen {
            index,
            id: id(n),
            key: format!("bn-1.{n}"),
            state,
            prepared_here,
            given_back: false,
        }
    }

    fn id(n: u32) -> NodeId {
        NodeId::parse(&format!("node-{n}")).unwrap()
    }

    fn ids(v: &[u32]) -> Vec<NodeId> {
        v.iter().map(|n| id(*n)).collect()
    }

    fn booting() -> WaitCause {
        WaitCause::Booting {
            backing_label: "vm".into(),
        }
    }

    fn reserve(o: &mut Observed, index: u32, n: u32) {
        o.reserved.insert(index, slot(n));
    }

    fn keys(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    // ---- ownership ---------------------------------------------------------------------

    #[test]
    fn ownership_follows_the_owner_and_its_lease() {
        let mut r = request(&["a"]);
        assert_eq!(ownership(&r, &me(), true), Ownership::Mine);
        r.owner = Some(LauncherId::parse("launcher-other").unwrap());
        assert_eq!(ownership(&r, &me(), true), Ownership::Theirs);
        assert_eq!(
            ownership(&r, &me(), false),
            Ownership::TakeOver,
            "adopted after its launcher died"
        );
        r.owner = None;
        assert_eq!(ownership(&r, &me(), false), Ownership::TakeOver);
    }

    #[test]
    fn a_final_request_has_no_driver_whoever_owns_it() {
        for state in [
            RequestState::Fulfilled,
            RequestState::Failed,
            RequestState::Canceled,
        ] {
            let mut r = request(&["a"]);
            r.state = state;
            assert_eq!(ownership(&r, &me(), true), Ownership::Ended, "{state:?}");
            r.owner = None;
            assert_eq!(ownership(&r, &me(), false), Ownership::Ended, "{state:?}");
        }
    }

    #[test]
    fn a_request_taken_over_by_another_launcher_is_left() {
        let mut r = request(&["a"]);
        r.owner = Some(LauncherId::parse("launcher-other").unwrap());
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Preparing, false)];
        assert_eq!(next(&r, &o, NOW), RequestStep::Leave);
        r.owner = None;
        assert_eq!(next(&r, &o, NOW), RequestStep::Leave);
    }

    // ---- final states ------------------------------------------------------------------

    #[test]
    fn a_fulfilled_request_stops_giving_back_only_the_nodes_it_was_fulfilled_without() {
        let mut r = request(&["a"]);
        r.state = RequestState::Fulfilled;
        r.nodes = vec![id(0)];
        let mut o = observed();
        o.nodes = vec![
            node(0, 0, NodeState::Ready, true),
            node(0, 1, NodeState::Ready, false),
        ];
        assert_eq!(next(&r, &o, NOW), RequestStep::Stop { strays: ids(&[1]) });
    }

    #[test]
    fn a_failed_request_stops_giving_back_every_node() {
        let mut r = request(&["a", "b"]);
        r.state = RequestState::Failed;
        let mut o = observed();
        o.nodes = vec![
            node(0, 0, NodeState::Ready, true),
            node(1, 1, NodeState::Failed, false),
        ];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Stop {
                strays: ids(&[0, 1])
            }
        );
    }

    #[test]
    fn a_request_canceled_during_prepare_gives_back_what_it_claimed() {
        let mut r = request(&["a", "b"]);
        r.state = RequestState::Canceled;
        let mut o = observed();
        o.nodes = vec![
            node(0, 0, NodeState::Preparing, false),
            node(1, 1, NodeState::Ready, true),
        ];
        reserve(&mut o, 1, 5);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Stop {
                strays: ids(&[0, 1])
            },
            "nothing more is claimed or prepared"
        );
    }

    #[test]
    fn a_final_request_without_nodes_just_stops() {
        let mut r = request(&["a"]);
        r.state = RequestState::Canceled;
        assert_eq!(
            next(&r, &observed(), NOW),
            RequestStep::Stop { strays: vec![] }
        );
    }

    // ---- failing -----------------------------------------------------------------------

    #[test]
    fn a_label_no_pool_serves_fails_the_request_naming_what_is_served() {
        let r = request(&["a", "gpu"]);
        let mut o = observed();
        o.unknown = Some(UnknownLabel {
            label: "gpu".into(),
            served: keys(&["a", "b"]),
        });
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fail {
                reason: "unknown label \"gpu\"; this pool serves: a, b".into(),
                release: ids(&[0]),
            }
        );
    }

    #[test]
    fn a_timed_out_request_fails_with_its_last_status_and_gives_back_a_partial_set() {
        let mut r = request(&["a", "b"]);
        r.timeout_secs = Some(5);
        r.status = "waiting for a free slot of b (1 of 2 slots assigned)".into();
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        assert_eq!(
            next(&r, &o, 6_000),
            RequestStep::Fail {
                reason: "timed out after 5s: waiting for a free slot of b (1 of 2 slots assigned)"
                    .into(),
                release: ids(&[0]),
            }
        );
    }

    #[test]
    fn a_request_times_out_even_while_its_nodes_are_being_prepared() {
        let mut r = request(&["a"]);
        r.timeout_secs = Some(1);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Preparing, false)];
        o.refused_at = Some(1_900);
        assert!(matches!(
            next(&r, &o, 2_000),
            RequestStep::Fail { reason, .. } if reason.starts_with("timed out after 1s")
        ));
    }

    #[test]
    fn a_waiting_request_wakes_at_its_deadline() {
        let mut r = request(&["a"]);
        r.timeout_secs = Some(5);
        let mut o = observed();
        o.waiting_since = Some(1_000);
        let status = "waiting for a free slot of a (0 of 1 slots assigned)";
        r.status = status.into();
        r.waiting = Some(Waiting::next(None, Kind::Taken, 1_000));
        assert_eq!(
            next(&r, &o, 5_999),
            RequestStep::Wait {
                missing: keys(&["a"]),
                until: Some(6_000),
                status: None,
                waiting: None,
            }
        );
    }

    #[test]
    fn a_failed_launch_for_a_missing_label_fails_the_request() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        reserve(&mut o, 0, 0);
        o.launch_failures
            .insert("b".into(), "could not launch: quota".into());
        // Nothing is claimed while b cannot be: it fails at once.
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fail {
                reason: "could not launch: quota".into(),
                release: vec![],
            }
        );
        // One holding a node of a (claimed before its b failed) gives it back.
        o.reserved.clear();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fail {
                reason: "could not launch: quota".into(),
                release: ids(&[0]),
            }
        );
    }

    #[test]
    fn a_failed_launch_for_a_label_already_served_is_ignored() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        o.causes.insert("b".into(), booting());
        o.launch_failures
            .insert("a".into(), "could not launch: quota".into());
        assert!(
            matches!(next(&r, &o, NOW), RequestStep::Wait { missing, .. } if missing == keys(&["b"]))
        );
    }

    // ---- claiming ----------------------------------------------------------------------

    #[test]
    fn free_slots_are_claimed_for_every_label() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        reserve(&mut o, 0, 0);
        reserve(&mut o, 1, 1);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Claim {
                slots: vec![(0, slot(0)), (1, slot(1))],
                missing: vec![],
            }
        );
    }

    #[test]
    fn a_set_that_cannot_complete_claims_nothing_and_queues_only_for_what_is_taken() {
        let r = request(&["a", "b", "a"]);
        let mut o = observed();
        reserve(&mut o, 0, 0);
        reserve(&mut o, 2, 2);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Wait {
                missing: keys(&["b"]),
                until: Some(NOW + STATUS_DELAY.as_millis() as u64),
                status: None,
                waiting: None,
            },
            "the free slots of a stay free for others; it queues for b alone"
        );
        reserve(&mut o, 1, 1);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Claim {
                slots: vec![(0, slot(0)), (1, slot(1)), (2, slot(2))],
                missing: vec![],
            },
            "claimed all at once"
        );
    }

    #[test]
    fn a_set_that_cannot_complete_gives_back_what_it_holds() {
        let r = request(&["a", "b", "c"]);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        reserve(&mut o, 1, 1);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Release(ids(&[0])),
            "c is taken and nothing is coming for it"
        );
        o.causes.insert(
            "c".into(),
            WaitCause::OutOfCapacity {
                provider: "cloud".into(),
                backing_label: "vm".into(),
                failure: None,
                backoff: Duration::from_secs(10),
            },
        );
        assert_eq!(next(&r, &o, NOW), RequestStep::Release(ids(&[0])));
        reserve(&mut o, 2, 2);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Claim {
                slots: vec![(1, slot(1)), (2, slot(2))],
                missing: vec![],
            },
            "the rest claimed all together"
        );
    }

    #[test]
    fn a_set_whose_missing_labels_are_booting_claims_what_is_free_meanwhile() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        reserve(&mut o, 0, 0);
        o.causes.insert(
            "b".into(),
            WaitCause::Booting {
                backing_label: "vm".into(),
            },
        );
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Claim {
                slots: vec![(0, slot(0))],
                missing: keys(&["b"]),
            },
            "its ready node is not left idle (and released) while the other boots"
        );
        o.reserved.clear();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        assert!(matches!(next(&r, &o, NOW), RequestStep::Wait { .. }));
        o.causes.insert("b".into(), WaitCause::Taken);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Release(ids(&[0])),
            "the booting node went to another request"
        );
    }

    #[test]
    fn claims_come_before_prepares() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Preparing, false)];
        reserve(&mut o, 1, 1);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Claim {
                slots: vec![(1, slot(1))],
                missing: vec![],
            }
        );
    }

    #[test]
    fn a_claim_lost_to_another_launcher_is_tried_again_or_waited_for() {
        // The lost claim left no node; the next look reserved another slot, or none.
        let r = request(&["a"]);
        let mut o = observed();
        reserve(&mut o, 0, 3);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Claim {
                slots: vec![(0, slot(3))],
                missing: vec![],
            }
        );
        o.reserved.clear();
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Wait {
                missing: keys(&["a"]),
                until: Some(NOW + STATUS_DELAY.as_millis() as u64),
                status: None,
                waiting: None,
            }
        );
    }

    // ---- preparing ---------------------------------------------------------------------

    #[test]
    fn claimed_nodes_are_prepared_while_missing_labels_stay_queued() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        o.causes.insert("b".into(), booting());
        o.nodes = vec![node(0, 0, NodeState::Preparing, false)];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Prepare {
                nodes: keys(&["bn-1.0"]),
                missing: keys(&["b"]),
            }
        );
    }

    #[test]
    fn a_node_claimed_ready_is_still_prepared_before_the_request_is_fulfilled() {
        // Claimed `ready` from the agent's heartbeat plan: the agent has not prepared it.
        let r = request(&["a"]);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Ready, false)];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Prepare {
                nodes: keys(&["bn-1.0"]),
                missing: vec![],
            }
        );
    }

    #[test]
    fn an_adopted_request_prepares_the_nodes_its_dead_owner_claimed_again() {
        // A new worker after a takeover: nothing is prepared by it, whatever the records
        // say; the slot left unclaimed is claimed.
        let r = request(&["a", "b", "c"]);
        let mut o = observed();
        o.nodes = vec![
            node(0, 0, NodeState::Ready, false),
            node(1, 1, NodeState::Preparing, false),
        ];
        reserve(&mut o, 2, 2);
        assert!(
            matches!(next(&r, &o, NOW), RequestStep::Claim { slots, .. } if slots == vec![(2, slot(2))])
        );
        o.reserved.clear();
        o.nodes.push(node(2, 2, NodeState::Preparing, false));
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Prepare {
                nodes: keys(&["bn-1.0", "bn-1.1", "bn-1.2"]),
                missing: vec![],
            }
        );
    }

    #[test]
    fn an_agent_refusing_a_prepare_pauses_the_request_then_it_claims_again() {
        // The refused slot was given back: the label has no node any more.
        let r = request(&["a"]);
        let mut o = observed();
        o.refused_at = Some(NOW);
        reserve(&mut o, 0, 1);
        let until = NOW + PREPARE_RETRY_PAUSE.as_millis() as u64;
        assert_eq!(next(&r, &o, NOW + 1), RequestStep::Pause { until });
        assert_eq!(
            next(&r, &o, until),
            RequestStep::Claim {
                slots: vec![(0, slot(1))],
                missing: vec![],
            }
        );
    }

    #[test]
    fn a_node_whose_backing_node_failed_before_fulfilment_is_given_back() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        o.nodes = vec![
            node(0, 0, NodeState::Ready, true),
            node(1, 1, NodeState::Failed, false),
        ];
        reserve(&mut o, 1, 2);
        assert_eq!(next(&r, &o, NOW), RequestStep::Release(ids(&[1])));
    }

    #[test]
    fn a_node_being_released_is_given_back_before_its_label_is_served_again() {
        let r = request(&["a"]);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Releasing, true)];
        assert_eq!(next(&r, &o, NOW), RequestStep::Release(ids(&[0])));
    }

    /// The mirror may still hold a node this launcher gave back as it was (the write
    /// marking it releasing timed out, the watch that would bring its deletion is away):
    /// such a node is given back again, never prepared, never handed out, even one the
    /// agent prepared here before.
    #[test]
    fn a_node_given_back_is_never_prepared_or_handed_out_whatever_the_mirror_says() {
        let r = request(&["a", "b"]);
        for (state, prepared_here) in [
            (NodeState::Ready, false),
            (NodeState::Preparing, false),
            (NodeState::Ready, true),
        ] {
            let mut o = observed();
            let mut given_back = node(1, 1, state, prepared_here);
            given_back.given_back = true;
            o.nodes = vec![node(0, 0, NodeState::Ready, true), given_back];
            assert_eq!(
                next(&r, &o, NOW),
                RequestStep::Release(ids(&[1])),
                "{state:?}, prepared here: {prepared_here}"
            );
        }
        // A final request gives it back as a stray.
        let mut done = request(&["a"]);
        done.state = RequestState::Canceled;
        let mut o = observed();
        let mut given_back = node(0, 0, NodeState::Ready, true);
        given_back.given_back = true;
        o.nodes = vec![given_back];
        assert_eq!(
            next(&done, &o, NOW),
            RequestStep::Stop { strays: ids(&[0]) }
        );
    }

    // ---- fulfilling --------------------------------------------------------------------

    #[test]
    fn a_request_whose_every_node_is_prepared_here_is_fulfilled_in_label_order() {
        let r = request(&["a", "b", "a"]);
        let mut o = observed();
        o.nodes = vec![
            node(2, 5, NodeState::Ready, true),
            node(0, 7, NodeState::Ready, true),
            node(1, 1, NodeState::Ready, true),
        ];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fulfil {
                nodes: vec![id(7), id(1), id(5)],
                hold_until: None,
            }
        );
    }

    #[test]
    fn of_two_nodes_for_one_label_the_prepared_one_is_handed_out() {
        let r = request(&["a"]);
        let mut o = observed();
        o.nodes = vec![
            node(0, 4, NodeState::Ready, true),
            node(0, 2, NodeState::Preparing, false),
            node(0, 3, NodeState::Ready, true),
        ];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fulfil {
                nodes: vec![id(3)],
                hold_until: None,
            }
        );
    }

    #[test]
    fn a_single_node_request_with_a_refusal_long_past_is_fulfilled() {
        let r = request(&["a"]);
        let mut o = observed();
        o.refused_at = Some(1_000);
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fulfil {
                nodes: vec![id(0)],
                hold_until: None,
            }
        );
    }

    // ---- keep-alive and hold limits -----------------------------------------------------

    fn fulfilled(labels: &[&str]) -> NodeRequest {
        let mut r = request(labels);
        r.state = RequestState::Fulfilled;
        r.nodes = (0..labels.len() as u32).map(id).collect();
        r.fulfilled_at = Some(5_000);
        r
    }

    fn held_nodes(n: u32) -> Vec<NodeSeen> {
        (0..n).map(|i| node(i, i, NodeState::Ready, true)).collect()
    }

    #[test]
    fn a_fulfilled_request_without_limits_needs_no_driver() {
        let r = fulfilled(&["a"]);
        let mut o = observed();
        o.nodes = held_nodes(1);
        assert_eq!(next(&r, &o, NOW), RequestStep::Stop { strays: vec![] });
        assert_eq!(ownership(&r, &me(), true), Ownership::Ended);
    }

    #[test]
    fn a_kept_alive_request_holds_its_nodes_until_the_keep_alive_lapses() {
        let mut r = fulfilled(&["a", "b"]);
        r.keep_alive_secs = Some(30);
        r.alive_until = Some(NOW + 1_000);
        let mut o = observed();
        o.nodes = held_nodes(2);
        assert_eq!(ownership(&r, &me(), true), Ownership::Mine);
        let mut theirs = r.clone();
        theirs.owner = Some(LauncherId::parse("launcher-other").unwrap());
        assert_eq!(
            ownership(&theirs, &me(), false),
            Ownership::TakeOver,
            "a held request outlives its launcher's lease: another one times it"
        );
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Hold {
                strays: vec![],
                until: NOW + 1_000
            }
        );
        assert_eq!(
            next(&r, &o, NOW + 1_000),
            RequestStep::Reclaim {
                reason: "keep-alive lapsed: not renewed within 30s".into(),
                nodes: vec![id(0), id(1)],
                strays: vec![],
            }
        );
        // Renewed (the record's alive_until moved on): held again.
        r.alive_until = Some(NOW + 31_000);
        assert!(matches!(
            next(&r, &o, NOW + 1_000),
            RequestStep::Hold { until, .. } if until == NOW + 31_000
        ));
    }

    #[test]
    fn a_request_whose_nodes_were_all_released_is_held_no_more() {
        let mut r = fulfilled(&["a"]);
        r.keep_alive_secs = Some(30);
        r.alive_until = Some(NOW - 1);
        r.nodes_released_at = Some(NOW - 5);
        assert_eq!(
            next(&r, &observed(), NOW),
            RequestStep::Stop { strays: vec![] }
        );
        assert_eq!(ownership(&r, &me(), true), Ownership::Ended);
    }

    #[test]
    fn a_label_max_hold_reclaims_at_hold_until_whatever_the_keep_alive() {
        let mut r = fulfilled(&["a"]);
        r.hold_until = Some(7_000);
        let mut o = observed();
        o.nodes = held_nodes(1);
        assert_eq!(
            next(&r, &o, 6_000),
            RequestStep::Hold {
                strays: vec![],
                until: 7_000
            }
        );
        r.keep_alive_secs = Some(60);
        r.alive_until = Some(60_000);
        assert_eq!(
            next(&r, &o, 7_000),
            RequestStep::Reclaim {
                reason: "max-hold-time reached: held 2s since fulfilled".into(),
                nodes: vec![id(0)],
                strays: vec![],
            }
        );
    }

    #[test]
    fn a_held_request_gives_back_a_stray_claim_and_keeps_holding() {
        let mut r = fulfilled(&["a"]);
        r.hold_until = Some(NOW + 5);
        let mut o = observed();
        o.nodes = vec![
            node(0, 0, NodeState::Ready, true),
            node(0, 9, NodeState::Preparing, false),
        ];
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Hold {
                strays: ids(&[9]),
                until: NOW + 5
            }
        );
    }

    #[test]
    fn fulfilment_sets_the_hold_limit_of_the_labels() {
        let r = request(&["a"]);
        let mut o = observed();
        o.nodes = held_nodes(1);
        o.max_hold = Some(Duration::from_secs(60));
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Fulfil {
                nodes: vec![id(0)],
                hold_until: Some(NOW + 60_000),
            }
        );
    }

    #[test]
    fn a_waiting_request_whose_keep_alive_lapses_fails_and_gives_back_its_claims() {
        let mut r = request(&["a", "b"]);
        r.keep_alive_secs = Some(10);
        r.alive_until = Some(NOW + 500);
        r.status = "waiting for a backing node of vm to boot (1 of 2 slots assigned)".into();
        r.waiting = Some(Waiting::next(None, Kind::Booting, 1_000));
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        o.causes.insert("b".into(), booting());
        o.waiting_since = Some(1_000);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Wait {
                missing: keys(&["b"]),
                until: Some(NOW + 500),
                status: None,
                waiting: None,
            },
            "woken by a timer at the lapse"
        );
        assert_eq!(
            next(&r, &o, NOW + 500),
            RequestStep::Fail {
                reason: "keep-alive lapsed: not renewed within 10s while waiting: \
                         waiting for a backing node of vm to boot (1 of 2 slots assigned)"
                    .into(),
                release: ids(&[0]),
            }
        );
    }

    // ---- waiting and its status --------------------------------------------------------

    #[test]
    fn a_short_wait_writes_no_status() {
        let r = request(&["a"]);
        let mut o = observed();
        o.waiting_since = Some(NOW - 100);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Wait {
                missing: keys(&["a"]),
                until: Some(NOW - 100 + STATUS_DELAY.as_millis() as u64),
                status: None,
                waiting: None,
            }
        );
    }

    #[test]
    fn a_longer_wait_says_a_backing_node_is_booting() {
        let r = request(&["a", "b"]);
        let mut o = observed();
        o.nodes = vec![node(0, 0, NodeState::Ready, true)];
        o.waiting_since = Some(1_000);
        o.causes.insert(
            "b".into(),
            WaitCause::Booting {
                backing_label: "large".into(),
            },
        );
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Wait {
                missing: keys(&["b"]),
                until: None,
                status: Some(
                    "waiting for a backing node of large to boot (1 of 2 slots assigned)".into()
                ),
                waiting: Some(Waiting::next(None, Kind::Booting, NOW)),
            }
        );
    }

    #[test]
    fn a_new_cause_is_written_with_the_time_the_last_one_held_the_request() {
        let mut r = request(&["a"]);
        r.status = "waiting for a free slot of a (0 of 1 slots assigned)".into();
        r.waiting = Some(Waiting::next(None, Kind::Taken, 1_000));
        let mut o = observed();
        o.waiting_since = Some(1_000);
        o.causes
            .insert("a".into(), WaitCause::Behind { requests: 3 });
        let RequestStep::Wait {
            status: Some(status),
            waiting: Some(waiting),
            ..
        } = next(&r, &o, 4_000)
        else {
            panic!("a new cause is written");
        };
        assert_eq!(
            status,
            "waiting behind 3 request(s) served first for the free slots of a (0 of 1 slots assigned)"
        );
        assert_eq!((waiting.cause, waiting.since), (Kind::Behind, 4_000));
        assert_eq!(waiting.held(Kind::Taken, 9_000), 3_000);
        assert_eq!(waiting.held(Kind::Behind, 9_000), 5_000);
        r.status = status;
        r.waiting = Some(waiting);
        assert!(
            matches!(
                next(&r, &o, 6_000),
                RequestStep::Wait {
                    status: None,
                    waiting: None,
                    ..
                }
            ),
            "the same cause later is not written again"
        );
    }

    #[test]
    fn a_status_already_written_is_not_written_again() {
        let mut r = request(&["a"]);
        r.status = "waiting for a free slot of a (0 of 1 slots assigned)".into();
        r.waiting = Some(Waiting::next(None, Kind::Taken, 1_000));
        let mut o = observed();
        o.waiting_since = Some(1_000);
        assert_eq!(
            next(&r, &o, NOW),
            RequestStep::Wait {
                missing: keys(&["a"]),
                until: None,
                status: None,
                waiting: None,
            }
        );
    }

    #[test]
    fn waiting_statuses_say_why() {
        let r = request(&["a"]);
        let missing = keys(&["a"]);
        let mut causes = BTreeMap::new();
        causes.insert(
            "a".to_string(),
            WaitCause::OutOfCapacity {
                provider: "cloud".into(),
                backing_label: "large".into(),
                failure: Some("quota exceeded".into()),
                backoff: Duration::from_secs(10),
            },
        );
        assert_eq!(
            waiting_status(&r, &missing, &causes),
            "waiting for capacity: provider cloud is out of capacity for large (quota exceeded); asking again every 10s (0 of 1 slots assigned)"
        );
        causes.insert("a".to_string(), WaitCause::PoolsFull);
        assert_eq!(
            waiting_status(&r, &missing, &causes),
            "waiting for a free slot of a: every pool serving it is at max-servers (0 of 1 slots assigned)"
        );
        causes.clear();
        assert_eq!(
            waiting_status(&r, &missing, &causes),
            "waiting for a free slot of a (0 of 1 slots assigned)"
        );
    }

    #[test]
    fn only_claims_prepares_and_waits_keep_the_request_queued() {
        let missing = keys(&["a"]);
        let queued = [
            RequestStep::Claim {
                slots: vec![],
                missing: missing.clone(),
            },
            RequestStep::Prepare {
                nodes: vec![],
                missing: missing.clone(),
            },
            RequestStep::Wait {
                missing: missing.clone(),
                until: None,
                status: None,
                waiting: None,
            },
        ];
        for step in queued {
            assert_eq!(step.missing(), missing.as_slice(), "{step:?}");
        }
        for step in [
            RequestStep::Leave,
            RequestStep::Pause { until: 1 },
            RequestStep::Release(vec![]),
            RequestStep::Hold {
                strays: vec![],
                until: 1,
            },
            RequestStep::Fulfil {
                nodes: vec![],
                hold_until: None,
            },
        ] {
            assert!(step.missing().is_empty(), "{step:?}");
        }
    }
}
