//! The paired comparison of shadow traffic: each mirrored request against its primary,
//! the same prompt at the same moment on two backends. Per metric, the mean of the pairs'
//! log ratios (b over a) with a 95% CI; where the two sides ran at different concurrency
//! and that difference varies across pairs, the log ratio is regressed on it and the
//! intercept (the ratio at matched concurrency) is taken, as the A/B verdict matches
//! concurrency. A different output length is reported, not hidden.

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
    // Each metric: (log ratio b/a, concurrency difference b − a) of the pairs with both.
    let obs = |f: fn(&Side) -> Option<f64>| -> Vec<(f64, f64)> {
        both.iter()
            .filter_map(|p| {
                let (x, y) = (f(&p.a)?, f(&p.b)?);
                let dc = p.b.concurrency? - p.a.concurrency?;
                (x > 0.0 && y > 0.0 && x.is_finite() && y.is_finite()).then(|| ((y / x).ln(), dc))
            })
            .collect()
    };
    let tpot = obs(|s| s.tpot_ms);
    // Regressed on the concurrency difference only where that is an interpolation: the
    // differences vary enough to identify the slope, and span 0 (matched). A mirror that
    // always runs at another load is compared as it ran, and says at what concurrency.
    let dcs: Vec<f64> = tpot.iter().map(|&(_, dc)| dc).collect();
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
    let lower_better = |o: &[(f64, f64)]| diff(a, b, o, regress, true);
    let metrics = PairedMetrics {
        tpot_ms: lower_better(&tpot),
        ttft_ms: lower_better(&obs(|s| s.ttft_ms)),
        e2e_ms: lower_better(&obs(|s| Some(s.e2e_ms))),
        // Neither is better for a length: `better` stays empty.
        output_tokens: diff(a, b, &obs(|s| Some(s.output_tokens as f64)), false, false),
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
        None => verdict(a, b, &metrics, regress, (a_conc, b_conc), tpot.len()),
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
        metrics,
        length_differs_pct: (!both.is_empty()).then(|| 100.0 * differ as f64 / both.len() as f64),
        reason,
        verdict,
    }
}

/// One metric's paired difference, (b − a)/a percent: the mean log ratio (or, `regress`,
/// its intercept against the concurrency difference), with a normal 95% CI.
fn diff(a: &str, b: &str, o: &[(f64, f64)], regress: bool, lower: bool) -> MetricDiff {
    let n = o.len();
    if n < 2 {
        return MetricDiff {
            a: None,
            b: None,
            diff_pct: None,
            ci95_pct: None,
            significant: false,
            better: None,
        };
    }
    let nf = n as f64;
    let (est, se) = if regress {
        // Least squares y = α + β·x; α's standard error.
        let mx = o.iter().map(|p| p.1).sum::<f64>() / nf;
        let my = o.iter().map(|p| p.0).sum::<f64>() / nf;
        let sxx: f64 = o.iter().map(|p| (p.1 - mx).powi(2)).sum();
        let sxy: f64 = o.iter().map(|p| (p.1 - mx) * (p.0 - my)).sum();
        let beta = if sxx > 0.0 { sxy / sxx } else { 0.0 };
        let alpha = my - beta * mx;
        let rss: f64 = o.iter().map(|p| (p.0 - alpha - beta * p.1).powi(2)).sum();
        let s2 = rss / (nf - 2.0).max(1.0);
        let se = (s2 * (1.0 / nf + mx * mx / sxx.max(f64::MIN_POSITIVE))).sqrt();
        (alpha, se)
    } else {
        let m = o.iter().map(|p| p.0).sum::<f64>() / nf;
        let var = o.iter().map(|p| (p.0 - m).powi(2)).sum::<f64>() / (nf - 1.0);
        (m, (var / nf).sqrt())
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

fn verdict(
    a: &str,
    b: &str,
    m: &PairedMetrics,
    regress: bool,
    (ac, bc): (Option<f64>, Option<f64>),
    n: usize,
) -> String {
    // Said as b against a, as the figures are: "b is 10.0% slower", "b is 4.8% faster".
    let say = |what: &str, d: &MetricDiff| match (&d.better, d.diff_pct, d.ci95_pct) {
        (Some(_), Some(pct), Some([lo, hi])) if pct > 0.0 => {
            format!("{what}: {b} is {pct:.1}% slower than {a} (95% CI {lo:.1}–{hi:.1}%)")
        }
        (Some(_), Some(pct), Some([lo, hi])) => format!(
            "{what}: {b} is {:.1}% faster than {a} (95% CI {:.1}–{:.1}%)",
            -pct, -hi, -lo
        ),
        _ => format!("{what}: no significant difference"),
    };
    let at = match (ac, bc, regress) {
        (_, _, true) => "at matched concurrency (regressed on the difference)".to_owned(),
        (Some(ac), Some(bc), false) => {
            format!("{a} at {ac:.1} in flight, {b} at {bc:.1}")
        }
        _ => String::new(),
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

    #[test]
    fn a_tenth_slower_mirror_is_named_with_a_ci_covering_ten_percent() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(36);
        let pairs: Vec<Pair> = (0..200)
            .map(|i| {
                // The same prompt: shared noise, and each side's own.
                let base = 20.0 * rng.gen_range(0.9..1.1);
                Pair {
                    at: i,
                    primary: "a".into(),
                    a: side(base * rng.gen_range(0.98..1.02), 32.0),
                    b: side(1.1 * base * rng.gen_range(0.98..1.02), 6.0),
                }
            })
            .collect();
        let c = compare("a", "b", &pairs, 600);
        let t = &c.metrics.tpot_ms;
        assert_eq!(t.better.as_deref(), Some("a"), "{c:?}");
        let [lo, hi] = t.ci95_pct.unwrap_or_default();
        assert!(lo < 10.0 && 10.0 < hi, "{t:?}");
        assert!(
            !c.matched_by_regression,
            "one concurrency difference: not identifiable"
        );
        assert!(c.verdict.contains("b is 10."), "{}", c.verdict);
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
                Pair {
                    at: i,
                    primary: "a".into(),
                    a: side(base, ca),
                    b: side(base * slow * rng.gen_range(0.99..1.01), cb),
                }
            })
            .collect();
        let c = compare("a", "b", &pairs, 600);
        assert!(c.matched_by_regression);
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
        pairs.push(Pair {
            at: 5,
            primary: "a".into(),
            a: side(1.0, 1.0),
            b: side(1.0, 1.0),
        });
        assert_eq!(pairs.of("a", 5).len(), 1);
        assert!(pairs.of("a", 6).is_empty() && pairs.of("x", 0).is_empty());
        assert_eq!(
            pairs.counts().into_iter().collect::<Vec<_>>(),
            vec![("a".to_owned(), 1)]
        );
    }
}
