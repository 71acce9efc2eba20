//! One evaluation of a rollout: the comparison of `to` with `from` at matched concurrency
//! over the step so far, and the counts since the step began, judged against the
//! rollout's bounds.

use serde::Serialize;

use super::RolloutConfig;
use crate::compare::{Comparison, MetricDiff};

/// What each upstream did since the step began (requests include `to`'s shadow copies).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counts {
    pub requests: u64,
    pub errors: u64,
    /// Requests judged against the upstream's SLO, and those good.
    pub judged: u64,
    pub good: u64,
}

impl Counts {
    /// These counts less those at `base` (a reload's fresh counter reads as zero since).
    pub fn since(self, base: Counts) -> Counts {
        Counts {
            requests: self.requests.saturating_sub(base.requests),
            errors: self.errors.saturating_sub(base.errors),
            judged: self.judged.saturating_sub(base.judged),
            good: self.good.saturating_sub(base.good),
        }
    }

    fn error_pct(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            100.0 * self.errors as f64 / self.requests as f64
        }
    }
}

/// What an evaluation decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Advance,
    Wait,
    RollBack,
}

/// A ratio of `to`'s figure to `from`'s, with its 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Ratio {
    pub ratio: f64,
    pub ci95: [f64; 2],
    /// The bound it is judged against.
    pub max: f64,
}

/// One evaluation, as `GET /rollout` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Evaluation {
    /// Seconds since the Unix epoch.
    pub at: u64,
    pub percent: f64,
    pub decision: Decision,
    /// Why, in words.
    pub reason: String,
    pub from_requests: u64,
    pub to_requests: u64,
    pub from_error_pct: f64,
    pub to_error_pct: f64,
    /// TPOT and TTFT of `to` over `from`'s at matched concurrency (`null`: no verdict yet).
    pub tpot: Option<Ratio>,
    pub ttft: Option<Ratio>,
    /// Goodput attainment of each, percent, when both were judged against an SLO.
    pub goodput_pct: Option<[f64; 2]>,
}

fn ratio(d: &MetricDiff, max: f64) -> Option<Ratio> {
    let (diff, [lo, hi]) = (d.diff_pct?, d.ci95_pct?);
    let r = |pct: f64| ((1.0 + pct / 100.0) * 1e4).round() / 1e4;
    Some(Ratio {
        ratio: r(diff),
        ci95: [r(lo), r(hi)],
        max,
    })
}

/// Judges the step so far: `cmp` of `from` (a) with `to` (b), and each one's counts.
/// Rolled back at once when `to` fails (its error rate past `from`'s by more than
/// `max_error_pct`) or is worse than a bound with 95% confidence (the interval's lower end
/// past it); advanced only when every bound holds with 95% confidence (the upper end within
/// it) and its goodput is not lower; else it waits for evidence.
pub fn judge(
    c: &RolloutConfig,
    percent: f64,
    at: u64,
    cmp: &Comparison,
    from: Counts,
    to: Counts,
) -> Evaluation {
    let tpot = ratio(&cmp.metrics.tpot_ms, c.max_tpot_ratio);
    let ttft = c
        .max_ttft_ratio
        .and_then(|max| ratio(&cmp.metrics.ttft_ms, max));
    let goodput = (from.judged > 0 && to.judged > 0)
        .then(|| [from, to].map(|n| (1000.0 * n.good as f64 / n.judged as f64).round() / 10.0));
    let (decision, reason) = decide(c, cmp, from, to, tpot, ttft);
    Evaluation {
        at,
        percent,
        decision,
        reason,
        from_requests: from.requests,
        to_requests: to.requests,
        from_error_pct: (from.error_pct() * 100.0).round() / 100.0,
        to_error_pct: (to.error_pct() * 100.0).round() / 100.0,
        tpot,
        ttft,
        goodput_pct: goodput,
    }
}

fn decide(
    c: &RolloutConfig,
    cmp: &Comparison,
    from: Counts,
    to: Counts,
    tpot: Option<Ratio>,
    ttft: Option<Ratio>,
) -> (Decision, String) {
    use Decision::*;
    // Failing is judged on what there is (a backend answering 500s has no TPOT to
    // compare), with 95% confidence: the low end of `to`'s error rate past `from`'s and the
    // allowance (Wilson's interval), so one error in 30 is not a rollback and 12 in 12 is.
    if wilson_low(to.errors, to.requests) * 100.0 > from.error_pct() + c.max_error_pct {
        return (
            RollBack,
            format!(
                "to fails: {:.1}% of its requests failed against from's {:.1}% (at most {} points more)",
                to.error_pct(),
                from.error_pct(),
                c.max_error_pct
            ),
        );
    }
    if let Some((name, r)) = past(tpot, ttft, 0) {
        return (
            RollBack,
            format!(
                "to is worse: its {name} is {:.3}× from's (95% CI {:.3}–{:.3}), past the {} allowed",
                r.ratio, r.ci95[0], r.ci95[1], r.max
            ),
        );
    }
    let fewest = from.requests.min(to.requests);
    if fewest < c.min_requests {
        return (
            Wait,
            format!(
                "waiting for requests: {} of from's and {} of to's since the step began, {} of each needed",
                from.requests, to.requests, c.min_requests
            ),
        );
    }
    let Some(tpot) = tpot else {
        return (
            Wait,
            cmp.reason
                .clone()
                .unwrap_or_else(|| "no TPOT verdict at matched concurrency yet".into()),
        );
    };
    if c.max_ttft_ratio.is_some() && ttft.is_none() {
        return (Wait, "no TTFT verdict at matched concurrency yet".into());
    }
    if let Some((name, r)) = past(Some(tpot), ttft, 1) {
        return (
            Wait,
            format!(
                "not yet shown within bounds: {name} {:.3}× from's, 95% CI up to {:.3} against {} allowed",
                r.ratio, r.ci95[1], r.max
            ),
        );
    }
    if goodput_lower(from, to) {
        return (
            Wait,
            "to's goodput attainment is lower than from's (95% confidence)".into(),
        );
    }
    (
        Advance,
        format!(
            "not worse: TPOT {:.3}× from's (95% CI up to {:.3}, {} allowed)",
            tpot.ratio, tpot.ci95[1], tpot.max
        ),
    )
}

/// The first of TPOT and TTFT whose interval's `end` (0: low, 1: high) is past its bound.
fn past(tpot: Option<Ratio>, ttft: Option<Ratio>, end: usize) -> Option<(&'static str, Ratio)> {
    [("TPOT", tpot), ("TTFT", ttft)]
        .into_iter()
        .find_map(|(name, r)| r.filter(|r| r.ci95[end] > r.max).map(|r| (name, r)))
}

/// The low end of the one-sided 95% Wilson interval of `k` in `n`.
fn wilson_low(k: u64, n: u64) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let (z, n, p) = (1.645_f64, n as f64, k as f64 / n as f64);
    let centre = p + z * z / (2.0 * n);
    let spread = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt();
    ((centre - spread) / (1.0 + z * z / n)).max(0.0)
}

/// Whether `to`'s share of good requests is below `from`'s with 95% confidence (a
/// one-sided test of two proportions).
fn goodput_lower(from: Counts, to: Counts) -> bool {
    if from.judged == 0 || to.judged == 0 {
        return false;
    }
    let (p1, n1) = (from.good as f64 / from.judged as f64, from.judged as f64);
    let (p2, n2) = (to.good as f64 / to.judged as f64, to.judged as f64);
    let pooled = (from.good + to.good) as f64 / (n1 + n2);
    let se = (pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2)).sqrt();
    se > 0.0 && (p1 - p2) / se > 1.645
}
