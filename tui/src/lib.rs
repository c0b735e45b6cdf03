//! `slotpool-console`: the operator's terminal UI.
//!
//! - [`feed`]: one task per KV bucket turns watch changes into messages;
//! - [`state`]: the pure `State` and its reducer `update(state, msg)`, which derives the
//!   view model (pool aggregates, timers, filtered and sorted rows);
//! - [`view`]: draws a `State` with ratatui widgets (only the rows on screen);
//! - [`console`]: the event loop ([`run_console`]), generic over the ratatui backend;
//! - [`rules`]: the label timers and pool sizes taken from the launcher's config;
//! - [`theme`]: colours, or none under `NO_COLOR`.
//!
//! The console never writes state: it reads the buckets and sends operator orders
//! (`slotpool.admin.v1.*`) through the client.

#![forbid(unsafe_code)]

pub mod console;
pub mod feed;
#[cfg(test)]
mod fixtures;
pub mod rules;
pub mod state;
pub mod theme;
pub mod view;

pub use console::{default_actor, run_console, run_on, Outcome, Settings};
pub use rules::Rules;
pub use theme::Theme;
