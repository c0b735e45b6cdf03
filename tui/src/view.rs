//! Drawing: pure functions from [`State`] to a ratatui frame. Tables build only the rows
//! on screen (from the view's scroll offset), so 10,000 backing nodes cost no more to
//! draw than ten.
//!
//! Screen layout, top to bottom: header (or the red connection banner), view tabs, the
//! table with its column header, two detail lines about the selected row, the status
//! line and the key hints. Help and confirmation dialogs are drawn over it.

use crate::format::{fmt_duration, idle_name, node_state_name, request_state_name, state_name};
use crate::input::Input;
use crate::layout::pane_lines;
use crate::rows::{BackingRow, Heartbeat, IdleTimer, PoolRow, TenantRow, View, FOLD_KEY};
use crate::state::pane::{Pane, Tone};
use crate::state::State;
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Clear, Paragraph, Row, Sparkline, Table, Wrap};
use ratatui::Frame;
use slotpool_protocol::model::{BackingState, EventKind, RequestState};

/// At least this wide to show full ids and more columns.
const WIDE: u16 = 120;

/// Draws the whole console.
pub fn draw(frame: &mut Frame, state: &State, theme: &Theme) {
    let area = frame.area();
    let [header, tabs, body, detail, status, keys] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(1),
        Constraint::Length(2),
        Constraint::Length(1),
        Constraint::Length(1),
    ])
    .areas(area);
    draw_header(frame, header, state, theme);
    draw_tabs(frame, tabs, state, theme);
    let [body, pane] = Layout::vertical([
        Constraint::Min(1),
        Constraint::Length(pane_lines((area.width, area.height), state.details)),
    ])
    .areas(body);
    if state.details {
        draw_pane(
            frame,
            pane,
            &crate::state::pane::build(state),
            state.pane_scroll,
            theme,
        );
    }
    match state.view {
        View::Pools => draw_pools(frame, body, state, theme),
        View::Backing => draw_backing(frame, body, state, theme),
        View::Slots => draw_slots(frame, body, state, theme),
        View::Requests => draw_requests(frame, body, state, theme),
        View::Events => draw_events(frame, body, state, theme),
    }
    frame.render_widget(
        Paragraph::new(detail_lines(state, theme)).wrap(Wrap { trim: false }),
        detail,
    );
    draw_status(frame, status, state, theme);
    frame.render_widget(Paragraph::new(key_hints(state, theme)), keys);
    match &state.input {
        Input::Help => draw_help(frame, area, theme),
        Input::Confirm { order, reason } => {
            draw_confirm(frame, area, &order.describe(), reason, theme)
        }
        Input::None | Input::Filter { .. } => {}
    }
}

fn draw_header(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    if !state.link_up {
        let text = " NATS connection lost — reconnecting… (showing the last state seen)";
        frame.render_widget(Paragraph::new(text).style(theme.banner()), area);
        return;
    }
    let t = state.totals();
    // Narrower than WIDE, the title makes room for the figures and the endpoint.
    let title = if area.width < WIDE {
        " slotpool "
    } else {
        " slotpool console "
    };
    let mut spans = vec![Span::styled(title, theme.title())];
    if !state.loaded() {
        spans.push(Span::styled("loading… ", theme.warn()));
    }
    spans.push(Span::raw(format!("│ {} backing", t.backing)));
    if t.failed > 0 {
        spans.push(Span::raw(", "));
        spans.push(Span::styled(format!("{} failed", t.failed), theme.error()));
    }
    spans.push(Span::raw(format!(
        " · {}/{} slots · {} waiting │ ",
        t.used, t.slots, t.waiting
    )));
    // Free slots nobody hands out take the endpoint's place: a stall must not hide.
    match state.unattended() {
        Some(u) => spans.push(Span::styled(
            format!("nobody hands out {} free slots", u.free),
            theme.error(),
        )),
        None => spans.push(Span::raw(state.endpoint.clone())),
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// The launchers' table under the pools: each one's lease age and last pass, marked
/// stalled past `stall-after` (as its `/readyz` is), and the line saying when requests
/// wait for free slots while no launcher decides.
fn draw_launchers(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let wide = area.width >= WIDE;
    let stall_after = state.rules.stall_after();
    let (warning, area) = match state.unattended() {
        Some(u) => {
            let [line, rest] =
                Layout::vertical([Constraint::Length(1), Constraint::Fill(1)]).areas(area);
            (Some((line, u.line(stall_after))), rest)
        }
        None => (None, area),
    };
    if let Some((line, text)) = warning {
        frame.render_widget(Paragraph::new(text).style(theme.error()), line);
    }
    let width = if wide { 36 } else { 20 };
    let cols = [
        col("LAUNCHER", width, 0),
        col("LEASE", 6, 0),
        col("LAST PASS", 9, 0),
        fill("DECIDING", 8, 1),
    ];
    let fitted = Fitted::new(&cols, area.width);
    let header = fitted.headers();
    let widths = fitted.widths();
    let rows: Vec<Row> = state
        .launcher_rows()
        .iter()
        .map(|l| {
            let pass = l.pass_age_ms.map_or("never".into(), fmt_duration);
            let (pass_style, deciding) = if l.stalled {
                (
                    theme.warn(),
                    format!("stalled: past stall-after ({}s)", stall_after.as_secs()),
                )
            } else {
                (Style::new(), "yes".to_string())
            };
            Row::new(fitted.pick(vec![
                Cell::from(short_id(&l.id, width as usize)),
                Cell::from(fmt_duration(l.lease_age_ms)),
                Cell::from(Span::styled(pass, pass_style)),
                Cell::from(Span::styled(deciding, pass_style)),
            ]))
        })
        .collect();
    let empty = rows.is_empty();
    frame.render_widget(
        Table::new(rows, widths)
            .header(Row::new(header).style(theme.header_row()))
            .column_spacing(1),
        area,
    );
    if empty && area.height > 1 {
        let [_, below] = Layout::vertical([Constraint::Length(1), Constraint::Fill(1)]).areas(area);
        frame.render_widget(
            Paragraph::new(" no launcher holds a liveness lease").style(theme.warn()),
            below,
        );
    }
}

/// The view tabs, then the view's sort, pool and filter. When they do not all fit, the
/// other views' tabs shrink to their numbers: the pool and filter in force stay in sight.
fn draw_tabs(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let vs = state.view_state();
    let sort = state.view.sorts()[vs.sort.min(state.view.sorts().len() - 1)];
    let mut right = format!("  sort:{sort}{}", sort_mark(state).1);
    if let Some(pool) = &vs.pool {
        right.push_str(&format!(" pool:{pool}"));
    }
    if !vs.filter.is_empty() {
        right.push_str(&format!(" /{}", vs.filter));
    }
    let tabs = |short: bool| -> Vec<Span<'static>> {
        let mut spans = Vec::new();
        for (i, v) in View::ALL.iter().enumerate() {
            if i > 0 {
                spans.push(Span::styled(" │ ", theme.dim()));
            }
            let current = *v == state.view;
            let title = if short && !current {
                String::new()
            } else if *v == View::Backing && area.width < WIDE {
                " Backing".into()
            } else {
                format!(" {}", v.title())
            };
            spans.push(Span::styled(
                format!("{}{title}", i + 1),
                theme.tab(current),
            ));
        }
        spans
    };
    let mut spans = tabs(false);
    let width: usize = spans.iter().map(|s| s.content.chars().count()).sum();
    if width + right.chars().count() > usize::from(area.width) {
        spans = tabs(true);
    }
    spans.push(Span::styled(right, theme.dim()));
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// The rows of the current view that are on screen: (index in rows, key).
fn visible(state: &State, height: u16) -> impl Iterator<Item = (usize, &String)> {
    let vs = state.view_state();
    let page = height.saturating_sub(1) as usize;
    let start = vs.offset.min(vs.rows.len());
    let end = (start + page).min(vs.rows.len());
    vs.rows[start..end]
        .iter()
        .enumerate()
        .map(move |(i, k)| (start + i, k))
}

/// A table column: its header, its width (the least width for `fill`), and how early it
/// goes when the terminal is too narrow (0: never; higher goes first).
struct Col {
    header: &'static str,
    width: u16,
    fill: bool,
    drop: u8,
}

const fn col(header: &'static str, width: u16, drop: u8) -> Col {
    Col {
        header,
        width,
        fill: false,
        drop,
    }
}

const fn fill(header: &'static str, width: u16, drop: u8) -> Col {
    Col {
        header,
        width,
        fill: true,
        drop,
    }
}

/// The columns of a table that fit in its width, and the cells and widths of those.
struct Fitted<'c> {
    cols: &'c [Col],
    keep: Vec<bool>,
}

impl<'c> Fitted<'c> {
    fn new(cols: &'c [Col], width: u16) -> Self {
        Fitted {
            cols,
            keep: fit(cols, width),
        }
    }

    /// The items of `all` (one per column) whose columns fit.
    fn pick<T>(&self, all: Vec<T>) -> Vec<T> {
        all.into_iter()
            .zip(&self.keep)
            .filter(|(_, k)| **k)
            .map(|(c, _)| c)
            .collect()
    }

    fn headers(&self) -> Vec<Cell<'static>> {
        self.pick(self.cols.iter().map(|c| Cell::from(c.header)).collect())
    }

    fn widths(&self) -> Vec<Constraint> {
        self.pick(
            self.cols
                .iter()
                .map(|c| {
                    if c.fill {
                        Constraint::Fill(1)
                    } else {
                        Constraint::Length(c.width)
                    }
                })
                .collect(),
        )
    }
}

/// Which columns fit in `width`: the ones most willing to go are dropped first.
fn fit(cols: &[Col], width: u16) -> Vec<bool> {
    let mut keep = vec![true; cols.len()];
    loop {
        let need: u16 = cols
            .iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|(c, _)| c.width + 1)
            .sum();
        if need <= width + 1 {
            return keep;
        }
        let Some(i) = (0..cols.len())
            .filter(|i| keep[*i] && cols[*i].drop > 0)
            .max_by_key(|i| (cols[*i].drop, *i))
        else {
            return keep;
        };
        keep[i] = false;
    }
}

/// The column header the current view's sort is by, and the mark it carries: `▾` in
/// the sort's own order, `▴` reversed.
fn sort_mark(state: &State) -> (&'static str, &'static str) {
    let vs = state.view_state();
    let sorts = state.view.sorts();
    let header = match sorts[vs.sort.min(sorts.len() - 1)] {
        "used" => "SLOTS",
        "timer" => "IDLE",
        "time" => "TIME UTC",
        "seat" => "SEAT",
        "pool" => "POOL",
        "waiting" => "WAITING",
        "state" => "STATE",
        "age" => "AGE",
        "label" => "LABEL",
        "slot" => "SLOT",
        "held" => "HELD",
        "requestor" => "REQUESTOR",
        "kind" => "KIND",
        _ => "",
    };
    (header, if vs.reverse { "▴" } else { "▾" })
}

/// A table of the columns that fit in `area`, with `rows` of (cells, selected); the
/// column the view is sorted by carries the sort mark.
fn render_table<'a>(
    frame: &mut Frame,
    area: Rect,
    cols: &[Col],
    rows: Vec<(Vec<Cell<'a>>, bool)>,
    state: &State,
    theme: &Theme,
) {
    let (sorted, mark) = sort_mark(state);
    let fitted = Fitted::new(cols, area.width);
    let header: Vec<Cell> = fitted.pick(
        cols.iter()
            .map(|c| {
                if c.header == sorted {
                    Cell::from(format!("{}{mark}", c.header))
                } else {
                    Cell::from(c.header)
                }
            })
            .collect(),
    );
    let widths = fitted.widths();
    let rows: Vec<Row> = rows
        .into_iter()
        .map(|(cells, selected)| {
            let row = Row::new(fitted.pick(cells));
            if selected {
                row.style(theme.selected())
            } else {
                row
            }
        })
        .collect();
    frame.render_widget(
        Table::new(rows, widths)
            .header(Row::new(header).style(theme.header_row()))
            .column_spacing(1),
        area,
    );
}

fn empty_hint(frame: &mut Frame, area: Rect, text: &str, theme: &Theme) {
    let inner = Rect {
        y: area.y + 1,
        height: area.height.saturating_sub(1),
        ..area
    };
    frame.render_widget(Paragraph::new(format!(" {text}")).style(theme.dim()), inner);
}

/// `id` shortened to `max` characters, keeping its end (a ULID's random part).
pub fn short_id(id: &str, max: usize) -> String {
    let n = id.chars().count();
    if n <= max || max < 4 {
        return id.to_string();
    }
    let prefix: String = id.split_inclusive('-').next().unwrap_or("").to_string();
    let prefix = if prefix.ends_with('-') && prefix.len() < max / 2 {
        prefix
    } else {
        String::new()
    };
    let keep = max - prefix.chars().count() - 1;
    let tail: String = id.chars().skip(n - keep).collect();
    format!("{prefix}…{tail}")
}

/// `used` of `total` as a bar of `width` cells and the figures.
/// Only a full node draws a full bar, and any use at least one cell, however narrow.
pub fn slot_bar(used: u32, total: u32, width: usize) -> String {
    let filled = if total == 0 || used == 0 {
        0
    } else if used >= total {
        width
    } else {
        // One cell short of full at most, and at least one cell if there is room.
        let most = width.saturating_sub(1);
        (used as usize * width)
            .div_ceil(total as usize)
            .clamp(most.min(1), most)
    }
    .min(width);
    format!(
        "{}{} {used}/{total}",
        "█".repeat(filled),
        "░".repeat(width - filled)
    )
}

/// The IDLE column: when an empty node is released, and nothing else.
fn idle_text(row: &BackingRow) -> String {
    match row.timer {
        IdleTimer::ReleaseIn(0) => "due".into(),
        IdleTimer::ReleaseIn(ms) => format!("rel {}", fmt_duration(ms)),
        IdleTimer::IdleFor(ms) => format!("idle {}", fmt_duration(ms)),
        IdleTimer::Held => "never".into(),
        IdleTimer::KeptWarm(_) => "warm".into(),
        IdleTimer::Draining => "at once".into(),
        IdleTimer::None => "-".into(),
    }
}

fn max_age_text(row: &BackingRow) -> String {
    match row.max_age_ms {
        Some(ms) if ms <= 0 => "reached".into(),
        Some(ms) => fmt_duration(ms as u64),
        None => "-".into(),
    }
}

fn heartbeat_text(hb: &Heartbeat) -> String {
    match hb {
        Heartbeat::Missing => "none".into(),
        Heartbeat::Healthy { age_ms } => format!("ok {}", fmt_duration(*age_ms)),
        Heartbeat::Unhealthy { age_ms, .. } => format!("sick {}", fmt_duration(*age_ms)),
        Heartbeat::Impostor { .. } => "impostor".into(),
        Heartbeat::Draining { age_ms } => format!("bye {}", fmt_duration(*age_ms)),
    }
}

fn heartbeat_style(row: &BackingRow, theme: &Theme) -> Style {
    let expected = matches!(row.state, BackingState::Ready | BackingState::Retiring);
    match &row.heartbeat {
        Heartbeat::Healthy { .. } if row.reason.is_none() => theme.ok(),
        Heartbeat::Missing if !expected && row.reason.is_none() => theme.dim(),
        _ => theme.error(),
    }
}

/// The part of a node id that tells nodes apart: its ULID (the slot and backing id it
/// names are shown beside it).
pub fn short_node(id: &str, max: usize) -> String {
    short_id(id.split('_').next().unwrap_or(id), max)
}

fn draw_backing(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let wide = area.width >= WIDE;
    let id_width = if wide { 29 } else { 12 };
    let bar = if wide { 8 } else { 3 };
    let cols = [
        col("ID", id_width as u16, 0),
        col("SEAT", 16, if wide { 6 } else { 9 }),
        col("LABEL", if wide { 12 } else { 7 }, 4),
        col("STATE", 9, 0),
        col("MODE", 5, 1),
        col("SLOTS", bar as u16 + 6, 2),
        col("AGE", 6, 5),
        col("IDLE", 10, 3),
        col("MAX AGE", 8, 8),
        fill("HEALTH", 12, 2),
    ];
    let rows = visible(state, area.height)
        .filter_map(|(i, key)| {
            let r = state.backing_row(key)?;
            // While the link is down the heartbeats seen are old news: say so.
            let mut health = if state.link_up {
                heartbeat_text(&r.heartbeat)
            } else {
                "? link down".into()
            };
            if let Some(reason) = r.reason.as_ref().filter(|_| state.link_up) {
                health = format!("{health}: {reason}");
            }
            let cells = vec![
                Cell::from(short_id(&r.id, id_width)),
                Cell::from(format!("{}/{}/{}", r.provider, r.pool, r.seat)),
                Cell::from(r.label.clone()),
                Cell::from(Span::styled(
                    state_name(r.state),
                    theme.backing_state(r.state),
                )),
                Cell::from(Span::styled(idle_name(r.idle), theme.idle(r.idle))),
                Cell::from(slot_bar(r.used, r.slots, bar)),
                Cell::from(fmt_duration(r.age_ms)),
                Cell::from(idle_text(&r)),
                Cell::from(max_age_text(&r)),
                Cell::from(Span::styled(
                    health,
                    if state.link_up {
                        heartbeat_style(&r, theme)
                    } else {
                        theme.warn()
                    },
                )),
            ];
            Some((cells, state.view_state().is_selected(i)))
        })
        .collect::<Vec<_>>();
    let empty = rows.is_empty();
    render_table(frame, area, &cols, rows, state, theme);
    if empty {
        let text = if state.backing_count() == 0 {
            if state.loaded() {
                "No backing nodes: the pool is empty."
            } else {
                "Loading…"
            }
        } else {
            "No backing node matches the filter or pool (Esc clears it)."
        };
        empty_hint(frame, area, text, theme);
    }
}

/// The detail pane: a box titled with the row, its sparklines (one line each, the label
/// on the left) and its lines from `scroll` on, cut at the box's edges. When the lines do
/// not fit, the bottom border says which are shown and how to scroll.
fn draw_pane(frame: &mut Frame, area: Rect, pane: &Pane, scroll: usize, theme: &Theme) {
    let text_rows = area
        .height
        .saturating_sub(2)
        .saturating_sub(pane.sparks.len() as u16) as usize;
    let scroll = scroll.min(pane.lines.len().saturating_sub(text_rows.max(1)));
    let bottom = if pane.lines.len() > text_rows {
        let last = (scroll + text_rows).min(pane.lines.len());
        format!(
            " lines {}-{last} of {} · ] [ scroll · i closes ",
            scroll + 1,
            pane.lines.len()
        )
    } else {
        " i closes ".to_string()
    };
    let block = Block::bordered()
        .title(pane.title.clone())
        .title_bottom(bottom)
        .border_style(theme.dim());
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let sparks = (pane.sparks.len() as u16).min(inner.height);
    let [top, rest] =
        Layout::vertical([Constraint::Length(sparks), Constraint::Min(0)]).areas(inner);
    for (i, spark) in pane.sparks.iter().enumerate().take(sparks as usize) {
        let row = Rect {
            y: top.y + i as u16,
            height: 1,
            ..top
        };
        let [label, line] =
            Layout::horizontal([Constraint::Length(10), Constraint::Min(0)]).areas(row);
        frame.render_widget(
            Paragraph::new(spark.label.clone()).style(theme.dim()),
            label,
        );
        // The newest samples, as many as fit.
        let shown = &spark.samples[spark.samples.len().saturating_sub(line.width as usize)..];
        let mut widget = Sparkline::default().data(shown).style(theme.ok());
        if let Some(max) = spark.max {
            widget = widget.max(max);
        }
        frame.render_widget(widget, line);
    }
    let lines: Vec<Line> = pane
        .lines
        .iter()
        .map(|l| {
            let style = match l.tone {
                Tone::Plain => Style::new(),
                Tone::Heading => theme.title(),
                Tone::Dim => theme.dim(),
                Tone::Warn => theme.warn(),
                Tone::Error => theme.error(),
            };
            Line::from(Span::styled(format!(" {}", l.text), style))
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).scroll((scroll as u16, 0)), rest);
}

fn pool_states(p: &PoolRow) -> String {
    let names = [
        "requested",
        "launching",
        "ready",
        "retiring",
        "releasing",
        "failed",
    ];
    let parts: Vec<String> = names
        .iter()
        .zip(p.by_state)
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

/// The tenants' table under the pools: what each holds against its share and its
/// max-slots, its open requests, and its p95 wait over the last hour.
fn draw_tenants(frame: &mut Frame, area: Rect, tenants: &[TenantRow], theme: &Theme) {
    let cols = [
        col("TENANT", 14, 0),
        col("WEIGHT", 6, 2),
        col("HELD", 5, 0),
        col("SHARE", 5, 1),
        col("MAX", 5, 1),
        col("WAITING", 8, 0),
        fill("P95 WAIT (1H)", 8, 3),
    ];
    let fitted = Fitted::new(&cols, area.width);
    let header = fitted.headers();
    let widths = fitted.widths();
    let rows: Vec<Row> = tenants
        .iter()
        .map(|t| {
            let over = t.max_slots.is_some_and(|m| t.held >= m);
            Row::new(fitted.pick(vec![
                Cell::from(t.name.clone()),
                Cell::from(t.weight.to_string()),
                Cell::from(Span::styled(
                    t.held.to_string(),
                    if over { theme.warn() } else { Style::new() },
                )),
                Cell::from(t.share.to_string()),
                Cell::from(t.max_slots.map_or("-".into(), |m| m.to_string())),
                Cell::from(Span::styled(
                    t.waiting.to_string(),
                    if t.waiting > 0 {
                        theme.warn()
                    } else {
                        Style::new()
                    },
                )),
                Cell::from(t.p95_wait_ms.map_or("-".into(), fmt_duration)),
            ]))
        })
        .collect();
    frame.render_widget(
        Table::new(rows, widths)
            .header(Row::new(header).style(theme.header_row()))
            .column_spacing(1),
        area,
    );
}

fn draw_pools(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    // The launchers' table (and the line saying nobody acts) takes the bottom, if the
    // pools keep room.
    let launchers =
        state.launcher_rows().len().max(1) + 1 + usize::from(state.unattended().is_some());
    let area = match u16::try_from(launchers) {
        Ok(height) if area.height >= height + 8 => {
            let [pools, _, below] = Layout::vertical([
                Constraint::Fill(1),
                Constraint::Length(1),
                Constraint::Length(height),
            ])
            .areas(area);
            draw_launchers(frame, below, state, theme);
            pools
        }
        _ => area,
    };
    // With tenants configured, their table takes the bottom, if the pools keep room.
    let tenants = state.tenant_rows();
    let area = match u16::try_from(tenants.len() + 1) {
        Ok(height) if !tenants.is_empty() && area.height >= height + 8 => {
            let [pools, _, below] = Layout::vertical([
                Constraint::Fill(1),
                Constraint::Length(1),
                Constraint::Length(height),
            ])
            .areas(area);
            draw_tenants(frame, below, tenants, theme);
            pools
        }
        _ => area,
    };
    let wide = area.width >= WIDE;
    let cols = [
        col("POOL", if wide { 20 } else { 12 }, 0),
        col("LABEL", if wide { 14 } else { 8 }, 0),
        col("NODES", 5, 1),
        col("SLOTS", if wide { 18 } else { 11 }, 2),
        col("WAITING", 8, 1),
        col("OLDEST", 6, 3),
        fill("BACKING NODES BY STATE", 10, 4),
    ];
    let rows = visible(state, area.height)
        .filter_map(|(i, key)| {
            let p = state.pool_row(key)?;
            let states = pool_states(p);
            let failed = p.by_state[5] > 0;
            let pool = format!("{}/{}", p.provider, p.pool);
            let cells = vec![
                // A provider whose last call failed is marked; the pane (`i`) says why.
                if state.provider_error(&p.provider).is_some() {
                    Cell::from(Line::from(vec![
                        Span::styled("! ", theme.error()),
                        Span::raw(pool),
                    ]))
                } else {
                    Cell::from(pool)
                },
                Cell::from(p.label.clone()),
                Cell::from(format!(
                    "{}/{}",
                    p.nodes(),
                    p.max_servers.map_or("?".into(), |m| m.to_string())
                )),
                Cell::from(slot_bar(p.used, p.total, if wide { 10 } else { 4 })),
                Cell::from(Span::styled(
                    p.waiting.to_string(),
                    if p.waiting > 0 {
                        theme.warn()
                    } else {
                        Style::new()
                    },
                )),
                Cell::from(p.oldest_wait_ms.map_or("-".into(), fmt_duration)),
                Cell::from(Span::styled(
                    states,
                    if failed { theme.error() } else { Style::new() },
                )),
            ];
            Some((cells, state.view_state().is_selected(i)))
        })
        .collect::<Vec<_>>();
    let empty = rows.is_empty();
    render_table(frame, area, &cols, rows, state, theme);
    if empty {
        empty_hint(
            frame,
            area,
            if state.loaded() {
                "No pools yet: nothing in KV (with --config, configured pools show too)."
            } else {
                "Loading…"
            },
            theme,
        );
    }
}

fn draw_slots(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let wide = area.width >= WIDE;
    let node_width = if wide { 31 } else { 13 };
    let cols = [
        col("SLOT", 5, 0),
        col("NODE", node_width as u16, 0),
        col("STATE", 9, 0),
        col("REQUESTOR", if wide { 30 } else { 18 }, 2),
        col("HELD", 6, 1),
        fill("FAILURE", 10, 3),
    ];
    let [title, rest] = Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(area);
    let Some(b) = state.focused() else {
        render_table(frame, rest, &cols, vec![], state, theme);
        empty_hint(
            frame,
            rest,
            "No backing node selected: pick one in the Backing view and press Enter.",
            theme,
        );
        return;
    };
    let rows = visible(state, rest.height)
        .filter_map(|(i, key)| {
            let s = state.slot_row(key)?;
            let cells = match &s.node {
                Some(n) => vec![
                    Cell::from(s.slot.to_string()),
                    Cell::from(short_node(n.id.as_str(), node_width)),
                    Cell::from(Span::styled(
                        node_state_name(n.state),
                        theme.node_state(n.state),
                    )),
                    Cell::from(n.requestor.clone()),
                    Cell::from(s.held_ms.map_or("-".into(), fmt_duration)),
                    Cell::from(Span::styled(
                        n.failure.clone().unwrap_or_default(),
                        theme.error().remove_modifier(Modifier::BOLD),
                    )),
                ],
                None => {
                    let mut cells = vec![
                        Cell::from(s.slot.to_string()),
                        Cell::from(Span::styled("free", theme.dim())),
                    ];
                    cells.extend((0..4).map(|_| Cell::from("")));
                    cells
                }
            };
            Some((cells, state.view_state().is_selected(i)))
        })
        .collect::<Vec<_>>();
    frame.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled(format!(" {} ", b.id), theme.title()),
            Span::styled(state_name(b.state), theme.backing_state(b.state)),
            Span::raw(format!(" · {} · mode: ", b.label)),
            Span::styled(idle_name(b.idle), theme.idle(b.idle)),
        ])),
        title,
    );
    render_table(frame, rest, &cols, rows, state, theme);
}

fn draw_requests(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let wide = area.width >= WIDE;
    let id_width = if wide { 30 } else { 12 };
    let cols = [
        col("ID", id_width as u16, 0),
        col("LABELS", if wide { 16 } else { 12 }, 2),
        col("REQUESTOR", if wide { 24 } else { 12 }, 3),
        col("AGE", 6, 1),
        col("STATE", 9, 0),
        fill("STATUS / FAILURE", 10, 4),
    ];
    let rows = visible(state, area.height)
        .filter_map(|(i, key)| {
            if key == FOLD_KEY {
                return Some((fold_row(state, theme), state.view_state().is_selected(i)));
            }
            let r = state.request(key)?;
            let detail = match r.state {
                RequestState::Failed => r.failure.clone().unwrap_or_else(|| r.status.clone()),
                _ => r.status.clone(),
            };
            let cells = vec![
                Cell::from(short_id(r.id.as_str(), id_width)),
                Cell::from(r.labels.join(",")),
                Cell::from(r.requestor.clone()),
                Cell::from(fmt_duration(state.now.saturating_sub(r.created_at))),
                Cell::from(Span::styled(
                    if crate::rows::is_finished(r) && r.state == RequestState::Fulfilled {
                        "released"
                    } else {
                        request_state_name(r.state)
                    },
                    theme.request_state(r.state),
                )),
                Cell::from(detail),
            ];
            Some((cells, state.view_state().is_selected(i)))
        })
        .collect::<Vec<_>>();
    let empty = rows.is_empty();
    render_table(frame, area, &cols, rows, state, theme);
    if empty {
        empty_hint(frame, area, "No requests.", theme);
    }
}

/// The Requests view's row the finished requests fold into (their counts are on the
/// detail lines when it is selected).
fn fold_row<'a>(state: &State, theme: &Theme) -> Vec<Cell<'a>> {
    let (released, failed, canceled) = state.finished_requests();
    let (mark, verb) = if state.view_state().unfolded {
        ("▾", "folds")
    } else {
        ("▸", "shows")
    };
    let mut cells = vec![Cell::from(Span::styled(
        format!("{mark} {} finished", released + failed + canceled),
        theme.dim(),
    ))];
    cells.extend((0..4).map(|_| Cell::from("")));
    cells.push(Cell::from(Span::styled(
        format!("Enter {verb} them"),
        theme.dim(),
    )));
    cells
}

pub use crate::format::clock;

fn draw_events(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let wide = area.width >= WIDE;
    let id_width = if wide { 29 } else { 12 };
    let actor_width = if wide { 24 } else { 12 };
    let cols = [
        col("TIME UTC", 9, 0),
        col("KIND", 8, 2),
        col("ACTOR", actor_width as u16, 3),
        col("BACKING", id_width as u16, 1),
        fill("MESSAGE", 12, 0),
    ];
    let rows = visible(state, area.height)
        .filter_map(|(i, key)| {
            let e = state.event(key)?;
            let (kind, style) = match e.kind {
                EventKind::Operator => ("operator", theme.warn()),
                EventKind::Backing => ("backing", Style::new()),
            };
            let cells = vec![
                Cell::from(clock(e.at)),
                Cell::from(Span::styled(kind, style)),
                // A launcher's id keeps its random end, not the prefix all share.
                Cell::from(short_id(&e.actor, actor_width)),
                Cell::from(
                    e.backing_id
                        .as_ref()
                        .map_or(String::new(), |b| short_id(b.as_str(), id_width)),
                ),
                Cell::from(e.message.clone()),
            ];
            Some((cells, state.view_state().is_selected(i)))
        })
        .collect::<Vec<_>>();
    let empty = rows.is_empty();
    render_table(frame, area, &cols, rows, state, theme);
    if empty {
        empty_hint(frame, area, "No events yet.", theme);
    }
}

fn detail_lines<'a>(state: &'a State, theme: &Theme) -> Vec<Line<'a>> {
    if let Some((gone, hidden)) = state.unshown() {
        let why = if hidden {
            "is hidden by the filter"
        } else {
            "went away"
        };
        return vec![Line::from(Span::styled(
            format!(" {} {why}: nothing is selected (↑ ↓ select a row)", gone.id),
            theme.warn(),
        ))];
    }
    let key = state.view_state().selected_key.clone().unwrap_or_default();
    match state.view {
        View::Pools => match state.pool_row(&key) {
            Some(p) => vec![
                Line::from(format!(
                    " {}/{} label {}: max-servers {} · {} slots used of {}",
                    p.provider,
                    p.pool,
                    p.label,
                    p.max_servers
                        .map_or("unknown (no --config)".into(), |m| m.to_string()),
                    p.used,
                    p.total
                )),
                Line::from(format!(" backing nodes: {}", pool_states(p))),
            ],
            None => vec![],
        },
        View::Backing => match state.backing_row(&key) {
            Some(r) => backing_detail(state, &r, theme),
            None => vec![],
        },
        View::Slots => {
            let node = state.slot_row(&key).and_then(|s| s.node);
            match node {
                Some(n) => vec![
                    Line::from(format!(" {} · request {}", n.id, n.request_id)),
                    Line::from(format!(
                        " host {} · workspace {}{}",
                        if n.host.is_empty() { "?" } else { &n.host },
                        n.workspace.as_deref().unwrap_or("-"),
                        n.failure
                            .as_ref()
                            .map_or(String::new(), |f| format!(" · failed: {f}"))
                    )),
                ],
                None => state
                    .focused()
                    .and_then(|b| {
                        state.backing_row(&slotpool_protocol::layout::seat_key(
                            &b.provider,
                            &b.pool,
                            b.seat,
                        ))
                    })
                    .map_or_else(Vec::new, |row| backing_detail(state, &row, theme)),
            }
        }
        View::Requests if key == FOLD_KEY => {
            let (released, failed, canceled) = state.finished_requests();
            vec![
                Line::from(format!(
                    " finished requests: {released} released, {failed} failed, {canceled} canceled"
                )),
                Line::from(Span::styled(
                    format!(
                        " each leaves KV {} after it ends",
                        fmt_duration(slotpool_protocol::layout::FINISHED_REQUEST_TTL_SECS * 1000)
                    ),
                    theme.dim(),
                )),
            ]
        }
        View::Requests => match state.request(&key) {
            Some(r) => vec![
                Line::from(format!(
                    " {} · priority {} · {}",
                    r.id,
                    r.priority,
                    r.failure.as_deref().unwrap_or(&r.status)
                )),
                Line::from(if r.nodes.is_empty() {
                    " no nodes yet".to_string()
                } else {
                    format!(
                        " nodes: {}",
                        r.nodes
                            .iter()
                            .map(|n| n.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }),
            ],
            None => vec![],
        },
        View::Events => match state.event(&key) {
            Some(e) => vec![
                Line::from(format!(" {}", e.message)),
                Line::from(format!(
                    " by {}{}{}",
                    e.actor,
                    e.backing_id
                        .as_ref()
                        .map_or(String::new(), |b| format!(" · backing {b}")),
                    e.node_id
                        .as_ref()
                        .map_or(String::new(), |n| format!(" · node {n}"))
                )),
            ],
            None => vec![],
        },
    }
}

fn backing_detail<'a>(state: &State, r: &BackingRow, theme: &Theme) -> Vec<Line<'a>> {
    let mut first = vec![Span::raw(format!(
        " {} · {}/{} seat {} · {} of {} slots used",
        r.id, r.provider, r.pool, r.seat, r.used, r.slots
    ))];
    if let Some(o) = &r.order {
        first.push(Span::styled(format!(" · last order: {o}"), theme.warn()));
    }
    let mut timers = Vec::new();
    match r.timer {
        IdleTimer::ReleaseIn(ms) => timers.push(format!("empty: released in {}", fmt_duration(ms))),
        IdleTimer::IdleFor(ms) => timers.push(format!(
            "empty for {} (grace-time unknown: start with --config)",
            fmt_duration(ms)
        )),
        IdleTimer::Held => timers.push("held: never released automatically".into()),
        IdleTimer::KeptWarm(n) => timers.push(format!(
            "empty: kept warm, its free slots are part of the {n} its label keeps ready"
        )),
        IdleTimer::Draining => timers.push("draining: released as soon as empty".into()),
        IdleTimer::None => {}
    }
    if let Some(ms) = r.retained_ms {
        timers.push(format!("min-retention {} left", fmt_duration(ms)));
    }
    match r.max_age_ms {
        Some(ms) if ms <= 0 => timers.push("max-age reached".into()),
        Some(ms) => timers.push(format!("max-age in {}", fmt_duration(ms as u64))),
        None => {}
    }
    let mut second = vec![Span::raw(format!(" {}", timers.join(" · ")))];
    if let Some(reason) = &r.reason {
        if !timers.is_empty() {
            second.push(Span::raw(" · "));
        }
        second.push(Span::styled(reason.clone(), theme.error()));
    }
    if timers.is_empty() && r.reason.is_none() && !state.rules.is_known() {
        second = vec![Span::styled(
            " timers: start with --config to see grace-time and max-age countdowns",
            theme.dim(),
        )];
    }
    vec![Line::from(first), Line::from(second)]
}

fn draw_status(frame: &mut Frame, area: Rect, state: &State, theme: &Theme) {
    let line = match &state.input {
        Input::Filter { text, .. } => Line::from(vec![
            Span::styled(" filter /", theme.key()),
            Span::raw(format!("{text}▏")),
            Span::styled("  Enter keep · Esc undo", theme.dim()),
        ]),
        _ => match &state.status {
            Some(s) => Line::from(Span::styled(
                format!(" {}", s.text),
                if s.error { theme.error() } else { theme.ok() },
            )),
            None => Line::from(""),
        },
    };
    frame.render_widget(Paragraph::new(line), area);
}

fn key_hints<'a>(state: &State, theme: &Theme) -> Line<'a> {
    let hints: &[(&str, &str)] = match state.view {
        View::Backing => &[
            ("Enter", "slots"),
            ("H", "hold"),
            ("D", "drain"),
            ("R", "run"),
            ("K", "kill"),
            ("/", "filter"),
            ("s", "sort"),
            ("Tab", "view"),
            ("?", "help"),
            ("q", "quit"),
        ],
        View::Slots => &[
            ("X", "release slot"),
            ("H/D/R/K", "node"),
            ("Esc", "back"),
            ("/", "filter"),
            ("s", "sort"),
            ("Tab", "view"),
            ("?", "help"),
            ("q", "quit"),
        ],
        View::Pools => &[
            ("Enter", "its nodes"),
            ("i", "why waiting"),
            ("/", "filter"),
            ("s", "sort"),
            ("Tab", "view"),
            ("?", "help"),
            ("q", "quit"),
        ],
        View::Requests => &[
            ("Enter", "its slots"),
            ("i", "details"),
            ("/", "filter"),
            ("s", "sort"),
            ("Tab", "view"),
            ("?", "help"),
            ("q", "quit"),
        ],
        View::Events => &[
            ("i", "details"),
            ("/", "filter"),
            ("s", "sort"),
            ("Tab", "view"),
            ("?", "help"),
            ("q", "quit"),
        ],
    };
    let mut spans = Vec::new();
    for (k, what) in hints {
        spans.push(Span::styled(format!(" {k}"), theme.key()));
        spans.push(Span::raw(format!(" {what}")));
    }
    Line::from(spans)
}

/// Every key, for the help screen (and the README).
pub const HELP: &[(&str, &str)] = &[
    ("↑ ↓  j k", "move the selection"),
    ("PgUp PgDn  Ctrl-u Ctrl-d", "a page up or down"),
    ("Home End  g G", "first or last row"),
    ("Tab Shift-Tab  ← →  h l", "next or previous view"),
    ("1 2 3 4 5", "Pools, Backing, Slots, Requests, Events"),
    ("Enter", "pool → its nodes, node → its slots; unfold"),
    ("Esc", "clear filter, then pool; back from Slots"),
    ("/", "filter as you type (Esc undoes)"),
    ("s  S", "next sort column; reverse the order"),
    ("H", "hold: no new slots, never released"),
    ("D", "drain: no new slots, released once empty"),
    ("R", "run: back to normal"),
    ("K", "kill the backing node now (confirms)"),
    ("X", "release the selected slot (confirms)"),
    ("i", "details: record, slots, events, why waiting"),
    ("] [  Shift-↓ ↑", "scroll the details a page or a line"),
    ("?", "this help"),
    ("q  Ctrl-c", "quit"),
];

fn centered(area: Rect, width: u16, height: u16) -> Rect {
    let width = width.min(area.width);
    let height = height.min(area.height);
    Rect {
        x: area.x + (area.width - width) / 2,
        y: area.y + (area.height - height) / 2,
        width,
        height,
    }
}

fn draw_help(frame: &mut Frame, area: Rect, theme: &Theme) {
    let popup = centered(area, 72, HELP.len() as u16 + 2);
    let lines: Vec<Line> = HELP
        .iter()
        .map(|(k, what)| {
            Line::from(vec![
                Span::styled(format!(" {k:<24} "), theme.key()),
                Span::raw(*what),
            ])
        })
        .collect();
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::bordered()
                .title(" Keys ")
                .title_bottom(" any key closes "),
        ),
        popup,
    );
}

fn draw_confirm(frame: &mut Frame, area: Rect, question: &str, reason: &str, theme: &Theme) {
    // Tall enough for the question as it wraps (words move whole, so allow a spare line),
    // the reason and the keys: the "Enter confirm" line is never cut off.
    let inner_width = usize::from(70.min(area.width).saturating_sub(2)).max(1);
    let question_lines = question.chars().count().div_ceil(inner_width) + 1;
    let popup = centered(area, 70, (question_lines + 6) as u16);
    let lines = vec![
        Line::from(Span::styled(question.to_string(), theme.error())),
        Line::from(""),
        Line::from(vec![
            Span::raw("Reason (optional): "),
            Span::styled(
                format!("{reason}▏"),
                Style::new().add_modifier(Modifier::UNDERLINED),
            ),
        ]),
        Line::from(""),
        Line::from(vec![
            Span::styled("Enter", theme.key()),
            Span::raw(" confirm   "),
            Span::styled("Esc", theme.key()),
            Span::raw(" cancel"),
        ]),
    ];
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: true })
            .block(Block::bordered().title(" Confirm ")),
        popup,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::*;
    use crate::mirror::Bucket;
    use crate::mirror::{Change, Record};
    use crate::rules::Rules;
    use crate::state::{apply_all, Msg};
    use crossterm::event::KeyCode;
    use ratatui::backend::TestBackend;
    use ratatui::style::Color;
    use ratatui::Terminal;
    use slotpool_protocol::model::{OperatorAction, OperatorOrder, ProviderCall, ProviderStatus};

    fn render(state: &State, theme: &Theme) -> Terminal<TestBackend> {
        let mut t = Terminal::new(TestBackend::new(state.size.0, state.size.1)).unwrap();
        t.draw(|f| draw(f, state, theme)).unwrap();
        t
    }

    fn screen(state: &State) -> String {
        render(state, &Theme::plain()).backend().to_string()
    }

    fn sample_state(w: u16, h: u16) -> State {
        let mut changes = sample();
        // An operator's order on the idle node.
        if let Change::Put {
            record: Record::Backing(b),
            ..
        } = &mut changes[1]
        {
            b.idle = slotpool_protocol::model::IdleBehaviour::Hold;
            b.order = Some(OperatorOrder {
                action: OperatorAction::Hold,
                actor: "alice@ops".into(),
                reason: Some("kernel update".into()),
                at: NOW - 10 * SEC,
            });
        }
        loaded(rules(), changes, w, h)
    }

    #[test]
    fn backing_view_80x24() {
        insta::assert_snapshot!(screen(&sample_state(80, 24)));
    }

    #[test]
    fn backing_view_wide() {
        insta::assert_snapshot!(screen(&sample_state(160, 30)));
    }

    #[test]
    fn backing_view_without_config_shows_idle_times() {
        let state = loaded(Rules::unknown(), sample(), 80, 24);
        let mut state = state;
        press(&mut state, [key('j')]);
        insta::assert_snapshot!(screen(&state));
    }

    #[test]
    fn backing_view_an_empty_node_kept_for_min_ready() {
        let r = small_rules(0, 8);
        let mut state = loaded(r, sample(), 80, 24);
        press(&mut state, [key('j')]);
        let text = screen(&state);
        assert!(text.contains("kept warm"), "{text}");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn failed_node_selected() {
        let mut state = sample_state(80, 24);
        press(&mut state, [key('j'), key('j')]);
        let text = screen(&state);
        assert!(text.contains("agent heartbeat expired"), "{text}");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn selected_node_gone() {
        let mut state = sample_state(80, 24);
        press(&mut state, [key('j')]);
        apply_all(
            &mut state,
            [Msg::Feed(vec![Change::Removed {
                bucket: Bucket::Backing,
                key: "cloud.main.1".into(),
            }])],
        );
        let text = screen(&state);
        assert!(text.contains("went away: nothing is selected"), "{text}");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn detail_pane_of_a_busy_node() {
        let mut state = sample_state(80, 24);
        // Its agent reports slot 3 dirty.
        let b = backing(0, BackingState::Ready, 4);
        let mut hb = agent(&b, NOW - SEC);
        hb.dirty_slots = vec![3];
        hb.dirty_reasons = [(3, "a process survived".to_string())].into();
        apply_all(
            &mut state,
            [Msg::Feed(vec![put(Record::Agent(Box::new(hb)))])],
        );
        press(&mut state, [key('i')]);
        let text = screen(&state);
        assert!(text.contains("req-ci-job-1 by ci-job-1"), "{text}");
        assert!(text.contains("3 dirty: a process survived"), "{text}");
        insta::assert_snapshot!(text);
        // Taller: the recent events and the record.
        state.size = (100, 40);
        apply_all(&mut state, [Msg::Resize(100, 40)]);
        let text = screen(&state);
        assert!(
            text.contains("created_at: 11:00:00 UTC (1h00m ago)"),
            "{text}"
        );
        assert!(text.contains("ready (by"), "{text}");
        insta::assert_snapshot!("detail_pane_of_a_busy_node_100x40", text);
    }

    #[test]
    fn detail_pane_of_a_pool_says_why_it_waits_with_sparklines() {
        let mut state = sample_state(80, 24);
        // Five minutes of samples: more slots used, then requests waiting.
        for i in 0..60u64 {
            let at = NOW + i * crate::history::SAMPLE_MS;
            let mut waiting: Vec<Change> = (0..i / 20)
                .map(|n| {
                    put(Record::Request(Box::new(request(
                        &format!("req-w{n}"),
                        &["small"],
                        RequestState::Requested,
                        NOW,
                    ))))
                })
                .collect();
            // The launcher goes on deciding.
            let mut live = launcher("n1m0", 0, Some(0));
            (live.renewed_at, live.passed_at) = (Some(at), Some(at));
            waiting.push(put(Record::Launcher(Box::new(live))));
            apply_all(&mut state, [Msg::Feed(waiting), Msg::Tick(at)]);
        }
        press(&mut state, [key('1'), key('i')]);
        let text = screen(&state);
        assert!(text.contains("why") || text.contains("waiting"), "{text}");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn a_providers_last_error_marks_its_pools_and_shows_in_the_pool_pane() {
        let mut state = sample_state(80, 24);
        let status = ProviderStatus {
            v: 1,
            provider: "cloud".into(),
            error: "cloud: create exited with status 1: quota exceeded for region eu-1".into(),
            call: ProviderCall::Launch,
            at: NOW - 90 * 1000,
            failures: 3,
            capacity_until: Some(NOW + 8 * 1000),
            launcher: slotpool_protocol::LauncherId::parse("launcher-01jq3m2f7h8g9k0m1n2p3q4r5s")
                .unwrap(),
        };
        apply_all(
            &mut state,
            [Msg::Feed(vec![put(Record::Provider(Box::new(status)))])],
        );
        press(&mut state, [key('1')]);
        let table = screen(&state);
        assert!(table.contains("! cloud/main"), "{table}");
        insta::assert_snapshot!("provider_error_pools", table);
        press(&mut state, [key('i')]);
        let text = screen(&state);
        assert!(
            text.contains("3 failures in a row, the last a launch"),
            "{text}"
        );
        assert!(text.contains("quota exceeded"), "{text}");
        insta::assert_snapshot!("provider_error_pool_pane", text);
        // Cleared after a success: the mark and the lines go.
        apply_all(
            &mut state,
            [Msg::Feed(vec![Change::Removed {
                bucket: Bucket::Providers,
                key: "provider.cloud".into(),
            }])],
        );
        let cleared = screen(&state);
        assert!(!cleared.contains("failures in a row"), "{cleared}");
        assert!(!cleared.contains("! cloud/main"), "{cleared}");
    }

    #[test]
    fn a_pools_nodes_filtered_while_typing() {
        let mut state = sample_state(80, 24);
        press(
            &mut state,
            [key('1'), code(KeyCode::Enter), key('/'), key('r'), key('e')],
        );
        let text = screen(&state);
        assert!(text.contains("pool:cloud/main/small /re"), "{text}");
        assert!(text.contains("filter /re"), "{text}");
        insta::assert_snapshot!(text);
    }

    /// Team a (weight 3, max-slots 1) holds one slot and waited 30 s for it; the
    /// default tenant holds one and waits for a set of two.
    #[test]
    fn pools_view_shows_each_tenant() {
        let config = slotpool_config::Config::parse(
            std::path::Path::new("pool.yaml"),
            "providers:\n  - name: local\n    driver: local\n    pools:\n      - name: main\n        max-servers: 4\n        labels:\n          - {name: small, backing-label: vm, max-parallel-jobs: 4}\ntenants:\n  - {name: team-a, clients: [ci-a], weight: 3, max-slots: 1}\n",
        )
        .unwrap();
        let mut rules = rules();
        rules.set_tenants(config.tenants.clone());
        let client = slotpool_protocol::UserName::parse("ci-a").unwrap();
        let mut changes = sample();
        for change in &mut changes {
            match change {
                Change::Put {
                    record: Record::Slot(n),
                    ..
                } if n.slot == 0 => n.client = Some(client.clone()),
                Change::Put {
                    record: Record::Request(r),
                    ..
                } if r.state == RequestState::Fulfilled => {
                    r.client = Some(client.clone());
                    r.fulfilled_at = Some(r.created_at + 30 * SEC);
                }
                _ => {}
            }
        }
        let mut state = loaded(rules, changes, 100, 24);
        press(&mut state, [key('1')]);
        let text = screen(&state);
        let row = |name: &str| -> Vec<String> {
            let line = text
                .lines()
                .find(|l| l.trim_start_matches('"').starts_with(name))
                .unwrap_or_else(|| panic!("no row of {name}:\n{text}"));
            line.trim_matches('"')
                .split_whitespace()
                .map(str::to_string)
                .collect()
        };
        assert_eq!(row("TENANT")[0], "TENANT", "{text}");
        // name, weight, held, share (8 ready slots, 3:1), max, waiting, p95.
        assert_eq!(row("team-a"), ["team-a", "3", "1", "6", "1", "0", "30s"]);
        assert_eq!(row("default"), ["default", "1", "1", "2", "-", "1", "-"]);
        // Without tenants, no table.
        let mut state = sample_state(100, 24);
        press(&mut state, [key('1')]);
        assert!(!screen(&state).contains("TENANT"));
    }

    /// The launcher's own line of the Pools view's launchers' table, split in cells.
    fn launcher_cells(text: &str, id_end: &str) -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.contains(id_end))
            .unwrap_or_else(|| panic!("no row of launcher …{id_end}:\n{text}"));
        line.trim_matches('"')
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    /// Each launcher's lease age and last pass; one that passed 75 s ago is stalled
    /// (past the default `stall-after`, 60 s); while another decides, nobody is said
    /// to be missing.
    #[test]
    fn pools_view_shows_each_launchers_liveness() {
        let mut changes = sample();
        changes.push(put(Record::Launcher(Box::new(launcher(
            "zzzz",
            1,
            Some(75),
        )))));
        let mut state = loaded(rules(), changes, 120, 30);
        press(&mut state, [key('1')]);
        let text = screen(&state);
        assert_eq!(
            launcher_cells(&text, "LAUNCHER"),
            ["LAUNCHER", "LEASE", "LAST", "PASS", "DECIDING"],
            "{text}"
        );
        assert_eq!(
            launcher_cells(&text, "n1m0"),
            ["launcher-01jq3kz9w8v7t6s5r4q3p2n1m0", "2s", "3s", "yes"],
            "{text}"
        );
        assert_eq!(
            launcher_cells(&text, "zzzz")[1..],
            ["1s", "1m15s", "stalled:", "past", "stall-after", "(60s)"],
            "{text}"
        );
        assert!(!text.contains("nobody"), "{text}");
        insta::assert_snapshot!(text);
    }

    /// A waiting request with free slots of its label and no launcher deciding: the
    /// header, the Pools view and the pool's pane say nobody hands the slots out, in
    /// every view and as the clock moves; a pass ends it.
    #[test]
    fn a_stall_cannot_hide_free_slots_nobody_hands_out() {
        let mut state = sample_state(120, 30);
        // The sample's launcher passed 3 s ago; 70 s later, with no renewal since, it
        // has not passed for 73 s. Seen from the Backing view, which is not rebuilt
        // on a tick.
        apply_all(&mut state, [Msg::Tick(NOW + 70 * SEC)]);
        let text = screen(&state);
        assert!(text.contains("nobody hands out 2 free slots"), "{text}");
        press(&mut state, [key('1')]);
        let text = screen(&state);
        assert!(
            text.contains(
                "nobody acts: 1 requests wait with 2 slots of their labels free, and no \
                 launcher finished a pass in the last 60s"
            ),
            "{text}"
        );
        assert_eq!(
            launcher_cells(&text, "n1m0")[1..4],
            ["1m12s", "1m13s", "stalled:"],
            "{text}"
        );
        press(&mut state, [key('i')]);
        let text = screen(&state);
        assert!(
            text.contains("2 free slots on running nodes, but nobody hands them out"),
            "{text}"
        );
        insta::assert_snapshot!(text);
        // A renewal that says it passed: the warnings go.
        let mut fresh = launcher("n1m0", 0, Some(0));
        fresh.renewed_at = Some(NOW + 70 * SEC);
        fresh.passed_at = Some(NOW + 69 * SEC);
        apply_all(
            &mut state,
            [Msg::Feed(vec![put(Record::Launcher(Box::new(fresh)))])],
        );
        let text = screen(&state);
        assert!(!text.contains("nobody"), "{text}");
        assert!(text.contains("handed out next pass"), "{text}");
        // No launcher at all (its lease expired).
        apply_all(
            &mut state,
            [Msg::Feed(vec![Change::Removed {
                bucket: Bucket::Launchers,
                key: "launcher.launcher-01jq3kz9w8v7t6s5r4q3p2n1m0".into(),
            }])],
        );
        let text = screen(&state);
        assert!(
            text.contains("and no launcher holds a liveness lease"),
            "{text}"
        );
    }

    /// The console's threshold is the launchers' own `stall-after`, from `--config`.
    #[test]
    fn a_launcher_is_stalled_past_the_configs_stall_after() {
        let config = slotpool_config::Config::parse(
            std::path::Path::new("pool.yaml"),
            "launcher:\n  stall-after: 120\nproviders:\n  - name: cloud\n    driver: local\n    pools:\n      - name: main\n        max-servers: 4\n        labels:\n          - {name: small, backing-label: vm, max-parallel-jobs: 4}\n",
        )
        .unwrap();
        let mut changes = sample();
        changes.push(put(Record::Launcher(Box::new(launcher(
            "zzzz",
            1,
            Some(75),
        )))));
        let mut state = loaded(Rules::from_config(&config), changes, 100, 30);
        press(&mut state, [key('1')]);
        let text = screen(&state);
        assert_eq!(launcher_cells(&text, "zzzz")[3], "yes", "{text}");
        apply_all(&mut state, [Msg::Tick(NOW + 50 * SEC)]);
        let text = screen(&state);
        assert_eq!(
            launcher_cells(&text, "zzzz")[3..],
            ["stalled:", "past", "stall-after", "(120s)"],
            "{text}"
        );
    }

    #[test]
    fn pools_view() {
        let mut state = sample_state(80, 24);
        press(&mut state, [key('1')]);
        insta::assert_snapshot!(screen(&state));
    }

    #[test]
    fn the_slot_pane_asks_who_is_in_the_slot_and_shows_the_answer() {
        use crate::state::Command;
        use slotpool_protocol::api::{SlotOccupants, SlotSession};
        let mut state = sample_state(100, 40);
        press(&mut state, [code(KeyCode::Enter)]);
        // The first used slot of the node: opening its pane asks its agent.
        let mut asked = None;
        for _ in 0..4 {
            let commands = press(&mut state, [key('i')]);
            asked = commands.into_iter().find_map(|c| match c {
                Command::AskOccupants { ask, .. } => Some(ask),
                _ => None,
            });
            if asked.is_some() {
                break;
            }
            press(&mut state, [key('i'), key('j')]);
        }
        let ask = asked.expect("opening a used slot's pane asks who is in it");
        assert!(screen(&state).contains("asking its agent"));
        let answer = SlotOccupants {
            processes: 3,
            logins: vec![SlotSession {
                user: "sp1a2b3c4ds0".into(),
                from: "10.0.0.9:51234".into(),
                since: NOW - 120 * 1000,
            }],
        };
        apply_all(
            &mut state,
            [Msg::Occupants {
                ask,
                result: Ok(answer),
            }],
        );
        let text = screen(&state);
        assert!(text.contains("in it: 3 processes · 1 SSH login"), "{text}");
        assert!(text.contains("sp1a2b3c4ds0@10.0.0.9:51234 since"), "{text}");
        insta::assert_snapshot!("slot_pane_occupants", text);
    }

    #[test]
    fn slot_hidden_by_the_filter_after_its_release() {
        let mut state = sample_state(80, 24);
        let mut keys = vec![code(KeyCode::Enter), key('j'), key('j'), key('/')];
        keys.extend("ci-job".chars().map(key));
        keys.push(code(KeyCode::Enter));
        press(&mut state, keys);
        apply_all(
            &mut state,
            [Msg::Feed(vec![Change::Removed {
                bucket: Bucket::Slots,
                key: slotpool_protocol::layout::slot_key(&bid(0), 2),
            }])],
        );
        let text = screen(&state);
        assert!(
            text.contains(&format!("slot 2 of {} is hidden by the filter", bid(0))),
            "{text}"
        );
        insta::assert_snapshot!(text);
    }

    #[test]
    fn the_slot_pane_follows_the_selection_to_the_next_slot() {
        use crate::state::Command;
        use slotpool_protocol::api::SlotOccupants;
        let mut state = sample_state(100, 40);
        let asks: Vec<u64> = press(
            &mut state,
            [code(KeyCode::Enter), key('i'), key('j'), key('j')],
        )
        .into_iter()
        .filter_map(|c| match c {
            Command::AskOccupants { ask, .. } => Some(ask),
            _ => None,
        })
        .collect();
        assert_eq!(
            asks.len(),
            2,
            "slot 0 on open, slot 2 on the move: {asks:?}"
        );
        // The answer about slot 0 comes late: slot 2's pane still asks.
        apply_all(
            &mut state,
            [Msg::Occupants {
                ask: asks[0],
                result: Ok(SlotOccupants {
                    processes: 5,
                    logins: vec![],
                }),
            }],
        );
        let text = screen(&state);
        assert!(text.contains("_2_"), "{text}");
        assert!(text.contains("asking its agent"), "{text}");
        assert!(!text.contains("5 processes"), "{text}");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn the_backing_pane_shows_its_agents_log_tail_escaped_and_an_unreachable_agent() {
        use crate::state::{Command, LOG_PANE_LINES};
        let mut state = sample_state(100, 40);
        let ask = |n: u32, ask: u64| Command::AskLogTail {
            backing_id: bid(n),
            lines: LOG_PANE_LINES,
            ask,
        };
        // Opening the pane asks the selected node's agent; moving to another node asks
        // that one's; a move that stays on it asks nothing more.
        assert_eq!(press(&mut state, [key('i')]), [ask(0, 1)]);
        assert!(screen(&state).contains("agent log: asking its agent…"));
        assert_eq!(press(&mut state, [key('j')]), [ask(1, 2)]);
        assert_eq!(press(&mut state, [key('s'), key('s')]), []);
        // An answer about a node no longer shown is dropped; an agent that does not
        // answer is said so.
        apply_all(
            &mut state,
            [
                Msg::LogTail {
                    ask: 1,
                    result: Ok(vec!["stale".into()]),
                },
                Msg::LogTail {
                    ask: 2,
                    result: Err("the agent of bn-01 does not answer".into()),
                },
            ],
        );
        let text = screen(&state);
        assert!(!text.contains("stale"), "{text}");
        assert!(
            text.contains("agent log: cannot be reached: the agent of bn-01 does not answer"),
            "{text}"
        );
        assert_eq!(press(&mut state, [key('k')]), [ask(0, 3)]);
        // A tenant's text in the agent's log: as the agent sends it (escaped), and raw,
        // as an agent of another version, or a forged one, might send it.
        let raw: Vec<String> = vec![
            "2026-11-24T11:59:00.000001Z  INFO agent: slotpool_agent: agent starting slots=4 backing_id=bn-01jq3m2f7h8g9k0m1n2p3q4r00".into(),
            "2026-11-24T11:59:30.000002Z  WARN refusing prepare err=x\\u{1b}[2J\\u{a} FAKE".into(),
            "2026-11-24T11:59:59.000003Z  INFO slot prepared user=ev\u{1b}]0;own\u{7}\r\n\u{9b}2J\u{202e}il"
                .into(),
        ];
        apply_all(
            &mut state,
            [Msg::LogTail {
                ask: 3,
                result: Ok(raw),
            }],
        );
        let text = screen(&state);
        assert!(text.contains("agent log, newest first"), "{text}");
        assert!(
            text.contains(r"11:59:59.000003Z  INFO slot prepared user=ev\u{1b}]0;own\u{7}\u{d}\u{a}\u{9b}2J\u{202e}il"),
            "{text}"
        );
        assert!(text.contains(r"err=x\u{1b}[2J\u{a} FAKE"), "{text}");
        let buffer = render(&state, &Theme::plain()).backend().buffer().clone();
        assert!(
            buffer.content().iter().all(|c| !c
                .symbol()
                .contains(|c: char| c.is_control() || c == '\u{202e}')),
            "a control character or a bidi override reached the terminal"
        );
        insta::assert_snapshot!("backing_pane_agent_log", text);
    }

    #[test]
    fn slots_view() {
        let mut state = sample_state(80, 24);
        press(&mut state, [code(KeyCode::Enter), key('j'), key('j')]);
        insta::assert_snapshot!(screen(&state));
    }

    #[test]
    fn requests_view() {
        let mut state = sample_state(80, 24);
        press(&mut state, [key('4')]);
        insta::assert_snapshot!(screen(&state));
    }

    #[test]
    fn requests_view_folds_finished_requests() {
        let mut state = sample_state(80, 24);
        apply_all(&mut state, [Msg::Feed(finished_requests())]);
        press(&mut state, [key('4')]);
        let folded = screen(&state);
        assert!(folded.contains("▸ 3 finished"), "{folded}");
        insta::assert_snapshot!("requests_folded", folded);
        press(&mut state, [key('G'), code(KeyCode::Enter)]);
        insta::assert_snapshot!("requests_unfolded", screen(&state));
    }

    #[test]
    fn events_view() {
        let mut state = sample_state(80, 24);
        press(&mut state, [key('5')]);
        insta::assert_snapshot!(screen(&state));
    }

    /// Launcher ids share their prefix: at 80 columns the ACTOR column keeps their
    /// random ends, so two launchers' events are told apart.
    #[test]
    fn launcher_ids_keep_their_random_end_at_80x24() {
        let b = bid(0);
        let changes = [
            "launcher-01jq3kz0a1b2c3d4e5f6g7h8j9",
            "launcher-01jq3kz0a1b2c3d4e5f6g7zzzz",
        ]
        .iter()
        .enumerate()
        .map(|(i, actor)| {
            let mut e = event(i as u32, NOW - SEC, EventKind::Backing, &b, "ready");
            e.actor = actor.to_string();
            put(Record::Event(Box::new(e)))
        })
        .collect();
        let mut state = loaded(Rules::unknown(), changes, 80, 24);
        press(&mut state, [key('5')]);
        let text = screen(&state);
        assert!(text.contains("…4e5f6g7h8j9"), "{text}");
        assert!(text.contains("…4e5f6g7zzzz"), "{text}");
    }

    #[test]
    fn empty_pool() {
        let state = loaded(Rules::unknown(), vec![], 80, 24);
        insta::assert_snapshot!(screen(&state));
    }

    #[test]
    fn loading() {
        let mut state = State::new(Rules::unknown(), "nats://127.0.0.1:4222");
        apply_all(&mut state, [Msg::Resize(80, 24), Msg::Tick(NOW)]);
        let text = screen(&state);
        assert!(text.contains("loading"), "{text}");
    }

    #[test]
    fn narrow_terminal() {
        insta::assert_snapshot!(screen(&sample_state(50, 14)));
    }

    #[test]
    fn tiny_terminals_do_not_panic() {
        for (w, h) in [(1, 1), (10, 3), (20, 7), (79, 8)] {
            let mut state = sample_state(w, h);
            for v in ['1', '2', '3', '4', '5', '?'] {
                press(&mut state, [key(v)]);
                screen(&state);
            }
        }
    }

    #[test]
    fn help_lists_every_key() {
        let mut state = sample_state(80, 24);
        press(&mut state, [key('?')]);
        let text = screen(&state);
        for (k, _) in HELP {
            assert!(text.contains(k), "help misses {k}:\n{text}");
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn kill_confirmation() {
        let mut state = sample_state(80, 24);
        let mut msgs = vec![key('K')];
        msgs.extend("bad disk".chars().map(key));
        press(&mut state, msgs);
        insta::assert_snapshot!(screen(&state));
    }

    #[test]
    fn drain_confirmation_names_the_node_at_80x24() {
        let mut state = sample_state(80, 24);
        let mut msgs = vec![key('D')];
        msgs.extend("disk swap".chars().map(key));
        press(&mut state, msgs);
        let text = screen(&state);
        assert!(text.contains("Enter confirm"), "{text}");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn a_long_confirmation_keeps_its_keys_on_screen() {
        for width in [80, 60, 44] {
            let mut state = sample_state(width, 24);
            press(&mut state, [key('D')]);
            let shown = screen(&state);
            assert!(shown.contains("Drain backing node"), "{shown}");
            assert!(
                shown.contains("Enter confirm"),
                "at {width} columns:\n{shown}"
            );
        }
    }

    #[test]
    fn connection_lost_banner() {
        let mut state = sample_state(80, 24);
        apply_all(&mut state, [Msg::Link(false)]);
        let text = screen(&state);
        assert!(
            text.contains("NATS connection lost — reconnecting…"),
            "{text}"
        );
        insta::assert_snapshot!(text);
    }

    #[test]
    fn no_color_means_no_colours() {
        let state = sample_state(80, 24);
        let plain = render(&state, &Theme::plain());
        for cell in plain.backend().buffer().content() {
            assert_eq!(cell.fg, Color::Reset);
            assert_eq!(cell.bg, Color::Reset);
        }
        let colored = render(&state, &Theme::colored());
        assert!(
            colored
                .backend()
                .buffer()
                .content()
                .iter()
                .any(|c| c.fg == Color::Red),
            "the failed node is red"
        );
    }

    #[test]
    fn ten_thousand_nodes_render_only_the_visible_rows() {
        let changes = ready_backing(10_000, 4);
        let mut state = loaded(rules(), changes, 80, 24);
        press(&mut state, [key('G')]);
        let started = std::time::Instant::now();
        for _ in 0..100 {
            screen(&state);
        }
        let text = screen(&state);
        assert!(text.contains("10000 backing"), "{text}");
        // The last node is on screen.
        assert!(text.contains("…4r9999") || text.contains("9999"), "{text}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "100 frames took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn short_ids_keep_the_random_end() {
        assert_eq!(
            short_id("bn-01jq3m2f7h8g9k0m1n2p3q4r5s", 12),
            "bn-…k0m1n2p3q4r5s".chars().take(3).collect::<String>() + "…" + "2p3q4r5s"
        );
        assert_eq!(short_id("build-01", 12), "build-01");
        assert_eq!(slot_bar(1, 4, 4), "█░░░ 1/4");
        assert_eq!(slot_bar(0, 0, 4), "░░░░ 0/0");
        assert_eq!(clock(NOW + 61_000), "12:01:01");
    }

    #[test]
    fn only_a_full_node_draws_a_full_bar() {
        for width in 1..=10 {
            let full = "█".repeat(width);
            assert!(slot_bar(4, 4, width).starts_with(&full), "width {width}");
            assert!(
                !slot_bar(3, 4, width).starts_with(&full),
                "3/4 at width {width}: {}",
                slot_bar(3, 4, width)
            );
            assert!(!slot_bar(99, 100, width).starts_with(&full));
        }
        assert_eq!(slot_bar(3, 4, 3), "██░ 3/4");
        assert_eq!(slot_bar(1, 100, 3), "█░░ 1/100", "any use shows");
    }
}
