//! The paired comparison of shadow traffic: each mirrored request against its primary,
//! the same prompt at the same moment on two backends. Per metric, the mean of the pairs'
//! log ratios (b over a) with a 95% CI, at matched concurrency as the A/B verdict is
//! ([`Matching`]):
//!
//! - the pairs ran at the same concurrency: the mean as it is;
//! - their concurrency difference varies across 0: the log ratio is regressed on it and
//!   the intercept (the ratio at a difference of 0) is taken;
//! - the copies ran apart from their primaries (more or fewer in flight, never matched: a
//!   mirrored share that is small, or 100% of a slower backend): each copy's figure is
//!   moved to its primary's concurrency along b's own curve, and the CI carries that
//!   step's uncertainty. The curve's slope is read from the pairs' log ratios (regressed on
//!   b's concurrency, a's beside it), not from b's figures alone: a stall of the machine
//!   slows both sides of a pair and cancels in its ratio, where on b's figures alone it
//!   would read as a rising curve (a slower stream stays longer, so more copies are in
//!   flight). With b's load never varying the step cannot be taken: no CI, and the verdict
//!   says why. A CI never claims a precision the design cannot give.
//!
//! A different output length is reported, not hidden.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use serde::Serialize;

use super::MetricDiff;
use crate::meter::Nanos;

/// One side of a pair: what its request showed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Side {
    /// From when it was sent (a wait in tokentap's queue left out).
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
    pub output_tokens: u64,
    /// Mean requests in flight on its endpoint as its tokens arrived.
    pub concurrency: Option<f64>,
    /// It completed (a pair counts only when both did).
    pub ok: bool,
}

/// A mirrored request and its primary.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub at: Nanos,
    /// The primary's upstream.
    pub primary: String,
    pub a: Side,
    pub b: Side,
}

/// The pairs finished on a mirror upstream, newest last, and how many there are of each
/// primary.
#[derive(Debug, Default)]
pub struct Pairs(Mutex<(VecDeque<Pair>, std::collections::BTreeMap<String, usize>)>);

/// Pairs kept per mirror upstream, at most.
const MAX_PAIRS: usize = 50_000;

impl Pairs {
    pub fn push(&self, pair: Pair) {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (p, counts) = &mut *guard;
        if p.len() == MAX_PAIRS {
            if let Some(old) = p.pop_front() {
                if let Some(n) = counts.get_mut(&old.primary) {
                    *n -= 1;
                    if *n == 0 {
                        counts.remove(&old.primary);
                    }
                }
            }
        }
        *counts.entry(pair.primary.clone()).or_default() += 1;
        p.push_back(pair);
    }

    /// Pairs kept, by primary.
    pub fn counts(&self) -> std::collections::BTreeMap<String, usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .clone()
    }

    /// The pairs with `primary` finished since `since`.
    pub fn of(&self, primary: &str, since: Nanos) -> Vec<Pair> {
        let p = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        p.0.iter()
            .filter(|x| x.at >= since && x.primary == primary)
            .cloned()
            .collect()
    }
}

/// The slot where a request and its copy meet: whichever finishes second makes the pair.
#[derive(Debug)]
pub struct Meeting {
    primary: String,
    sides: Mutex<(Option<Side>, Option<Side>)>,
}

impl Meeting {
    pub fn new(primary: &str) -> Meeting {
        Meeting {
            primary: primary.to_owned(),
            sides: Mutex::new((None, None)),
        }
    }

    /// One side finished at `at` (`shadow`: the copy's); the pair, when it is whole.
    pub fn arrive(&self, at: Nanos, shadow: bool, side: Side) -> Option<Pair> {
        let mut s = self.sides.lock().unwrap_or_else(PoisonError::into_inner);
        if shadow {
            s.1 = Some(side);
        } else {
            s.0 = Some(side);
        }
        match *s {
            (Some(a), Some(b)) => Some(Pair {
                at,
                primary: self.primary.clone(),
                a,
                b,
            }),
            _ => None,
        }
    }
}

/// The paired comparison (`/compare?a=PRIMARY&b=MIRROR`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PairedComparison {
    pub a: String,
    pub b: String,
    pub since_secs: u64,
    pub method: &'static str,
    /// Pairs where both sides completed, and those used (a TPOT on both sides).
    pub pairs: usize,
    /// Mean requests in flight on each side's endpoint as their tokens arrived.
    pub a_concurrency: Option<f64>,
    pub b_concurrency: Option<f64>,
    /// Whether the log ratios were regressed on the concurrency difference.
    pub matched_by_regression: bool,
    /// How the two sides were brought to the same concurrency: `matched` (they ran at it),
    /// `regression`, `b_curve` (moved along b's own curve), or `none` (apart, and b's load
    /// never varied: no CI).
    pub matching: Matching,
    /// With `b_curve`: a's mean concurrency lies outside the range b's copies ran at, so
    /// b's curve was extrapolated to it.
    pub extrapolated: bool,
    pub metrics: PairedMetrics,
    /// Pairs whose two answers differ in length, percent.
    pub length_differs_pct: Option<f64>,
    pub reason: Option<String>,
    pub verdict: String,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PairedMetrics {
    pub tpot_ms: MetricDiff,
    pub ttft_ms: MetricDiff,
    pub e2e_ms: MetricDiff,
    pub output_tokens: MetricDiff,
}

/// Pairs needed for a verdict.
pub const MIN_PAIRS: usize = 30;

/// A mean concurrency difference under this is matched (requests in flight).
const MATCHED: f64 = 0.5;

/// How the paired sides were brought to the same concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Matching {
    /// They ran at it: the pairs' mean difference is under half a request.
    Matched,
    /// The log ratio regressed on a difference that varies across 0.
    Regression,
    /// The copies ran apart: moved to their primaries' concurrency along b's own curve.
    BCurve,
    /// Apart, and b's load never varied: no estimate at matched concurrency.
    None,
}

/// One pair's figures for a metric: the log ratio b/a, the concurrency difference b − a,
/// and each side's concurrency.
#[derive(Debug, Clone, Copy)]
struct Obs {
    log_ratio: f64,
    dc: f64,
    cb: f64,
    ca: f64,
}

/// The paired comparison of `pairs` (a: the primary, b: the mirror).
pub fn compare(a: &str, b: &str, pairs: &[Pair], since_secs: u64) -> PairedComparison {
    let both: Vec<&Pair> = pairs.iter().filter(|p| p.a.ok && p.b.ok).collect();
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let conc = |f: fn(&Pair) -> Option<f64>| {
        let v: Vec<f64> = both.iter().filter_map(|p| f(p)).collect();
        mean(&v)
    };
    let a_conc = conc(|p| p.a.concurrency);
    let b_conc = conc(|p| p.b.concurrency);
    // Each metric's observations, of the pairs with it on both sides.
    let obs = |f: fn(&Side) -> Option<f64>| -> Vec<Obs> {
        both.iter()
            .filter_map(|p| {
                let (x, y) = (f(&p.a)?, f(&p.b)?);
                let (cb, ca) = (p.b.concurrency?, p.a.concurrency?);
                (x > 0.0 && y > 0.0 && x.is_finite() && y.is_finite()).then(|| Obs {
                    log_ratio: (y / x).ln(),
                    dc: cb - ca,
                    cb,
                    ca,
                })
            })
            .collect()
    };
    let tpot = obs(|s| s.tpot_ms);
    // Regressed on the concurrency difference only where that is an interpolation: the
    // differences vary enough to identify the slope, and span 0 (matched). Copies that
    // always ran at another load are moved along b's own curve.
    let dcs: Vec<f64> = tpot.iter().map(|o| o.dc).collect();
    let spread = {
        let m = mean(&dcs).unwrap_or(0.0);
        let var = dcs.iter().map(|d| (d - m).powi(2)).sum::<f64>() / dcs.len().max(1) as f64;
        var.sqrt()
    };
    // A tenth of the differences on each side of 0 at least: not one outlier.
    let tenth = dcs.len() / 10;
    let spans_zero = dcs.iter().filter(|&&d| d < 0.0).count() > tenth
        && dcs.iter().filter(|&&d| d > 0.0).count() > tenth;
    let regress = spread >= 0.5 && spans_zero && tpot.len() >= MIN_PAIRS;
    let mean_gap = dcs.iter().map(|d| d.abs()).sum::<f64>() / dcs.len().max(1) as f64;
    let b_varies = {
        let cbs: Vec<f64> = tpot.iter().map(|o| o.cb).collect();
        let m = mean(&cbs).unwrap_or(0.0);
        cbs.iter().any(|c| (c - m).abs() > 1e-9)
    };
    let matching = if regress {
        Matching::Regression
    } else if mean_gap < MATCHED {
        Matching::Matched
    } else if b_varies {
        Matching::BCurve
    } else {
        Matching::None
    };
    // b's range against a's mean: within it, b's curve is interpolated.
    let extrapolated = matching == Matching::BCurve && {
        let (lo, hi) = tpot.iter().fold((f64::MAX, f64::MIN), |(lo, hi), o| {
            (lo.min(o.cb), hi.max(o.cb))
        });
        a_conc.is_some_and(|ac| ac < lo || ac > hi)
    };
    // A first token waits on b's arrivals as much as on its load (a burst of copies queues
    // their prefills): past the loads b ran at, its curve says nothing of a's, and TTFT and
    // e2e are given as they ran, with no interval. A token's pace follows the batch.
    let queued = if extrapolated {
        Matching::None
    } else {
        matching
    };
    let metrics = PairedMetrics {
        tpot_ms: diff(a, b, &tpot, matching, true),
        ttft_ms: diff(a, b, &obs(|s| s.ttft_ms), queued, true),
        e2e_ms: diff(a, b, &obs(|s| Some(s.e2e_ms)), queued, true),
        // Neither is better for a length, and a length does not depend on the load:
        // compared as it ran, and `better` stays empty.
        output_tokens: diff(
            a,
            b,
            &obs(|s| Some(s.output_tokens as f64)),
            Matching::Matched,
            false,
        ),
    };
    let differ = both
        .iter()
        .filter(|p| p.a.output_tokens != p.b.output_tokens)
        .count();
    let reason = (tpot.len() < MIN_PAIRS).then(|| {
        format!(
            "{} pairs with a TPOT on both sides, {MIN_PAIRS} needed: mirror a larger share or wait",
            tpot.len()
        )
    });
    let verdict = match &reason {
        Some(r) => format!("no verdict: {r}"),
        None => verdict(
            a,
            b,
            &metrics,
            &Design {
                matching,
                extrapolated,
                a_concurrency: a_conc,
                b_concurrency: b_conc,
                pairs: tpot.len(),
            },
        ),
    };
    PairedComparison {
        a: a.to_owned(),
        b: b.to_owned(),
        since_secs,
        method: "paired: each mirrored request against its primary, mean log ratio with a 95% CI",
        pairs: both.len(),
        a_concurrency: a_conc,
        b_concurrency: b_conc,
        matched_by_regression: regress,
        matching,
        extrapolated,
        metrics,
        length_differs_pct: (!both.is_empty()).then(|| 100.0 * differ as f64 / both.len() as f64),
        reason,
        verdict,
    }
}

/// Least squares `y = α + β·x` over `(x, y)`: α, β, the residual variance and Σ(x − x̄)²
/// (0: x never varies, β is not identified).
fn least_squares(points: impl Iterator<Item = (f64, f64)> + Clone) -> (f64, f64, f64, f64, f64) {
    let n = points.clone().count() as f64;
    let mx = points.clone().map(|p| p.0).sum::<f64>() / n;
    let my = points.clone().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.clone().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.clone().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let beta = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let alpha = my - beta * mx;
    let rss: f64 = points.map(|p| (p.1 - alpha - beta * p.0).powi(2)).sum();
    (alpha, beta, rss / (n - 2.0).max(1.0), sxx, mx)
}

/// b's curve: the slope of the log figure against b's concurrency, and its variance, from
/// the pairs' log ratios regressed on b's concurrency and a's (a's curve is the other
/// slope). A pair's ratio holds nothing the two sides shared. None where b's concurrency
/// never varies, where it moved only in step with a's (the two slopes are not told apart),
/// or with too few pairs to leave a residual.
fn b_slope(o: &[Obs]) -> Option<(f64, f64)> {
    if o.len() < 4 {
        return None;
    }
    let n = o.len() as f64;
    let (mb, ma) = (
        o.iter().map(|p| p.cb).sum::<f64>() / n,
        o.iter().map(|p| p.ca).sum::<f64>() / n,
    );
    let my = o.iter().map(|p| p.log_ratio).sum::<f64>() / n;
    let (mut sbb, mut saa, mut sab, mut sby, mut say) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for p in o {
        let (b, a, y) = (p.cb - mb, p.ca - ma, p.log_ratio - my);
        sbb += b * b;
        saa += a * a;
        sab += a * b;
        sby += b * y;
        say += a * y;
    }
    if sbb <= 0.0 {
        return None;
    }
    // a's load never varied (its mean's rounding aside): b's slope alone.
    if saa <= 1e-12 * sbb {
        let (_, slope, s2, sxx, _) = least_squares(o.iter().map(|p| (p.cb, p.log_ratio)));
        return Some((slope, s2 / sxx));
    }
    let det = sbb * saa - sab * sab;
    if det <= 1e-9 * sbb * saa {
        return None;
    }
    let slope_b = (saa * sby - sab * say) / det;
    let slope_a = (sbb * say - sab * sby) / det;
    let rss: f64 = o
        .iter()
        .map(|p| {
            let fit = my + slope_b * (p.cb - mb) + slope_a * (p.ca - ma);
            (p.log_ratio - fit).powi(2)
        })
        .sum();
    Some((slope_b, rss / (n - 3.0) * saa / det))
}

/// The mean of `values` and its standard error.
fn mean_and_se(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = values.collect();
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

/// One metric's paired difference, (b − a)/a percent, at matched concurrency as
/// `matching` says, with a normal 95% CI.
fn diff(a: &str, b: &str, o: &[Obs], matching: Matching, lower: bool) -> MetricDiff {
    let n = o.len();
    let none = MetricDiff::none();
    if n < 2 {
        return none;
    }
    let nf = n as f64;
    let (est, se) = match matching {
        Matching::Matched => mean_and_se(o.iter().map(|p| p.log_ratio)),
        Matching::Regression => {
            // The intercept: the ratio at a difference of 0, and its standard error.
            let (alpha, _, s2, sxx, mx) = least_squares(o.iter().map(|p| (p.dc, p.log_ratio)));
            let se = (s2 * (1.0 / nf + mx * mx / sxx.max(f64::MIN_POSITIVE))).sqrt();
            (alpha, se)
        }
        Matching::BCurve => {
            // Each copy moved by b's slope to its primary's concurrency; the slope's own
            // uncertainty, times the mean step, widens the interval.
            let Some((slope, var_slope)) = b_slope(o) else {
                return none;
            };
            let (m, se_moved) = mean_and_se(o.iter().map(|p| p.log_ratio - slope * p.dc));
            let step = o.iter().map(|p| p.dc).sum::<f64>() / nf;
            (m, (se_moved.powi(2) + step * step * var_slope).sqrt())
        }
        Matching::None => {
            // As it ran, with no interval: the difference in load cannot be told apart
            // from the difference in backend.
            let (m, _) = mean_and_se(o.iter().map(|p| p.log_ratio));
            return MetricDiff {
                diff_pct: m.is_finite().then(|| 100.0 * (m.exp() - 1.0)),
                ..none
            };
        }
    };
    let pct = |l: f64| 100.0 * (l.exp() - 1.0);
    let (lo, hi) = (est - 1.96 * se, est + 1.96 * se);
    let significant = lo > 0.0 || hi < 0.0;
    let better = match (significant, lower) {
        (false, _) => None,
        (true, true) if est > 0.0 => Some(a.to_owned()),
        (true, true) => Some(b.to_owned()),
        (true, false) => None,
    };
    MetricDiff {
        a: None,
        b: None,
        diff_pct: est.is_finite().then(|| pct(est)),
        ci95_pct: (lo.is_finite() && hi.is_finite()).then(|| [pct(lo), pct(hi)]),
        significant,
        better,
    }
}

/// How the pairs were made comparable, for the verdict's words.
struct Design {
    matching: Matching,
    extrapolated: bool,
    a_concurrency: Option<f64>,
    b_concurrency: Option<f64>,
    pairs: usize,
}

fn verdict(a: &str, b: &str, m: &PairedMetrics, d: &Design) -> String {
    let Design {
        matching,
        extrapolated,
        a_concurrency: ac,
        b_concurrency: bc,
        pairs: n,
    } = *d;
    // Said as b against a, as the figures are: "b is 10.0% slower", "b is 4.8% faster".
    let say = |what: &str, d: &MetricDiff| match (&d.better, d.diff_pct, d.ci95_pct) {
        (Some(_), Some(pct), Some([lo, hi])) if pct > 0.0 => {
            format!("{what}: {b} is {pct:.1}% slower than {a} (95% CI {lo:.1}–{hi:.1}%)")
        }
        (Some(_), Some(pct), Some([lo, hi])) => format!(
            "{what}: {b} is {:.1}% faster than {a} (95% CI {:.1}–{:.1}%)",
            -pct, -hi, -lo
        ),
        (None, Some(pct), None) if extrapolated => format!(
            "{what}: {b} {pct:+.1}% against {a} as they ran, not moved past the loads {b} ran at"
        ),
        _ => format!("{what}: no significant difference"),
    };
    let (ac, bc) = (ac.unwrap_or(0.0), bc.unwrap_or(0.0));
    let at = match matching {
        Matching::Regression => "at matched concurrency (regressed on the difference)".to_owned(),
        Matching::Matched => format!("{a} at {ac:.1} in flight, {b} at {bc:.1}"),
        Matching::BCurve => format!(
            "the copies ran apart from their primaries, {b} at {bc:.1} in flight against \
             {a}'s {ac:.1}: each moved to its primary's concurrency along {b}'s own curve{}",
            if extrapolated {
                ", extrapolated past the loads it ran at, TPOT's interval widened by that \
                 step; TTFT and e2e as they ran"
            } else {
                ", the intervals widened by that step"
            }
        ),
        Matching::None => {
            return format!(
                "no verdict at matched concurrency: the copies ran apart from their \
                 primaries ({b} at {bc:.1} in flight against {a}'s {ac:.1}) and {b}'s load \
                 never varied, so its curve cannot bring them together; as they ran, per \
                 output token {b} is {:+.1}% against {a}",
                m.tpot_ms.diff_pct.unwrap_or(0.0)
            )
        }
    };
    let tokens = m.output_tokens.diff_pct.map_or(String::new(), |d| {
        format!("; output tokens {d:+.1}% on {b}")
    });
    format!(
        "paired on {n} prompts: {}; {}; {}{tokens} ({at})",
        say("per output token", &m.tpot_ms),
        say("TTFT", &m.ttft_ms),
        say("e2e", &m.e2e_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A mirrored request of primary `a`, finished at `at`.
    fn pair(at: Nanos, a: Side, b: Side) -> Pair {
        Pair {
            at,
            primary: "a".into(),
            a,
            b,
        }
    }

    fn side(tpot: f64, c: f64) -> Side {
        Side {
            ttft_ms: Some(50.0),
            tpot_ms: Some(tpot),
            e2e_ms: 50.0 + 63.0 * tpot,
            output_tokens: 64,
            concurrency: Some(c),
            ok: true,
        }
    }

    /// The reference curve (Llama 3.1 70B FP8 on an H100), ms a token at `c` in flight.
    fn reference(c: f64) -> f64 {
        let points = [(1.0, 20.0), (16.0, 22.0), (64.0, 26.0), (128.0, 36.0)];
        let i = points.iter().rposition(|p| p.0 <= c).unwrap_or(0).min(2);
        let ((x0, y0), (x1, y1)) = (points[i], points[i + 1]);
        y0 + (y1 - y0) * (c - x0) / (x1 - x0)
    }

    /// b 10% slower per token at every load, mirrored at 100%: slower, its copies stay
    /// longer and run at more in flight than their primaries (never matched), which alone
    /// makes them slower still. As they ran the ratio is 11–12% with a CI a tenth of a
    /// percent wide, which excludes the truth; moved along b's own curve, the CI covers
    /// 10% and the verdict says how it was reached.
    #[test]
    fn copies_run_apart_are_moved_along_bs_curve_and_the_ci_covers_the_truth() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(43);
        let pairs: Vec<Pair> = (0..300)
            .map(|i| {
                let ca: f64 = rng.gen_range(28.0..34.0);
                let cb = 1.1 * ca + rng.gen_range(1.0..8.0);
                // The same prompt: shared noise, and each side's own.
                let base = rng.gen_range(0.9..1.1);
                pair(
                    i,
                    side(base * reference(ca) * rng.gen_range(0.99..1.01), ca),
                    side(1.1 * base * reference(cb) * rng.gen_range(0.99..1.01), cb),
                )
            })
            .collect();
        let c = compare("a", "b", &pairs, 600);
        assert_eq!(c.matching, Matching::BCurve, "{c:?}");
        // Every copy ran above a's mean load: b's curve is extended down to it.
        assert!(c.extrapolated, "{c:?}");
        let t = &c.metrics.tpot_ms;
        assert_eq!(t.better.as_deref(), Some("a"), "{c:?}");
        let [lo, hi] = t.ci95_pct.unwrap_or_default();
        assert!(lo < 10.0 && 10.0 < hi, "{t:?}");
        assert!(hi - lo < 5.0, "still a useful interval: {t:?}");
        assert!(c.verdict.contains("along b's own curve"), "{}", c.verdict);
        // A first token's wait is not carried past the loads b ran at.
        for m in [&c.metrics.ttft_ms, &c.metrics.e2e_ms] {
            assert_eq!((m.ci95_pct, &m.better), (None, &None), "{m:?}");
        }
        assert!(
            c.verdict
                .contains("TTFT: b +0.0% against a as they ran, not moved past the loads b ran at"),
            "{}",
            c.verdict
        );
        // As they ran, the mean alone would have excluded 10%.
        let plain = diff("a", "b", &obs_of(&pairs), Matching::Matched, true);
        let [plo, _] = plain.ci95_pct.unwrap_or_default();
        assert!(plo > 10.5, "{plain:?}");
    }

    /// Both backends flat (b 10% slower at every load), mirrored at a fifth, on a machine
    /// that stalls: a stall slows both sides of a pair, and a slower copy stays longer, so
    /// more copies are in flight when the machine stalls. On b's figures alone its curve
    /// would seem to rise steeply and the move to a's load would carry that; in the pairs'
    /// ratios the stall cancels, and the CI covers 10%.
    #[test]
    fn a_stall_both_sides_share_does_not_bend_bs_curve() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let pairs: Vec<Pair> = (0..300)
            .map(|i| {
                let stall: f64 = rng.gen_range(0.0..0.3);
                let ca = 31.5 + rng.gen_range(-0.5..0.5);
                let cb = 6.0 + 20.0 * stall + rng.gen_range(-1.0..1.0);
                let slow = stall.exp();
                pair(
                    i,
                    side(50.0 * slow * rng.gen_range(0.99..1.01), ca),
                    side(55.0 * slow * rng.gen_range(0.99..1.01), cb),
                )
            })
            .collect();
        let c = compare("a", "b", &pairs, 600);
        assert_eq!(c.matching, Matching::BCurve, "{c:?}");
        let t = &c.metrics.tpot_ms;
        let [lo, hi] = t.ci95_pct.unwrap_or_default();
        assert!(lo < 10.0 && 10.0 < hi && hi - lo < 3.0, "{t:?}");
        // b's own figures against its load: a slope that would have moved b by over half.
        let b_alone = least_squares(pairs.iter().map(|p| {
            let b = p.b.tpot_ms.unwrap_or(1.0).ln();
            (p.b.concurrency.unwrap_or(0.0), b)
        }));
        let moved = (b_alone.1 * -25.0).exp();
        assert!(moved < 0.5, "{b_alone:?}");
    }

    fn obs_of(pairs: &[Pair]) -> Vec<Obs> {
        pairs
            .iter()
            .map(|p| {
                let (x, y) = (p.a.tpot_ms.unwrap_or(1.0), p.b.tpot_ms.unwrap_or(1.0));
                let (ca, cb) = (
                    p.a.concurrency.unwrap_or(0.0),
                    p.b.concurrency.unwrap_or(0.0),
                );
                Obs {
                    log_ratio: (y / x).ln(),
                    dc: cb - ca,
                    cb,
                    ca,
                }
            })
            .collect()
    }

    /// A small mirrored share at a load of its own that never varies: no curve to move
    /// the copies along, so no interval and no winner, and the verdict says why.
    #[test]
    fn copies_apart_at_one_load_get_no_interval() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(36);
        let pairs: Vec<Pair> = (0..200)
            .map(|i| {
                let base = 20.0 * rng.gen_range(0.9..1.1);
                pair(
                    i,
                    side(base * rng.gen_range(0.98..1.02), 32.0),
                    side(1.1 * base * rng.gen_range(0.98..1.02), 6.0),
                )
            })
            .collect();
        let c = compare("a", "b", &pairs, 600);
        assert_eq!(c.matching, Matching::None, "{c:?}");
        let t = &c.metrics.tpot_ms;
        assert_eq!((t.better.as_deref(), t.ci95_pct), (None, None), "{c:?}");
        assert!(
            t.diff_pct.is_some_and(|d| (9.0..11.0).contains(&d)),
            "{t:?}"
        );
        assert!(
            c.verdict.starts_with("no verdict at matched concurrency"),
            "{}",
            c.verdict
        );
        assert_eq!(c.metrics.output_tokens.better, None);
    }

    #[test]
    fn a_varying_concurrency_difference_is_regressed_out() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        // b 5% slower at matched concurrency, and 1% slower still per request more in
        // flight than a, running at a's load give or take 5 and mostly above it: the raw
        // ratio would overstate it.
        let pairs: Vec<Pair> = (0..400)
            .map(|i| {
                let (ca, cb): (f64, f64) = (16.0, rng.gen_range(13.0..26.0));
                let base = 20.0 * rng.gen_range(0.95..1.05);
                let slow = 1.05 * (0.01 * (cb - ca)).exp();
                pair(
                    i,
                    side(base, ca),
                    side(base * slow * rng.gen_range(0.99..1.01), cb),
                )
            })
            .collect();
        let c = compare("a", "b", &pairs, 600);
        assert!(c.matched_by_regression);
        assert_eq!(c.matching, Matching::Regression);
        let [lo, hi] = c.metrics.tpot_ms.ci95_pct.unwrap_or_default();
        assert!(lo < 5.0 && 5.0 < hi, "{:?}", c.metrics.tpot_ms);
    }

    #[test]
    fn too_few_pairs_say_so_and_a_meeting_needs_both() {
        let m = Meeting::new("a");
        assert!(m.arrive(1, true, side(20.0, 1.0)).is_none());
        let p = m.arrive(2, false, side(22.0, 1.0)).expect("a pair");
        assert_eq!((p.a.tpot_ms, p.b.tpot_ms), (Some(22.0), Some(20.0)));
        let c = compare("a", "b", &[p], 600);
        assert!(c.reason.is_some() && c.verdict.starts_with("no verdict"));
        let pairs = Pairs::default();
        pairs.push(pair(5, side(1.0, 1.0), side(1.0, 1.0)));
        assert_eq!(pairs.of("a", 5).len(), 1);
        assert!(pairs.of("a", 6).is_empty() && pairs.of("x", 0).is_empty());
        assert_eq!(
            pairs.counts().into_iter().collect::<Vec<_>>(),
            vec![("a".to_owned(), 1)]
        );
    }
}
