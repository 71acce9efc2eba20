//! A/B comparison at matched concurrency (`GET /compare`).
//!
//! TPOT rises with concurrency, so comparing an arm that ran at 10 in flight with one at 60
//! says nothing about the backends. Each finished streamed request is a sample tagged with
//! the mean concurrency its tokens arrived at. The verdict comes from [`matched`]: a
//! regression of each metric against concurrency over the range both arms ran in, with one
//! slope for both and an offset for b, whatever the bucket edges; at least
//! [`MIN_IN_OVERLAP`] requests per arm inside that range. A difference is significant when
//! its 95% CI excludes 0.
//!
//! The earlier method stays as a cross-check (`cross_check`, `strata`): samples stratified
//! by power-of-two concurrency bucket (1, 2, 3–4, 5–8, …), the relative difference inside
//! every stratum where both arms have [`MIN_PER_STRATUM`] samples, combined weighted by the
//! smaller arm's count, with a seeded stratified bootstrap. It was the verdict until a
//! closed loop showed why it cannot be: the slower arm always runs at a little more
//! concurrency, and at 32 clients the two arms fell into neighbouring strata in 3 runs of
//! 4 (a at 14–16, b at 16–17), leaving no stratum with both.
//!
//! Metrics per request: TPOT and TTFT (lower is better), single-stream T/s = 1000 / TPOT and
//! system T/s = concurrency × 1000 / TPOT, the rate the backend sustained while the request
//! ran (higher is better).

mod cost;
pub mod matched;
pub mod paired;

pub use cost::{ArmPrice, CostComparison};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::meter::{bucket_of, RequestSample};

/// Samples each arm needs in a stratum for it to count: below ~20 a stratum's mean is too
/// noisy to be worth its weight, and a bootstrap of it is unreliable.
pub const MIN_PER_STRATUM: usize = 20;
/// Bootstrap rounds.
pub const BOOTSTRAP: usize = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Better {
    Lower,
    Higher,
}

const METRICS: [(&str, Better, &str); 4] = [
    ("tpot_ms", Better::Lower, "per output token"),
    ("ttft_ms", Better::Lower, "to first token"),
    ("single_stream_tps", Better::Higher, "single-stream T/s"),
    ("system_tps", Better::Higher, "system T/s"),
];

fn value(s: &RequestSample, metric: usize) -> f64 {
    match metric {
        0 => s.tpot_ms,
        1 => s.ttft_ms,
        2 => 1000.0 / s.tpot_ms,
        _ => s.concurrency * 1000.0 / s.tpot_ms,
    }
}

/// One metric's comparison.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MetricDiff {
    /// Stratified means of each arm.
    pub a: Option<f64>,
    pub b: Option<f64>,
    /// (b − a) / a, percent, combined over strata.
    pub diff_pct: Option<f64>,
    pub ci95_pct: Option<[f64; 2]>,
    pub significant: bool,
    /// The arm that is better, when significant.
    pub better: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Metrics {
    pub tpot_ms: MetricDiff,
    pub ttft_ms: MetricDiff,
    pub single_stream_tps: MetricDiff,
    pub system_tps: MetricDiff,
}

/// One concurrency stratum.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stratum {
    /// The bucket's upper bound.
    pub concurrency: u64,
    pub a_requests: usize,
    pub b_requests: usize,
    /// Whether both arms have enough samples for it to count.
    pub used: bool,
    pub tpot_ms: StratumMeans,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StratumMeans {
    pub a: Option<f64>,
    pub b: Option<f64>,
    pub diff_pct: Option<f64>,
}

pub use matched::MIN_IN_OVERLAP;

/// The `/compare` document.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    pub since_secs: u64,
    /// How the verdict was reached.
    pub method: &'static str,
    pub min_in_overlap: usize,
    /// Where both arms ran, and the requests compared there; `null` without samples.
    pub overlap: Option<Overlap>,
    pub metrics: Metrics,
    /// Why there is no verdict, in words a user can act on; `null` when there is one.
    pub reason: Option<String>,
    pub verdict: String,
    /// The window's levels (one when it is narrow), each fitted alone, TPOT.
    pub levels: Vec<Level>,
    /// The stratified comparison, for reference.
    pub cross_check: CrossCheck,
    pub min_per_stratum: usize,
    pub strata: Vec<Stratum>,
    /// Each arm's cost per million output tokens at matched concurrency, when both have a
    /// price in one currency and a verdict was reached.
    pub cost: Option<CostComparison>,
}

/// The concurrency range compared.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Overlap {
    /// The window compared (requests in flight).
    pub concurrency: Option<[f64; 2]>,
    /// Each arm's range: the 5th and 95th percentiles of its requests' concurrency.
    pub a_range: [f64; 2],
    pub b_range: [f64; 2],
    /// Requests of each arm inside the window.
    pub a_requests: usize,
    pub b_requests: usize,
}

/// One level of the window: TPOT fitted there alone.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Level {
    pub concurrency: [f64; 2],
    pub a_requests: usize,
    pub b_requests: usize,
    /// Whether both arms had enough requests in it to count.
    pub used: bool,
    pub tpot_diff_pct: Option<f64>,
    pub tpot_ci95_pct: Option<[f64; 2]>,
}

/// The levels a verdict rests on: their range and requests.
struct Compared {
    concurrency: [f64; 2],
    a_requests: usize,
    b_requests: usize,
}

/// The stratified comparison of TPOT.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CrossCheck {
    pub method: &'static str,
    pub tpot_ms: MetricDiff,
    pub strata_used: usize,
}

const METHOD: &str = "regression at matched concurrency: ln(metric) = α + β·concurrency + γ·[arm b] over the range both arms ran in, 95% CI from robust (HC1) standard errors";
const CROSS_METHOD: &str =
    "power-of-two concurrency strata, weighted by the smaller arm's count, stratified bootstrap";

/// Compares the samples of arm `a` with those of arm `b`.
pub fn compare(
    a_name: &str,
    a: &[RequestSample],
    b_name: &str,
    b: &[RequestSample],
    since_secs: u64,
) -> Comparison {
    let usable = |s: &[RequestSample]| -> Vec<RequestSample> {
        s.iter()
            .filter(|s| s.tpot_ms > 0.0 && s.tpot_ms.is_finite() && s.concurrency > 0.0)
            .copied()
            .collect()
    };
    let (a, b) = (usable(a), usable(b));
    let (overlap, fitted, reason) = matched_comparison(a_name, &a, b_name, &b);
    // Each level's samples, when there is a window.
    let levels: Vec<(matched::Window, Vec<RequestSample>, Vec<RequestSample>)> = fitted
        .as_ref()
        .map(|(ia, ib, w)| {
            matched::levels(ia, ib, *w)
                .into_iter()
                .map(|l| (l, matched::inside(ia, l), matched::inside(ib, l)))
                .collect()
        })
        .unwrap_or_default();
    let level_fit = |m: usize, (_, la, lb): &(matched::Window, Vec<_>, Vec<_>)| {
        (la.len() >= matched::MIN_PER_LEVEL && lb.len() >= matched::MIN_PER_LEVEL)
            .then(|| matched::fit(la, lb, m))
            .flatten()
    };
    let metric_diff = |m: usize| match fitted.as_ref() {
        Some((ia, _, _)) => {
            let fits: Vec<matched::LogFit> =
                levels.iter().filter_map(|l| level_fit(m, l)).collect();
            let a_mean = mean(ia, m).unwrap_or(f64::NAN);
            from_fit(matched::combine(&fits), a_mean, m, a_name, b_name)
        }
        None => MetricDiff::none(),
    };
    let mut diffs: Vec<MetricDiff> = (0..METRICS.len()).map(metric_diff).collect();
    let levels_out: Vec<Level> = levels
        .iter()
        .map(|l| {
            let fit = level_fit(0, l);
            let (diff, ci) = fit.map(|f| f.pct()).unzip();
            Level {
                concurrency: [l.0.lo, l.0.hi],
                a_requests: l.1.len(),
                b_requests: l.2.len(),
                used: fit.is_some(),
                tpot_diff_pct: diff,
                tpot_ci95_pct: ci,
            }
        })
        .collect();
    // Curves that cross: one arm significantly faster per token in one level, the other
    // in another. No single arm is better then.
    let faster_in = |b_faster: bool| {
        levels_out.iter().find(|l| {
            l.tpot_ci95_pct
                .is_some_and(|[lo, hi]| if b_faster { hi < 0.0 } else { lo > 0.0 })
        })
    };
    let crossing = faster_in(true).zip(faster_in(false));
    // What was compared: the levels with enough of both arms.
    let used: Vec<&Level> = levels_out.iter().filter(|l| l.used).collect();
    let compared = used.first().zip(used.last()).map(|(first, last)| Compared {
        concurrency: [first.concurrency[0], last.concurrency[1]],
        a_requests: used.iter().map(|l| l.a_requests).sum(),
        b_requests: used.iter().map(|l| l.b_requests).sum(),
    });
    let reason = match (reason, &overlap, &compared) {
        (None, Some(o), None) => Some(format!(
            "not enough data: where both ran ({} in flight) no concurrency level has {} finished requests of each arm yet; let both run longer at the same load",
            o.concurrency.map_or_else(String::new, span),
            matched::MIN_PER_LEVEL
        )),
        (reason, _, _) => reason,
    };
    if crossing.is_some() {
        diffs[0].better = None;
        diffs[2].better = None;
    }

    let strata = stratify(&a, &b);
    let used: Vec<&(usize, Vec<RequestSample>, Vec<RequestSample>)> = strata
        .iter()
        .filter(|(_, sa, sb)| sa.len() >= MIN_PER_STRATUM && sb.len() >= MIN_PER_STRATUM)
        .collect();
    let seed = (a.len() as u64) << 32 ^ b.len() as u64;
    let cross_check = CrossCheck {
        method: CROSS_METHOD,
        tpot_ms: metric(&used, 0, a_name, b_name, seed),
        strata_used: used.len(),
    };
    let strata_out = strata
        .iter()
        .map(|(k, sa, sb)| {
            let (ma, mb) = (mean(sa, 0), mean(sb, 0));
            Stratum {
                concurrency: 1 << k,
                a_requests: sa.len(),
                b_requests: sb.len(),
                used: sa.len() >= MIN_PER_STRATUM && sb.len() >= MIN_PER_STRATUM,
                tpot_ms: StratumMeans {
                    a: ma,
                    b: mb,
                    diff_pct: ma.zip(mb).map(|(x, y)| (y - x) / x * 100.0),
                },
            }
        })
        .collect();
    let verdict = match (&reason, &compared, crossing) {
        (Some(why), _, _) => why.clone(),
        (None, Some(o), None) => verdict(&diffs, o, None),
        (None, Some(o), Some((b_level, a_level))) => {
            let pct = |l: &Level| l.tpot_diff_pct.map_or(0.0, f64::abs);
            let which = format!(
                "which arm is faster per output token depends on load: {a_name} by {:.1}% at {} in flight, {b_name} by {:.1}% at {}",
                pct(a_level),
                span(a_level.concurrency),
                pct(b_level),
                span(b_level.concurrency)
            );
            verdict(&diffs, o, Some(which))
        }
        (None, None, _) => unreachable!("no reason means a level was compared"),
    };
    let mut it = diffs.into_iter();
    let mut next = || it.next().unwrap_or_else(|| unreachable!("four metrics"));
    Comparison {
        a: a_name.to_owned(),
        b: b_name.to_owned(),
        since_secs,
        method: METHOD,
        min_in_overlap: MIN_IN_OVERLAP,
        overlap,
        metrics: Metrics {
            tpot_ms: next(),
            ttft_ms: next(),
            single_stream_tps: next(),
            system_tps: next(),
        },
        reason,
        verdict,
        levels: levels_out,
        cross_check,
        min_per_stratum: MIN_PER_STRATUM,
        strata: strata_out,
        cost: None,
    }
}

type Fitted = (Vec<RequestSample>, Vec<RequestSample>, matched::Window);

/// The window both arms ran in and their samples inside it, or why there is none.
fn matched_comparison(
    a_name: &str,
    a: &[RequestSample],
    b_name: &str,
    b: &[RequestSample],
) -> (Option<Overlap>, Option<Fitted>, Option<String>) {
    let (Some(ra), Some(rb)) = (matched::range(a), matched::range(b)) else {
        let missing = if a.is_empty() { a_name } else { b_name };
        let why = format!(
            "not enough data: no finished streamed request on {missing} yet; send traffic to both arms"
        );
        return (None, None, Some(why));
    };
    let Some(w) = matched::window(ra, rb) else {
        let overlap = Overlap {
            concurrency: None,
            a_range: ra,
            b_range: rb,
            a_requests: 0,
            b_requests: 0,
        };
        let why = format!(
            "no verdict: {a_name} ran at {} in flight, {b_name} at {}: no overlap to compare; send both the same load",
            span(ra),
            span(rb)
        );
        return (Some(overlap), None, Some(why));
    };
    let (ia, ib) = (matched::inside(a, w), matched::inside(b, w));
    let overlap = Overlap {
        concurrency: Some([w.lo, w.hi]),
        a_range: ra,
        b_range: rb,
        a_requests: ia.len(),
        b_requests: ib.len(),
    };
    if ia.len() < MIN_IN_OVERLAP || ib.len() < MIN_IN_OVERLAP {
        let why = format!(
            "not enough data: where both ran ({} in flight) {a_name} has {} finished requests and {b_name} {}; {MIN_IN_OVERLAP} each are needed",
            span([w.lo, w.hi]),
            ia.len(),
            ib.len()
        );
        return (Some(overlap), None, Some(why));
    }
    (Some(overlap), Some((ia, ib, w)), None)
}

/// A concurrency range as people say it: "14–17".
fn span([lo, hi]: [f64; 2]) -> String {
    let (lo, hi) = (lo.round(), hi.round());
    if lo == hi {
        format!("{lo:.0}")
    } else {
        format!("{lo:.0}–{hi:.0}")
    }
}

/// A metric's verdict from its combined fit; `a_mean`: arm a's mean in the window.
fn from_fit(
    fit: Option<matched::LogFit>,
    a_mean: f64,
    m: usize,
    a_name: &str,
    b_name: &str,
) -> MetricDiff {
    let Some(f) = fit else {
        return MetricDiff::none();
    };
    let (diff_pct, ci95_pct) = f.pct();
    let significant = f.significant();
    let better = significant.then(|| winner(m, diff_pct, a_name, b_name));
    MetricDiff {
        a: Some(a_mean),
        b: Some(a_mean * (1.0 + diff_pct / 100.0)),
        diff_pct: Some(diff_pct),
        ci95_pct: Some(ci95_pct),
        significant,
        better,
    }
}

impl MetricDiff {
    fn none() -> Self {
        MetricDiff {
            a: None,
            b: None,
            diff_pct: None,
            ci95_pct: None,
            significant: false,
            better: None,
        }
    }
}

/// Samples by concurrency bucket, buckets in order.
fn stratify(
    a: &[RequestSample],
    b: &[RequestSample],
) -> Vec<(usize, Vec<RequestSample>, Vec<RequestSample>)> {
    let mut out: Vec<(usize, Vec<RequestSample>, Vec<RequestSample>)> = Vec::new();
    for (arm, samples) in [(0, a), (1, b)] {
        for s in samples
            .iter()
            .filter(|s| s.tpot_ms > 0.0 && s.tpot_ms.is_finite())
        {
            let k = bucket_of(s.concurrency);
            let i = match out.iter().position(|(b, _, _)| *b == k) {
                Some(i) => i,
                None => {
                    out.push((k, Vec::new(), Vec::new()));
                    out.len() - 1
                }
            };
            if arm == 0 {
                out[i].1.push(*s);
            } else {
                out[i].2.push(*s);
            }
        }
    }
    out.sort_by_key(|(k, _, _)| *k);
    out
}

/// The better arm of metric `m` when b differs from a by `diff_pct`.
fn winner(m: usize, diff_pct: f64, a_name: &str, b_name: &str) -> String {
    let b_wins = match METRICS[m].1 {
        Better::Lower => diff_pct < 0.0,
        Better::Higher => diff_pct > 0.0,
    };
    if b_wins { b_name } else { a_name }.to_owned()
}

fn mean(s: &[RequestSample], m: usize) -> Option<f64> {
    (!s.is_empty()).then(|| s.iter().map(|x| value(x, m)).sum::<f64>() / s.len() as f64)
}

/// The combined relative difference, percent: Σ w·(b̄−ā)/ā over strata / Σ w with
/// w = min(n_a, n_b); and the same-weighted means of each arm. Takes (ā, b̄, w) per stratum.
fn combined(strata: impl Iterator<Item = (f64, f64, f64)>) -> (f64, f64, f64) {
    let (mut num, mut den, mut ma, mut mb) = (0.0, 0.0, 0.0, 0.0);
    for (x, y, w) in strata {
        num += w * (y - x) / x;
        den += w;
        ma += w * x;
        mb += w * y;
    }
    (num / den * 100.0, ma / den, mb / den)
}

fn avg(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn metric(
    used: &[&(usize, Vec<RequestSample>, Vec<RequestSample>)],
    m: usize,
    a_name: &str,
    b_name: &str,
    seed: u64,
) -> MetricDiff {
    if used.is_empty() {
        return MetricDiff::none();
    }
    let values: Vec<(Vec<f64>, Vec<f64>)> = used
        .iter()
        .map(|(_, sa, sb)| {
            (
                sa.iter().map(|s| value(s, m)).collect(),
                sb.iter().map(|s| value(s, m)).collect(),
            )
        })
        .collect();
    let weight = |a: &[f64], b: &[f64]| a.len().min(b.len()) as f64;
    let (diff, ma, mb) = combined(values.iter().map(|(a, b)| (avg(a), avg(b), weight(a, b))));

    // Stratified bootstrap: resample each arm within each stratum, recombine.
    let mut rng = SmallRng::seed_from_u64(seed ^ m as u64);
    let mut resampled_mean = |v: &[f64]| {
        (0..v.len())
            .map(|_| v[rng.gen_range(0..v.len())])
            .sum::<f64>()
            / v.len() as f64
    };
    let mut boots: Vec<f64> = (0..BOOTSTRAP)
        .map(|_| {
            let means: Vec<(f64, f64, f64)> = values
                .iter()
                .map(|(a, b)| (resampled_mean(a), resampled_mean(b), weight(a, b)))
                .collect();
            combined(means.into_iter()).0
        })
        .collect();
    boots.sort_unstable_by(f64::total_cmp);
    let lo = boots[(0.025 * BOOTSTRAP as f64) as usize];
    let hi = boots[((0.975 * BOOTSTRAP as f64) as usize).min(BOOTSTRAP - 1)];
    let significant = lo > 0.0 || hi < 0.0;
    let better = significant.then(|| winner(m, diff, a_name, b_name));
    MetricDiff {
        a: Some(ma),
        b: Some(mb),
        diff_pct: Some(diff),
        ci95_pct: Some([lo, hi]),
        significant,
        better,
    }
}

/// The winner, the gap as a positive percent, and its CI as positive percents.
fn gap(m: &MetricDiff) -> Option<(&str, f64, f64, f64)> {
    match (&m.better, m.diff_pct, m.ci95_pct) {
        (Some(w), Some(diff), Some([lo, hi])) => Some((
            w,
            diff.abs(),
            lo.abs().min(hi.abs()),
            lo.abs().max(hi.abs()),
        )),
        _ => None,
    }
}

fn verdict(d: &[MetricDiff], o: &Compared, crossing: Option<String>) -> String {
    let tpot = match (crossing, gap(&d[0])) {
        (Some(which), _) => which,
        (None, Some((w, pct, lo, hi))) => format!("{w} is {pct:.1}% faster per output token (95% CI {lo:.1}–{hi:.1}%) at matched concurrency"),
        (None, None) => "TPOT: no significant difference at matched concurrency".to_owned(),
    };
    let ttft = match gap(&d[1]) {
        Some((w, pct, lo, hi)) => {
            format!("TTFT: {w} is {pct:.1}% faster (95% CI {lo:.1}–{hi:.1}%)")
        }
        None => "TTFT: no significant difference".to_owned(),
    };
    let system = match gap(&d[3]) {
        Some((w, pct, lo, hi)) => {
            format!("system T/s: {w} {pct:.1}% higher (95% CI {lo:.1}–{hi:.1}%)")
        }
        None => "system T/s: no significant difference".to_owned(),
    };
    let at = span(o.concurrency);
    format!(
        "{tpot}; {ttft}; {system} (compared at {at} in flight, {} and {} requests, by regression at matched concurrency)",
        o.a_requests, o.b_requests
    )
}

#[cfg(test)]
mod tests;
