//! The plot: slots paid and busy over the day, and the distribution of waits, as one
//! SVG written by hand (two line charts need a few dozen lines, not a plotting crate).

use super::ledger::Report;
use super::Policy;
use std::fmt::Write;

const W: f64 = 720.0;
const H: f64 = 220.0;
const PAD: f64 = 40.0;
const COLOURS: [&str; 2] = ["#1f77b4", "#d62728"];

fn polyline(out: &mut String, points: &[(f64, f64)], colour: &str, dash: bool) {
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    let _ = writeln!(
        out,
        r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5"{} points="{}"/>"#,
        if dash {
            r#" stroke-dasharray="4 3""#
        } else {
            ""
        },
        pts.join(" ")
    );
}

fn axes(out: &mut String, top: f64, title: &str, x_label: &str, y_max: f64, y_label: &str) {
    let bottom = top + H;
    let right = PAD + W;
    let _ = writeln!(
        out,
        r#"<text x="{PAD}" y="{}" font-weight="bold">{title}</text>
<line x1="{PAD}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>
<line x1="{PAD}" y1="{top}" x2="{PAD}" y2="{bottom}" stroke="black"/>
<text x="{right}" y="{}" text-anchor="end">{x_label}</text>
<text x="{}" y="{}" >{y_max:.0} {y_label}</text>"#,
        top - 8.0,
        bottom + 16.0,
        PAD + 4.0,
        top + 12.0,
    );
}

/// One SVG with both charts for every report (one colour per policy; paid solid, busy
/// dashed).
pub fn plot(reports: &[Report]) -> String {
    let mut out = String::new();
    let height = 2.0 * (H + 2.0 * PAD) + PAD;
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="12">"#,
        W + 2.0 * PAD
    );
    let bins = reports
        .iter()
        .map(|r| r.series.paid_slots.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let bin_secs = reports.first().map_or(300, |r| r.series.bin_secs) as f64;
    let slots_max = reports
        .iter()
        .flat_map(|r| r.series.paid_slots.iter())
        .fold(1.0_f64, |a, b| a.max(*b));
    let top = PAD;
    axes(
        &mut out,
        top,
        "Slots paid (solid) and busy (dashed)",
        &format!("{:.0} h", bins as f64 * bin_secs / 3600.0),
        slots_max,
        "slots",
    );
    for (r, colour) in reports.iter().zip(COLOURS) {
        let at = |i: usize, v: f64| {
            (
                PAD + W * i as f64 / bins as f64,
                top + H - H * v / slots_max,
            )
        };
        let paid: Vec<_> = r
            .series
            .paid_slots
            .iter()
            .enumerate()
            .map(|(i, v)| at(i, *v))
            .collect();
        let busy: Vec<_> = r
            .series
            .busy_slots
            .iter()
            .enumerate()
            .map(|(i, v)| at(i, *v))
            .collect();
        polyline(&mut out, &paid, colour, false);
        polyline(&mut out, &busy, colour, true);
    }
    let top = 2.0 * PAD + H + PAD;
    let wait_max = reports
        .iter()
        .flat_map(|r| r.series.waits_secs.last())
        .fold(1.0_f64, |a, b| a.max(*b));
    axes(
        &mut out,
        top,
        "Wait distribution: share of jobs (x) waiting at most y",
        "100 %",
        wait_max,
        "s",
    );
    for (i, (r, colour)) in reports.iter().zip(COLOURS).enumerate() {
        let n = r.series.waits_secs.len().max(1) as f64;
        let pts: Vec<_> = r
            .series
            .waits_secs
            .iter()
            .enumerate()
            .map(|(k, w)| (PAD + W * (k + 1) as f64 / n, top + H - H * w / wait_max))
            .collect();
        polyline(&mut out, &pts, colour, false);
        let name = match r.policy {
            Policy::Slotpool => "slotpool",
            Policy::Nodepool => "nodepool",
        };
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" fill="{colour}">{name}: efficiency {:.3}, wait p99 {:.0} s</text>"#,
            PAD + 8.0,
            top + 28.0 + 14.0 * i as f64,
            r.efficiency,
            r.wait_p99_secs
        );
    }
    out.push_str("</svg>\n");
    out
}
