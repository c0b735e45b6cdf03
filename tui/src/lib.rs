//! `slotpool-console`: the operator's terminal UI.
//!
//! - [`feed`]: one task per KV bucket turns watch changes into messages;
//! - [`mirror`]: the records as the watches show them (epochs, `Synced`, last release);
//! - [`rows`]: the derived rows (pool aggregates, timers, health, filtered and sorted
//!   keys, selection), computed from the mirror, the rules and the time;
//! - [`input`]: the operator's [`input::Action`]s and the prompts that take them (filter,
//!   help, confirmation);
//! - [`keys`]: what a terminal key means (the only crossterm key handling outside the loop);
//! - [`state`]: the pure `State` and its reducer `update(state, msg)`;
//! - [`format`]: names and durations for display; [`layout`]: table rows per screen;
//! - [`history`]: slots used and requests waiting per pool over the last minutes;
//! - [`pane`]: what the detail pane says about the selected row;
//! - [`view`]: draws a `State` with ratatui widgets (only the rows on screen);
//! - [`console`]: the event loop ([`run_console`]), generic over the ratatui backend;
//! - [`rules`]: the label timers and pool sizes taken from the launcher's config;
//! - [`theme`]: colours, or none under `NO_COLOR`.
//!
//! The console never writes state: it reads the buckets and sends operator orders
//! (`slotpool.admin.v2.<operator>.*`) through the client.

#![forbid(unsafe_code)]

pub mod console;
pub mod feed;
#[cfg(test)]
mod fixtures;
pub mod format;
pub mod history;
pub mod input;
pub mod keys;
pub mod layout;
pub mod mirror;
pub mod rows;
pub mod rules;
pub mod state;
pub mod theme;
pub mod view;

pub use console::{run_console, run_on, Outcome, Settings};
pub use rules::Rules;
pub use theme::Theme;
