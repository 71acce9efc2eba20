//! A/B comparison at matched concurrency (`GET /compare`).
//!
//! TPOT rises with concurrency, so comparing an arm that ran at 10 in flight with one at 60
//! says nothing about the backends. Each finished request is a sample tagged with the mean
//! concurrency its tokens arrived at; samples are stratified by concurrency bucket (1, 2,
//! 3–4, 5–8, …), each metric's relative difference is taken inside every stratum where both
//! arms have at least [`MIN_PER_STRATUM`] samples, and the strata are combined weighted by
//! the smaller arm's count. The 95% CI comes from a stratified bootstrap (resampling each
//! arm within each stratum, [`BOOTSTRAP`] rounds, seeded so one data set always gives the
//! same answer). A difference is significant when its CI excludes 0.
//!
//! Metrics per request: TPOT and TTFT (lower is better), single-stream T/s = 1000 / TPOT and
//! system T/s = concurrency × 1000 / TPOT, the rate the backend sustained while the request
//! ran (higher is better).

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

/// The `/compare` document.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    pub since_secs: u64,
    pub min_per_stratum: usize,
    pub metrics: Metrics,
    pub strata: Vec<Stratum>,
    pub verdict: String,
}

/// Compares the samples of arm `a` with those of arm `b`.
pub fn compare(
    a_name: &str,
    a: &[RequestSample],
    b_name: &str,
    b: &[RequestSample],
    since_secs: u64,
) -> Comparison {
    let strata = stratify(a, b);
    let used: Vec<&(usize, Vec<RequestSample>, Vec<RequestSample>)> = strata
        .iter()
        .filter(|(_, sa, sb)| sa.len() >= MIN_PER_STRATUM && sb.len() >= MIN_PER_STRATUM)
        .collect();
    let seed = (a.len() as u64) << 32 ^ b.len() as u64;
    let diffs: Vec<MetricDiff> = (0..METRICS.len())
        .map(|m| metric(&used, m, a_name, b_name, seed))
        .collect();
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
    let verdict = verdict(&diffs, used.len(), a_name, b_name);
    let mut it = diffs.into_iter();
    let mut next = || it.next().unwrap_or_else(|| unreachable!("four metrics"));
    Comparison {
        a: a_name.to_owned(),
        b: b_name.to_owned(),
        since_secs,
        min_per_stratum: MIN_PER_STRATUM,
        metrics: Metrics {
            tpot_ms: next(),
            ttft_ms: next(),
            single_stream_tps: next(),
            system_tps: next(),
        },
        strata: strata_out,
        verdict,
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
        return MetricDiff {
            a: None,
            b: None,
            diff_pct: None,
            ci95_pct: None,
            significant: false,
            better: None,
        };
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
    let b_bigger = diff > 0.0;
    let better = significant.then(|| {
        let b_wins = match METRICS[m].1 {
            Better::Lower => !b_bigger,
            Better::Higher => b_bigger,
        };
        if b_wins { b_name } else { a_name }.to_owned()
    });
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

fn verdict(d: &[MetricDiff], strata: usize, a: &str, b: &str) -> String {
    if strata == 0 {
        return format!(
            "not enough data: no concurrency level where both {a} and {b} have {MIN_PER_STRATUM} finished requests yet"
        );
    }
    let tpot = match gap(&d[0]) {
        Some((w, pct, lo, hi)) => format!("{w} is {pct:.1}% faster per output token (95% CI {lo:.1}–{hi:.1}%) at matched concurrency"),
        None => "TPOT: no significant difference at matched concurrency".to_owned(),
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
    format!(
        "{tpot}; {ttft}; {system} ({strata} concurrency level{} compared)",
        if strata == 1 { "" } else { "s" }
    )
}

#[cfg(test)]
mod tests;
