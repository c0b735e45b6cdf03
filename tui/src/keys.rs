//! The edge between the terminal and the reducer: what a key means, given the prompt
//! that is open. The only module besides the event loop that knows crossterm's key types.

use crate::input::{Action, Input};
use crate::rows::View;
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

/// The action `key` asks for while `input` is open, if any.
pub fn action(key: &KeyEvent, input: &Input) -> Option<Action> {
    let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
    if ctrl && key.code == KeyCode::Char('c') {
        return Some(Action::Quit);
    }
    match input {
        // Any key closes the help.
        Input::Help => Some(Action::Cancel),
        Input::Filter { .. } | Input::Confirm { .. } => match key.code {
            KeyCode::Esc => Some(Action::Cancel),
            KeyCode::Enter => Some(Action::Confirm),
            KeyCode::Backspace => Some(Action::DeleteChar),
            KeyCode::Char(c) if !ctrl => Some(Action::TypeChar(c)),
            _ => None,
        },
        Input::None if key.modifiers.contains(KeyModifiers::SHIFT) && key.code == KeyCode::Down => {
            Some(Action::PaneLineDown)
        }
        Input::None if key.modifiers.contains(KeyModifiers::SHIFT) && key.code == KeyCode::Up => {
            Some(Action::PaneLineUp)
        }
        Input::None => table_action(key.code, ctrl),
    }
}

/// What a key means when no prompt is open.
fn table_action(code: KeyCode, ctrl: bool) -> Option<Action> {
    Some(match code {
        KeyCode::Char('q') => Action::Quit,
        KeyCode::Char('?') => Action::Help,
        KeyCode::Char('i') => Action::Details,
        KeyCode::Char(']') => Action::PanePageDown,
        KeyCode::Char('[') => Action::PanePageUp,
        KeyCode::Down | KeyCode::Char('j') => Action::MoveDown,
        KeyCode::Up | KeyCode::Char('k') => Action::MoveUp,
        KeyCode::PageDown => Action::PageDown,
        KeyCode::PageUp => Action::PageUp,
        KeyCode::Char('d') | KeyCode::Char('f') if ctrl => Action::PageDown,
        KeyCode::Char('u') | KeyCode::Char('b') if ctrl => Action::PageUp,
        KeyCode::Home | KeyCode::Char('g') => Action::Top,
        KeyCode::End | KeyCode::Char('G') => Action::Bottom,
        KeyCode::Tab | KeyCode::Right | KeyCode::Char('l') => Action::NextView,
        KeyCode::BackTab | KeyCode::Left | KeyCode::Char('h') => Action::PrevView,
        KeyCode::Char(c @ '1'..='5') => Action::SwitchView(View::ALL[c as usize - '1' as usize]),
        KeyCode::Char('/') => Action::StartFilter,
        KeyCode::Esc => Action::Back,
        KeyCode::Char('s') => Action::CycleSort,
        KeyCode::Char('S') => Action::ReverseSort,
        KeyCode::Enter => Action::Open,
        KeyCode::Char('H') => Action::Hold,
        KeyCode::Char('D') => Action::Drain,
        KeyCode::Char('R') => Action::Run,
        KeyCode::Char('K') => Action::Kill,
        KeyCode::Char('X') => Action::Release,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::PendingOrder;
    use slotpool_protocol::BackingId;

    fn press(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    fn ctrl(c: char) -> KeyEvent {
        KeyEvent::new(KeyCode::Char(c), KeyModifiers::CONTROL)
    }

    #[test]
    fn a_key_means_a_table_action_when_no_prompt_is_open() {
        let none = Input::None;
        let cases = [
            (press(KeyCode::Char('q')), Some(Action::Quit)),
            (press(KeyCode::Char('j')), Some(Action::MoveDown)),
            (press(KeyCode::Up), Some(Action::MoveUp)),
            (ctrl('d'), Some(Action::PageDown)),
            (ctrl('b'), Some(Action::PageUp)),
            (press(KeyCode::Char('d')), None),
            (
                press(KeyCode::Char('3')),
                Some(Action::SwitchView(View::Slots)),
            ),
            (press(KeyCode::BackTab), Some(Action::PrevView)),
            (press(KeyCode::Esc), Some(Action::Back)),
            (press(KeyCode::Enter), Some(Action::Open)),
            (press(KeyCode::Char('X')), Some(Action::Release)),
            (press(KeyCode::Char(']')), Some(Action::PanePageDown)),
            (press(KeyCode::Char('[')), Some(Action::PanePageUp)),
            (
                KeyEvent::new(KeyCode::Down, KeyModifiers::SHIFT),
                Some(Action::PaneLineDown),
            ),
            (
                KeyEvent::new(KeyCode::Up, KeyModifiers::SHIFT),
                Some(Action::PaneLineUp),
            ),
            (ctrl('c'), Some(Action::Quit)),
        ];
        for (key, want) in cases {
            assert_eq!(action(&key, &none), want, "{key:?}");
        }
    }

    #[test]
    fn a_prompt_takes_keys_as_text() {
        let prompts = [
            Input::Filter {
                text: "x".into(),
                before: String::new(),
            },
            Input::Confirm {
                order: PendingOrder::Kill {
                    id: BackingId::parse("bn-x").unwrap(),
                    used: 0,
                    slots: 1,
                },
                reason: String::new(),
            },
        ];
        for input in prompts {
            let cases = [
                (press(KeyCode::Char('q')), Some(Action::TypeChar('q'))),
                (press(KeyCode::Esc), Some(Action::Cancel)),
                (press(KeyCode::Enter), Some(Action::Confirm)),
                (press(KeyCode::Backspace), Some(Action::DeleteChar)),
                (ctrl('u'), None),
                (ctrl('c'), Some(Action::Quit)),
            ];
            for (key, want) in cases {
                assert_eq!(action(&key, &input), want, "{key:?} in {input:?}");
            }
        }
    }

    #[test]
    fn any_key_closes_the_help_but_ctrl_c_quits() {
        assert_eq!(
            action(&press(KeyCode::F(5)), &Input::Help),
            Some(Action::Cancel)
        );
        assert_eq!(action(&ctrl('c'), &Input::Help), Some(Action::Quit));
    }
}
