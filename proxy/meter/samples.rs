//! What the meter hands the SLO controller: one tick's evidence ([`ControlSample`]), its
//! per-token gaps as a histogram that travels and merges exactly ([`Gaps`]; the fleet's
//! Redis wire format for them is `limit::fleet`'s).

use hdrhistogram::Histogram;

use super::hist::{histogram, HIST_MAX_US};

/// One controller tick's evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlSample {
    /// The asked percentile of per-token gaps, ms; `None` without gaps.
    pub tpot_ms: Option<f64>,
    /// Time-weighted mean in flight.
    pub concurrency: f64,
    /// The tick's per-token gaps, to be merged with other replicas' (`[cluster]`).
    pub gaps: Gaps,
}

/// Per-token gaps as (µs, count) pairs at the meter's resolution (2 significant digits):
/// a histogram that travels, and merges exactly with others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gaps(Vec<(u64, u64)>);

impl Gaps {
    pub(super) fn of(h: &Histogram<u32>) -> Gaps {
        Gaps(
            h.iter_recorded()
                .map(|v| {
                    (
                        h.median_equivalent(v.value_iterated_to()),
                        u64::from(v.count_at_value()),
                    )
                })
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The gaps of `parts` together.
    pub fn merged<'a>(parts: impl IntoIterator<Item = &'a Gaps>) -> Gaps {
        let mut h = histogram();
        for part in parts {
            for &(v, n) in &part.0 {
                let _ = h.record_n(
                    v.clamp(1, HIST_MAX_US),
                    u32::try_from(n).unwrap_or(u32::MAX),
                );
            }
        }
        Gaps::of(&h)
    }

    /// The `percentile` (0–100) of the gaps, ms.
    pub fn percentile_ms(&self, percentile: f64) -> Option<f64> {
        let total: u64 = self.0.iter().map(|p| p.1).sum();
        if total == 0 {
            return None;
        }
        // The hdrhistogram rule: the lowest value with at least q·n at or below it.
        let want = ((percentile / 100.0).clamp(0.0, 1.0) * total as f64)
            .ceil()
            .max(1.0) as u64;
        let mut seen = 0;
        self.0
            .iter()
            .find(|&&(_, n)| {
                seen += n;
                seen >= want
            })
            .map(|&(v, _)| v as f64 / 1e3)
    }

    /// The (µs, count) pairs, lowest first.
    pub fn pairs(&self) -> &[(u64, u64)] {
        &self.0
    }

    /// Gaps from (µs, count) pairs, as [`Gaps::pairs`] gives them.
    pub fn from_pairs(pairs: Vec<(u64, u64)>) -> Gaps {
        Gaps(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::hist::quantile_us;

    pub(crate) fn recorded(values: impl IntoIterator<Item = u64>) -> Histogram<u32> {
        let mut h = histogram();
        for v in values {
            h.record(v).unwrap();
        }
        h
    }

    #[test]
    fn gaps_merged_give_the_percentiles_of_the_whole() {
        let a: Vec<u64> = (0..500).map(|i| 18_000 + i * 13).collect();
        let b: Vec<u64> = (0..300).map(|i| 25_000 + i * 71).collect();
        let whole = recorded(a.iter().chain(&b).copied());
        let merged = Gaps::merged([&Gaps::of(&recorded(a)), &Gaps::of(&recorded(b))]);
        for p in [1.0, 50.0, 90.0, 99.0, 99.9] {
            assert_eq!(
                merged.percentile_ms(p),
                Some(quantile_us(&whole, p / 100.0) / 1e3),
                "p{p}"
            );
        }
        assert_eq!(Gaps::default().percentile_ms(90.0), None);
    }
}
