//! The detail pane (`i`): everything about the selected row that the table has no room
//! for. For a backing node: who holds each slot, its dirty slots, its last failure, its
//! recent events, its agent's newest log lines (asked of the agent when the pane opens on
//! it) and its whole record; for a pool: why requests wait (capacity held,
//! draining, failed, out of capacity, at max-servers), its provider's last error and the sparklines of its slots
//! used and requests waiting; for a slot: who is in it (asked of its agent when the pane
//! opens) and its record; for a request or an event: its record.
//!
//! Pure: built from the [`State`]; the view only lays it out.

use super::State;
use crate::format::{clock, fmt_duration, node_state_name};
use crate::rows::{PoolRow, View, FOLD_KEY};
use serde::Serialize;
use slotpool_protocol::model::{
    BackingNode, BackingState, Event, IdleBehaviour, Node, ProviderCall,
};
use slotpool_protocol::text::printable;

/// Recent events shown for a backing node or a node.
pub const RECENT_EVENTS: usize = 5;

/// How a line of the pane is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tone {
    Plain,
    Heading,
    Dim,
    Warn,
    Error,
}

/// One line of the pane.
#[derive(Clone, Debug, PartialEq)]
pub struct PaneLine {
    pub text: String,
    pub tone: Tone,
}

/// A sparkline: what it shows and its samples, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct Spark {
    pub label: String,
    pub samples: Vec<u64>,
    /// The top of the scale (the pool's slots, for slots used).
    pub max: Option<u64>,
}

/// What the pane shows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pane {
    pub title: String,
    pub sparks: Vec<Spark>,
    pub lines: Vec<PaneLine>,
}

impl Pane {
    fn line(&mut self, tone: Tone, text: impl Into<String>) {
        self.lines.push(PaneLine {
            text: text.into(),
            tone,
        });
    }
}

/// The pane of the current view's selected row.
pub fn build(state: &State) -> Pane {
    let vs = state.view_state();
    let Some(key) = vs.selected_key.as_deref() else {
        let mut pane = Pane {
            title: " Details ".into(),
            ..Default::default()
        };
        pane.line(Tone::Dim, "nothing selected");
        return pane;
    };
    match state.view {
        View::Pools => state
            .pool_row(key)
            .map(|p| pool_pane(state, p))
            .unwrap_or_default(),
        View::Backing => state
            .backing(key)
            .map(|b| backing_pane(state, b))
            .unwrap_or_default(),
        View::Slots => match state.slot_row(key).and_then(|s| s.node) {
            Some(n) => {
                let mut pane = Pane {
                    title: format!(" Node {} ", n.id),
                    ..Default::default()
                };
                occupants(&mut pane, state, &n);
                events_of(&mut pane, state, |e| e.node_id.as_ref() == Some(&n.id));
                record(&mut pane, state, &n);
                pane
            }
            None => {
                let mut pane = Pane {
                    title: " Free slot ".into(),
                    ..Default::default()
                };
                pane.line(Tone::Dim, "no node in this slot");
                pane
            }
        },
        View::Requests if key == FOLD_KEY => Pane::default(),
        View::Requests => match state.request(key) {
            Some(r) => {
                let mut pane = Pane {
                    title: format!(" Request {} ", r.id),
                    ..Default::default()
                };
                record(&mut pane, state, r);
                pane
            }
            None => Pane::default(),
        },
        View::Events => match state.event(key) {
            Some(e) => {
                let mut pane = Pane {
                    title: " Event ".into(),
                    ..Default::default()
                };
                record(&mut pane, state, e);
                pane
            }
            None => Pane::default(),
        },
    }
}

/// A pool's capacity as it stands: what a waiting request could get and what keeps it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Capacity {
    /// Free slots on ready nodes that run normally.
    pub free: u32,
    /// Held nodes and their free slots (kept by an operator, take no new work).
    pub held: (usize, u32),
    /// Draining nodes and their free slots (take no new work, go once empty).
    pub draining: (usize, u32),
    pub failed: usize,
    /// Nodes requested or launching, and the slots they bring.
    pub coming: (usize, u32),
    /// Nodes retiring or releasing.
    pub leaving: usize,
    /// Nodes the provider said it has no capacity for.
    pub out_of_capacity: usize,
    /// Slots the agents report dirty: never handed out until an operator acts.
    pub dirty: u32,
    /// Nodes counted against max-servers, and max-servers if known.
    pub nodes: usize,
    pub max_servers: Option<u32>,
}

impl Capacity {
    pub fn of(state: &State, p: &PoolRow) -> Capacity {
        let mut c = Capacity {
            max_servers: p.max_servers,
            ..Default::default()
        };
        let mine =
            |b: &&BackingNode| b.provider == p.provider && b.pool == p.pool && b.label == p.label;
        for b in state.backing_nodes().filter(mine) {
            let used = state
                .backing_row(&slotpool_protocol::layout::seat_key(
                    &b.provider,
                    &b.pool,
                    b.seat,
                ))
                .map_or(0, |r| r.used);
            let dirty = state
                .agent(b.id.as_str())
                .map_or(0, |a| a.dirty_slots.len() as u32);
            let free = b.slots.saturating_sub(used).saturating_sub(dirty);
            c.dirty += dirty;
            c.out_of_capacity += usize::from(b.out_of_capacity);
            if b.state != BackingState::Gone {
                c.nodes += 1;
            }
            match (b.state, b.idle) {
                (BackingState::Ready, IdleBehaviour::Run) => c.free += free,
                (BackingState::Ready, IdleBehaviour::Hold) => {
                    c.held.0 += 1;
                    c.held.1 += free;
                }
                (BackingState::Ready, IdleBehaviour::Drain) => {
                    c.draining.0 += 1;
                    c.draining.1 += free;
                }
                (BackingState::Requested | BackingState::Launching, _) => {
                    c.coming.0 += 1;
                    c.coming.1 += b.slots;
                }
                (BackingState::Retiring | BackingState::Releasing, _) => c.leaving += 1,
                (BackingState::Failed, _) => c.failed += 1,
                (BackingState::Gone, _) => {}
            }
        }
        c
    }

    /// Whether max-servers is reached: no more nodes can be launched.
    pub fn at_max(&self) -> bool {
        self.max_servers.is_some_and(|m| self.nodes >= m as usize)
    }

    /// Why a request for this pool's label waits, in a line.
    pub fn why_waiting(&self) -> String {
        if self.free > 0 {
            return format!(
                "{} free slots on running nodes: handed out next pass",
                self.free
            );
        }
        let mut why = Vec::new();
        if self.coming.0 > 0 {
            why.push(format!(
                "{} nodes launching ({} slots coming)",
                self.coming.0, self.coming.1
            ));
        }
        if self.held.1 > 0 {
            why.push(format!("{} slots idle on held nodes", self.held.1));
        }
        if self.draining.1 > 0 {
            why.push(format!(
                "{} slots closed on draining nodes",
                self.draining.1
            ));
        }
        if self.dirty > 0 {
            why.push(format!("{} dirty slots", self.dirty));
        }
        if self.failed > 0 {
            why.push(format!("{} failed nodes take seats", self.failed));
        }
        if self.out_of_capacity > 0 {
            why.push(format!(
                "the provider is out of capacity for {} seats",
                self.out_of_capacity
            ));
        }
        if self.at_max() {
            why.push(format!(
                "max-servers reached ({} of {})",
                self.nodes,
                self.max_servers.unwrap_or(0)
            ));
        }
        if why.is_empty() {
            "no free slot and nothing launching yet".into()
        } else {
            why.join(" · ")
        }
    }
}

fn pool_pane(state: &State, p: &PoolRow) -> Pane {
    let mut pane = Pane {
        title: format!(" {}/{} label {} ", p.provider, p.pool, p.label),
        ..Default::default()
    };
    if let Some(series) = state.history.series(&p.key()) {
        pane.sparks.push(Spark {
            label: format!("used {:>3}", p.used),
            samples: series.used.iter().copied().collect(),
            max: Some(u64::from(p.total.max(1))),
        });
        pane.sparks.push(Spark {
            label: format!("wait {:>3}", p.waiting),
            samples: series.waiting.iter().copied().collect(),
            max: None,
        });
    }
    let c = Capacity::of(state, p);
    if p.waiting > 0 {
        // Free slots are handed out at the next pass only while a launcher passes.
        let why = match state.unattended() {
            Some(u) if c.free > 0 => format!(
                "{} free slots on running nodes, but nobody hands them out: {}",
                c.free,
                u.nobody(state.rules.stall_after())
            ),
            _ => c.why_waiting(),
        };
        pane.line(
            Tone::Warn,
            format!(
                "{} waiting, oldest {}: {}",
                p.waiting,
                p.oldest_wait_ms.map_or("-".into(), fmt_duration),
                why
            ),
        );
    } else {
        pane.line(Tone::Plain, "nothing waiting");
    }
    pane.line(
        Tone::Plain,
        format!(
            "slots {}/{} used · free: {} running, {} on {} held, {} on {} draining · {} dirty",
            p.used, p.total, c.free, c.held.1, c.held.0, c.draining.1, c.draining.0, c.dirty
        ),
    );
    pane.line(
        if c.failed + c.out_of_capacity > 0 {
            Tone::Error
        } else {
            Tone::Plain
        },
        format!(
            "nodes {}/{} max · {} launching · {} leaving · {} failed · {} out of capacity",
            c.nodes,
            c.max_servers.map_or("?".into(), |m| m.to_string()),
            c.coming.0,
            c.leaving,
            c.failed,
            c.out_of_capacity,
        ),
    );
    provider_error(&mut pane, state, &p.provider);
    pane
}

/// Who is in the node's slot, as its agent answered the question asked for this node
/// (an answer about the slot before, or an earlier node in it, is not shown).
fn occupants(pane: &mut Pane, state: &State, n: &Node) {
    let Some(o) = state.occupancy.as_ref().filter(|o| o.node_id == n.id) else {
        pane.line(Tone::Dim, "who is in it: i i asks its agent");
        return;
    };
    match &o.answer {
        None => pane.line(Tone::Dim, "who is in it: asking its agent…"),
        Some(Err(err)) => pane.line(Tone::Warn, format!("who is in it: {err}")),
        Some(Ok(a)) => {
            pane.line(
                Tone::Plain,
                format!(
                    "in it: {} process{} · {} SSH login{}",
                    a.processes,
                    if a.processes == 1 { "" } else { "es" },
                    a.logins.len(),
                    if a.logins.len() == 1 { "" } else { "s" },
                ),
            );
            for l in &a.logins {
                pane.line(
                    Tone::Plain,
                    format!("  {}@{} since {}", l.user, l.from, clock(l.since)),
                );
            }
        }
    }
}

/// The provider's last error, while its last call failed.
fn provider_error(pane: &mut Pane, state: &State, provider: &str) {
    let Some(e) = state.provider_error(provider) else {
        return;
    };
    let call = match e.call {
        ProviderCall::Launch => "launch",
        ProviderCall::Delete => "delete",
        ProviderCall::List => "list",
    };
    pane.line(
        Tone::Error,
        format!(
            "provider {provider}: {} failure{} in a row, the last a {call} {} ago",
            e.failures,
            if e.failures == 1 { "" } else { "s" },
            fmt_duration(state.now.saturating_sub(e.at)),
        ),
    );
    if let Some(until) = e.capacity_until.filter(|u| *u > state.now) {
        pane.line(
            Tone::Warn,
            format!("out of capacity: launches wait until {}", clock(until)),
        );
    }
    pane.line(Tone::Error, e.error.clone());
}

fn backing_pane(state: &State, b: &BackingNode) -> Pane {
    let mut pane = Pane {
        title: format!(" {} ", b.id),
        ..Default::default()
    };
    let agent = state.agent(b.id.as_str());
    let dirty: Vec<u32> = agent.map(|a| a.dirty_slots.clone()).unwrap_or_default();
    let why_dirty = |slot: u32| {
        agent
            .and_then(|a| a.dirty_reasons.get(&slot))
            .map_or("the agent gives no reason".to_string(), |r| r.clone())
    };
    pane.line(Tone::Heading, "slots");
    for s in state.slot_rows(b) {
        match &s.node {
            Some(n) => pane.line(
                Tone::Plain,
                // Who holds it first; the node id (its ULID part) last, where a narrow
                // pane cuts.
                format!(
                    "  {:>2} {} by {}{} · {} {} · {}",
                    s.slot,
                    n.request_id,
                    n.requestor,
                    n.client
                        .as_ref()
                        .map_or(String::new(), |c| format!(" (client {c})")),
                    node_state_name(n.state),
                    s.held_ms.map_or("-".into(), fmt_duration),
                    n.id.as_str().split('_').next().unwrap_or(n.id.as_str()),
                ),
            ),
            None if dirty.contains(&s.slot) => pane.line(
                Tone::Error,
                format!(
                    "  {:>2} dirty: {}; not handed out until an operator acts",
                    s.slot,
                    why_dirty(s.slot)
                ),
            ),
            None => {}
        }
    }
    if let Some(f) = &b.failure {
        pane.line(Tone::Error, format!("last failure: {f}"));
    }
    if b.out_of_capacity {
        pane.line(Tone::Error, "the provider reported no capacity for it");
    }
    events_of(&mut pane, state, |e| e.backing_id.as_ref() == Some(&b.id));
    agent_log(&mut pane, state, b);
    record(&mut pane, state, b);
    pane
}

/// The newest lines of the node's agent log, newest first (the pane cuts at its bottom),
/// with the date left out of each line's time. Control characters are shown escaped,
/// whatever the agent sent: a slot's tenant can put text of its own into that log.
fn agent_log(pane: &mut Pane, state: &State, b: &BackingNode) {
    let Some(log) = state.agent_log.as_ref().filter(|l| l.backing_id == b.id) else {
        return;
    };
    match &log.answer {
        None => pane.line(Tone::Dim, "agent log: asking its agent…"),
        Some(Err(err)) => pane.line(
            Tone::Warn,
            format!("agent log: cannot be reached: {}", printable(err)),
        ),
        Some(Ok(lines)) if lines.is_empty() => pane.line(Tone::Dim, "agent log: empty"),
        Some(Ok(lines)) => {
            pane.line(Tone::Heading, "agent log, newest first");
            for l in lines.iter().rev() {
                pane.line(Tone::Plain, format!("  {}", printable(without_date(l))));
            }
        }
    }
}

/// A log line without the date of its leading RFC 3339 time
/// (`2026-11-24T07:10:00.123456Z  INFO …` → `07:10:00.123456Z  INFO …`).
fn without_date(line: &str) -> &str {
    let b = line.as_bytes();
    let dated = b.len() > 11
        && b[..10].iter().enumerate().all(|(i, c)| {
            if i == 4 || i == 7 {
                *c == b'-'
            } else {
                c.is_ascii_digit()
            }
        })
        && b[10] == b'T';
    if dated {
        &line[11..]
    } else {
        line
    }
}

fn events_of(pane: &mut Pane, state: &State, about: impl Fn(&Event) -> bool) {
    let recent: Vec<&Event> = state
        .events()
        .filter(|e| about(e))
        .take(RECENT_EVENTS)
        .collect();
    if recent.is_empty() {
        return;
    }
    pane.line(Tone::Heading, "recent events");
    for e in recent {
        pane.line(
            Tone::Plain,
            format!("  {} {} (by {})", clock(e.at), e.message, e.actor),
        );
    }
}

/// The record as `key: value` lines: empty fields left out, times as UTC clock and age.
fn record(pane: &mut Pane, state: &State, r: &impl Serialize) {
    pane.line(Tone::Heading, "record");
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(r) else {
        return;
    };
    for (k, v) in fields {
        let text = match &v {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(a) if a.is_empty() => continue,
            serde_json::Value::Object(o) if o.is_empty() => continue,
            serde_json::Value::String(s) if s.is_empty() => continue,
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) if k.ends_with("_at") || k.ends_with("_since") => {
                let at = n.as_u64().unwrap_or(0);
                format!(
                    "{} UTC ({} ago)",
                    clock(at),
                    fmt_duration(state.now.saturating_sub(at))
                )
            }
            other => other.to_string(),
        };
        pane.line(Tone::Dim, format!("  {k}: {text}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::*;
    use crate::mirror::Record;
    use slotpool_protocol::model::{NodeRequest, RequestState};

    fn waiting() -> NodeRequest {
        request("req-w", &["small"], RequestState::Requested, NOW - 30 * SEC)
    }

    #[test]
    fn why_waiting_counts_held_draining_failed_and_out_of_capacity_capacity() {
        let mut held = backing(0, BackingState::Ready, 4);
        held.idle = IdleBehaviour::Hold;
        let mut draining = backing(1, BackingState::Ready, 2);
        draining.idle = IdleBehaviour::Drain;
        let mut failed = backing(2, BackingState::Failed, 4);
        failed.out_of_capacity = true;
        let busy = backing(3, BackingState::Ready, 1);
        let mut changes: Vec<_> = [held, draining, failed, busy.clone()]
            .into_iter()
            .map(|b| put(Record::Backing(Box::new(b))))
            .collect();
        changes.push(put(Record::Slot(Box::new(node(&busy, 0, "ci", NOW)))));
        changes.push(put(Record::Request(Box::new(waiting()))));
        let state = loaded(rules(), changes, 80, 24);
        let p = &state.pools()[0];
        let c = Capacity::of(&state, p);
        assert_eq!(c.free, 0);
        assert_eq!(c.held, (1, 4));
        assert_eq!(c.draining, (1, 2));
        assert_eq!((c.failed, c.out_of_capacity), (1, 1));
        assert!(c.at_max(), "4 nodes of max-servers 4");
        assert_eq!(
            c.why_waiting(),
            "4 slots idle on held nodes · 2 slots closed on draining nodes · 1 failed nodes \
             take seats · the provider is out of capacity for 1 seats · max-servers reached \
             (4 of 4)"
        );
    }

    #[test]
    fn free_slots_on_running_nodes_are_the_answer_first() {
        let changes = vec![
            put(Record::Backing(Box::new(backing(
                0,
                BackingState::Ready,
                4,
            )))),
            put(Record::Request(Box::new(waiting()))),
        ];
        let state = loaded(rules(), changes, 80, 24);
        let c = Capacity::of(&state, &state.pools()[0]);
        assert_eq!(c.free, 4);
        assert!(
            c.why_waiting().starts_with("4 free slots"),
            "{}",
            c.why_waiting()
        );
    }
}
