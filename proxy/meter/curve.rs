//! The concurrency→TPOT curve's state: per concurrency bucket, the tokens that arrived
//! there, their per-token gaps, and the time spent there, kept in [`EPOCHS`] epochs of
//! `curve_window / EPOCHS` each. `/stats` reads the epochs of the last window, so the curve
//! stays current (after a backend upgrade the old backend leaves it within the window);
//! `/metrics` reads everything since start (the epochs that left the window are added into
//! `retired`), so its counters only grow.
//!
//! [`Events`] is the per-event half, one per shard; [`Times`] the per-request half (time
//! and ∫ concurrency dt per bucket), one per upstream.

use std::collections::VecDeque;
use std::time::Duration;

use hdrhistogram::Histogram;

use super::Nanos;

/// Concurrency buckets of the curve: 1, 2, 4, …, 2^(CURVE_BUCKETS-1).
pub(super) const CURVE_BUCKETS: usize = 21;
/// Epochs per curve window: the window read spans between (EPOCHS-1)/EPOCHS of it and all
/// of it.
pub(super) const EPOCHS: u64 = 6;
/// The support a point needs to be more than `sparse`: time spent in its bucket…
pub(super) const MIN_SECS: f64 = 2.0;
/// …and per-token gaps measured there.
pub(super) const MIN_GAPS: u64 = 50;

/// What to read: the current window, or everything since start.
#[derive(Debug, Clone, Copy)]
pub(super) enum Scope {
    Window(Nanos),
    All,
}

/// The per-event part of one concurrency bucket.
#[derive(Default)]
pub(super) struct Bucket {
    pub(super) tokens: u64,
    pub(super) gap_sum_us: f64,
    pub(super) gaps: Option<Histogram<u64>>,
}

impl Bucket {
    pub(super) fn add(&mut self, other: &Bucket) {
        self.tokens += other.tokens;
        self.gap_sum_us += other.gap_sum_us;
        if let Some(g) = &other.gaps {
            let _ = self
                .gaps
                .get_or_insert_with(super::window::histogram64)
                .add(g);
        }
    }
}

fn epoch_ns(window: Duration) -> Nanos {
    let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
    (ns / EPOCHS).max(1)
}

/// Whether epoch `id` is inside the window read at `scope`.
fn inside(scope: Scope, id: u64, epoch_ns: Nanos) -> bool {
    match scope {
        Scope::All => true,
        Scope::Window(now) => id + EPOCHS > now / epoch_ns,
    }
}

/// One shard's tokens and gaps by bucket.
pub(super) struct Events {
    epoch_ns: Nanos,
    live: VecDeque<(u64, Vec<Bucket>)>,
    retired: Vec<Bucket>,
}

fn buckets() -> Vec<Bucket> {
    (0..CURVE_BUCKETS).map(|_| Bucket::default()).collect()
}

impl Events {
    pub(super) fn new(window: Duration) -> Events {
        Events {
            epoch_ns: epoch_ns(window),
            live: VecDeque::new(),
            retired: buckets(),
        }
    }

    /// Bucket `b` of the epoch of `now` (a new epoch retires those out of the window).
    pub(super) fn at(&mut self, now: Nanos, b: usize) -> &mut Bucket {
        let id = now / self.epoch_ns;
        if self.live.back().is_none_or(|(last, _)| *last < id) {
            while self
                .live
                .front()
                .is_some_and(|(first, _)| first + EPOCHS <= id)
            {
                if let Some((_, old)) = self.live.pop_front() {
                    retire(&mut self.retired, &old);
                }
            }
            self.live.push_back((id, buckets()));
        }
        // Out-of-order timestamps are clamped by the shard, so the newest epoch is `id`.
        let last = self.live.len() - 1;
        &mut self.live[last].1[b.min(CURVE_BUCKETS - 1)]
    }

    /// Adds this shard's buckets of `scope` to `into`.
    pub(super) fn add(&self, into: &mut [Bucket], scope: Scope) {
        if matches!(scope, Scope::All) {
            for (sum, b) in into.iter_mut().zip(&self.retired) {
                sum.add(b);
            }
        }
        for (id, epoch) in &self.live {
            if inside(scope, *id, self.epoch_ns) {
                for (sum, b) in into.iter_mut().zip(epoch) {
                    sum.add(b);
                }
            }
        }
    }

    /// The window starts afresh (`POST /curve/reset`, a new `curve_window_secs`); what
    /// it held stays in the since-start totals.
    pub(super) fn reset(&mut self, window: Duration) {
        for (_, old) in std::mem::take(&mut self.live) {
            retire(&mut self.retired, &old);
        }
        self.epoch_ns = epoch_ns(window);
    }
}

fn retire(into: &mut [Bucket], old: &[Bucket]) {
    for (sum, b) in into.iter_mut().zip(old) {
        sum.add(b);
    }
}

/// Time in one bucket: how long, ∫ concurrency dt, and how long the backend counted it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Time {
    pub(super) ns: Nanos,
    pub(super) busy: u128,
    pub(super) backend_ns: Nanos,
}

impl Time {
    fn add(&mut self, other: &Time) {
        self.ns += other.ns;
        self.busy += other.busy;
        self.backend_ns += other.backend_ns;
    }
}

/// The time spent in each bucket, by epoch.
pub(super) struct Times {
    epoch_ns: Nanos,
    live: VecDeque<(u64, [Time; CURVE_BUCKETS])>,
    retired: [Time; CURVE_BUCKETS],
}

impl Times {
    pub(super) fn new(window: Duration) -> Times {
        Times {
            epoch_ns: epoch_ns(window),
            live: VecDeque::new(),
            retired: [Time::default(); CURVE_BUCKETS],
        }
    }

    /// `from..to` spent in bucket `b` at concurrency `c` (counted by the backend or not),
    /// split at epoch edges.
    pub(super) fn add(&mut self, from: Nanos, to: Nanos, b: usize, c: u64, backend: bool) {
        let mut t = from;
        while t < to {
            let id = t / self.epoch_ns;
            let end = ((id + 1) * self.epoch_ns).min(to);
            let epoch = self.epoch(id);
            let slot = &mut epoch[b.min(CURVE_BUCKETS - 1)];
            let dt = end - t;
            slot.ns += dt;
            slot.busy += u128::from(c) * u128::from(dt);
            if backend {
                slot.backend_ns += dt;
            }
            t = end;
        }
    }

    fn epoch(&mut self, id: u64) -> &mut [Time; CURVE_BUCKETS] {
        if self.live.back().is_none_or(|(last, _)| *last < id) {
            while self
                .live
                .front()
                .is_some_and(|(first, _)| first + EPOCHS <= id)
            {
                if let Some((_, old)) = self.live.pop_front() {
                    for (sum, t) in self.retired.iter_mut().zip(&old) {
                        sum.add(t);
                    }
                }
            }
            self.live.push_back((id, [Time::default(); CURVE_BUCKETS]));
        }
        let last = self.live.len() - 1;
        &mut self.live[last].1
    }

    /// The time of `scope`, by bucket.
    pub(super) fn sum(&self, scope: Scope) -> [Time; CURVE_BUCKETS] {
        let mut out = if matches!(scope, Scope::All) {
            self.retired
        } else {
            [Time::default(); CURVE_BUCKETS]
        };
        for (id, epoch) in &self.live {
            if inside(scope, *id, self.epoch_ns) {
                for (sum, t) in out.iter_mut().zip(epoch) {
                    sum.add(t);
                }
            }
        }
        out
    }

    pub(super) fn reset(&mut self, window: Duration) {
        for (_, old) in std::mem::take(&mut self.live) {
            for (sum, t) in self.retired.iter_mut().zip(&old) {
                sum.add(t);
            }
        }
        self.epoch_ns = epoch_ns(window);
    }
}
