//! Screen geometry shared by the reducer (paging, scrolling the selection into view) and
//! the view (where the table goes): how many table rows a terminal has room for.

/// Lines that are not table rows: header, tabs, column header, 2 detail lines, status,
/// key hints (the view's layout draws exactly these around the table).
pub const CHROME_LINES: u16 = 7;

/// The most lines the detail pane takes.
pub const PANE_MAX_LINES: u16 = 16;

/// How many lines the detail pane takes on a terminal of `size`, when it is open: half
/// of what the table would have, at most [`PANE_MAX_LINES`].
pub fn pane_lines(size: (u16, u16), open: bool) -> u16 {
    if !open {
        return 0;
    }
    (size.1.saturating_sub(CHROME_LINES) / 2).min(PANE_MAX_LINES)
}

/// How many table rows fit on a terminal of `size` (columns, lines), with the detail
/// pane open or not.
pub fn table_rows(size: (u16, u16), pane: bool) -> u16 {
    size.1
        .saturating_sub(CHROME_LINES)
        .saturating_sub(pane_lines(size, pane))
}
