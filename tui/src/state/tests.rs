//! The reducer's unit tests, fed with the fixtures' records and keys.

use super::*;
use crate::fixtures::*;
use crate::mirror::{Bucket, Record, EVENT_HISTORY};
use crate::rows::Heartbeat;
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use slotpool_protocol::model::{BackingState, EventKind, IdleBehaviour};

fn selected_backing(state: &State) -> String {
    state.views[View::Backing.index()]
        .selected_key
        .clone()
        .unwrap()
}

#[test]
fn pools_aggregate_nodes_slots_and_waiting_requests() {
    let state = loaded(rules(), sample(), 80, 24);
    let pools = state.pools();
    assert_eq!(pools.len(), 1, "{pools:?}");
    let p = &pools[0];
    assert_eq!(
        (p.provider.as_str(), p.pool.as_str(), p.label.as_str()),
        ("cloud", "main", "small")
    );
    // requested, launching, ready, retiring, releasing, failed
    assert_eq!(p.by_state, [0, 1, 2, 0, 0, 1]);
    assert_eq!((p.used, p.total), (2, 16));
    assert_eq!(p.max_servers, Some(4));
    assert_eq!(p.waiting, 1);
    assert_eq!(p.oldest_wait_ms, Some(75 * SEC));
}

#[test]
fn waiting_labels_no_pool_serves_get_a_row() {
    let changes = vec![put(Record::Request(Box::new(request(
        "req-9",
        &["gpu"],
        RequestState::Requested,
        NOW - 5 * SEC,
    ))))];
    let state = loaded(Rules::unknown(), changes, 80, 24);
    assert_eq!(state.pools().len(), 1);
    assert_eq!(state.pools()[0].label, "gpu");
    assert_eq!(state.pools()[0].provider, "-");
    assert_eq!(state.pools()[0].waiting, 1);
}

#[test]
fn idle_timer_counts_down_grace_time_and_respects_min_retention() {
    let mut b = backing(1, BackingState::Ready, 2);
    b.idle_since = Some(NOW - 42 * SEC);
    let key = "cloud.main.1";
    let state = loaded(
        rules(),
        vec![put(Record::Backing(Box::new(b.clone())))],
        80,
        24,
    );
    assert_eq!(
        state.backing_row(key).unwrap().timer,
        IdleTimer::ReleaseIn((300 - 42) * SEC)
    );

    // min-retention later than grace-time: it wins.
    let r = small_rules(7200, 0);
    let state = loaded(r, vec![put(Record::Backing(Box::new(b.clone())))], 80, 24);
    let row = state.backing_row(key).unwrap();
    assert_eq!(row.timer, IdleTimer::ReleaseIn(3600 * SEC));
    assert_eq!(row.retained_ms, Some(3600 * SEC));
    assert_eq!(row.max_age_ms, None);

    // No config: how long it has been idle.
    let state = loaded(
        Rules::unknown(),
        vec![put(Record::Backing(Box::new(b.clone())))],
        80,
        24,
    );
    assert_eq!(
        state.backing_row(key).unwrap().timer,
        IdleTimer::IdleFor(42 * SEC)
    );

    // Hold and drain override grace-time.
    b.idle = IdleBehaviour::Hold;
    let state = loaded(
        rules(),
        vec![put(Record::Backing(Box::new(b.clone())))],
        80,
        24,
    );
    assert_eq!(state.backing_row(key).unwrap().timer, IdleTimer::Held);
    b.idle = IdleBehaviour::Drain;
    let state = loaded(
        rules(),
        vec![put(Record::Backing(Box::new(b.clone())))],
        80,
        24,
    );
    assert_eq!(state.backing_row(key).unwrap().timer, IdleTimer::Draining);
}

#[test]
fn timers_follow_the_tick_without_reading_the_clock() {
    let mut state = loaded(rules(), sample(), 80, 24);
    let before = state.backing_row("cloud.main.1").unwrap();
    apply_all(&mut state, [Msg::Tick(NOW + 10 * SEC)]);
    let after = state.backing_row("cloud.main.1").unwrap();
    assert_eq!(before.timer, IdleTimer::ReleaseIn(258 * SEC));
    assert_eq!(after.timer, IdleTimer::ReleaseIn(248 * SEC));
    assert_eq!(
        after.max_age_ms,
        Some((24 * 3600 - 3500 - 10) as i64 * SEC as i64)
    );
}

#[test]
fn a_used_node_has_no_idle_timer_and_shows_its_slots() {
    let state = loaded(rules(), sample(), 80, 24);
    let row = state.backing_row("cloud.main.0").unwrap();
    assert_eq!(row.timer, IdleTimer::None);
    assert_eq!((row.used, row.slots), (2, 4));
    assert_eq!(row.heartbeat, Heartbeat::Healthy { age_ms: SEC });
    let b = state.backing("cloud.main.0").unwrap().clone();
    let slots = state.slot_rows(&b);
    assert_eq!(slots.len(), 4);
    assert_eq!(slots[2].held_ms, Some(95 * SEC));
    assert!(slots[1].node.is_none());
}

#[test]
fn heartbeat_health_and_failure_reasons() {
    let b = backing(0, BackingState::Ready, 2);
    let mut hb = agent(&b, NOW - 3 * SEC);
    hb.health.healthy = false;
    hb.health.reason = Some("disk 98% full".into());
    let state = loaded(
        rules(),
        vec![
            put(Record::Backing(Box::new(b.clone()))),
            put(Record::Agent(Box::new(hb.clone()))),
        ],
        80,
        24,
    );
    let row = state.backing_row("cloud.main.0").unwrap();
    assert!(row.heartbeat.is_bad());
    assert_eq!(row.reason.as_deref(), Some("disk 98% full"));

    hb.secret_sha256 = "other".into();
    let state = loaded(
        rules(),
        vec![
            put(Record::Backing(Box::new(b))),
            put(Record::Agent(Box::new(hb))),
        ],
        80,
        24,
    );
    let row = state.backing_row("cloud.main.0").unwrap();
    assert_eq!(row.heartbeat, Heartbeat::Impostor { age_ms: 3 * SEC });

    let state = loaded(rules(), sample(), 80, 24);
    let failed = state.backing_row("cloud.main.2").unwrap();
    assert_eq!(failed.reason.as_deref(), Some("agent heartbeat expired"));
    assert_eq!(failed.heartbeat, Heartbeat::Missing);
}

#[test]
fn a_restarted_watch_reconciles_on_synced() {
    let mut state = loaded(rules(), sample(), 80, 24);
    assert_eq!(state.backing_count(), 4);
    // The watch restarts (connection came back); only seats 0 and 3 still exist.
    let again: Vec<Change> = sample()
        .into_iter()
        .filter(|c| matches!(c, Change::Put { key, .. } if key == "cloud.main.0" || key == "cloud.main.3"))
        .collect();
    let mut batch = vec![Change::Restarted(Bucket::Backing)];
    batch.extend(again);
    apply_all(&mut state, [Msg::Feed(batch)]);
    assert!(!state.loaded());
    assert_eq!(state.backing_count(), 4, "nothing dropped before Synced");
    apply_all(
        &mut state,
        [Msg::Feed(vec![Change::Synced(Bucket::Backing)])],
    );
    assert!(state.loaded());
    assert_eq!(state.backing_count(), 2);
    assert_eq!(
        state.view_state().rows,
        vec!["cloud.main.0", "cloud.main.3"]
    );
}

#[test]
fn removals_and_puts_update_rows_and_selection_follows_its_row() {
    let mut state = loaded(rules(), sample(), 80, 24);
    assert_eq!(state.view, View::Backing);
    press(&mut state, [key('j'), key('j')]);
    assert_eq!(selected_backing(&state), "cloud.main.2");
    // Sort by state: failed first; the selection stays on the failed node.
    press(&mut state, [key('s')]);
    assert_eq!(state.view_state().rows[0], "cloud.main.2");
    assert_eq!(selected_backing(&state), "cloud.main.2");
    assert_eq!(state.view_state().selected, 0);
    // It goes away: nothing is selected, not the row that took its place.
    apply_all(
        &mut state,
        [Msg::Feed(vec![Change::Removed {
            bucket: Bucket::Backing,
            key: "cloud.main.2".into(),
        }])],
    );
    assert_eq!(state.backing_count(), 3);
    assert_eq!(state.view_state().rows.len(), 3);
    assert_eq!(state.view_state().selected_key, None);
}

#[test]
fn a_selected_node_that_goes_away_leaves_nothing_selected_so_no_order_hits_another() {
    let mut state = loaded(rules(), sample(), 80, 24);
    // Drain the idle node on seat 1; below it the failed node, above it the busy one.
    press(&mut state, [key('j'), key('D'), code(KeyCode::Enter)]);
    assert_eq!(selected_backing(&state), "cloud.main.1");
    // It is released: its row disappears.
    apply_all(
        &mut state,
        [Msg::Feed(vec![Change::Removed {
            bucket: Bucket::Backing,
            key: "cloud.main.1".into(),
        }])],
    );
    let vs = state.view_state();
    assert_eq!(
        vs.selected_key, None,
        "selection moved to {:?}",
        vs.selected_key
    );
    assert_eq!(
        vs.gone.as_ref().map(|g| g.id.clone()),
        Some(bid(1).to_string())
    );
    let status = state.status.clone().unwrap().text;
    assert!(status.contains("went away"), "{status}");
    // A second D has no target: it says so and sends nothing.
    assert!(press(&mut state, [key('D'), code(KeyCode::Enter)]).is_empty());
    assert_eq!(state.input, Input::None);
    assert!(state.status.as_ref().unwrap().error);
    // The next node launched into the same seat is another node: still nothing selected.
    let mut next = backing(1, BackingState::Launching, 4);
    next.id = bid(9);
    apply_all(
        &mut state,
        [Msg::Feed(vec![put(Record::Backing(Box::new(next)))])],
    );
    assert_eq!(state.view_state().rows[1], "cloud.main.1");
    assert_eq!(state.view_state().selected_key, None);
    // Moving down selects the row in its place; up, the one above.
    press(&mut state, [key('j')]);
    assert_eq!(selected_backing(&state), "cloud.main.1");
    assert_eq!(state.view_state().gone, None);
    apply_all(
        &mut state,
        [Msg::Feed(vec![Change::Removed {
            bucket: Bucket::Backing,
            key: "cloud.main.1".into(),
        }])],
    );
    press(&mut state, [key('k')]);
    assert_eq!(selected_backing(&state), "cloud.main.0");
}

#[test]
fn the_status_line_clears_itself_on_a_later_tick() {
    let mut state = loaded(rules(), sample(), 80, 24);
    press(&mut state, [key('D'), code(KeyCode::Esc)]);
    assert_eq!(state.status.as_ref().unwrap().text, "canceled");
    apply_all(&mut state, [Msg::Tick(NOW + STATUS_MS - 1)]);
    assert!(state.status.is_some(), "still fresh");
    apply_all(&mut state, [Msg::Tick(NOW + STATUS_MS)]);
    assert_eq!(state.status, None);
    // An error stays longer.
    press(&mut state, [key('5'), key('D')]);
    assert!(state.status.as_ref().unwrap().error);
    apply_all(&mut state, [Msg::Tick(NOW + 2 * STATUS_MS)]);
    assert!(state.status.is_some());
    apply_all(&mut state, [Msg::Tick(NOW + STATUS_MS + STATUS_ERROR_MS)]);
    assert_eq!(state.status, None);
}

#[test]
fn filter_as_you_type_and_reverse_sort() {
    let mut state = loaded(rules(), sample(), 80, 24);
    let mut msgs = vec![key('/')];
    msgs.extend("fail".chars().map(key));
    press(&mut state, msgs);
    // Applied as typed, before Enter.
    assert_eq!(state.view_state().filter, "fail");
    assert_eq!(state.view_state().rows, vec!["cloud.main.2"]);
    press(&mut state, [code(KeyCode::Backspace), code(KeyCode::Enter)]);
    assert_eq!(state.view_state().filter, "fai");
    assert_eq!(state.input, Input::None);
    // Esc in the prompt puts back the filter it opened with.
    press(&mut state, [key('/'), key('x'), code(KeyCode::Esc)]);
    assert_eq!(state.view_state().filter, "fai");
    assert_eq!(state.view_state().rows, vec!["cloud.main.2"]);
    press(&mut state, [code(KeyCode::Esc)]);
    assert_eq!(state.view_state().rows.len(), 4);
    press(&mut state, [key('S')]);
    assert_eq!(state.view_state().rows[0], "cloud.main.3");
}

#[test]
fn drain_hold_and_run_ask_for_confirmation_naming_the_node() {
    let mut state = loaded(rules(), sample(), 80, 24);
    // D asks first; the dialog names the node the order would hit and how it stands.
    let cmds = press(&mut state, [key('j'), key('D')]);
    assert!(cmds.is_empty(), "nothing is sent before Enter");
    let Input::Confirm { order, .. } = &state.input else {
        panic!("D opens a confirmation: {:?}", state.input)
    };
    let said = order.describe();
    assert!(
        said.starts_with(&format!(
            "Drain backing node {} (0 of 4 slots in use)?",
            bid(1)
        )),
        "{said}"
    );
    // Esc cancels: nothing is sent.
    assert!(press(&mut state, [code(KeyCode::Esc)]).is_empty());
    assert_eq!(state.input, Input::None);
    // Enter sends it, with the reason typed.
    let mut keys = vec![key('D')];
    keys.extend("disk swap".chars().map(key));
    keys.push(code(KeyCode::Enter));
    assert_eq!(
        press(&mut state, keys),
        vec![Command::Order {
            action: OperatorAction::Drain,
            backing_id: bid(1),
            reason: Some("disk swap".into())
        }]
    );
    let cmds = press(
        &mut state,
        [
            key('H'),
            code(KeyCode::Enter),
            key('R'),
            code(KeyCode::Enter),
        ],
    );
    assert_eq!(cmds.len(), 2);
    assert!(matches!(
        cmds[0],
        Command::Order {
            action: OperatorAction::Hold,
            ..
        }
    ));
    assert!(matches!(
        cmds[1],
        Command::Order {
            action: OperatorAction::Run,
            ..
        }
    ));
    // The busy node: its slots in use are named.
    press(&mut state, [key('k'), key('D')]);
    let Input::Confirm { order, .. } = &state.input else {
        panic!("D opens a confirmation")
    };
    assert!(
        order.describe().contains("(2 of 4 slots in use)"),
        "{}",
        order.describe()
    );
    press(&mut state, [code(KeyCode::Esc)]);
    // Not in the Events view.
    let cmds = press(&mut state, [key('5'), key('D')]);
    assert!(cmds.is_empty());
    assert_eq!(state.input, Input::None);
    assert!(state.status.as_ref().unwrap().error);
}

#[test]
fn run_on_a_held_node_idle_past_its_grace_time_says_it_is_released_at_once() {
    let mut held = backing(1, BackingState::Ready, 4);
    held.idle = IdleBehaviour::Hold;
    held.idle_since = Some(NOW - 3600 * SEC);
    let mut state = loaded(rules(), vec![put(Record::Backing(Box::new(held)))], 80, 24);
    press(&mut state, [key('R')]);
    let Input::Confirm { order, .. } = &state.input else {
        panic!("R opens a confirmation")
    };
    assert!(
        order
            .describe()
            .contains("idle past its grace-time: released at once"),
        "{}",
        order.describe()
    );
    // Held a moment ago: no such warning.
    let mut fresh = backing(1, BackingState::Ready, 4);
    fresh.idle = IdleBehaviour::Hold;
    fresh.idle_since = Some(NOW - 10 * SEC);
    let mut state = loaded(rules(), vec![put(Record::Backing(Box::new(fresh)))], 80, 24);
    press(&mut state, [key('R')]);
    let Input::Confirm { order, .. } = &state.input else {
        panic!("R opens a confirmation")
    };
    assert!(
        !order.describe().contains("released at once"),
        "{}",
        order.describe()
    );
}

#[test]
fn kill_asks_for_confirmation_and_a_reason() {
    let mut state = loaded(rules(), sample(), 80, 24);
    let cmds = press(&mut state, [key('K')]);
    assert!(cmds.is_empty());
    assert!(matches!(state.input, Input::Confirm { .. }));
    // Esc cancels.
    let cmds = press(&mut state, [code(KeyCode::Esc)]);
    assert!(cmds.is_empty());
    assert_eq!(state.input, Input::None);
    let mut msgs = vec![key('K')];
    msgs.extend("bad disk".chars().map(key));
    msgs.push(code(KeyCode::Enter));
    let cmds = press(&mut state, msgs);
    assert_eq!(
        cmds,
        vec![Command::Order {
            action: OperatorAction::Kill,
            backing_id: bid(0),
            reason: Some("bad disk".into())
        }]
    );
    // 'q' typed into the reason is text, not quit.
    let cmds = press(&mut state, [key('K'), key('q')]);
    assert!(cmds.is_empty());
}

#[test]
fn enter_drills_into_slots_and_x_releases_one() {
    let mut state = loaded(rules(), sample(), 80, 24);
    press(&mut state, [code(KeyCode::Enter)]);
    assert_eq!(state.view, View::Slots);
    assert_eq!(state.focused().unwrap().id, bid(0));
    assert_eq!(state.view_state().rows.len(), 4);
    // Slot 1 is free: nothing to release.
    let cmds = press(&mut state, [key('j'), key('X')]);
    assert!(cmds.is_empty());
    let mut msgs = vec![key('j'), key('X')];
    msgs.extend("stuck".chars().map(key));
    msgs.push(code(KeyCode::Enter));
    let cmds = press(&mut state, msgs);
    match &cmds[..] {
        [Command::ReleaseNode { node_id, reason }] => {
            assert!(node_id.as_str().ends_with(&format!("_2_{}", bid(0))));
            assert_eq!(reason.as_deref(), Some("stuck"));
        }
        other => panic!("{other:?}"),
    }
    press(&mut state, [code(KeyCode::Esc)]);
    assert_eq!(state.view, View::Backing);
}

#[test]
fn tab_and_number_keys_switch_views_and_q_quits() {
    let mut state = loaded(rules(), sample(), 80, 24);
    press(&mut state, [code(KeyCode::Tab)]);
    assert_eq!(state.view, View::Slots);
    press(&mut state, [code(KeyCode::BackTab), code(KeyCode::BackTab)]);
    assert_eq!(state.view, View::Pools);
    press(&mut state, [key('5')]);
    assert_eq!(state.view, View::Events);
    // Newest event first.
    assert!(state.view_state().rows[0].ends_with("3"));
    press(&mut state, [key('?')]);
    assert_eq!(state.input, Input::Help);
    assert!(
        press(&mut state, [key('q')]).is_empty(),
        "q closes the help first"
    );
    assert_eq!(press(&mut state, [key('q')]), vec![Command::Quit]);
}

#[test]
fn paging_scrolls_and_keeps_the_selection_visible() {
    let changes = ready_backing(100, 2);
    let mut state = loaded(rules(), changes, 80, 24);
    let page = state.page_rows();
    assert_eq!(page, 17);
    press(&mut state, [code(KeyCode::PageDown)]);
    assert_eq!(state.view_state().selected, 17);
    assert_eq!(state.view_state().offset, 1);
    press(&mut state, [key('G')]);
    assert_eq!(state.view_state().selected, 99);
    assert_eq!(state.view_state().offset, 100 - page);
    press(&mut state, [key('g')]);
    assert_eq!(state.view_state().offset, 0);
    // A smaller terminal keeps the selection on screen.
    press(&mut state, [key('G')]);
    apply_all(&mut state, [Msg::Resize(80, 12)]);
    assert_eq!(state.view_state().offset, 100 - 5);
}

#[test]
fn the_event_log_follows_new_entries_while_on_top() {
    let mut state = loaded(rules(), sample(), 80, 24);
    press(&mut state, [key('5')]);
    let newest = put(Record::Event(Box::new(event(
        9,
        NOW,
        EventKind::Operator,
        &bid(0),
        "drain by bob",
    ))));
    apply_all(&mut state, [Msg::Feed(vec![newest])]);
    assert!(state
        .view_state()
        .selected_key
        .as_ref()
        .unwrap()
        .ends_with('9'));
    // Scrolled down: the selection stays on its entry.
    press(&mut state, [key('j')]);
    let kept = state.view_state().selected_key.clone();
    let newer = put(Record::Event(Box::new(event(
        10,
        NOW,
        EventKind::Operator,
        &bid(0),
        "run by bob",
    ))));
    apply_all(&mut state, [Msg::Feed(vec![newer])]);
    assert_eq!(state.view_state().selected_key, kept);
}

#[test]
fn the_event_log_keeps_the_latest_entries() {
    let b = bid(0);
    let changes: Vec<Change> = (0..(EVENT_HISTORY as u32 + 20))
        .map(|i| {
            put(Record::Event(Box::new(event(
                i,
                NOW,
                EventKind::Backing,
                &b,
                "x",
            ))))
        })
        .collect();
    let state = loaded(rules(), changes, 80, 24);
    assert_eq!(state.views[View::Events.index()].rows.len(), EVENT_HISTORY);
}

#[test]
fn order_results_and_connection_show_in_the_state() {
    let mut state = loaded(rules(), sample(), 80, 24);
    apply_all(
        &mut state,
        [Msg::OrderDone {
            what: "drain bn-1".into(),
            result: Err("no launcher answers".into()),
        }],
    );
    let s = state.status.clone().unwrap();
    assert!(s.error && s.text.contains("drain bn-1 failed"), "{s:?}");
    apply_all(&mut state, [Msg::Link(false)]);
    assert!(!state.link_up);
    apply_all(&mut state, [Msg::Link(true)]);
    assert!(state.link_up);
}

#[test]
fn requests_show_waiting_then_live_then_the_finished_folded() {
    let mut changes = sample();
    changes.extend(finished_requests());
    let mut state = loaded(rules(), changes, 80, 24);
    press(&mut state, [key('4')]);
    assert_eq!(
        state.view_state().rows,
        vec!["req-02", "req-01", rows::FOLD_KEY]
    );
    // Enter on the fold shows them, newest first; again folds them.
    press(&mut state, [key('G'), code(KeyCode::Enter)]);
    assert_eq!(
        state.view_state().rows,
        vec![
            "req-02",
            "req-01",
            rows::FOLD_KEY,
            "req-r1",
            "req-c1",
            "req-f1"
        ]
    );
    press(&mut state, [code(KeyCode::Enter)]);
    assert_eq!(state.view_state().rows.len(), 3);
    // On top, the view follows the newest request as it arrives.
    press(&mut state, [key('g')]);
    apply_all(
        &mut state,
        [Msg::Feed(vec![put(Record::Request(Box::new(request(
            "req-03",
            &["small"],
            RequestState::Requested,
            NOW - SEC,
        ))))])],
    );
    assert_eq!(state.view_state().selected_key.as_deref(), Some("req-03"));
}

#[test]
fn enter_on_a_pool_shows_that_pools_backing_nodes_not_every_label_alike() {
    let mut other = backing(7, BackingState::Ready, 2);
    other.pool = "spare".into();
    let mut changes = sample();
    changes.push(put(Record::Backing(Box::new(other))));
    let mut state = loaded(rules(), changes, 80, 24);
    press(&mut state, [key('1')]);
    assert_eq!(
        state.view_state().rows.len(),
        2,
        "{:?}",
        state.view_state().rows
    );
    let spare = state
        .view_state()
        .rows
        .iter()
        .position(|k| k.starts_with("cloud/spare/"))
        .unwrap();
    press(&mut state, [key('g')]);
    for _ in 0..spare {
        press(&mut state, [key('j')]);
    }
    press(&mut state, [code(KeyCode::Enter)]);
    assert_eq!(state.view, View::Backing);
    assert_eq!(state.view_state().rows, vec!["cloud.spare.7"]);
    assert_eq!(state.view_state().filter, "", "not a text filter");
    // Esc shows every pool again.
    press(&mut state, [code(KeyCode::Esc)]);
    assert_eq!(state.view_state().rows.len(), 5);
}

#[test]
fn i_opens_the_detail_pane_which_takes_rows_from_the_table() {
    let mut state = loaded(rules(), sample(), 80, 24);
    let rows = state.page_rows();
    press(&mut state, [key('i')]);
    assert!(state.details);
    assert!(state.page_rows() < rows, "{} of {rows}", state.page_rows());
    assert!(state.page_rows() > 0);
    press(&mut state, [key('i')]);
    assert_eq!(state.page_rows(), rows);
}

/// The slot key of slot `slot` of backing node `seat` of the sample.
fn slot_of(seat: u32, slot: u32) -> String {
    slotpool_protocol::layout::slot_key(&bid(seat), slot)
}

/// The sample's busy node released: its slots' records and its own go.
fn busy_node_released() -> Msg {
    let removed = |bucket, key: String| Change::Removed { bucket, key };
    Msg::Feed(vec![
        removed(Bucket::Slots, slot_of(0, 0)),
        removed(Bucket::Slots, slot_of(0, 2)),
        removed(Bucket::Backing, "cloud.main.0".into()),
    ])
}

fn selected_slot(state: &State) -> Option<String> {
    state.views[View::Slots.index()].selected_key.clone()
}

#[test]
fn the_slots_view_selection_follows_the_slot_never_its_index() {
    let mut state = loaded(rules(), sample(), 80, 24);
    // The busy node's slots: 0 and 2 used, 1 and 3 free. Select slot 2.
    press(&mut state, [code(KeyCode::Enter), key('j'), key('j')]);
    assert_eq!(selected_slot(&state), Some(slot_of(0, 2)));
    // Sorted by state, the free slots come first: the selection moves with slot 2.
    press(&mut state, [key('s')]);
    assert_eq!(state.view_state().rows[0], slot_of(0, 1));
    assert_eq!(selected_slot(&state), Some(slot_of(0, 2)));
    // Only the used slots (filtered by requestor): slot 0 (busy) and slot 2.
    let mut msgs = vec![key('/')];
    msgs.extend("ci-job".chars().map(key));
    msgs.push(code(KeyCode::Enter));
    press(&mut state, msgs);
    assert_eq!(state.view_state().rows, vec![slot_of(0, 0), slot_of(0, 2)]);
    // Slot 2's node is released: its row leaves the filtered table. Nothing is selected,
    // never busy slot 0, which now has the row.
    apply_all(
        &mut state,
        [Msg::Feed(vec![Change::Removed {
            bucket: Bucket::Slots,
            key: slot_of(0, 2),
        }])],
    );
    assert_eq!(state.view_state().rows, vec![slot_of(0, 0)]);
    assert_eq!(selected_slot(&state), None);
    let (gone, hidden) = state.unshown().expect("the gone slot is remembered");
    assert_eq!(gone.id, format!("slot 2 of {}", bid(0)));
    assert!(hidden, "the free slot is there, hidden by the filter");
    // X has no target: nothing is sent.
    assert!(press(&mut state, [key('X'), code(KeyCode::Enter)]).is_empty());
    assert_eq!(state.input, Input::None);
    // Its backing node goes away: the slot is no longer there at all.
    apply_all(&mut state, [busy_node_released()]);
    press(&mut state, [code(KeyCode::Esc)]);
    assert_eq!(state.view, View::Slots);
    apply_all(&mut state, [Msg::Tick(NOW + 1)]);
    let (gone, hidden) = state.unshown().expect("the gone slot is remembered");
    assert_eq!(
        (gone.id.as_str(), hidden),
        (&*format!("slot 2 of {}", bid(0)), false)
    );
}

#[test]
fn a_selected_slot_whose_backing_node_goes_away_is_said_to_be_gone() {
    let mut state = loaded(rules(), sample(), 80, 24);
    press(&mut state, [code(KeyCode::Enter), key('j'), key('j')]);
    apply_all(&mut state, [busy_node_released()]);
    assert_eq!(selected_slot(&state), None);
    let status = state.status.clone().expect("a status").text;
    assert_eq!(status, "the selected slot went away: select another");
    // No order lands on a slot of another node.
    assert!(press(&mut state, [key('X'), code(KeyCode::Enter)]).is_empty());
}

#[test]
fn another_backing_node_starts_the_slots_view_afresh() {
    let mut state = loaded(rules(), sample(), 80, 24);
    // Slot 2 of the busy node, then back to the Backing view and down to the idle node.
    press(&mut state, [code(KeyCode::Enter), key('j'), key('j')]);
    press(&mut state, [code(KeyCode::Esc), key('j'), key('3')]);
    assert_eq!(state.view, View::Slots);
    assert_eq!(state.focused().unwrap().id, bid(1));
    // The idle node's first slot, not a leftover of the busy node's.
    assert_eq!(selected_slot(&state), Some(slot_of(1, 0)));
    assert_eq!(state.unshown(), None);
    // Back on the busy node: its first slot again.
    press(&mut state, [key('2'), key('k'), code(KeyCode::Enter)]);
    assert_eq!(selected_slot(&state), Some(slot_of(0, 0)));
}

#[test]
fn enter_on_a_request_selects_its_nodes_slot() {
    let mut state = loaded(rules(), sample(), 80, 24);
    // Slot 3 of the busy node is selected in the Slots view.
    press(&mut state, [code(KeyCode::Enter), key('G')]);
    assert_eq!(selected_slot(&state), Some(slot_of(0, 3)));
    // The fulfilled request's node is in slot 0 of the busy node.
    press(&mut state, [key('4')]);
    let at = (state.view_state().rows.iter())
        .position(|k| k == "req-01")
        .expect("the fulfilled request's row");
    state.views[View::Requests.index()].select(at, |k| Some(k.to_string()));
    press(&mut state, [code(KeyCode::Enter)]);
    assert_eq!(state.view, View::Slots);
    assert_eq!(selected_slot(&state), Some(slot_of(0, 0)));
}

/// The question in `commands`, if any.
fn asked(commands: &[Command]) -> Option<(BackingId, u32, u64)> {
    commands.iter().find_map(|c| match c {
        Command::AskOccupants {
            backing_id,
            slot,
            ask,
        } => Some((backing_id.clone(), *slot, *ask)),
        _ => None,
    })
}

#[test]
fn the_slot_pane_asks_again_for_each_slot_it_shows_and_drops_stale_answers() {
    use slotpool_protocol::api::SlotOccupants;
    let mut state = loaded(rules(), sample(), 100, 40);
    // Slot 0 of the busy node: opening the pane asks.
    press(&mut state, [code(KeyCode::Enter)]);
    let (b, slot, first) = asked(&press(&mut state, [key('i')])).expect("asked on open");
    assert_eq!((b, slot), (bid(0), 0));
    // A free slot: nobody to ask about.
    assert_eq!(asked(&press(&mut state, [key('j')])), None);
    // Slot 2, while the pane is open: asked again, about slot 2.
    let (b, slot, second) = asked(&press(&mut state, [key('j')])).expect("asked on move");
    assert_eq!((b, slot), (bid(0), 2));
    assert_ne!(first, second);
    // The late answer about slot 0 is not shown for slot 2.
    let processes = |n| {
        Ok(SlotOccupants {
            processes: n,
            logins: vec![],
        })
    };
    apply_all(
        &mut state,
        [Msg::Occupants {
            ask: first,
            result: processes(7),
        }],
    );
    let o = state.occupancy.clone().unwrap();
    assert_eq!((o.slot, o.ask, o.answer), (2, second, None));
    apply_all(
        &mut state,
        [Msg::Occupants {
            ask: second,
            result: processes(3),
        }],
    );
    assert_eq!(state.occupancy.clone().unwrap().answer, Some(processes(3)));
    // Nothing new to ask while the selection stays.
    assert_eq!(asked(&apply_all(&mut state, [Msg::Tick(NOW + 1)])), None);
    // Another node in slot 2 (the first released, the slot taken again): asked anew.
    let busy = backing(0, BackingState::Ready, 4);
    let mut next = node(&busy, 2, "ci-job-9", NOW);
    next.id = NodeId::parse(&format!("node-01jq3m8x5v9k2c7t4r6y0a1b99_2_{}", bid(0))).unwrap();
    let commands = apply_all(
        &mut state,
        [Msg::Feed(vec![put(Record::Slot(Box::new(next)))])],
    );
    let (_, slot, third) = asked(&commands).expect("asked about the new node");
    assert_eq!(slot, 2);
    assert!(third > second);
    assert_eq!(state.occupancy.clone().unwrap().answer, None);
    // Closed, it asks nothing; opened again, it asks again.
    assert_eq!(asked(&press(&mut state, [key('i'), key('j')])), None);
    assert!(asked(&press(&mut state, [key('k'), key('i')])).is_some());
}

/// The log tail questions in `commands`: (backing node, question number).
fn log_asks(commands: &[Command]) -> Vec<(BackingId, u64)> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::AskLogTail {
                backing_id, ask, ..
            } => Some((backing_id.clone(), *ask)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_backing_pane_asks_its_agents_log_again_while_open_one_question_at_a_time() {
    let mut state = loaded(rules(), sample(), 100, 40);
    let tick = |state: &mut State, at| log_asks(&apply_all(state, [Msg::Tick(at)]));
    let answer = |state: &mut State, ask, line: &str| {
        log_asks(&apply_all(
            state,
            [Msg::LogTail {
                ask,
                result: Ok(vec![line.to_string()]),
            }],
        ))
    };
    let shown = |state: &State| {
        let log = state.agent_log.clone().unwrap();
        (log.asking, log.answer.unwrap().unwrap().concat())
    };
    let asks = log_asks(&press(&mut state, [key('i')]));
    let [(b, first)] = asks.as_slice() else {
        panic!("opening the pane asks once: {asks:?}")
    };
    assert_eq!(*b, bid(0));
    // Answered at once: asked again LOG_REFRESH_MS after the question, not before.
    assert_eq!(tick(&mut state, NOW + 1), []);
    assert_eq!(answer(&mut state, *first, "one"), []);
    assert_eq!(tick(&mut state, NOW + LOG_REFRESH_MS - 1), []);
    let asks = tick(&mut state, NOW + LOG_REFRESH_MS);
    let [(b, second)] = asks.as_slice() else {
        panic!("a tick asks again once answered: {asks:?}")
    };
    assert_eq!((b, second > first), (&bid(0), true));
    // While that question is out, ticks ask nothing more, however long it takes; the
    // lines shown stay, and a late answer to the first question neither replaces them
    // nor ends the wait.
    assert_eq!(tick(&mut state, NOW + 10 * LOG_REFRESH_MS), []);
    assert_eq!(shown(&state), (Some(*second), "one".into()));
    assert_eq!(answer(&mut state, *first, "late"), []);
    assert_eq!(shown(&state), (Some(*second), "one".into()));
    // A slow answer: the next question goes with it.
    let asks = answer(&mut state, *second, "two");
    assert_eq!(asks.len(), 1, "{asks:?}");
    assert_eq!(shown(&state), (Some(asks[0].1), "two".into()));
    // Closed, the pane asks nothing, however long.
    press(&mut state, [key('i')]);
    assert_eq!(tick(&mut state, NOW + 20 * LOG_REFRESH_MS), []);
}

#[test]
fn a_node_the_records_bring_into_the_pane_is_asked_about_without_a_key() {
    // The backing pane open before any node exists: the first one, selected as it
    // appears, is asked for its log tail in the batch's settle.
    let mut state = loaded(rules(), vec![], 100, 40);
    assert_eq!(log_asks(&press(&mut state, [key('i')])), []);
    let busy = backing(0, BackingState::Ready, 4);
    let commands = apply_all(
        &mut state,
        [Msg::Feed(vec![put(Record::Backing(Box::new(
            busy.clone(),
        )))])],
    );
    assert_eq!(log_asks(&commands).len(), 1, "{commands:?}");
    assert_eq!(log_asks(&commands)[0].0, bid(0));

    // The slot pane open in the Slots view before any node exists: the first node's
    // used first slot is asked about in the same settle that shows it.
    let mut state = loaded(rules(), vec![], 100, 40);
    assert_eq!(asked(&press(&mut state, [key('3'), key('i')])), None);
    let commands = apply_all(
        &mut state,
        [Msg::Feed(vec![
            put(Record::Backing(Box::new(busy.clone()))),
            put(Record::Slot(Box::new(node(&busy, 0, "ci-job-1", NOW)))),
        ])],
    );
    let (b, slot, _) = asked(&commands).expect("asked about the first node's slot 0");
    assert_eq!((b, slot), (bid(0), 0));
}

#[test]
fn an_empty_node_kept_for_min_ready_says_warm_not_a_countdown() {
    // Two empty ready nodes of 2 slots, min-ready 2: as the launcher decides, the first
    // seat is kept for the label's warm slots and the second one counts down.
    let r = small_rules(0, 2);
    let mut changes = Vec::new();
    for seat in [1, 2] {
        let mut b = backing(seat, BackingState::Ready, 2);
        b.idle_since = Some(NOW - 42 * SEC);
        changes.push(put(Record::Agent(Box::new(agent(&b, NOW - SEC)))));
        changes.push(put(Record::Backing(Box::new(b))));
    }
    let state = loaded(r.clone(), changes.clone(), 80, 24);
    assert_eq!(
        state.backing_row("cloud.main.1").unwrap().timer,
        IdleTimer::KeptWarm(2)
    );
    assert_eq!(
        state.backing_row("cloud.main.2").unwrap().timer,
        IdleTimer::ReleaseIn((300 - 42) * SEC)
    );
    // The first node's agent draining: it takes no slots, so the second is kept.
    let mut draining = agent(&backing(1, BackingState::Ready, 2), NOW - SEC);
    draining.draining = true;
    changes.push(put(Record::Agent(Box::new(draining))));
    let state = loaded(r, changes, 80, 24);
    assert_eq!(
        state.backing_row("cloud.main.2").unwrap().timer,
        IdleTimer::KeptWarm(2)
    );
}

#[test]
fn an_empty_node_kept_for_the_warm_window_says_warm_as_long_as_its_arrivals_count() {
    // No min-ready; a warm-window of 10 minutes whose lead equals it: one arrival in the
    // window (a request already finished: it counts all the same) keeps 2 slots ready.
    let mut r = small_rules(0, 0);
    let mut label = r.label("cloud", "main", "small").unwrap();
    let window = std::time::Duration::from_secs(600);
    label.warm = Some((
        slotpool_config::Warm {
            window,
            lead: window,
        },
        8,
    ));
    r.insert("cloud", "main", "small", label);
    let mut b = backing(1, BackingState::Ready, 2);
    b.idle_since = Some(NOW - 42 * SEC);
    let node = vec![
        put(Record::Agent(Box::new(agent(&b, NOW - SEC)))),
        put(Record::Backing(Box::new(b))),
    ];
    let arrived = |at| {
        let mut done = request("req-w1", &["small"], RequestState::Fulfilled, at);
        done.nodes_released_at = Some(at + SEC);
        put(Record::Request(Box::new(done)))
    };
    let timer = |changes: Vec<Change>| {
        loaded(r.clone(), changes, 80, 24)
            .backing_row("cloud.main.1")
            .unwrap()
            .timer
    };
    let within = [node.clone(), vec![arrived(NOW - 60 * SEC)]].concat();
    assert_eq!(timer(within), IdleTimer::KeptWarm(2));
    let before = [node.clone(), vec![arrived(NOW - 700 * SEC)]].concat();
    assert_eq!(
        timer(before),
        IdleTimer::ReleaseIn((300 - 42) * SEC),
        "an arrival older than the window keeps nothing"
    );
    assert_eq!(timer(node), IdleTimer::ReleaseIn((300 - 42) * SEC));
}

#[test]
fn the_kill_dialog_counts_the_jobs_that_fail() {
    let mut state = loaded(rules(), sample(), 80, 24);
    // The busy node holds two of its four slots.
    press(&mut state, [key('K')]);
    let Input::Confirm { order, .. } = &state.input else {
        panic!("no confirmation: {:?}", state.input)
    };
    assert_eq!(
        order,
        &PendingOrder::Kill {
            id: bid(0),
            used: 2,
            slots: 4
        }
    );
    let asked = order.describe();
    assert!(asked.contains("(2 of 4 slots in use)"), "{asked}");
    assert!(asked.contains("2 jobs fail"), "{asked}");
    // The idle node: nothing runs there.
    press(&mut state, [code(KeyCode::Esc), key('j'), key('K')]);
    let Input::Confirm { order, .. } = &state.input else {
        panic!("no confirmation")
    };
    assert!(
        order.describe().contains("No job runs on it"),
        "{}",
        order.describe()
    );
}

#[test]
fn the_totals_count_live_backing_nodes_only() {
    // The sample: busy (4 slots, 2 used), idle (4), failed (4), launching (4).
    let state = loaded(rules(), sample(), 80, 24);
    let t = state.totals();
    assert_eq!((t.backing, t.failed), (3, 1));
    assert_eq!((t.used, t.slots), (2, 12));
    assert_eq!(t.waiting, 1);
    // Killed (failed): its slots and its nodes' slots leave the totals at once.
    let mut killed = backing(0, BackingState::Failed, 4);
    killed.failure = Some("killed by alice: bad disk".into());
    let mut changes = sample();
    changes.push(put(Record::Backing(Box::new(killed))));
    let state = loaded(rules(), changes, 80, 24);
    let t = state.totals();
    assert_eq!((t.backing, t.failed), (2, 2));
    assert_eq!((t.used, t.slots), (0, 8));
}

#[test]
fn a_filter_that_hides_the_selection_selects_the_first_row_left() {
    let mut state = loaded(rules(), sample(), 80, 24);
    assert_eq!(selected_backing(&state), "cloud.main.0");
    // Seat 3 alone matches: it is selected, so an order has a target at once.
    let mut keys = vec![key('/')];
    keys.extend("4r03".chars().map(key));
    keys.push(code(KeyCode::Enter));
    press(&mut state, keys);
    assert_eq!(state.view_state().rows, vec!["cloud.main.3".to_string()]);
    assert_eq!(selected_backing(&state), "cloud.main.3");
    // A filter that keeps the selection keeps it.
    let mut state = loaded(rules(), sample(), 80, 24);
    let mut keys = vec![key('/')];
    keys.extend("small".chars().map(key));
    press(&mut state, keys);
    assert_eq!(selected_backing(&state), "cloud.main.0");
}

#[test]
fn the_detail_pane_scrolls_to_its_last_line_and_back_to_the_top_on_another_row() {
    let mut state = loaded(rules(), sample(), 80, 24);
    press(&mut state, [key('i')]);
    let lines = pane::build(&state).lines.len();
    let page = state.pane_page();
    assert!(
        lines > page,
        "the busy node's pane fits at 80x24: {lines} lines, {page} shown"
    );
    press(&mut state, [key(']')]);
    assert_eq!(state.pane_scroll, page);
    for _ in 0..lines {
        press(&mut state, [key(']')]);
    }
    assert_eq!(state.pane_scroll, lines - page, "scrolled past the end");
    press(
        &mut state,
        [KeyEvent::new(KeyCode::Up, KeyModifiers::SHIFT)],
    );
    assert_eq!(state.pane_scroll, lines - page - 1);
    press(&mut state, [key('[')]);
    assert_eq!(state.pane_scroll, (lines - page - 1).saturating_sub(page));
    // Another row: from the top.
    press(&mut state, [key(']'), key('j')]);
    assert_eq!(state.pane_scroll, 0);
}
