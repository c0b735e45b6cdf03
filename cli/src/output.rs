//! Printing records as aligned tables or JSON.

use super::Output;
use serde::Serialize;
use slotpool_protocol::time::now_ms;

/// Prints `rows` under `header` as an aligned table, or `items` as JSON.
pub fn print<T: Serialize>(output: Output, items: &T, header: &[&str], rows: Vec<Vec<String>>) {
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(items).expect("records serialize")
        ),
        Output::Table => print_table(header, &rows),
    }
}

pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
}

/// "12s", "4m", "3h" since a timestamp.
pub fn age(since: u64) -> String {
    let secs = now_ms().saturating_sub(since) / 1000;
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

/// A timestamp as UTC to the second, "2026-11-24T01:20:31Z".
pub fn time(at: u64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(at);
    humantime::format_rfc3339_seconds(at).to_string()
}

pub fn state<T: Serialize>(s: &T) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}
