//! `[upstream.slo]`: the adaptive cap's TPOT SLO and the latency SLOs each request is
//! judged by.

use serde::Deserialize;

use crate::config::Problems;
use crate::limit::controller::Slo;
use crate::meter::Targets;

/// The default of `slo.min_concurrency`: the adaptive cap's floor.
pub(crate) const MIN_CONCURRENCY: u64 = 1;

/// The default of `slo.max_concurrency`: the adaptive cap's ceiling without a `max_concurrency`.
pub(crate) const MAX_CONCURRENCY: u64 = 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloFile {
    /// The TPOT to hold, ms: the adaptive cap steers on it, and each request's own TPOT is
    /// judged by it. Default: none.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    /// A request is good only with its TTFT at most this, ms. Default: none.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// …and its end-to-end latency at most this, ms. Default: none.
    #[serde(default)]
    pub e2e_ms: Option<f64>,
    /// The share of requests that must be good, percent: where a curve point stands
    /// within the SLO (with `ttft_ms` or `e2e_ms`). Default 90.
    #[serde(default)]
    pub attainment_pct: Option<f64>,
    /// Which percentile of per-token gaps must stay under it (1–99.9). Default 90.
    #[serde(default = "ninety")]
    pub percentile: f64,
    /// The adaptive cap never goes below this. Default 1.
    #[serde(default)]
    pub min_concurrency: Option<u64>,
    /// Nor above this. Default `max_concurrency` (the upstream's), else 1024.
    #[serde(default)]
    pub max_concurrency: Option<u64>,
}

fn ninety() -> f64 {
    90.0
}

/// `upstream[i].slo` checked: the adaptive cap's SLO (with `tpot_ms`), the targets each
/// request is judged by, and the attainment a curve point needs.
pub(super) fn slo(
    i: usize,
    s: &SloFile,
    max_concurrency: Option<u64>,
    p: &mut Problems,
) -> (Option<Slo>, Targets, f64) {
    let at = |f: &str| format!("upstream[{i}].slo.{f}");
    let before = p.len();
    let mut ms = |key: &str, v: Option<f64>| {
        if let Some(v) = v.filter(|v| !(*v > 0.0 && v.is_finite())) {
            p.add(at(key), format!("must be a positive number of ms, not {v}"));
        }
    };
    ms("tpot_ms", s.tpot_ms);
    ms("ttft_ms", s.ttft_ms);
    ms("e2e_ms", s.e2e_ms);
    let targets = Targets {
        ttft_ms: s.ttft_ms,
        tpot_ms: s.tpot_ms,
        e2e_ms: s.e2e_ms,
    };
    if !targets.any() {
        p.add(
            format!("upstream[{i}].slo"),
            "give at least one of tpot_ms, ttft_ms and e2e_ms",
        );
    }
    let attainment = s
        .attainment_pct
        .unwrap_or(crate::decide::DEFAULT_ATTAINMENT_PCT);
    if !(attainment > 0.0 && attainment <= 100.0) {
        p.add(
            at("attainment_pct"),
            format!("must be above 0 and at most 100, not {attainment}"),
        );
    }
    if !(1.0..=99.9).contains(&s.percentile) {
        p.add(
            at("percentile"),
            format!("must be between 1 and 99.9, not {}", s.percentile),
        );
    }
    let min = s.min_concurrency.unwrap_or(MIN_CONCURRENCY);
    let max = s
        .max_concurrency
        .or(max_concurrency)
        .unwrap_or(MAX_CONCURRENCY);
    if s.tpot_ms.is_none() {
        for (key, given) in [
            ("min_concurrency", s.min_concurrency.is_some()),
            ("max_concurrency", s.max_concurrency.is_some()),
        ] {
            if given {
                p.add(at(key), "applies with tpot_ms (the adaptive cap) only");
            }
        }
    }
    if min == 0 {
        p.add(at("min_concurrency"), "must be at least 1");
    }
    if min > max {
        p.add(
            at("min_concurrency"),
            format!("{min} is above max_concurrency {max}"),
        );
    }
    let cap = s.tpot_ms.filter(|_| p.len() == before).map(|tpot_ms| Slo {
        tpot_ms,
        percentile: s.percentile,
        min_concurrency: min,
        max_concurrency: max,
    });
    (cap, targets, attainment)
}
