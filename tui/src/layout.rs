//! Screen geometry shared by the reducer (paging, scrolling the selection into view) and
//! the view (where the table goes): how many table rows a terminal has room for.

/// Lines that are not table rows: header, tabs, column header, 2 detail lines, status,
/// key hints (the view's layout draws exactly these around the table).
pub const CHROME_LINES: u16 = 7;

/// How many table rows fit on a terminal of `size` (columns, lines).
pub fn table_rows(size: (u16, u16)) -> u16 {
    size.1.saturating_sub(CHROME_LINES)
}
