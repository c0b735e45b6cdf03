//! Records for the unit and snapshot tests: a small pool at a fixed time.

use crate::keys;
use crate::mirror::{Bucket, Change, Record};
use crate::rules::{LabelRules, Rules};
use crate::state::{apply_all, update, Command, Msg, State};
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use slotpool_config::timing::IdleRules;
use slotpool_protocol::model::{
    AgentHeartbeat, BackingNode, BackingState, Event, EventKind, Health, IdleBehaviour, Instance,
    Lease, Node, NodeRequest, NodeState, RequestState,
};
use slotpool_protocol::{BackingId, EventId, LauncherId, NodeId, RequestId};
use std::time::Duration;

/// 2026-01-01 12:00:00 UTC.
pub const NOW: u64 = 1_767_268_800_000;
pub const SEC: u64 = 1000;

pub fn bid(n: u32) -> BackingId {
    BackingId::parse(&format!("bn-01jq3m2f7h8g9k0m1n2p3q4r{n:02}")).unwrap()
}

pub fn backing(seat: u32, state: BackingState, slots: u32) -> BackingNode {
    BackingNode {
        v: 1,
        id: bid(seat),
        provider: "cloud".into(),
        pool: "main".into(),
        seat,
        label: "small".into(),
        backing_label: "vm".into(),
        slots,
        state,
        idle: IdleBehaviour::Run,
        instance: Some(Instance {
            id: format!("i-{seat}"),
            host: format!("10.0.0.{seat}"),
            data: serde_json::Value::Null,
        }),
        secret_sha256: "abc".into(),
        created_at: NOW - 3600 * SEC,
        launched_at: Some(NOW - 3600 * SEC),
        ready_at: Some(NOW - 3500 * SEC),
        idle_since: None,
        attempts: 1,
        failure: None,
        attributes: Default::default(),
        order: None,
        interruption: None,
        out_of_capacity: false,
        create_queued: false,
        uses: 0,
        updated_at: NOW - 60 * SEC,
    }
}

pub fn node(b: &BackingNode, slot: u32, requestor: &str, allocated_at: u64) -> Node {
    Node {
        v: 1,
        id: NodeId::parse(&format!(
            "node-01jq3m8x5v9k2c7t4r6y0a1b{slot:02}_{slot}_{}",
            b.id
        ))
        .unwrap(),
        request_id: RequestId::parse(&format!("req-{requestor}")).unwrap(),
        index: 0,
        label: b.label.clone(),
        backing_id: b.id.clone(),
        slot,
        state: NodeState::Ready,
        requestor: requestor.into(),
        client: None,
        host: "10.0.0.1".into(),
        workspace: Some(format!("/var/lib/slotpool/agent/slots/{slot}")),
        attributes: Default::default(),
        allocated_at,
        released_at: None,
        failure: None,
        login: Default::default(),
    }
}

pub fn agent(b: &BackingNode, sent_at: u64) -> AgentHeartbeat {
    AgentHeartbeat {
        v: 1,
        backing_id: b.id.clone(),
        secret_sha256: b.secret_sha256.clone(),
        agent_version: "0.1.0".into(),
        hostname: "vm".into(),
        pid: 7,
        started_at: NOW - 3500 * SEC,
        sent_at,
        ttl_secs: None,
        health: Health {
            healthy: true,
            ..Default::default()
        },
        slots: vec![],
        draining: false,
        dirty_slots: vec![],
        dirty_reasons: Default::default(),
        isolation: None,
        ssh_port: None,
        ssh_host_keys: vec![],
        slot_names: None,
        interruption: None,
    }
}

pub fn request(id: &str, labels: &[&str], state: RequestState, created_at: u64) -> NodeRequest {
    NodeRequest {
        v: 1,
        id: RequestId::parse(id).unwrap(),
        labels: labels.iter().map(|s| s.to_string()).collect(),
        requestor: format!("ci/{id}"),
        client: None,
        priority: 100,
        timeout_secs: None,
        ssh_public_key: None,
        created_at,
        state,
        status: match state {
            RequestState::Requested => "waiting for a free slot of small".into(),
            _ => "fulfilled: 1 node(s) ready".into(),
        },
        nodes: vec![],
        failure: None,
        updated_at: created_at,
        owner: None,
        nodes_released_at: None,
        keep_alive_secs: None,
        alive_until: None,
        fulfilled_at: None,
        hold_until: None,
        nodes_failed: Vec::new(),
        waiting: None,
    }
}

pub fn event(n: u32, at: u64, kind: EventKind, b: &BackingId, message: &str) -> Event {
    Event {
        v: 1,
        id: EventId::parse(&format!("evt-01jq3m{n:020}")).unwrap(),
        at,
        kind,
        actor: if kind == EventKind::Operator {
            "alice@ops".into()
        } else {
            "launcher-1".into()
        },
        backing_id: Some(b.clone()),
        node_id: None,
        message: message.into(),
        reason: None,
    }
}

/// Changes putting `count` ready backing nodes of `slots` slots each (seats 0..count).
pub fn ready_backing(count: u32, slots: u32) -> Vec<Change> {
    (0..count)
        .map(|i| {
            put(Record::Backing(Box::new(backing(
                i,
                BackingState::Ready,
                slots,
            ))))
        })
        .collect()
}

/// The liveness lease of launcher `id` (a ULID's end), renewed `lease_age_s` ago, its
/// last pass `pass_age_s` ago.
pub fn launcher(id: &str, lease_age_s: u64, pass_age_s: Option<u64>) -> Lease {
    Lease {
        v: 1,
        holder: LauncherId::parse(&format!("launcher-01jq3kz9w8v7t6s5r4q3p2{id}")).unwrap(),
        acquired_at: NOW - 3600 * SEC,
        renewed_at: Some(NOW - lease_age_s * SEC),
        passed_at: pass_age_s.map(|s| NOW - s * SEC),
    }
}

pub fn put(record: Record) -> Change {
    let key = match &record {
        Record::Backing(b) => slotpool_protocol::layout::seat_key(&b.provider, &b.pool, b.seat),
        Record::Slot(n) => slotpool_protocol::layout::slot_key(&n.backing_id, n.slot),
        Record::Request(r) => r.id.to_string(),
        Record::Agent(a) => a.backing_id.to_string(),
        Record::Event(e) => e.id.to_string(),
        Record::Provider(p) => slotpool_protocol::layout::provider_status_key(&p.provider),
        Record::Launcher(l) => slotpool_protocol::layout::launcher_lease_key(&l.holder),
    };
    Change::Put { key, record }
}

pub fn rules() -> Rules {
    with_small(LabelRules {
        idle: IdleRules {
            grace_time: Duration::from_secs(300),
            min_retention_time: Duration::ZERO,
            max_age: Duration::from_secs(24 * 3600),
        },
        min_ready: 0,
        warm: None,
    })
}

/// Pool `cloud/main` of 4 backing nodes whose label `small` has `timers`.
fn with_small(timers: LabelRules) -> Rules {
    let mut r = Rules::unknown();
    r.insert("cloud", "main", "small", timers);
    r.set_max_servers("cloud", "main", 4);
    r
}

/// [`rules`] with label `small`'s timers set: a 300 s grace-time, `min_retention_s` and
/// `min_ready`, and no max-age.
pub fn small_rules(min_retention_s: u64, min_ready: u32) -> Rules {
    with_small(LabelRules {
        idle: IdleRules {
            grace_time: Duration::from_secs(300),
            min_retention_time: Duration::from_secs(min_retention_s),
            max_age: Duration::ZERO,
        },
        min_ready,
        warm: None,
    })
}

/// A state with every bucket loaded and `changes` applied, at [`NOW`], size `w`×`h`.
pub fn loaded(rules: Rules, changes: Vec<Change>, w: u16, h: u16) -> State {
    let mut state = State::new(rules, "nats://127.0.0.1:4222");
    let mut all: Vec<Change> = Bucket::ALL.iter().map(|b| Change::Restarted(*b)).collect();
    all.extend(changes);
    all.extend(Bucket::ALL.iter().map(|b| Change::Synced(*b)));
    apply_all(
        &mut state,
        [Msg::Resize(w, h), Msg::Tick(NOW), Msg::Feed(all)],
    );
    state
}

/// The key of character `c`, no modifiers.
pub fn key(c: char) -> KeyEvent {
    KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
}

/// The key `code`, no modifiers.
pub fn code(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
}

/// Presses `keys` one after the other, each meaning what it means in the prompt open at
/// the time and settled before the next (as the event loop does).
pub fn press(state: &mut State, keys: impl IntoIterator<Item = KeyEvent>) -> Vec<Command> {
    let mut out = Vec::new();
    for key in keys {
        if let Some(action) = keys::action(&key, &state.input) {
            out.extend(update(state, Msg::Action(action)));
        }
        out.extend(state.settle());
    }
    out.extend(state.settle());
    out
}

/// A failed, a canceled and a released request, all older than the sample's.
pub fn finished_requests() -> Vec<Change> {
    let mut failed = request("req-f1", &["small"], RequestState::Failed, NOW - 900 * SEC);
    failed.failure = Some("timed out after 300s".into());
    let canceled = request(
        "req-c1",
        &["small"],
        RequestState::Canceled,
        NOW - 800 * SEC,
    );
    let mut released = request(
        "req-r1",
        &["small"],
        RequestState::Fulfilled,
        NOW - 700 * SEC,
    );
    released.nodes_released_at = Some(NOW - 650 * SEC);
    [failed, canceled, released]
        .into_iter()
        .map(|r| put(Record::Request(Box::new(r))))
        .collect()
}

/// A small pool: a busy node, an idle one, a failed one; requests and events.
pub fn sample() -> Vec<Change> {
    let busy = backing(0, BackingState::Ready, 4);
    let mut idle = backing(1, BackingState::Ready, 4);
    idle.idle_since = Some(NOW - 42 * SEC);
    let mut failed = backing(2, BackingState::Failed, 4);
    failed.failure = Some("agent heartbeat expired".into());
    failed.ready_at = None;
    let mut launching = backing(3, BackingState::Launching, 4);
    launching.ready_at = None;
    launching.created_at = NOW - 20 * SEC;
    launching.launched_at = Some(NOW - 20 * SEC);
    let mut fulfilled = request(
        "req-01",
        &["small"],
        RequestState::Fulfilled,
        NOW - 600 * SEC,
    );
    fulfilled.nodes = vec![node(&busy, 0, "ci-job-1", NOW - 600 * SEC).id];
    vec![
        put(Record::Backing(Box::new(busy.clone()))),
        put(Record::Backing(Box::new(idle.clone()))),
        put(Record::Backing(Box::new(failed.clone()))),
        put(Record::Backing(Box::new(launching))),
        put(Record::Slot(Box::new(node(
            &busy,
            0,
            "ci-job-1",
            NOW - 600 * SEC,
        )))),
        put(Record::Slot(Box::new(node(
            &busy,
            2,
            "ci-job-2",
            NOW - 95 * SEC,
        )))),
        put(Record::Agent(Box::new(agent(&busy, NOW - SEC)))),
        put(Record::Agent(Box::new(agent(&idle, NOW - 2 * SEC)))),
        put(Record::Launcher(Box::new(launcher("n1m0", 2, Some(3))))),
        put(Record::Request(Box::new(fulfilled))),
        put(Record::Request(Box::new(request(
            "req-02",
            &["small", "small"],
            RequestState::Requested,
            NOW - 75 * SEC,
        )))),
        put(Record::Event(Box::new(event(
            1,
            NOW - 700 * SEC,
            EventKind::Backing,
            &busy.id,
            "ready",
        )))),
        put(Record::Event(Box::new(event(
            2,
            NOW - 120 * SEC,
            EventKind::Backing,
            &failed.id,
            "failed: agent heartbeat expired",
        )))),
        put(Record::Event(Box::new(event(
            3,
            NOW - 10 * SEC,
            EventKind::Operator,
            &idle.id,
            "hold: kernel update (by alice@ops)",
        )))),
    ]
}
