//! `tokentap load --plot FILE.svg`: the figure genai-perf made familiar, single-stream and
//! system T/s against concurrency on one chart, each on its own axis, with the SLO-bounded
//! phase marked (`--slo`). Plain SVG, written by hand: one `<circle>` per measured point
//! carrying its figures as `data-` attributes, so a script (or a test) reads back exactly
//! what the table printed.

use std::fmt::Write as _;

use super::report::{slo_bounded, PhaseReport, Slo};

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 80.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const SINGLE: &str = "#2563eb";
const SYSTEM: &str = "#ea580c";

/// The chart of the closed-loop phases of `reports`.
pub fn svg(reports: &[PhaseReport], slo: Option<&Slo>) -> String {
    let points: Vec<(f64, &PhaseReport)> = reports
        .iter()
        .filter_map(|r| r.concurrency.map(|c| (c as f64, r)))
        .collect();
    let max_of = |f: fn(&PhaseReport) -> Option<f64>| {
        points
            .iter()
            .filter_map(|(_, r)| f(r))
            .fold(0.0_f64, f64::max)
    };
    let single_max = nice(max_of(|r| r.single_stream_tps));
    let system_max = nice(max_of(|r| r.system_tps));
    let (c_min, c_max) = points.iter().fold((f64::MAX, 0.0_f64), |(lo, hi), (c, _)| {
        (lo.min(*c), hi.max(*c))
    });
    let (c_min, c_max) = if points.is_empty() {
        (1.0, 2.0)
    } else if c_max <= c_min {
        (c_min / 2.0, c_max * 2.0)
    } else {
        (c_min, c_max)
    };
    let plot_w = W - LEFT - RIGHT;
    let plot_h = H - TOP - BOTTOM;
    // Concurrency on a log₂ axis: 1, 2, 4 … 128 evenly apart, as the curve's buckets are.
    let x = |c: f64| LEFT + plot_w * (c.log2() - c_min.log2()) / (c_max.log2() - c_min.log2());
    let y_single = |v: f64| TOP + plot_h * (1.0 - v / single_max);
    let y_system = |v: f64| TOP + plot_h * (1.0 - v / system_max);

    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">
<title>single-stream and system T/s against concurrency</title>
<rect width="{W}" height="{H}" fill="#ffffff"/>
<text x="{}" y="24" text-anchor="middle" font-size="15" font-weight="bold">tokentap load: T/s against concurrency</text>
"##,
        W / 2.0
    );
    // Grid and the two value axes, five steps each.
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let yy = TOP + plot_h * (1.0 - f);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e7eb"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="{SINGLE}">{}</text><text x="{:.1}" y="{:.1}" fill="{SYSTEM}">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            yy + 4.0,
            label(single_max * f),
            W - RIGHT + 6.0,
            yy + 4.0,
            label(system_max * f)
        );
    }
    for (c, _) in &points {
        let xx = x(*c);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#f3f4f6"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{c}</text>"##,
            H - BOTTOM,
            H - BOTTOM + 18.0
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#9ca3af"/>
<text x="{:.1}" y="{:.1}" text-anchor="middle">concurrency (requests in flight)</text>
<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle" fill="{SINGLE}">single-stream T/s (1 / TPOT)</text>
<text transform="translate({:.1} {:.1}) rotate(90)" text-anchor="middle" fill="{SYSTEM}">system T/s (all streams)</text>"##,
        LEFT + plot_w / 2.0,
        H - 16.0,
        TOP + plot_h / 2.0,
        W - 18.0,
        TOP + plot_h / 2.0
    );
    for (class, colour, value, y) in [
        (
            "single",
            SINGLE,
            (|r: &PhaseReport| r.single_stream_tps) as fn(&PhaseReport) -> Option<f64>,
            &y_single as &dyn Fn(f64) -> f64,
        ),
        ("system", SYSTEM, |r: &PhaseReport| r.system_tps, &y_system),
    ] {
        let line: Vec<String> = points
            .iter()
            .filter_map(|(c, r)| value(r).map(|v| format!("{:.1},{:.1}", x(*c), y(v))))
            .collect();
        let _ = writeln!(
            s,
            r##"<polyline class="{class}" points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"##,
            line.join(" ")
        );
        for (c, r) in &points {
            if let Some(v) = value(r) {
                let _ = writeln!(
                    s,
                    r##"<circle class="{class}" data-concurrency="{c}" data-tps="{v}" cx="{:.1}" cy="{:.1}" r="4" fill="{colour}"/>"##,
                    x(*c),
                    y(v)
                );
            }
        }
    }
    if let Some(slo) = slo {
        let parts: Vec<String> = [
            ("TTFT", slo.ttft_ms),
            ("TPOT", slo.tpot_ms),
            ("e2e", slo.e2e_ms),
        ]
        .iter()
        .filter_map(|(n, v)| v.map(|v| format!("{n} ≤ {} ms", label(v))))
        .collect();
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="44" text-anchor="end" fill="#16a34a">SLO: {}, {}% of requests good</text>"##,
            W - RIGHT,
            parts.join(", "),
            label(slo.attainment_pct)
        );
    }
    if let Some(b) = slo.and_then(|slo| slo_bounded(reports, slo)) {
        if let (Some(c), Some(v)) = (b.concurrency, b.system_tps) {
            let (xx, yy) = (x(c as f64), y_system(v));
            let _ = writeln!(
                s,
                r##"<circle class="slo-bounded" data-concurrency="{c}" data-tps="{v}" cx="{xx:.1}" cy="{yy:.1}" r="9" fill="none" stroke="#16a34a" stroke-width="2.5"/>
<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#16a34a">SLO-bounded: {} T/s at {c} in flight</text>"##,
                xx - 12.0,
                yy - 12.0,
                label(v)
            );
        }
    }
    let _ = writeln!(
        s,
        r##"<g font-size="12"><circle cx="{:.1}" cy="40" r="4" fill="{SINGLE}"/><text x="{:.1}" y="44" fill="{SINGLE}">single-stream T/s</text><circle cx="{:.1}" cy="40" r="4" fill="{SYSTEM}"/><text x="{:.1}" y="44" fill="{SYSTEM}">system T/s</text></g>
</svg>"##,
        LEFT + 8.0,
        LEFT + 16.0,
        LEFT + 150.0,
        LEFT + 158.0
    );
    s
}

/// A round upper bound for an axis: 1, 2 or 5 × 10ⁿ at or above `v`.
fn nice(v: f64) -> f64 {
    if !(v > 0.0 && v.is_finite()) {
        return 1.0;
    }
    let step = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * step)
        .find(|&n| n >= v)
        .unwrap_or(10.0 * step)
}

fn label(v: f64) -> String {
    if v >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_at_round_numbers() {
        assert_eq!(nice(47.0), 50.0);
        assert_eq!(nice(3584.0), 5000.0);
        assert_eq!(nice(120.0), 200.0);
        assert_eq!(nice(0.0), 1.0);
    }
}
