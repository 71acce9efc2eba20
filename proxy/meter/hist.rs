//! The meter's histograms: per-token gaps and other durations in microseconds, 1 µs to
//! one hour at two significant figures (1% resolution), and how a quantile is read.

use hdrhistogram::Histogram;

use super::stats::Percentiles;

/// Histogram range: 1 µs to one hour, two significant figures (1% resolution).
pub(super) const HIST_MAX_US: u64 = 3_600_000_000;

pub(super) fn histogram() -> Histogram<u32> {
    // The bounds are constants that hdrhistogram accepts; the fallback is unreachable.
    Histogram::new_with_bounds(1, HIST_MAX_US, 2)
        .unwrap_or_else(|_| Histogram::new(2).unwrap_or_else(|_| unreachable!()))
}

/// A histogram kept since start: 64-bit counts, which a busy upstream cannot fill (32-bit
/// ones would, in about ten days at 5,000 events a second).
pub(super) fn histogram64() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 2)
        .unwrap_or_else(|_| Histogram::new(2).unwrap_or_else(|_| unreachable!()))
}

/// A quantile as the middle of its histogram bucket (not its top, which reads high).
pub(super) fn quantile_us<T: hdrhistogram::Counter>(h: &Histogram<T>, q: f64) -> f64 {
    h.median_equivalent(h.value_at_quantile(q)) as f64
}

pub(super) fn hist_percentiles(h: &Histogram<u32>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let q = |p: f64| Some(quantile_us(h, p) / 1e3);
    Percentiles {
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
    }
}
