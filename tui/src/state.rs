//! The console's state and its reducer: [`update`] takes a [`Msg`] (a batch of watch
//! changes, an operator's [`Action`], a tick, an order's result) and changes [`State`];
//! [`State::settle`] then rebuilds the derived rows. The state is made of
//! - the [`Mirror`] of the watched records (`mirror.rs`),
//! - the derived rows and each view's keys and selection (`rows.rs`),
//! - the open prompt ([`Input`], `input.rs`), which takes actions first;
//! - the detail pane built from it ([`pane`]), whose length bounds its scrolling;
//!
//! what no prompt takes is a table action (move, switch view, sort, drill in, order),
//! carried out here.
//!
//! Pure: no NATS, no terminal, no clock. The time is whatever the last [`Msg::Tick`] said,
//! so every timer here is computed from the records and that `now`.

pub mod pane;

use crate::history::History;
use crate::input::{Action, Input, PendingOrder, Taken};
use crate::layout::table_rows;
use crate::mirror::{Change, Mirror};
use crate::rows::{
    self, BackingRow, Facts, Gone, IdleTimer, Index, LauncherRow, PoolRow, PoolScope, SlotRow,
    TenantRow, Unattended, View, ViewState,
};
use crate::rules::Rules;
use slotpool_protocol::api::SlotOccupants;
use slotpool_protocol::model::{
    AgentHeartbeat, BackingNode, BackingState, Event, IdleBehaviour, NodeRequest, OperatorAction,
    ProviderStatus, RequestState,
};
use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{BackingId, NodeId};

/// What the detail pane shows that it asks an agent about.
#[derive(Clone, Debug, PartialEq)]
enum PaneSubject {
    /// A backing node, for its agent's log tail.
    Log(BackingId),
    /// A used slot, for who is in it, and the node in it.
    Slot {
        backing_id: BackingId,
        slot: u32,
        node_id: NodeId,
    },
}

/// Everything that changes the state.
#[derive(Clone, Debug)]
pub enum Msg {
    /// A batch of watch changes (applied together, rendered once).
    Feed(Vec<Change>),
    /// The NATS connection went down (false) or came back (true).
    Link(bool),
    /// What the operator asked for.
    Action(Action),
    /// The terminal's size.
    Resize(u16, u16),
    /// The time now, in ms since the epoch.
    Tick(UnixMillis),
    /// An order came back: `Ok(message)` or `Err(error)`.
    OrderDone {
        what: String,
        result: Result<String, String>,
    },
    /// The answer to [`Command::AskOccupants`] number `ask`.
    Occupants {
        ask: u64,
        result: Result<SlotOccupants, String>,
    },
    /// The answer to [`Command::AskLogTail`] number `ask`: the agent's lines, oldest
    /// first.
    LogTail {
        ask: u64,
        result: Result<Vec<String>, String>,
    },
}

/// What the reducer asks the event loop to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Quit,
    Order {
        action: OperatorAction,
        backing_id: BackingId,
        reason: Option<String>,
    },
    ReleaseNode {
        node_id: NodeId,
        reason: Option<String>,
    },
    /// Ask (through a launcher) who is in slot `slot` of `backing_id`; the answer comes
    /// back as [`Msg::Occupants`] with the same `ask`.
    AskOccupants {
        backing_id: BackingId,
        slot: u32,
        ask: u64,
    },
    /// Ask (through a launcher) for the newest `lines` lines of `backing_id`'s agent log;
    /// the answer comes back as [`Msg::LogTail`] with the same `ask`.
    AskLogTail {
        backing_id: BackingId,
        lines: u32,
        ask: u64,
    },
}

/// Log lines the detail pane asks a backing node's agent for.
pub const LOG_PANE_LINES: u32 = 10;

/// How often the detail pane asks a backing node's agent for its log tail again while it
/// stays open on the node: [`LOG_REFRESH_MS`] after the last question, once its answer
/// came.
pub const LOG_REFRESH_MS: UnixMillis = 2_000;

/// A backing node's agent log tail, as its agent last said: asked when the detail pane
/// comes to show the node (opened, or the selection moved to it by a key or by a change
/// of the records), and again every [`LOG_REFRESH_MS`] while it stays there.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentLog {
    pub backing_id: BackingId,
    /// The question out now, if any: an answer to any other (an earlier one, or one about
    /// a node shown before) is dropped. One at a time.
    pub asking: Option<u64>,
    /// When the last question was asked (the `now` of then).
    pub asked_at: UnixMillis,
    /// The last answer, kept while the next question is out; `None` until the first.
    /// The lines oldest first.
    pub answer: Option<Result<Vec<String>, String>>,
}

/// Who is in a slot, as its agent last said: asked when the detail pane opens on a used
/// slot, and again whenever the pane comes to show another slot or another node in it.
#[derive(Clone, Debug, PartialEq)]
pub struct Occupancy {
    pub backing_id: BackingId,
    pub slot: u32,
    /// The node in the slot when it was asked.
    pub node_id: NodeId,
    /// Which question this is: an answer to any other (an earlier slot's) is dropped.
    pub ask: u64,
    /// `None` while the question is out.
    pub answer: Option<Result<SlotOccupants, String>>,
}

/// The header's figures (see [`State::totals`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Live backing nodes: requested, launching, ready or retiring.
    pub backing: usize,
    /// Failed backing nodes whose record is still kept.
    pub failed: usize,
    /// Slots holding a node, on live backing nodes.
    pub used: u32,
    /// Slots of the live backing nodes.
    pub slots: u32,
    /// Requests waiting.
    pub waiting: usize,
}

/// How long the status line shows a message, and an error.
pub const STATUS_MS: UnixMillis = 5_000;
pub const STATUS_ERROR_MS: UnixMillis = 15_000;

/// One line of the status bar.
#[derive(Clone, Debug, PartialEq)]
pub struct Status {
    pub text: String,
    pub error: bool,
    /// When it was set (the `now` of the last tick then); a tick clears it once it is
    /// [`STATUS_MS`] old ([`STATUS_ERROR_MS`] for an error).
    pub at: UnixMillis,
}

impl Status {
    fn expired(&self, now: UnixMillis) -> bool {
        let ttl = if self.error {
            STATUS_ERROR_MS
        } else {
            STATUS_MS
        };
        now >= self.at.saturating_add(ttl)
    }
}

/// The whole console state.
#[derive(Debug)]
pub struct State {
    pub now: UnixMillis,
    pub rules: Rules,
    /// Where the console is connected (shown in the header).
    pub endpoint: String,
    pub link_up: bool,
    pub view: View,
    pub views: [ViewState; 5],
    pub input: Input,
    pub status: Option<Status>,
    pub size: (u16, u16),
    /// The backing node (by id) whose slots the Slots view shows.
    pub focus: Option<String>,
    /// Whether the detail pane of the selected row is open (`i`).
    pub details: bool,
    /// The detail pane's first line shown (scrolled with `]` `[` and Shift-↓ ↑); back to
    /// the top whenever the pane comes to show another row.
    pub pane_scroll: usize,
    /// The row the pane showed at the last settle (view and selected key), to know when
    /// it shows another.
    pane_row: Option<(View, Option<String>)>,
    /// The operator changed the current view's filter: when it hides the selected row,
    /// the first row shown is selected at the next rebuild (a filter that leaves one
    /// row selects it).
    filter_changed: bool,
    /// Slots used and requests waiting per pool over the last minutes, for sparklines.
    pub history: History,
    /// Who is in the slot the detail pane shows.
    pub occupancy: Option<Occupancy>,
    /// Questions to agents asked so far (numbers them).
    asks: u64,
    /// The agent log tail of the backing node the detail pane shows.
    pub agent_log: Option<AgentLog>,
    mirror: Mirror,
    /// Derived by [`State::settle`].
    index: Index,
    dirty: bool,
}

impl State {
    pub fn new(rules: Rules, endpoint: impl Into<String>) -> State {
        State {
            now: 0,
            rules,
            endpoint: endpoint.into(),
            link_up: true,
            view: View::Backing,
            views: Default::default(),
            input: Input::None,
            status: None,
            size: (80, 24),
            focus: None,
            details: false,
            pane_scroll: 0,
            pane_row: None,
            filter_changed: false,
            history: History::default(),
            occupancy: None,
            asks: 0,
            agent_log: None,
            mirror: Mirror::default(),
            index: Index::default(),
            dirty: true,
        }
    }

    /// Whether every bucket's initial values have arrived.
    pub fn loaded(&self) -> bool {
        self.mirror.loaded()
    }

    pub fn backing_count(&self) -> usize {
        self.mirror.backing_count()
    }

    pub fn pools(&self) -> &[PoolRow] {
        self.facts().pools()
    }

    pub fn view_state(&self) -> &ViewState {
        &self.views[self.view.index()]
    }

    fn view_state_mut(&mut self) -> &mut ViewState {
        &mut self.views[self.view.index()]
    }

    /// Rows of the table body that fit on screen.
    pub fn page_rows(&self) -> usize {
        table_rows(self.size, self.details) as usize
    }

    /// Totals for the header. Only live backing nodes count (requested, launching,
    /// ready, retiring): a failed or killed node's record stays in KV until it is
    /// cleaned up, but its slots are no capacity, and the slots its nodes held count
    /// no longer as used.
    pub fn totals(&self) -> Totals {
        let live = |b: &BackingNode| {
            !matches!(
                b.state,
                BackingState::Failed | BackingState::Releasing | BackingState::Gone
            )
        };
        let mut totals = Totals::default();
        let mut live_ids = std::collections::HashSet::new();
        for (_, b) in self.mirror.backing_nodes() {
            if live(b) {
                totals.backing += 1;
                totals.slots += b.slots;
                live_ids.insert(b.id.as_str());
            } else if b.state == BackingState::Failed {
                totals.failed += 1;
            }
        }
        totals.used = self
            .mirror
            .slots()
            .filter(|n| live_ids.contains(n.backing_id.as_str()))
            .count() as u32;
        totals.waiting = self
            .mirror
            .requests()
            .filter(|(_, r)| r.state == RequestState::Requested)
            .count();
        totals
    }

    /// What the rows are derived from, as of the last settle.
    fn facts(&self) -> Facts<'_> {
        Facts {
            mirror: &self.mirror,
            rules: &self.rules,
            now: self.now,
            index: &self.index,
        }
    }

    /// Rebuilds the derived rows if anything changed since the last call; returns the
    /// question to an agent that what the detail pane shows now calls for, if any (see
    /// [`State::pane_question`]). Called after every change of the state, whatever made
    /// it: a key, a watch batch, a tick.
    pub fn settle(&mut self) -> Option<Command> {
        // A rebuild that focuses the first backing node (one just appeared) leaves the
        // Slots view's rows to a second one.
        for _ in 0..2 {
            if self.dirty {
                self.rebuild();
            }
        }
        let row = Some((self.view, self.view_state().selected_key.clone()));
        if row != self.pane_row {
            self.pane_row = row;
            self.pane_scroll = 0;
        }
        self.pane_question()
    }

    fn rebuild(&mut self) {
        self.dirty = false;
        self.index = Index::build(&self.mirror, &self.rules, self.now);
        // Out of `self` while the facts borrow it.
        let mut views = std::mem::take(&mut self.views);
        let mut went_away = None;
        for view in View::ALL {
            let vs = &mut views[view.index()];
            let facts = self.facts();
            let keys = facts.keys(view, vs, self.focus.as_deref());
            let had_gone = vs.gone.is_some();
            rows::set_rows(view, vs, keys, |k| facts.identity(view, k));
            // A selection that orders act on (a backing node, a slot) just went away.
            let orders = matches!(view, View::Backing | View::Slots);
            // When both went, the current view's is the one said.
            let said = went_away.is_some() && view != self.view;
            let gone = vs.gone.as_ref().is_some_and(|g| !facts.exists(view, g));
            if orders && !said && !had_gone && gone {
                let what = if view == View::Slots {
                    "slot"
                } else {
                    "backing node"
                };
                went_away = Some(format!("the selected {what} went away: select another"));
            }
        }
        self.views = views;
        if std::mem::take(&mut self.filter_changed) {
            let view = self.view;
            let vs = &mut self.views[view.index()];
            if vs.selected_key.is_none() && !vs.rows.is_empty() {
                let mut vs = std::mem::take(vs);
                vs.select(0, |k| self.facts().identity(view, k));
                self.views[view.index()] = vs;
                if view == View::Backing {
                    self.set_focus(self.target_backing().map(|b| b.id.to_string()));
                }
            }
        }
        if let Some(text) = went_away {
            self.set_status(text, false);
        }
        if self.focus.is_none() {
            let first = self.views[View::Backing.index()]
                .selected_key
                .as_ref()
                .and_then(|k| self.mirror.backing(k))
                .map(|b| b.id.to_string());
            if first.is_some() {
                self.set_focus(first);
            }
        }
        let page = self.page_rows().max(1);
        for vs in &mut self.views {
            rows::scroll_into_view(vs, page);
        }
    }

    /// The current view's selected row that is no longer shown, and whether it still
    /// exists (hidden by the filter) rather than having gone away.
    pub fn unshown(&self) -> Option<(&Gone, bool)> {
        let vs = self.view_state();
        let gone = vs.gone.as_ref().filter(|_| vs.selected_key.is_none())?;
        Some((gone, self.facts().exists(self.view, gone)))
    }

    /// The backing node the Slots view is about.
    pub fn focused(&self) -> Option<&BackingNode> {
        self.facts().focused(self.focus.as_deref())
    }

    pub fn slot_rows(&self, b: &BackingNode) -> Vec<SlotRow> {
        self.facts().slot_rows(b)
    }

    /// The Slots view row of `key` (a slot key).
    pub fn slot_row(&self, key: &str) -> Option<SlotRow> {
        self.facts().slot_row(key)
    }

    pub fn pool_row(&self, key: &str) -> Option<&PoolRow> {
        self.facts().pool_row(key)
    }

    /// The tenants' rows (none without a `tenants` section in `--config`).
    pub fn tenant_rows(&self) -> &[TenantRow] {
        self.index.tenants()
    }

    /// One row per launcher whose liveness lease stands.
    pub fn launcher_rows(&self) -> &[LauncherRow] {
        self.index.launchers()
    }

    /// Requests that wait for free slots while no launcher decides, if any.
    pub fn unattended(&self) -> Option<&Unattended> {
        self.index.unattended()
    }

    /// The finished requests (see [`rows::is_finished`]), by state: released, failed and
    /// canceled.
    pub fn finished_requests(&self) -> (usize, usize, usize) {
        let mut n = (0, 0, 0);
        for (_, r) in self.mirror.requests().filter(|(_, r)| rows::is_finished(r)) {
            match r.state {
                RequestState::Failed => n.1 += 1,
                RequestState::Canceled => n.2 += 1,
                _ => n.0 += 1,
            }
        }
        n
    }

    /// The agent heartbeat of backing node `id`.
    pub fn agent(&self, id: &str) -> Option<&AgentHeartbeat> {
        self.mirror.agent(id)
    }

    /// The backing node records, by seat key.
    pub fn backing_nodes(&self) -> impl Iterator<Item = &BackingNode> {
        self.mirror.backing_nodes().map(|(_, b)| b)
    }

    /// The events kept, newest first.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.mirror.events_newest_first().map(|(_, e)| e)
    }

    pub fn request(&self, key: &str) -> Option<&NodeRequest> {
        self.mirror.request(key)
    }

    pub fn event(&self, key: &str) -> Option<&Event> {
        self.mirror.event(key)
    }

    pub fn backing(&self, key: &str) -> Option<&BackingNode> {
        self.mirror.backing(key)
    }

    /// The last error of `provider`, while its last call failed.
    pub fn provider_error(&self, provider: &str) -> Option<&ProviderStatus> {
        self.mirror
            .provider_errors()
            .find(|p| p.provider == provider)
    }

    /// The idle timer of `b` (see [`Facts::idle_timer`]).
    pub fn idle_timer(&self, b: &BackingNode) -> IdleTimer {
        self.facts().idle_timer(b)
    }

    /// The view model of one Backing nodes row.
    pub fn backing_row(&self, key: &str) -> Option<BackingRow> {
        self.facts().backing_row(key)
    }

    /// The selected backing node (Backing view), or the focused one (Slots view).
    /// How `b` stands, for the confirmation of `action` on it.
    fn order_context(&self, b: &BackingNode, action: OperatorAction) -> String {
        let key = slotpool_protocol::layout::seat_key(&b.provider, &b.pool, b.seat);
        let used = self.backing_row(&key).map_or(0, |r| r.used);
        let mut state = format!("{used} of {} slots in use", b.slots);
        let released_now = used == 0
            && b.idle == IdleBehaviour::Hold
            && b.idle_since.is_some()
            && self
                .rules
                .label(&b.provider, &b.pool, &b.label)
                .is_some_and(|r| {
                    let last = self.mirror.last_release(b.id.as_str());
                    slotpool_config::timing::release_at(b, last, self.now, &r.idle) <= self.now
                });
        if action == OperatorAction::Run && released_now {
            state.push_str(", idle past its grace-time: released at once");
        }
        state
    }

    fn target_backing(&self) -> Option<&BackingNode> {
        match self.view {
            View::Backing => self
                .view_state()
                .selected_key
                .as_ref()
                .and_then(|k| self.mirror.backing(k)),
            View::Slots => self.focused(),
            _ => None,
        }
    }

    /// Lines of text the open detail pane shows at once (inside its border, below its
    /// sparklines), at least one.
    pub fn pane_page(&self) -> usize {
        let inner = crate::layout::pane_lines(self.size, true).saturating_sub(2) as usize;
        let sparks = pane::build(self).sparks.len();
        inner.saturating_sub(sparks).max(1)
    }

    /// Scrolls the open detail pane by `delta` lines, within its text.
    fn scroll_pane(&mut self, delta: isize) {
        if !self.details {
            return;
        }
        let lines = pane::build(self).lines.len();
        let last = lines.saturating_sub(self.pane_page());
        self.pane_scroll = self.pane_scroll.saturating_add_signed(delta).min(last);
    }

    fn move_selection(&mut self, delta: isize) {
        if self.view_state().rows.is_empty() {
            return;
        }
        let (view, to) = (self.view, self.view_state().moved(delta));
        let mut vs = std::mem::take(&mut self.views[view.index()]);
        vs.select(to, |k| self.facts().identity(view, k));
        self.views[view.index()] = vs;
        if self.view == View::Backing {
            self.set_focus(self.target_backing().map(|b| b.id.to_string()));
        }
        let page = self.page_rows().max(1);
        rows::scroll_into_view(self.view_state_mut(), page);
    }

    /// Makes `id` the backing node the Slots view shows. Another node starts the Slots
    /// view afresh on its first slot: a slot of the node before is never carried over.
    fn set_focus(&mut self, id: Option<String>) {
        if id != self.focus {
            self.focus = id;
            self.views[View::Slots.index()].reset_selection();
        }
        self.dirty = true;
    }

    /// What the open detail pane shows that only an agent can tell: the log tail of the
    /// selected backing node (Backing view), or who is in the selected used slot (Slots
    /// view).
    fn pane_subject(&self) -> Option<PaneSubject> {
        if !self.details {
            return None;
        }
        match self.view {
            View::Backing => Some(PaneSubject::Log(self.target_backing()?.id.clone())),
            View::Slots => {
                let key = self.view_state().selected_key.as_deref()?;
                let n = self.slot_row(key)?.node?;
                Some(PaneSubject::Slot {
                    backing_id: n.backing_id,
                    slot: n.slot,
                    node_id: n.id,
                })
            }
            _ => None,
        }
    }

    /// The question what the detail pane shows now calls for, against what it last asked:
    /// a node or slot it has not asked about yet (whether a key, a watch batch or a tick
    /// brought it there), or the log tail it shows, again, once the last answer is in and
    /// [`LOG_REFRESH_MS`] have passed since that question. Answers are taken only for the
    /// question asked last.
    fn pane_question(&mut self) -> Option<Command> {
        match self.pane_subject()? {
            PaneSubject::Log(backing_id) => {
                let now = self.now;
                let shown = |l: &AgentLog| l.backing_id == backing_id;
                let wait = |l: &AgentLog| l.asking.is_some() || now < l.asked_at + LOG_REFRESH_MS;
                if self.agent_log.as_ref().is_some_and(|l| shown(l) && wait(l)) {
                    return None;
                }
                // The same node's last lines stay on screen until the next answer.
                let answer = self.agent_log.take().filter(shown).and_then(|l| l.answer);
                self.asks += 1;
                self.agent_log = Some(AgentLog {
                    backing_id: backing_id.clone(),
                    asking: Some(self.asks),
                    asked_at: now,
                    answer,
                });
                Some(Command::AskLogTail {
                    backing_id,
                    lines: LOG_PANE_LINES,
                    ask: self.asks,
                })
            }
            PaneSubject::Slot {
                backing_id,
                slot,
                node_id,
            } => {
                if self
                    .occupancy
                    .as_ref()
                    .is_some_and(|o| o.node_id == node_id)
                {
                    return None;
                }
                self.asks += 1;
                self.occupancy = Some(Occupancy {
                    backing_id: backing_id.clone(),
                    slot,
                    node_id,
                    ask: self.asks,
                    answer: None,
                });
                Some(Command::AskOccupants {
                    backing_id,
                    slot,
                    ask: self.asks,
                })
            }
        }
    }

    fn switch(&mut self, view: View) {
        self.view = view;
        self.dirty = true;
    }

    fn set_status(&mut self, text: impl Into<String>, error: bool) {
        self.status = Some(Status {
            text: text.into(),
            error,
            at: self.now,
        });
    }

    /// Gives `action` to the open prompt, or else carries it out on the table.
    fn act(&mut self, action: Action) -> Option<Command> {
        if action == Action::Quit {
            return Some(Command::Quit);
        }
        match self.input.take(action) {
            Taken::Table(action) => self.table_action(action),
            Taken::Done => None,
            Taken::Filter(text) => {
                self.view_state_mut().filter = text;
                self.dirty = true;
                self.filter_changed = true;
                None
            }
            Taken::Canceled => {
                self.set_status("canceled", false);
                None
            }
            Taken::Confirmed { order, reason } => Some(match order {
                PendingOrder::Kill { id: backing_id, .. } => {
                    self.set_status(format!("kill {backing_id}: sent"), false);
                    Command::Order {
                        action: OperatorAction::Kill,
                        backing_id,
                        reason,
                    }
                }
                PendingOrder::Idle { action, id, .. } => {
                    self.set_status(format!("{} {id}: sent", action.as_str()), false);
                    Command::Order {
                        action,
                        backing_id: id,
                        reason,
                    }
                }
                PendingOrder::Release(node_id) => {
                    self.set_status(format!("release {node_id}: sent"), false);
                    Command::ReleaseNode { node_id, reason }
                }
            }),
        }
    }

    /// An action no prompt took.
    fn table_action(&mut self, action: Action) -> Option<Command> {
        let page = self.page_rows().max(1) as isize;
        match action {
            Action::Quit => return Some(Command::Quit),
            Action::Help => self.input = Input::Help,
            Action::Details => {
                self.details = !self.details;
                self.dirty = true;
                self.pane_scroll = 0;
                // Opened again, it asks again (see `pane_question`).
                self.occupancy = None;
                self.agent_log = None;
            }
            Action::PaneLineDown => self.scroll_pane(1),
            Action::PaneLineUp => self.scroll_pane(-1),
            Action::PanePageDown => self.scroll_pane(self.pane_page() as isize),
            Action::PanePageUp => self.scroll_pane(-(self.pane_page() as isize)),
            Action::MoveDown => self.move_selection(1),
            Action::MoveUp => self.move_selection(-1),
            Action::PageDown => self.move_selection(page),
            Action::PageUp => self.move_selection(-page),
            Action::Top => self.move_selection(isize::MIN / 2),
            Action::Bottom => self.move_selection(isize::MAX / 2),
            Action::NextView => self.switch(View::ALL[(self.view.index() + 1) % View::ALL.len()]),
            Action::PrevView => {
                self.switch(View::ALL[(self.view.index() + View::ALL.len() - 1) % View::ALL.len()])
            }
            Action::SwitchView(view) => self.switch(view),
            Action::StartFilter => {
                let filter = self.view_state().filter.clone();
                self.input = Input::Filter {
                    text: filter.clone(),
                    before: filter,
                }
            }
            Action::Back => {
                if !self.view_state().filter.is_empty() {
                    self.view_state_mut().filter.clear();
                    self.dirty = true;
                } else if self.view_state().pool.is_some() {
                    self.view_state_mut().pool = None;
                    self.dirty = true;
                } else if self.view == View::Slots {
                    self.switch(View::Backing);
                }
            }
            Action::CycleSort => {
                let n = self.view.sorts().len();
                let vs = self.view_state_mut();
                vs.sort = (vs.sort + 1) % n;
                self.dirty = true;
            }
            Action::ReverseSort => {
                let vs = self.view_state_mut();
                vs.reverse = !vs.reverse;
                self.dirty = true;
            }
            Action::Open => self.drill_in(),
            Action::Hold => return self.backing_order(OperatorAction::Hold),
            Action::Drain => return self.backing_order(OperatorAction::Drain),
            Action::Run => return self.backing_order(OperatorAction::Run),
            Action::Kill => match self.target_backing() {
                Some(b) => {
                    let key = slotpool_protocol::layout::seat_key(&b.provider, &b.pool, b.seat);
                    self.input = Input::Confirm {
                        order: PendingOrder::Kill {
                            id: b.id.clone(),
                            used: self.backing_row(&key).map_or(0, |r| r.used),
                            slots: b.slots,
                        },
                        reason: String::new(),
                    }
                }
                None => self.set_status("kill: select a backing node first", true),
            },
            Action::Release => {
                let node = (self.view == View::Slots)
                    .then(|| self.view_state().selected_key.clone())
                    .flatten()
                    .and_then(|k| self.slot_row(&k))
                    .and_then(|r| r.node);
                match node {
                    Some(n) => {
                        self.input = Input::Confirm {
                            order: PendingOrder::Release(n.id),
                            reason: String::new(),
                        }
                    }
                    None => self.set_status("release: select a used slot in the Slots view", true),
                }
            }
            // Prompt actions with no prompt open.
            Action::TypeChar(_) | Action::DeleteChar | Action::Confirm | Action::Cancel => {}
        }
        None
    }

    fn drill_in(&mut self) {
        match self.view {
            View::Pools => {
                let Some(row) = self
                    .view_state()
                    .selected_key
                    .as_ref()
                    .and_then(|k| self.pool_row(k))
                else {
                    return;
                };
                let scope = PoolScope {
                    provider: row.provider.clone(),
                    pool: row.pool.clone(),
                    label: row.label.clone(),
                };
                let backing = &mut self.views[View::Backing.index()];
                backing.pool = Some(scope);
                backing.filter.clear();
                self.switch(View::Backing);
            }
            View::Backing => {
                if let Some(b) = self.target_backing() {
                    self.set_focus(Some(b.id.to_string()));
                    self.switch(View::Slots);
                }
            }
            View::Requests if self.view_state().selected_key.as_deref() == Some(rows::FOLD_KEY) => {
                let vs = self.view_state_mut();
                vs.unfolded = !vs.unfolded;
                self.dirty = true;
            }
            View::Requests => {
                // Show the slot of the request's first node.
                let node = self
                    .view_state()
                    .selected_key
                    .as_ref()
                    .and_then(|k| self.mirror.request(k))
                    .and_then(|r| r.nodes.first().cloned());
                if let Some((backing, slot)) = node.and_then(|n| n.slot()) {
                    self.set_focus(Some(backing.to_string()));
                    let key = slotpool_protocol::layout::slot_key(&backing, slot);
                    let id = self.facts().identity(View::Slots, &key);
                    self.views[View::Slots.index()].choose(key, id);
                    self.switch(View::Slots);
                }
            }
            View::Slots | View::Events => {}
        }
    }

    /// Asks to confirm a hold, drain or run of the selected backing node: the dialog names
    /// the node and how it stands, so an order never hits a row that moved under it.
    fn backing_order(&mut self, action: OperatorAction) -> Option<Command> {
        match self.target_backing() {
            Some(b) => {
                let id = b.id.clone();
                let state = self.order_context(b, action);
                self.input = Input::Confirm {
                    order: PendingOrder::Idle { action, id, state },
                    reason: String::new(),
                };
                None
            }
            None => {
                self.set_status(
                    format!(
                        "{}: select a backing node (Backing or Slots view)",
                        action.as_str()
                    ),
                    true,
                );
                None
            }
        }
    }
}

/// Applies `msg`; returns what the event loop should do, if anything. Call
/// [`State::settle`] before drawing.
pub fn update(state: &mut State, msg: Msg) -> Option<Command> {
    match msg {
        Msg::Feed(changes) => {
            for c in changes {
                if let Some((bucket, error)) = state.mirror.apply(c, state.now) {
                    state.set_status(
                        format!("watch of {bucket:?} failed: {error}; retrying"),
                        true,
                    );
                }
                state.dirty = true;
            }
            None
        }
        Msg::Link(up) => {
            state.link_up = up;
            None
        }
        Msg::Action(action) => state.act(action),
        Msg::Resize(w, h) => {
            state.size = (w, h);
            state.dirty = true;
            None
        }
        Msg::Tick(now) => {
            // Pool ages and timers are derived from `now`; rows only move for a timer sort.
            state.now = now;
            if state.status.as_ref().is_some_and(|s| s.expired(now)) {
                state.status = None;
            }
            if state.loaded() {
                state.history.sample(now, state.index.pools());
            }
            if state.view == View::Pools || state.view_state().sort != 0 {
                state.dirty = true;
            }
            if !state.dirty {
                state
                    .index
                    .refresh_liveness(&state.mirror, &state.rules, now);
            }
            None
        }
        Msg::OrderDone { what, result } => {
            match result {
                Ok(msg) => state.set_status(format!("{what}: {msg}"), false),
                Err(err) => state.set_status(format!("{what} failed: {err}"), true),
            }
            None
        }
        Msg::LogTail { ask, result } => {
            if let Some(l) = state.agent_log.as_mut().filter(|l| l.asking == Some(ask)) {
                l.asking = None;
                l.answer = Some(result);
                state.dirty = true;
            }
            None
        }
        Msg::Occupants { ask, result } => {
            if let Some(o) = state.occupancy.as_mut().filter(|o| o.ask == ask) {
                o.answer = Some(result);
                state.dirty = true;
            }
            None
        }
    }
}

/// Applies every message then settles: the convenient form for tests.
pub fn apply_all(state: &mut State, msgs: impl IntoIterator<Item = Msg>) -> Vec<Command> {
    let mut out: Vec<Command> = msgs.into_iter().filter_map(|m| update(state, m)).collect();
    out.extend(state.settle());
    out
}

#[cfg(test)]
mod tests;
