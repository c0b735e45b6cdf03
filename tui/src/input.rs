//! Input: the operator's [`Action`]s (what a key means is decided at the edge, in the
//! `keys` module) and the modal prompts that take them — the filter being typed, the
//! help, a destructive order waiting for confirmation with its reason. [`Input::take`]
//! is the prompts' state machine; an action no prompt takes is for the table, and the
//! reducer carries it out.
//!
//! No terminal types here: the reducer never sees a key.

use crate::rows::View;
use slotpool_protocol::model::OperatorAction;
use slotpool_protocol::{BackingId, NodeId};

/// Longest reason an operator can type.
pub const MAX_REASON_CHARS: usize = 200;

/// What the operator asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Quit,
    /// Open the help.
    Help,
    /// Open or close the detail pane of the selected row.
    Details,
    /// Scroll the detail pane a line down or up.
    PaneLineDown,
    PaneLineUp,
    /// Scroll the detail pane a page down or up.
    PanePageDown,
    PanePageUp,
    MoveUp,
    MoveDown,
    PageUp,
    PageDown,
    /// The first row.
    Top,
    /// The last row.
    Bottom,
    NextView,
    PrevView,
    SwitchView(View),
    /// Start typing a filter for the current view.
    StartFilter,
    /// Clear the view's filter, or go back from the Slots view to the backing nodes.
    Back,
    /// Sort by the view's next column.
    CycleSort,
    ReverseSort,
    /// Drill into the selected row.
    Open,
    Hold,
    Drain,
    Run,
    /// Kill the selected backing node (asks for confirmation).
    Kill,
    /// Release the selected slot's node (asks for confirmation).
    Release,
    /// A character typed into the open prompt.
    TypeChar(char),
    /// Delete the prompt's last character.
    DeleteChar,
    /// Accept the open prompt.
    Confirm,
    /// Close the open prompt (or the help).
    Cancel,
}

/// A modal input, if one is open.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    None,
    /// Typing a filter for the current view (applied as typed); `before` is the filter
    /// the prompt opened with, put back by Esc.
    Filter {
        text: String,
        before: String,
    },
    Help,
    /// A destructive order waiting for confirmation, with the reason typed so far.
    Confirm {
        order: PendingOrder,
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum PendingOrder {
    /// Kill a backing node; `used` is how many of its `slots` hold a node when the
    /// order was asked for: the jobs that fail.
    Kill {
        id: BackingId,
        used: u32,
        slots: u32,
    },
    /// Hold, drain or run a backing node; `state` is how it stands when the order was
    /// asked for (its slots in use, what the order does to it now), so the dialog names
    /// the node it will hit.
    Idle {
        action: OperatorAction,
        id: BackingId,
        state: String,
    },
    Release(NodeId),
}

impl PendingOrder {
    pub fn describe(&self) -> String {
        match self {
            PendingOrder::Kill { id, used, slots } => {
                let fail = match used {
                    0 => "No job runs on it.".to_string(),
                    1 => "1 job fails: its node fails and its requestor sees why.".to_string(),
                    n => format!("{n} jobs fail: their nodes fail and their requestors see why."),
                };
                format!(
                    "Kill backing node {id} now ({used} of {slots} slots in use)? {fail} \
                     It is deleted at once."
                )
            }
            PendingOrder::Idle { action, id, state } => {
                let does = match action {
                    OperatorAction::Hold => "It is kept while idle, until Run.",
                    OperatorAction::Drain => "It takes no new slots and is released once empty.",
                    _ => "It takes slots again and is released after its grace-time idle.",
                };
                format!(
                    "{} backing node {id} ({state})? {does}",
                    capitalised(action.as_str())
                )
            }
            PendingOrder::Release(id) => format!("Release node {id}? Its requestor loses it."),
        }
    }
}

fn capitalised(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// What the open prompt did with an action.
#[derive(Clone, Debug, PartialEq)]
pub enum Taken {
    /// No prompt is open: the action is for the table.
    Table(Action),
    /// The prompt took it (typed, ignored, or closed without effect).
    Done,
    /// The view's filter is now this.
    Filter(String),
    /// The order was confirmed, with the reason given, if any.
    Confirmed {
        order: PendingOrder,
        reason: Option<String>,
    },
    /// The confirmation was cancelled.
    Canceled,
}

impl Input {
    /// Gives `action` to the open prompt, if any.
    pub fn take(&mut self, action: Action) -> Taken {
        match std::mem::replace(self, Input::None) {
            Input::None => Taken::Table(action),
            // Any action closes the help.
            Input::Help => Taken::Done,
            // The filter applies as it is typed; Enter keeps it, Esc puts back the one
            // the prompt opened with.
            Input::Filter { mut text, before } => match action {
                Action::Cancel => Taken::Filter(before),
                Action::Confirm => Taken::Done,
                Action::DeleteChar | Action::TypeChar(_) => {
                    match action {
                        Action::TypeChar(c) => text.push(c),
                        _ => _ = text.pop(),
                    }
                    *self = Input::Filter {
                        text: text.clone(),
                        before,
                    };
                    Taken::Filter(text)
                }
                _ => {
                    *self = Input::Filter { text, before };
                    Taken::Done
                }
            },
            Input::Confirm { order, mut reason } => match action {
                Action::Cancel => Taken::Canceled,
                Action::Confirm => Taken::Confirmed {
                    order,
                    reason: Some(reason.trim().to_string()).filter(|r| !r.is_empty()),
                },
                Action::DeleteChar => {
                    reason.pop();
                    *self = Input::Confirm { order, reason };
                    Taken::Done
                }
                Action::TypeChar(c) => {
                    if reason.chars().count() < MAX_REASON_CHARS {
                        reason.push(c);
                    }
                    *self = Input::Confirm { order, reason };
                    Taken::Done
                }
                _ => {
                    *self = Input::Confirm { order, reason };
                    Taken::Done
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_applies_as_typed_and_esc_puts_back_the_old_one() {
        let mut input = Input::Filter {
            text: "o".into(),
            before: "o".into(),
        };
        assert_eq!(
            input.take(Action::TypeChar('a')),
            Taken::Filter("oa".into())
        );
        assert_eq!(
            input.take(Action::TypeChar('b')),
            Taken::Filter("oab".into())
        );
        assert_eq!(input.take(Action::DeleteChar), Taken::Filter("oa".into()));
        assert_eq!(input.take(Action::MoveDown), Taken::Done, "ignored");
        assert_eq!(
            input,
            Input::Filter {
                text: "oa".into(),
                before: "o".into()
            }
        );
        // Enter closes the prompt: the filter is already applied.
        assert_eq!(input.take(Action::Confirm), Taken::Done);
        assert_eq!(input, Input::None);
        input = Input::Filter {
            text: "xy".into(),
            before: "x".into(),
        };
        assert_eq!(input.take(Action::Cancel), Taken::Filter("x".into()));
        assert_eq!(input, Input::None);
    }

    #[test]
    fn a_confirmation_trims_and_caps_its_reason() {
        let order = PendingOrder::Release(NodeId::parse("node-01abc_3_bn-x").unwrap());
        let mut input = Input::Confirm {
            order: order.clone(),
            reason: String::new(),
        };
        for _ in 0..MAX_REASON_CHARS + 5 {
            input.take(Action::TypeChar(' '));
        }
        match &input {
            Input::Confirm { reason, .. } => assert_eq!(reason.len(), MAX_REASON_CHARS),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            input.take(Action::Confirm),
            Taken::Confirmed {
                order,
                reason: None
            }
        );
    }

    #[test]
    fn the_help_closes_on_any_action_and_no_prompt_passes_it_on() {
        let mut input = Input::Help;
        assert_eq!(input.take(Action::Drain), Taken::Done);
        assert_eq!(input, Input::None);
        assert_eq!(input.take(Action::Drain), Taken::Table(Action::Drain));
    }
}
