//! A phase's client-side figures, and how they print.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Quantiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub mean: Option<f64>,
}

impl Quantiles {
    pub fn of(mut v: Vec<f64>) -> Quantiles {
        if v.is_empty() {
            return Quantiles::default();
        }
        v.sort_unstable_by(f64::total_cmp);
        let q = |p: f64| {
            let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
            Some(v[rank.clamp(1, v.len()) - 1])
        };
        Quantiles {
            p50: q(50.0),
            p90: q(90.0),
            p99: q(99.0),
            mean: Some(v.iter().sum::<f64>() / v.len() as f64),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseReport {
    /// Closed-loop concurrency, or `null` for an open-loop phase.
    pub concurrency: Option<usize>,
    /// Open-loop arrival rate, requests/s.
    pub rate: Option<f64>,
    pub duration_secs: f64,
    /// Requests that finished inside the measured window.
    pub requests: u64,
    pub errors: BTreeMap<String, u64>,
    pub ttft_ms: Quantiles,
    pub tpot_ms: Quantiles,
    pub itl_ms: Quantiles,
    /// 1000 / mean TPOT.
    pub single_stream_tps: Option<f64>,
    /// Tokens that arrived inside the measured window, per second.
    pub system_tps: Option<f64>,
    pub output_tokens: u64,
}

fn f(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

impl PhaseReport {
    pub fn label(&self) -> String {
        match (self.concurrency, self.rate) {
            (Some(c), _) => format!("c={c}"),
            (_, Some(r)) => format!("rate={r}/s"),
            _ => "-".into(),
        }
    }

    pub fn one_line(&self) -> String {
        format!(
            "{}: {} requests, TTFT p50 {} ms, TPOT p50 {} ms, single-stream {} T/s, system {} T/s, errors {}",
            self.label(),
            self.requests,
            f(self.ttft_ms.p50),
            f(self.tpot_ms.p50),
            f(self.single_stream_tps),
            f(self.system_tps),
            self.errors.values().sum::<u64>()
        )
    }
}

/// The end-of-run table.
pub fn table(reports: &[PhaseReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>10} {:>7} {:>6} | {:>21} | {:>21} | {:>13} | {:>9} {:>9}",
        "load",
        "reqs",
        "errors",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90/mean ms",
        "ITL p50/p99",
        "1-str T/s",
        "sys T/s"
    );
    for r in reports {
        let errors = r.errors.values().sum::<u64>();
        let _ = writeln!(
            out,
            "{:>10} {:>7} {:>6} | {:>21} | {:>21} | {:>13} | {:>9} {:>9}",
            r.label(),
            r.requests,
            errors,
            format!(
                "{}/{}/{}",
                f(r.ttft_ms.p50),
                f(r.ttft_ms.p90),
                f(r.ttft_ms.p99)
            ),
            format!(
                "{}/{}/{}",
                f(r.tpot_ms.p50),
                f(r.tpot_ms.p90),
                f(r.tpot_ms.mean)
            ),
            format!("{}/{}", f(r.itl_ms.p50), f(r.itl_ms.p99)),
            f(r.single_stream_tps),
            f(r.system_tps)
        );
    }
    for r in reports.iter().filter(|r| !r.errors.is_empty()) {
        let kinds: Vec<String> = r.errors.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = writeln!(out, "errors at {}: {}", r.label(), kinds.join(", "));
    }
    out
}
