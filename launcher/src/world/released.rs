//! The nodes that left their slots lately, and whose they were: what lets a release sent
//! again after the first finished be answered as the first was (docs/protocol.md,
//! "Sending a call again"), when the slot is free or holds another node by then.

use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{NodeId, UserName};
use std::collections::{HashMap, VecDeque};

/// How long a node that left its slot is remembered: well past the client's whole
/// time-out, within which it sends a call again.
pub const REMEMBERED_MS: UnixMillis = 10 * 60 * 1000;

/// How many such nodes are remembered at most; the oldest are forgotten first.
pub const MAX_REMEMBERED: usize = 65_536;

/// Nodes that left their slots within [`REMEMBERED_MS`], at most [`MAX_REMEMBERED`],
/// with the client each was handed to.
#[derive(Debug, Default)]
pub struct Released {
    owners: HashMap<NodeId, (Option<UserName>, UnixMillis)>,
    order: VecDeque<NodeId>,
}

impl Released {
    /// Notes that node `id`, handed to `client`, left its slot at `now`.
    pub fn note(&mut self, id: NodeId, client: Option<UserName>, now: UnixMillis) {
        while self.order.len() >= MAX_REMEMBERED
            || self
                .order
                .front()
                .and_then(|oldest| self.owners.get(oldest))
                .is_some_and(|(_, at)| at.saturating_add(REMEMBERED_MS) <= now)
        {
            if let Some(oldest) = self.order.pop_front() {
                self.owners.remove(&oldest);
            }
        }
        if self.owners.insert(id.clone(), (client, now)).is_none() {
            self.order.push_back(id);
        }
    }

    /// Whether node `id` left its slot within [`REMEMBERED_MS`] before `now` and was
    /// `client`'s.
    pub fn was_of(&self, id: &NodeId, client: &UserName, now: UnixMillis) -> bool {
        self.owners.get(id).is_some_and(|(owner, at)| {
            owner.as_ref() == Some(client) && at.saturating_add(REMEMBERED_MS) > now
        })
    }

    /// How many nodes are remembered.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: usize) -> NodeId {
        NodeId::parse(&format!("node-{n}")).unwrap()
    }

    fn user(name: &str) -> UserName {
        UserName::parse(name).unwrap()
    }

    #[test]
    fn a_node_is_remembered_for_its_client_only_and_for_a_while() {
        let mut r = Released::default();
        r.note(node(1), Some(user("ci")), 1_000);
        assert!(r.was_of(&node(1), &user("ci"), 1_000 + REMEMBERED_MS - 1));
        assert!(!r.was_of(&node(1), &user("other"), 1_000));
        assert!(!r.was_of(&node(2), &user("ci"), 1_000));
        assert!(!r.was_of(&node(1), &user("ci"), 1_000 + REMEMBERED_MS));
        // A later note forgets what is too old.
        r.note(node(2), None, 1_000 + REMEMBERED_MS);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn the_memory_is_bounded_and_forgets_the_oldest_first() {
        let mut r = Released::default();
        for n in 0..MAX_REMEMBERED + 10 {
            r.note(node(n), Some(user("ci")), 5);
        }
        assert_eq!(r.len(), MAX_REMEMBERED);
        assert!(!r.was_of(&node(9), &user("ci"), 5));
        assert!(r.was_of(&node(10), &user("ci"), 5));
        assert!(r.was_of(&node(MAX_REMEMBERED + 9), &user("ci"), 5));
    }
}
