//! When an idle backing node is released and when it reaches max-age: the one rule the
//! launcher acts on (`lifecycle`) and the console counts down to.

use crate::LabelConfig;
use slotpool_protocol::model::BackingNode;
use slotpool_protocol::time::{after, UnixMillis};
use std::time::Duration;

/// A label's idle timers: the one carrier of grace-time, min-retention-time and max-age
/// from the configuration to the launcher's lifecycle and the console.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IdleRules {
    pub grace_time: Duration,
    pub min_retention_time: Duration,
    /// Zero: no maximum age.
    pub max_age: Duration,
}

impl LabelConfig {
    /// This label's idle timers, as the launcher and the console take them.
    pub fn idle_rules(&self) -> IdleRules {
        IdleRules {
            grace_time: self.grace_time,
            min_retention_time: self.min_retention_time,
            max_age: self.max_age,
        }
    }
}

/// When the node reaches max-age, if it has one: counted from when it became ready (or
/// was launched, or created).
pub fn max_age_at(b: &BackingNode, rules: &IdleRules) -> Option<UnixMillis> {
    (!rules.max_age.is_zero()).then(|| {
        after(
            b.ready_at.or(b.launched_at).unwrap_or(b.created_at),
            rules.max_age,
        )
    })
}

/// When an empty node may be released: grace-time after it became empty (`idle_since`,
/// or now when not recorded yet) or after its last slot came back (`last_release`, as
/// seen by the caller), whichever is later; and never before min-retention-time after
/// launch.
pub fn release_at(
    b: &BackingNode,
    last_release: Option<UnixMillis>,
    now: UnixMillis,
    rules: &IdleRules,
) -> UnixMillis {
    let emptied = b.idle_since.unwrap_or(now).max(last_release.unwrap_or(0));
    let retained = after(
        b.launched_at.unwrap_or(b.created_at),
        rules.min_retention_time,
    );
    after(emptied, rules.grace_time).max(retained)
}

/// The free slots an empty node may count on being there once it is released: those of
/// the other nodes of its label that take slots, where a node in use counts always and
/// an empty one only when it comes before `me` (seat key, slots) in keeping order: the
/// smallest first, then by seat key (as the launcher packs slots), so the big
/// empty nodes are the ones released. Of two empty nodes that could each go on the
/// other's slots, only the later one goes: launchers deciding at once never release both
/// and fall below `min-ready` (which would have the planner launch again, in a loop).
/// `others`: (seat key, slots, slots in use) of every other node of the label that takes
/// slots.
pub fn free_ahead<'a>(me: (&str, u32), others: impl Iterator<Item = (&'a str, u32, u32)>) -> u32 {
    let (my_seat, my_slots) = me;
    others
        .filter(|(seat, slots, used)| *used > 0 || (*slots, *seat) < (my_slots, my_seat))
        .map(|(_, slots, used)| slots.saturating_sub(used))
        .sum()
}
