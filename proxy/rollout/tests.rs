use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::judge::{Counts, Decision};
use super::*;
use crate::compare::{compare, Comparison};
use crate::meter::RequestSample;

const SEC: Nanos = 1_000_000_000;

fn config() -> RolloutConfig {
    RolloutConfig {
        from: 0,
        to: 1,
        steps: vec![10.0, 50.0, 100.0],
        every: Duration::from_secs(5),
        max_tpot_ratio: 1.05,
        max_ttft_ratio: None,
        max_error_pct: 1.0,
        min_requests: 20,
    }
}

fn route(c: RolloutConfig) -> Route {
    Route {
        name: "chat".into(),
        path_prefix: "/".into(),
        headers: vec![],
        split: vec![(0, 50), (1, 50)],
        sticky: None,
        spill: false,
        mirrors: vec![],
        rollout: Some(c),
    }
}

fn names() -> Vec<String> {
    vec!["a".into(), "b".into()]
}

/// `n` requests of each arm at concurrency 16..24, TPOT rising with it, b's `factor` × a's,
/// 3% noise.
fn samples(seed: u64, n: usize, factor: f64) -> [Vec<RequestSample>; 2] {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut arm = |f: f64| -> Vec<RequestSample> {
        (0..n)
            .map(|i| {
                let c = rng.gen_range(16.0..24.0);
                let noise = 1.0 + rng.gen_range(-0.03..0.03);
                RequestSample {
                    at: i as Nanos,
                    concurrency: c,
                    ttft_ms: 50.0 * noise,
                    tpot_ms: (10.0 + c) * f * noise,
                }
            })
            .collect()
    };
    [arm(1.0), arm(factor)]
}

fn comparison(seed: u64, n: usize, factor: f64) -> Comparison {
    let [a, b] = samples(seed, n, factor);
    compare("a", &a, "b", &b, 10)
}

fn counts(requests: u64, errors: u64) -> Counts {
    Counts {
        requests,
        errors,
        ..Counts::default()
    }
}

#[test]
fn slower_is_rolled_back_faster_advances_unsure_waits() {
    let c = config();
    let judged = |factor: f64, n: usize| {
        let e = judge::judge(
            &c,
            10.0,
            0,
            &comparison(7, n, factor),
            counts(n as u64, 0),
            counts(n as u64, 0),
        );
        (e.decision, e.reason)
    };
    let (d, why) = judged(1.25, 300);
    assert_eq!(d, Decision::RollBack, "{why}");
    assert!(why.contains("worse"), "{why}");
    let (d, why) = judged(0.9, 300);
    assert_eq!(d, Decision::Advance, "{why}");
    // At the bound: not shown within it with 95% confidence.
    let (d, why) = judged(1.05, 60);
    assert_eq!(d, Decision::Wait, "{why}");
    // Too few requests to judge speed: waits.
    let (d, why) = judged(0.9, 10);
    assert_eq!(d, Decision::Wait, "{why}");
    assert!(why.contains("waiting for requests"), "{why}");
}

#[test]
fn a_failing_to_is_rolled_back_on_few_requests() {
    let c = config();
    let cmp = comparison(3, 5, 1.0);
    let e = judge::judge(&c, 50.0, 0, &cmp, counts(40, 0), counts(12, 6));
    assert_eq!(e.decision, Decision::RollBack, "{}", e.reason);
    assert!(e.reason.contains("fails"), "{}", e.reason);
    assert_eq!(e.to_error_pct, 50.0);
    // Within the allowance: not failing.
    let e = judge::judge(&c, 50.0, 0, &cmp, counts(1000, 10), counts(1000, 15));
    assert_ne!(e.decision, Decision::RollBack, "{}", e.reason);
    // One error in 30 (3.3%, past 1 point) is not shown past it with 95% confidence.
    let e = judge::judge(&c, 50.0, 0, &cmp, counts(300, 0), counts(30, 1));
    assert_ne!(e.decision, Decision::RollBack, "{}", e.reason);
    // Every request failing, however few: rolled back.
    let e = judge::judge(&c, 50.0, 0, &cmp, counts(300, 0), counts(4, 4));
    assert_eq!(e.decision, Decision::RollBack, "{}", e.reason);
}

/// Ticks `r` every second from `start` for `secs`, its counts growing and the comparison
/// `factor`; the percent after each tick.
fn run(r: &Rollout, start: Nanos, secs: u64, factor: f64) -> Vec<f64> {
    (0..secs)
        .map(|s| {
            let now = start + s * SEC;
            let n = 100 * (s + 1);
            r.tick(
                now,
                || (counts(n, 0), counts(n, 0)),
                |_| comparison(s, 200, factor),
            );
            r.percent()
        })
        .collect()
}

#[test]
fn steps_advance_to_promoted_and_a_slower_one_rolls_back() {
    let r = Rollout::new(&route(config()), &config(), &names(), 0, None);
    assert_eq!((r.percent(), r.shadow_percent()), (10.0, 88.9));
    let seen = run(&r, 0, 20, 0.9);
    // Each evaluation 5 s apart; the first takes the step's counts, the next judges.
    assert_eq!(r.lock().state, State::Promoted, "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[1] >= w[0]),
        "never back: {seen:?}"
    );
    assert_eq!(r.shadow_percent(), 0.0);
    let history: Vec<f64> = r.stats().history.iter().map(|t| t.percent).collect();
    assert_eq!(history, vec![10.0, 50.0, 100.0]);

    let slow = Rollout::new(&route(config()), &config(), &names(), 0, None);
    let seen = run(&slow, 0, 20, 1.25);
    assert_eq!(slow.lock().state, State::RolledBack);
    assert!(seen.iter().all(|&p| p <= 10.0), "{seen:?}");
    assert_eq!(slow.percent(), 0.0);
    // Ended: no evaluation moves it again.
    run(&slow, 20 * SEC, 20, 0.5);
    assert_eq!(slow.lock().state, State::RolledBack);
}

#[test]
fn steers_pause_resume_abort_and_promote() {
    let r = Rollout::new(&route(config()), &config(), &names(), 0, None);
    r.act(Action::Pause, SEC).unwrap();
    // Paused: evaluations do not run, the share holds.
    run(&r, SEC, 30, 0.5);
    assert_eq!((r.lock().state, r.percent()), (State::Paused, 10.0));
    assert!(r.act(Action::Pause, SEC).is_err());
    r.act(Action::Resume, 40 * SEC).unwrap();
    r.act(Action::Promote, 41 * SEC).unwrap();
    assert_eq!((r.lock().state, r.percent()), (State::Promoted, 100.0));
    assert!(r.act(Action::Abort, 42 * SEC).is_err(), "ended");
    let r = Rollout::new(&route(config()), &config(), &names(), 0, None);
    r.act(Action::Abort, SEC).unwrap();
    assert_eq!((r.lock().state, r.percent()), (State::RolledBack, 0.0));
    assert_eq!(Action::parse(" promote\n"), Some(Action::Promote));
    assert_eq!(Action::parse("rollback"), None);
}

#[test]
fn a_reload_keeps_an_unchanged_rollout_and_a_restart_resumes_from_the_file() {
    let dir = std::env::temp_dir().join(format!("tokentap-rollout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rollouts.json");
    let _ = std::fs::remove_file(&file);
    let routes = [route(config())];
    let first = Rollouts::new(&routes, &names(), Some(&file), None, 0);
    let r = first.of(0).unwrap();
    run(r, 0, 12, 0.9);
    assert_eq!(r.percent(), 50.0);
    first.save();
    // A reload with the same rollout: the same one, its state kept.
    let kept = Rollouts::new(&routes, &names(), Some(&file), Some(&first), 13 * SEC);
    let k = kept.of(0).unwrap();
    assert_eq!((k.lock().state, k.percent()), (State::Running, 50.0));
    assert_eq!(k.stats().history, r.stats().history);
    // The same rollout with its upstreams at other places (one added before them): kept,
    // on the new places.
    let moved = [route(RolloutConfig {
        from: 1,
        to: 2,
        ..config()
    })];
    let three = vec!["z".to_owned(), "a".into(), "b".into()];
    let m = Rollouts::new(&moved, &three, Some(&file), Some(&first), 13 * SEC);
    let m = m.of(0).unwrap();
    assert_eq!((m.percent(), m.config.from, m.config.to), (50.0, 1, 2));
    // Changed: afresh.
    let changed = [route(RolloutConfig {
        max_tpot_ratio: 1.1,
        ..config()
    })];
    let fresh = Rollouts::new(&changed, &names(), Some(&file), Some(&first), 13 * SEC);
    assert_eq!(fresh.of(0).unwrap().percent(), 10.0);
    // A restart: resumed from the file where it was, its history kept.
    let resumed = Rollouts::new(&routes, &names(), Some(&file), None, 0);
    let r2 = resumed.of(0).unwrap();
    assert_eq!((r2.lock().state, r2.percent()), (State::Running, 50.0));
    assert!(r2
        .stats()
        .history
        .last()
        .unwrap()
        .why
        .starts_with("resumed from"));
    // A file that is not tokentap's: started afresh.
    std::fs::write(&file, "not json").unwrap();
    let afresh = Rollouts::new(&routes, &names(), Some(&file), None, 0);
    assert_eq!(afresh.of(0).unwrap().percent(), 10.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_copies_cost_100_minus_2p_of_each_100_requests_the_pair_serves() {
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(copies_per_request(10.0, 100.0), 0.8));
    assert!(close(copies_per_request(25.0, 100.0), 0.5));
    assert_eq!(copies_per_request(50.0, 100.0), 0.0);
    assert_eq!(copies_per_request(100.0, 100.0), 0.0);
    // A shadow mirror at 50% copies half of from's 90 at most.
    assert!(close(copies_per_request(10.0, 50.0), 0.45));
    // `to`'s load with its copies is from's: p + (100 − 2p) = 100 − p.
    for p in [1.0, 10.0, 33.0, 49.0] {
        assert!(close(
            p / 100.0 + copies_per_request(p, 100.0),
            1.0 - p / 100.0
        ));
    }
}

#[test]
fn served_share_and_copy_rate_are_read_over_the_ticks() {
    let r = Rollout::new(&route(config()), &config(), &names(), 0, None);
    r.see(0);
    // One reading: nothing to say yet.
    let s = r.stats();
    assert_eq!((s.served_percent, s.shadow_rps), (None, None));
    for i in 0..100 {
        // 9 of 10 to `from` (0), 1 to `to` (1); another upstream is not the pair's.
        r.sent(if i % 10 == 0 { 1 } else { 0 });
        r.sent(7);
    }
    for _ in 0..80 {
        r.copy(true);
    }
    r.copy(false);
    r.see(2 * SEC);
    let s = r.stats();
    assert_eq!(s.served_percent, Some(10.0));
    assert_eq!(s.shadow_rps, Some(40.0));
    assert_eq!((s.shadow_sent_total, s.shadow_skipped_total), (80, 1));
    // Only the last SEEN_KEPT readings count: a quiet spell after brings the rate down.
    for t in 3..3 + SEEN_KEPT as u64 {
        r.see(t * SEC);
    }
    let s = r.stats();
    assert_eq!((s.served_percent, s.shadow_rps), (None, Some(0.0)));
}

/// A steer (or an evaluation) made through the generation of the state a reload replaced
/// is the kept rollout's too: the two share one state, not copies of it.
#[test]
fn a_steer_through_the_replaced_generation_is_the_kept_rollout_s() {
    let routes = [route(config())];
    let first = Rollouts::new(&routes, &names(), None, None, 0);
    let kept = Rollouts::new(&routes, &names(), None, Some(&first), SEC);
    first.act("chat", Action::Pause, 2 * SEC).unwrap();
    let k = kept.of(0).unwrap();
    assert_eq!((k.lock().state, k.percent()), (State::Paused, 10.0));
    assert_eq!(
        k.stats().history.last().map(|t| t.why.as_str()),
        Some("paused by POST /rollout")
    );
    kept.act("chat", Action::Resume, 3 * SEC).unwrap();
    assert_eq!(first.of(0).unwrap().lock().state, State::Running);
}
