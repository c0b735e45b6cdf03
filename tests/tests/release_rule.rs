//! The console counts an idle backing node down to the moment the launcher releases it:
//! both call the configuration crate's one rule. This checks that they agree on
//! generated cases, the `last_release` term included (a slot seen coming back after the
//! node's `idle_since`), by driving the console's state with watch changes and the
//! launcher's lifecycle with the same observations.

use slotpool_config::timing::IdleRules;
use slotpool_launcher::backing::lifecycle::{self, AgentSeen, Observed};
use slotpool_protocol::layout::{seat_key, slot_key};
use slotpool_protocol::model::{BackingNode, BackingState, IdleBehaviour, Node, NodeState};
use slotpool_protocol::{BackingId, NodeId, RequestId};
use slotpool_tui::mirror::{Bucket, Change, Record};
use slotpool_tui::rows::IdleTimer;
use slotpool_tui::rules::{LabelRules, Rules};
use slotpool_tui::state::{apply_all, Msg, State};
use std::time::Duration;

const SEC: u64 = 1000;
const NOW: u64 = 1_767_268_800_000;

/// A small deterministic generator (xorshift), so a failing case can be replayed.
struct Cases(u64);

impl Cases {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn backing(launched_at: u64, idle_since: u64) -> BackingNode {
    BackingNode {
        v: 1,
        id: BackingId::parse("bn-rule").unwrap(),
        provider: "cloud".into(),
        pool: "main".into(),
        seat: 0,
        label: "small".into(),
        backing_label: "vm".into(),
        slots: 2,
        state: BackingState::Ready,
        idle: IdleBehaviour::Run,
        instance: None,
        secret_sha256: String::new(),
        created_at: launched_at - SEC,
        launched_at: Some(launched_at),
        ready_at: Some(launched_at + SEC),
        idle_since: Some(idle_since),
        attempts: 1,
        failure: None,
        attributes: Default::default(),
        order: None,
        interruption: None,
        out_of_capacity: false,
        create_queued: false,
        uses: 0,
        updated_at: idle_since,
    }
}

fn slot_of(b: &BackingNode) -> Node {
    Node {
        v: 1,
        id: NodeId::for_slot(&b.id, 0),
        request_id: RequestId::parse("req-rule").unwrap(),
        index: 0,
        label: b.label.clone(),
        backing_id: b.id.clone(),
        slot: 0,
        state: NodeState::Ready,
        requestor: "rule".into(),
        client: None,
        host: String::new(),
        workspace: None,
        attributes: Default::default(),
        allocated_at: b.launched_at.unwrap(),
        released_at: None,
        failure: None,
        login: Default::default(),
    }
}

/// The console's countdown for `b` at `now`, having seen a slot of it come back at
/// `last_release` (if any).
fn console_countdown(
    rules: LabelRules,
    b: &BackingNode,
    last_release: Option<u64>,
    now: u64,
) -> IdleTimer {
    let mut r = Rules::unknown();
    r.insert("cloud", "main", "small", rules);
    let mut state = State::new(r, "nats://127.0.0.1:4222");
    let mut start: Vec<Change> = Bucket::ALL.iter().map(|b| Change::Restarted(*b)).collect();
    start.push(Change::Put {
        key: seat_key(&b.provider, &b.pool, b.seat),
        record: Record::Backing(Box::new(b.clone())),
    });
    start.extend(Bucket::ALL.iter().map(|b| Change::Synced(*b)));
    apply_all(
        &mut state,
        [Msg::Tick(b.launched_at.unwrap()), Msg::Feed(start)],
    );
    if let Some(at) = last_release {
        let node = slot_of(b);
        let key = slot_key(&b.id, 0);
        let put = Change::Put {
            key: key.clone(),
            record: Record::Slot(Box::new(node)),
        };
        let removed = Change::Removed {
            bucket: Bucket::Slots,
            key,
        };
        apply_all(
            &mut state,
            [
                Msg::Feed(vec![put]),
                Msg::Tick(at),
                Msg::Feed(vec![removed]),
            ],
        );
    }
    apply_all(&mut state, [Msg::Tick(now)]);
    let key = seat_key(&b.provider, &b.pool, b.seat);
    state.backing_row(&key).expect("the backing row").timer
}

#[test]
fn the_console_counts_down_to_the_launchers_release_time() {
    let mut cases = Cases(0x5eed_2026);
    let mut with_last_release = 0;
    for case in 0..500 {
        let launched_at = NOW - cases.below(4 * 3600) * SEC;
        let idle_since = launched_at + cases.below(NOW - launched_at + 1);
        let last_release = (cases.below(2) == 0)
            .then(|| launched_at + cases.below(NOW - launched_at + 1))
            .filter(|at| *at <= NOW);
        let now = NOW;
        let label = LabelRules {
            idle: IdleRules {
                grace_time: Duration::from_millis(cases.below(3600) * SEC),
                min_retention_time: Duration::from_millis(cases.below(2) * cases.below(7200) * SEC),
                max_age: Duration::ZERO,
            },
            min_ready: 0,
            warm: None,
        };
        let b = backing(launched_at, idle_since);
        let obs = Observed {
            agent: AgentSeen::Up { draining: false },
            used: 0,
            last_release,
            rules: None,
            synced_since: Some(0),
            heartbeats_back_at: None,
            heartbeat_lost_at: None,
            heartbeat_ttl: Duration::from_secs(6),
            min_ready: 0,
            free_ahead: 0,
            ready_falls_at: None,
            waiting: 0,
            now,
        };
        let rules = lifecycle::Rules {
            idle: label.idle,
            boot_timeout: Duration::from_secs(60),
            launch_timeout: Duration::from_secs(60),
            launch_retries: 1,
            max_uses: None,
        };
        let launcher_at = lifecycle::release_at(&b, &obs, &rules);
        let console = console_countdown(label, &b, last_release, now);
        assert_eq!(
            console,
            IdleTimer::ReleaseIn(launcher_at.saturating_sub(now)),
            "case {case}: launched {launched_at}, idle since {idle_since}, last release \
             {last_release:?}, {label:?}"
        );
        if last_release.is_some_and(|at| at > idle_since) {
            with_last_release += 1;
        }
    }
    assert!(
        with_last_release > 50,
        "the cases exercise the last-release term ({with_last_release})"
    );
}
