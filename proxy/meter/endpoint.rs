//! One endpoint's share of its pool's meter: the requests metered on it now (the curve's
//! concurrency axis: the batch of the replica that served each token), the backend's own
//! running count when its metrics are scraped, its output tokens, and its recent finished
//! requests — what `/stats` `endpoints[]` reports.
//!
//! A token event adds to one atomic here (the stream's endpoint); everything else happens
//! when a request begins or ends, or when `/stats` reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::hist::{hist_percentiles, histogram};
use super::stats::Percentiles;
use super::{Nanos, UNKNOWN};

/// Finished requests kept for the endpoint's window figures, at most.
const MAX_DONE: usize = 1 << 16;

/// An endpoint's live figures.
#[derive(Debug)]
pub struct EndpointMeter {
    /// Metered requests on it now.
    pub(super) streams: AtomicU64,
    /// The backend's own running count the curve buckets by ([`UNKNOWN`] while not
    /// scraped or stale), changed only under the upstream's lock
    /// ([`super::UpstreamMeter::set_endpoint_backend`]), and its latest reading.
    pub(super) backend_running: AtomicU64,
    backend_reported: AtomicU64,
    tokens: AtomicU64,
    /// Prompt tokens of its requests that reported them, and of those the cached ones.
    input_tokens: AtomicU64,
    cached_input_tokens: AtomicU64,
    recent: Mutex<Recent>,
}

#[derive(Debug, Default)]
struct Recent {
    /// Finished requests, oldest first.
    done: VecDeque<Finished>,
    /// The token total, sampled about once a second.
    tokens_at: VecDeque<(Nanos, u64)>,
}

/// A finished request, as its endpoint's window figures and its own curve
/// (`balance = "slo_headroom"`) read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    pub at: Nanos,
    /// From the client's request (a wait in tokentap's queue included), ms.
    pub ttft_ms: Option<f64>,
    /// With ≥ 2 tokens, ms.
    pub tpot_ms: Option<f64>,
    /// From when it was sent to this endpoint, ms.
    pub sent_ttft_ms: Option<f64>,
    /// The batch it ran in: the curve's concurrency, the mean over its token events.
    pub batch: u64,
}

/// What `/stats` shows of an endpoint's metering, over the live window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EndpointFigures {
    pub output_tokens_total: u64,
    pub input_tokens_total: u64,
    pub cached_input_tokens_total: u64,
    pub system_tps: Option<f64>,
    pub single_stream_tps: Option<f64>,
    pub tpot_ms: Percentiles,
    pub ttft_ms: Percentiles,
}

// === impl EndpointMeter ===

impl Default for EndpointMeter {
    fn default() -> Self {
        EndpointMeter {
            streams: AtomicU64::new(0),
            backend_running: AtomicU64::new(UNKNOWN),
            backend_reported: AtomicU64::new(UNKNOWN),
            tokens: AtomicU64::new(0),
            input_tokens: AtomicU64::new(0),
            cached_input_tokens: AtomicU64::new(0),
            recent: Mutex::default(),
        }
    }
}

impl EndpointMeter {
    /// Metered requests on it now.
    pub fn streams(&self) -> u64 {
        self.streams.load(Relaxed)
    }

    /// The backend's running count, read from its own metrics (`None`: unknown or stale):
    /// kept as its latest reading, which the upstream's upkeep hands the curve.
    pub fn set_backend_running(&self, running: Option<u64>) {
        let v = running.map_or(UNKNOWN, |n| n.min(UNKNOWN - 1));
        self.backend_reported.store(v, Relaxed);
    }

    /// The backend's latest running count, as its metrics said it.
    pub fn backend_reported(&self) -> Option<u64> {
        match self.backend_reported.load(Relaxed) {
            UNKNOWN => None,
            n => Some(n),
        }
    }

    /// The count the curve buckets this endpoint's tokens by: the backend's batch while
    /// it is known, else `own` (tokentap's requests on it, as the caller read them).
    pub fn batch(&self, own: u64) -> u64 {
        match self.backend_running.load(Relaxed) {
            UNKNOWN => own,
            backend => backend,
        }
    }

    pub(super) fn add_tokens(&self, n: u64) {
        self.tokens.fetch_add(n, Relaxed);
    }

    /// A request on it finished.
    pub(super) fn done(&self, finished: Finished) {
        let mut r = self.lock();
        if r.done.len() >= MAX_DONE {
            r.done.pop_front();
        }
        r.done.push_back(finished);
    }

    /// Each request finished on it at or after `since`, the latest first, while `f` asks
    /// for more (returns true).
    pub fn finished_since(&self, since: Nanos, mut f: impl FnMut(&Finished) -> bool) {
        let r = self.lock();
        for d in r.done.iter().rev().take_while(|d| d.at >= since) {
            if !f(d) {
                return;
            }
        }
    }

    /// Takes the token total's sample for the window's rate (called about once a second),
    /// and forgets what is older than `window`.
    pub fn sample(&self, now: Nanos, window: Nanos) {
        let tokens = self.tokens.load(Relaxed);
        let mut r = self.lock();
        let due = r
            .tokens_at
            .back()
            .is_none_or(|&(at, _)| now.saturating_sub(at) >= 1_000_000_000);
        if due {
            r.tokens_at.push_back((now, tokens));
        }
        let horizon = now.saturating_sub(window);
        // One sample at or before the horizon stays: the rate's start.
        while r.tokens_at.len() > 1 && r.tokens_at[1].0 <= horizon {
            r.tokens_at.pop_front();
        }
        while r.done.front().is_some_and(|d| d.at < horizon) {
            r.done.pop_front();
        }
    }

    /// Its figures over the `window` before `now`.
    /// A request on it reported its prompt's tokens (`cached`: how many its backend read
    /// from its prefix cache, when it said).
    pub(super) fn prompt(&self, input: u64, cached: Option<u64>) {
        self.input_tokens.fetch_add(input, Relaxed);
        if let Some(cached) = cached {
            self.cached_input_tokens
                .fetch_add(cached.min(input), Relaxed);
        }
    }

    pub fn figures(&self, now: Nanos, window: Nanos) -> EndpointFigures {
        let total = self.tokens.load(Relaxed);
        let r = self.lock();
        let horizon = now.saturating_sub(window);
        let system_tps = r.tokens_at.front().and_then(|&(at, then)| {
            let secs = now.saturating_sub(at) as f64 / 1e9;
            (secs >= 0.5).then(|| total.saturating_sub(then) as f64 / secs)
        });
        let (mut ttft, mut tpot) = (histogram(), histogram());
        let (mut tpot_sum, mut tpot_n) = (0.0, 0u64);
        for d in r.done.iter().filter(|d| d.at >= horizon) {
            let (t, p) = (d.ttft_ms, d.tpot_ms);
            if let Some(t) = t {
                let _ = ttft.record(us(t));
            }
            if let Some(p) = p {
                let _ = tpot.record(us(p));
                tpot_sum += p;
                tpot_n += 1;
            }
        }
        EndpointFigures {
            output_tokens_total: total,
            input_tokens_total: self.input_tokens.load(Relaxed),
            cached_input_tokens_total: self.cached_input_tokens.load(Relaxed),
            system_tps,
            single_stream_tps: (tpot_n > 0 && tpot_sum > 0.0)
                .then(|| 1000.0 / (tpot_sum / tpot_n as f64)),
            tpot_ms: hist_percentiles(&tpot),
            ttft_ms: hist_percentiles(&ttft),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Recent> {
        self.recent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn us(ms: f64) -> u64 {
    ((ms * 1e3).round() as u64).clamp(1, super::hist::HIST_MAX_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Nanos = 1_000_000_000;

    #[test]
    fn an_endpoints_window_figures() {
        let m = EndpointMeter::default();
        assert_eq!(m.figures(0, 10 * S).system_tps, None);
        m.sample(0, 10 * S);
        m.add_tokens(500);
        let done = |at, ttft_ms, tpot_ms| Finished {
            at,
            ttft_ms,
            tpot_ms,
            sent_ttft_ms: ttft_ms,
            batch: 1,
        };
        m.done(done(S, Some(100.0), Some(20.0)));
        m.done(done(2 * S, Some(300.0), Some(30.0)));
        m.done(done(2 * S, Some(50.0), None));
        m.sample(2 * S, 10 * S);
        m.add_tokens(500);
        let f = m.figures(5 * S, 10 * S);
        assert_eq!(f.output_tokens_total, 1000);
        assert_eq!(f.system_tps, Some(200.0));
        // 1000 / mean TPOT (25 ms).
        assert_eq!(f.single_stream_tps, Some(40.0));
        assert!(f.tpot_ms.p50.is_some_and(|p| (p - 20.0).abs() < 0.5));
        // Past the window: the requests are forgotten, the rate starts at the last sample
        // at or before the horizon.
        m.sample(20 * S, 10 * S);
        let f = m.figures(20 * S, 10 * S);
        assert_eq!(f.single_stream_tps, None);
        assert_eq!(f.system_tps, Some(500.0 / 18.0));
    }
}
