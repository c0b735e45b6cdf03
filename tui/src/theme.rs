//! Colours, or none: with `NO_COLOR` set (to anything but the empty string) the console
//! uses only bold, underline and reverse video (<https://no-color.org>).

use ratatui::style::{Color, Modifier, Style};
use slotpool_protocol::model::{BackingState, IdleBehaviour, NodeState, RequestState};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Theme {
    pub color: bool,
}

impl Theme {
    /// Colour unless `NO_COLOR` says otherwise.
    pub fn from_env() -> Theme {
        Theme {
            color: std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        }
    }

    pub fn plain() -> Theme {
        Theme { color: false }
    }

    pub fn colored() -> Theme {
        Theme { color: true }
    }

    fn fg(&self, c: Color) -> Style {
        if self.color {
            Style::new().fg(c)
        } else {
            Style::new()
        }
    }

    pub fn title(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }

    pub fn banner(&self) -> Style {
        if self.color {
            Style::new()
                .fg(Color::White)
                .bg(Color::Red)
                .add_modifier(Modifier::BOLD)
        } else {
            Style::new().add_modifier(Modifier::REVERSED | Modifier::BOLD)
        }
    }

    pub fn header_row(&self) -> Style {
        self.fg(Color::Yellow).add_modifier(Modifier::BOLD)
    }

    pub fn selected(&self) -> Style {
        Style::new().add_modifier(Modifier::REVERSED)
    }

    pub fn tab(&self, active: bool) -> Style {
        if active {
            self.fg(Color::Cyan)
                .add_modifier(Modifier::BOLD | Modifier::UNDERLINED)
        } else {
            self.dim()
        }
    }

    pub fn dim(&self) -> Style {
        if self.color {
            Style::new().fg(Color::DarkGray)
        } else {
            Style::new()
        }
    }

    pub fn error(&self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }

    pub fn ok(&self) -> Style {
        self.fg(Color::Green)
    }

    pub fn warn(&self) -> Style {
        self.fg(Color::Yellow)
    }

    pub fn key(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }

    pub fn backing_state(&self, s: BackingState) -> Style {
        match s {
            BackingState::Ready => self.ok(),
            BackingState::Requested | BackingState::Launching => self.warn(),
            BackingState::Retiring | BackingState::Releasing => self.fg(Color::Magenta),
            BackingState::Failed => self.error(),
            BackingState::Gone => self.dim(),
        }
    }

    pub fn idle(&self, i: IdleBehaviour) -> Style {
        match i {
            IdleBehaviour::Run => Style::new(),
            IdleBehaviour::Hold => self.warn().add_modifier(Modifier::BOLD),
            IdleBehaviour::Drain => self.fg(Color::Magenta).add_modifier(Modifier::BOLD),
        }
    }

    pub fn node_state(&self, s: NodeState) -> Style {
        match s {
            NodeState::Ready => self.ok(),
            NodeState::Preparing => self.warn(),
            NodeState::Releasing => self.fg(Color::Magenta),
            NodeState::Failed => self.error(),
        }
    }

    pub fn request_state(&self, s: RequestState) -> Style {
        match s {
            RequestState::Requested => self.warn(),
            RequestState::Fulfilled => self.ok(),
            RequestState::Failed => self.error(),
            RequestState::Canceled => self.dim(),
            RequestState::Reclaimed => self.error(),
        }
    }
}
