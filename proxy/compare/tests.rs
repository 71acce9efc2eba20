//! The comparison against a seeded model of two batching backends.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::sim::Curve;

/// `n` requests of a backend whose TPOT is `factor` × the reference curve, at concurrencies
/// drawn from `levels`, with 5% per-request noise.
fn arm(rng: &mut StdRng, factor: f64, levels: &[f64], n: usize) -> Vec<RequestSample> {
    let curve = Curve::reference();
    (0..n)
        .map(|i| {
            let c = levels[rng.gen_range(0..levels.len())] * rng.gen_range(0.9..1.0);
            let noise = 1.0 + rng.gen_range(-0.05..0.05);
            RequestSample {
                at: i as u64,
                concurrency: c,
                ttft_ms: 60.0 * rng.gen_range(0.8..1.2),
                tpot_ms: curve.tpot_ms(c) * factor * noise,
            }
        })
        .collect()
}

const LEVELS: [f64; 3] = [4.0, 16.0, 64.0];

#[test]
fn names_the_slower_arm_and_covers_the_true_gap() {
    let mut covered = 0;
    for seed in 0..10 {
        let mut rng = StdRng::seed_from_u64(seed);
        let a = arm(&mut rng, 1.0, &LEVELS, 300);
        let b = arm(&mut rng, 1.1, &LEVELS, 300);
        let c = compare("a", &a, "b", &b, 600);
        let t = &c.metrics.tpot_ms;
        assert!(t.significant, "seed {seed}: {t:?}");
        assert_eq!(t.better.as_deref(), Some("a"), "seed {seed}");
        let [lo, hi] = t.ci95_pct.expect("ci");
        if lo <= 10.0 && 10.0 <= hi {
            covered += 1;
        }
        assert_eq!(c.metrics.single_stream_tps.better.as_deref(), Some("a"));
        assert!(c.verdict.starts_with("a is "), "{}", c.verdict);
        assert!(
            c.verdict.contains("faster per output token"),
            "{}",
            c.verdict
        );
    }
    assert!(
        covered >= 9,
        "the 95% CI covered the true 10% in {covered} of 10 runs"
    );
}

#[test]
fn identical_backends_are_not_called_different() {
    let mut significant = 0;
    for seed in 100..110 {
        let mut rng = StdRng::seed_from_u64(seed);
        let a = arm(&mut rng, 1.0, &LEVELS, 300);
        let b = arm(&mut rng, 1.0, &LEVELS, 300);
        let c = compare("a", &a, "b", &b, 600);
        if c.metrics.tpot_ms.significant {
            significant += 1;
        } else {
            assert_eq!(c.metrics.tpot_ms.better, None);
        }
    }
    assert!(
        significant <= 1,
        "{significant} of 10 identical pairs called significant"
    );
}

#[test]
fn the_matched_load_trap() {
    // Identical curves; a ran at low concurrency, b at high. Unstratified, b looks ~25%
    // slower per token; stratified, there is no level both reached, so no verdict.
    let mut rng = StdRng::seed_from_u64(7);
    let a = arm(&mut rng, 1.0, &[2.0, 4.0], 400);
    let b = arm(&mut rng, 1.0, &[64.0, 128.0], 400);
    let naive = |s: &[RequestSample]| s.iter().map(|x| x.tpot_ms).sum::<f64>() / s.len() as f64;
    assert!(
        naive(&b) / naive(&a) > 1.2,
        "the naive comparison would call it"
    );
    let c = compare("a", &a, "b", &b, 600);
    assert!(!c.metrics.tpot_ms.significant);
    assert_eq!(c.metrics.tpot_ms.better, None);
    assert!(c.verdict.starts_with("not enough data"), "{}", c.verdict);

    // Overlapping in one level: compared there only, and found equal.
    let mut a = arm(&mut rng, 1.0, &[4.0, 16.0], 400);
    let mut b = arm(&mut rng, 1.0, &[16.0, 64.0], 400);
    a.extend(arm(&mut rng, 1.0, &[16.0], 100));
    b.extend(arm(&mut rng, 1.0, &[16.0], 100));
    let c = compare("a", &a, "b", &b, 600);
    assert_eq!(
        c.strata.iter().filter(|s| s.used).count(),
        1,
        "{:?}",
        c.strata
    );
    assert!(!c.metrics.tpot_ms.significant, "{:?}", c.metrics.tpot_ms);
}

#[test]
fn too_few_samples_say_so() {
    let mut rng = StdRng::seed_from_u64(1);
    let a = arm(&mut rng, 1.0, &LEVELS, 10);
    let b = arm(&mut rng, 2.0, &LEVELS, 10);
    let c = compare("a", &a, "b", &b, 600);
    assert_eq!(c.metrics.tpot_ms.diff_pct, None);
    assert!(!c.metrics.tpot_ms.significant);
    assert!(c.strata.iter().all(|s| !s.used));
    let json = serde_json::to_value(&c).expect("serializes");
    assert!(json["metrics"]["tpot_ms"]["better"].is_null());
}
