//! Reading an upstream's window (`/stats`, a scrape and the dashboard's sampler every
//! second) and its comparison samples (`/compare`, a rollout's step) when it is full of
//! short requests: 28,000 a second for the default 10 s window, 16 tokens each. Measured:
//! a read of the window, and how long a request's meter updates on another thread wait
//! while either is read (each its own begin, tokens and finish, as a worker makes them).
//!
//! `cargo bench --bench meter`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};

use tokentap::meter::{Clock, Histograms, Nanos, Outcome, UpstreamMeter};

const RATE: u64 = 28_000;
const WINDOW_SECS: u64 = 10;
const MS: Nanos = 1_000_000;

/// A meter whose window holds `RATE` short requests a second for the whole window, and the
/// time at its end.
fn filled() -> (Arc<UpstreamMeter>, Nanos) {
    let meter = UpstreamMeter::new(
        "bench",
        Duration::from_secs(WINDOW_SECS),
        Clock::new(),
        Histograms::noop(),
    );
    let n = RATE * WINDOW_SECS;
    let gap = WINDOW_SECS * 1_000 * MS / n;
    for i in 0..n {
        let t0 = i * gap;
        let mut s = meter.begin(t0, t0);
        for k in 0..16 {
            s.tokens(t0 + 20 * MS + k * 100_000, 1);
        }
        s.finish(t0 + 22 * MS, Outcome::Ok);
    }
    (meter, n * gap + 30 * MS)
}

fn bench(c: &mut Criterion) {
    let (meter, end) = filled();
    let mut g = c.benchmark_group("meter read");
    g.sample_size(20);
    g.bench_function("stats, 280,000 requests in the window", |b| {
        b.iter(|| meter.stats(end))
    });
    g.finish();

    // A worker's requests while the window is read back to back (`stats`, as `/stats`, a
    // scrape and the dashboard's sampler read it; `samples`, as `/compare` and a rollout's
    // step do): the longest wait of one request's meter updates, against the same updates
    // with no read running. Each phase on a fresh meter whose window slides on at RATE
    // (the requests' clock is theirs, not the wall's), so it holds RATE × WINDOW_SECS
    // requests throughout, and is read at the latest request's time.
    let gap = 1_000_000_000 / RATE;
    let updates = |read: Option<fn(&UpstreamMeter, Nanos)>| -> (usize, usize, Duration, Duration) {
        let (meter, end) = filled();
        let latest = AtomicU64::new(end);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            if let Some(read) = read {
                let (meter, latest, stop) = (&meter, &latest, &stop);
                s.spawn(move || {
                    for _ in 0..20 {
                        read(meter, latest.load(Relaxed));
                    }
                    stop.store(true, Relaxed);
                });
            }
            let mut waits = Vec::new();
            let mut t = end;
            while !stop.load(Relaxed) && (read.is_some() || waits.len() < 200_000) {
                let started = Instant::now();
                let mut st = meter.begin(t, t);
                st.tokens(t + 20 * MS, 1);
                st.tokens(t + 21 * MS, 1);
                st.finish(t + 22 * MS, Outcome::Ok);
                waits.push(started.elapsed());
                t += gap;
                latest.store(t, Relaxed);
            }
            let over_ms = waits.iter().filter(|w| w.as_micros() > 1_000).count();
            waits.sort_unstable();
            let p999 = waits[waits.len().saturating_sub(1) * 999 / 1000];
            (
                waits.len(),
                over_ms,
                p999,
                waits.last().copied().unwrap_or_default(),
            )
        })
    };
    let (_, _, quiet_p999, quiet_max) = updates(None);
    println!(
        "meter read / a request's updates with no read running: p99.9 {quiet_p999:?}, max {quiet_max:?}"
    );
    let stats: fn(&UpstreamMeter, Nanos) = |m, now| drop(m.stats(now));
    let samples: fn(&UpstreamMeter, Nanos) = |m, now| drop(m.samples(now));
    for (what, read) in [("stats", stats), ("samples", samples)] {
        let (n, over_ms, p999, max) = updates(Some(read));
        println!(
            "meter read / a request's updates on another thread while {what} reads 20 times: \
             {n} requests, {over_ms} of them over 1 ms, p99.9 {p999:?}, max {max:?}"
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
