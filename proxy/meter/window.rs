//! The sliding windows of one upstream: a ring of time slots, the records of the requests
//! active inside the window, and the cumulative concurrency curve.
//!
//! The window is the last [`SLOTS`] slots of `window / SLOTS` each, the newest one still
//! filling, so it spans between `(SLOTS-1)/SLOTS` and all of `window` and rates are exact for
//! steady traffic: tokens counted over exactly the time they were counted in. Per-request
//! figures (TTFT, TPOT, single-stream T/s) are computed at read time from each request's
//! per-slot segments, which is what DESIGN §1 asks: each request's TPOT over its own token
//! events inside the window.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use hdrhistogram::Histogram;
use slab::Slab;

use super::stats::{CurvePoint, Percentiles, TokensPerEvent, UpstreamStats};
use super::{Nanos, Outcome};

/// Slots per window.
pub const SLOTS: usize = 20;
/// Concurrency buckets of the curve: 1, 2, 4, …, 2^(CURVE_BUCKETS-1).
const CURVE_BUCKETS: usize = 21;
/// Histogram range: 1 µs to one hour, two significant figures (1% resolution).
const HIST_MAX_US: u64 = 3_600_000_000;

/// One slot of the ring.
struct Slot {
    epoch: u64,
    tokens: u64,
    /// ∫ in_flight dt over the slot, in request·ns.
    busy: u128,
    /// Per-token gaps (ITL), µs.
    itl: Histogram<u32>,
}

/// A request's token events inside one slot.
#[derive(Clone, Copy, Default)]
struct Segment {
    epoch: u64,
    first: Nanos,
    last: Nanos,
    tokens: u64,
    events: u32,
}

/// A request in flight, or finished but still inside the window.
struct Record {
    t0: Nanos,
    first: Option<Nanos>,
    last: Nanos,
    finished_at: Option<Nanos>,
    segments: [Segment; SLOTS],
}

#[derive(Default)]
struct CurveBucket {
    tokens: u64,
    time: Nanos,
    gap_sum_us: f64,
    gaps: Option<Histogram<u32>>,
}

#[derive(Default)]
struct Totals {
    by_outcome: [u64; Outcome::ALL.len()],
    output_tokens: u64,
    exact_requests: u64,
    estimated_requests: u64,
    /// Output tokens that rest on the one-per-event estimate (no exact count arrived).
    estimated_tokens: u64,
    /// For requests that had both: Σ estimate and Σ exact.
    estimate_before_exact: u64,
    exact_after_estimate: u64,
    unparsed_events: u64,
}

pub(super) struct Windows {
    slot_ns: Nanos,
    started: Nanos,
    /// The latest time seen: timestamps taken just before the lock may arrive out of order.
    latest: Nanos,
    ring: Vec<Slot>,
    in_flight: u64,
    last_change: Nanos,
    records: Slab<Record>,
    /// Finished records in finishing order, removed once they leave the window.
    retired: VecDeque<(usize, Nanos)>,
    curve: Vec<CurveBucket>,
    totals: Totals,
    metered: bool,
    /// What the SLO controller reads each tick: per-token gaps and ∫ in_flight dt since
    /// the last read.
    control_gaps: Histogram<u32>,
    control_busy: u128,
    control_since: Nanos,
    /// Tokens per token-bearing fragment, since start.
    tokens_per_event: Histogram<u32>,
}

/// One controller tick's evidence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControlSample {
    /// The asked percentile of per-token gaps, ms; `None` without gaps.
    pub tpot_ms: Option<f64>,
    /// Time-weighted mean in flight.
    pub concurrency: f64,
}

fn histogram() -> Histogram<u32> {
    // The bounds are constants that hdrhistogram accepts; the fallback is unreachable.
    Histogram::new_with_bounds(1, HIST_MAX_US, 2)
        .unwrap_or_else(|_| Histogram::new(2).unwrap_or_else(|_| unreachable!()))
}

/// The curve bucket of a concurrency: 1, 2, 3–4, 5–8, … as 0, 1, 2, 3, …
pub(crate) fn bucket(concurrency: u64) -> usize {
    let b = if concurrency <= 1 {
        0
    } else {
        (64 - (concurrency - 1).leading_zeros()) as usize
    };
    b.min(CURVE_BUCKETS - 1)
}

fn ms(ns: Nanos) -> f64 {
    ns as f64 / 1e6
}

// === impl Windows ===

impl Windows {
    pub(super) fn new(window: Duration, now: Nanos) -> Self {
        let window_ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        let slot_ns = (window_ns / SLOTS as u64).max(1);
        Windows {
            slot_ns,
            started: now,
            latest: now,
            ring: (0..SLOTS)
                .map(|_| Slot {
                    epoch: u64::MAX,
                    tokens: 0,
                    busy: 0,
                    itl: histogram(),
                })
                .collect(),
            in_flight: 0,
            last_change: now,
            records: Slab::new(),
            retired: VecDeque::new(),
            curve: (0..CURVE_BUCKETS).map(|_| CurveBucket::default()).collect(),
            totals: Totals::default(),
            metered: false,
            control_gaps: histogram(),
            control_busy: 0,
            control_since: now,
            tokens_per_event: histogram(),
        }
    }

    /// A request whose client started it at `t0` was sent upstream at `now`.
    pub(super) fn begin(&mut self, t0: Nanos, now: Nanos) -> usize {
        let now = self.advance(now);
        self.in_flight += 1;
        self.metered = true;
        self.records.insert(Record {
            t0,
            first: None,
            last: now,
            finished_at: None,
            segments: [Segment::default(); SLOTS],
        })
    }

    /// Records `n` tokens of request `key` at `now`; returns the gap since its previous
    /// token event (`None` for its first) and the requests in flight as they arrived.
    pub(super) fn tokens(&mut self, key: usize, now: Nanos, n: u32) -> (Option<Nanos>, u64) {
        let now = self.clamp(now);
        let epoch = now / self.slot_ns;
        let in_flight = self.in_flight;
        let bucket = bucket(in_flight);
        let Some(rec) = self.records.get_mut(key) else {
            return (None, in_flight);
        };
        let gap = rec.first.map(|_| now.saturating_sub(rec.last));
        if rec.first.is_none() {
            rec.first = Some(now);
        }
        rec.last = now;
        let seg = &mut rec.segments[(epoch % SLOTS as u64) as usize];
        if seg.epoch != epoch || seg.events == 0 {
            *seg = Segment {
                epoch,
                first: now,
                last: now,
                tokens: 0,
                events: 0,
            };
        }
        seg.last = now;
        seg.tokens += u64::from(n);
        seg.events += 1;

        let _ = self.tokens_per_event.record(u64::from(n));
        let slot = slot_of(&mut self.ring, epoch);
        slot.tokens += u64::from(n);
        let curve = &mut self.curve[bucket];
        curve.tokens += u64::from(n);
        if let Some(gap) = gap {
            let per_token_us = gap as f64 / 1e3 / f64::from(n);
            let v = (per_token_us.round() as u64).clamp(1, HIST_MAX_US);
            let _ = slot.itl.record_n(v, n);
            let _ = self.control_gaps.record_n(v, n);
            let _ = curve.gaps.get_or_insert_with(histogram).record_n(v, n);
            curve.gap_sum_us += per_token_us * f64::from(n);
        }
        (gap, in_flight)
    }

    /// Ends request `key` at `now`. `estimated` is the tokens its events counted; an
    /// `exact` total replaces that estimate: the difference lands in the slot where the
    /// request ended and in its last segment, so nothing is counted twice.
    pub(super) fn finish(
        &mut self,
        key: usize,
        now: Nanos,
        outcome: Outcome,
        estimated: u64,
        exact: Option<u64>,
    ) {
        let now = self.advance(now);
        self.in_flight = self.in_flight.saturating_sub(1);
        self.count(outcome);
        let epoch = now / self.slot_ns;
        match exact {
            Some(total) => {
                self.totals.exact_requests += 1;
                self.totals.output_tokens += total;
                if estimated > 0 {
                    self.totals.estimate_before_exact += estimated;
                    self.totals.exact_after_estimate += total;
                }
                self.correct(key, epoch, estimated, total);
            }
            // A stream cut short never gets its exact count: it does not make the counts
            // of completed generations inexact.
            None if estimated > 0 && outcome == Outcome::Ok => {
                self.totals.estimated_requests += 1;
                self.totals.output_tokens += estimated;
                self.totals.estimated_tokens += estimated;
            }
            None => {
                self.totals.output_tokens += estimated;
                self.totals.estimated_tokens += estimated;
            }
        }
        if let Some(rec) = self.records.get_mut(key) {
            rec.finished_at = Some(now);
        }
        self.retired.push_back((key, now));
        self.purge(now);
    }

    /// Replaces a request's estimated tokens by its exact total. Streamed: each of its
    /// segments still in the window is scaled by exact/estimated, and so is the slot it
    /// counted in, so rates and its TPOT stay right without a jump at the end. Not
    /// streamed: the tokens arrive whole, in the slot where the response ended.
    fn correct(&mut self, key: usize, epoch: u64, estimated: u64, exact: u64) {
        if exact == estimated {
            return;
        }
        if estimated == 0 {
            slot_of(&mut self.ring, epoch).tokens += exact;
            return;
        }
        let ratio = exact as f64 / estimated as f64;
        let Some(rec) = self.records.get_mut(key) else {
            return;
        };
        for seg in rec.segments.iter_mut().filter(|s| s.events > 0) {
            let scaled = (seg.tokens as f64 * ratio).round() as u64;
            let slot = &mut self.ring[(seg.epoch % SLOTS as u64) as usize];
            if slot.epoch == seg.epoch {
                slot.tokens = (slot.tokens + scaled).saturating_sub(seg.tokens);
            }
            seg.tokens = scaled;
        }
    }

    pub(super) fn count(&mut self, outcome: Outcome) {
        self.totals.by_outcome[outcome.index()] += 1;
    }

    pub(super) fn unparsed(&mut self, events: u64) {
        self.totals.unparsed_events += events;
    }

    pub(super) fn stats(&mut self, name: &str, now: Nanos) -> UpstreamStats {
        let now = self.advance(now);
        self.purge(now);
        let epoch = now / self.slot_ns;
        let oldest = self.oldest_epoch(epoch);
        let span = now - (oldest * self.slot_ns).max(self.started);
        let in_window = |e: u64| e != u64::MAX && e >= oldest && e <= epoch;

        let (mut tokens, mut busy) = (0u64, 0u128);
        let mut itl = histogram();
        for slot in self.ring.iter().filter(|s| in_window(s.epoch)) {
            tokens += slot.tokens;
            busy += slot.busy;
            let _ = itl.add(&slot.itl);
        }
        let window_start = oldest * self.slot_ns;
        let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
        for (_, rec) in &self.records {
            if let Some(first) = rec.first.filter(|&f| f >= window_start) {
                ttft.push(ms(first.saturating_sub(rec.t0)));
            }
            if let Some(end) = rec.finished_at.filter(|&f| f >= window_start) {
                e2e.push(ms(end.saturating_sub(rec.t0)));
            }
            if let Some(t) = window_tpot(rec, oldest, epoch) {
                tpot.push(t);
            }
        }
        let mean_tpot = (!tpot.is_empty()).then(|| tpot.iter().sum::<f64>() / tpot.len() as f64);
        let metered = self.metered;
        let rate = |x: f64| (metered && span > 0).then(|| x / (span as f64 / 1e9));

        let t = &self.totals;
        let finished_generations = t.exact_requests + t.estimated_requests;
        UpstreamStats {
            name: name.to_owned(),
            in_flight: self.in_flight,
            queued: 0,
            limit: None,
            rejected_total: 0,
            rejected_by_reason: BTreeMap::new(),
            requests_total: t.by_outcome.iter().sum(),
            errors_total: Outcome::ALL
                .iter()
                .filter(|o| o.is_error())
                .map(|o| t.by_outcome[o.index()])
                .sum(),
            output_tokens_total: t.output_tokens,
            counts_exact: (finished_generations > 0).then_some(t.estimated_requests == 0),
            estimated_output_tokens_total: t.estimated_tokens,
            estimated_tokens_share_pct: (t.output_tokens > 0)
                .then(|| 100.0 * t.estimated_tokens as f64 / t.output_tokens as f64),
            estimate_to_exact_ratio: (t.exact_after_estimate > 0)
                .then(|| t.estimate_before_exact as f64 / t.exact_after_estimate as f64),
            tokens_per_event: TokensPerEvent::of(&self.tokens_per_event),
            requests_by_status: Outcome::ALL
                .iter()
                .map(|o| (o.label(), t.by_outcome[o.index()]))
                .filter(|(_, n)| *n > 0)
                .collect(),
            unparsed_events_total: t.unparsed_events,
            system_tps: rate(tokens as f64),
            single_stream_tps: mean_tpot.filter(|m| *m > 0.0).map(|m| 1000.0 / m),
            concurrency: rate(busy as f64 / 1e9),
            ttft_ms: Percentiles::of(&mut ttft),
            tpot_ms: Percentiles::of(&mut tpot),
            itl_ms: hist_percentiles(&itl),
            e2e_ms: Percentiles::of(&mut e2e),
            curve: self.curve(),
            slo: None,
            arms: Vec::new(),
        }
    }

    /// The controller's evidence since its last call, and a fresh start.
    pub(super) fn control_sample(&mut self, now: Nanos, percentile: f64) -> ControlSample {
        let now = self.advance(now);
        let span = now.saturating_sub(self.control_since);
        let gaps = &self.control_gaps;
        let sample = ControlSample {
            tpot_ms: (!gaps.is_empty()).then(|| quantile_us(gaps, percentile / 100.0) / 1e3),
            concurrency: if span > 0 {
                self.control_busy as f64 / span as f64
            } else {
                0.0
            },
        };
        self.control_gaps.reset();
        self.control_busy = 0;
        self.control_since = now;
        sample
    }

    /// The highest system T/s among curve buckets whose `percentile` of per-token gaps meets
    /// `tpot_ms`.
    pub(super) fn slo_bounded_system_tps(&self, tpot_ms: f64, percentile: f64) -> Option<f64> {
        self.curve
            .iter()
            .filter(|b| {
                b.time > 0
                    && b.gaps.as_ref().is_some_and(|h| {
                        !h.is_empty() && quantile_us(h, percentile / 100.0) / 1e3 <= tpot_ms
                    })
            })
            .map(|b| b.tokens as f64 / (b.time as f64 / 1e9))
            .max_by(f64::total_cmp)
    }

    fn curve(&self) -> Vec<CurvePoint> {
        self.curve
            .iter()
            .enumerate()
            .filter(|(_, b)| b.tokens > 0)
            .map(|(i, b)| {
                let samples = b.gaps.as_ref().map_or(0, Histogram::len);
                let q = |p: f64| {
                    b.gaps
                        .as_ref()
                        .filter(|h| !h.is_empty())
                        .map(|h| quantile_us(h, p) / 1e3)
                };
                let mean_ms = (samples > 0).then(|| b.gap_sum_us / samples as f64 / 1e3);
                CurvePoint {
                    concurrency: 1 << i,
                    tpot_ms_p50: q(0.5),
                    tpot_ms_p90: q(0.9),
                    single_stream_tps: mean_ms.filter(|m| *m > 0.0).map(|m| 1000.0 / m),
                    system_tps: (b.time > 0).then(|| b.tokens as f64 / (b.time as f64 / 1e9)),
                    samples,
                }
            })
            .collect()
    }

    /// Records held: in flight, or finished inside the window.
    #[cfg(test)]
    pub(super) fn records_held(&self) -> usize {
        self.records.len()
    }

    fn oldest_epoch(&self, epoch: u64) -> u64 {
        epoch.saturating_sub(SLOTS as u64 - 1)
    }

    fn clamp(&mut self, now: Nanos) -> Nanos {
        self.latest = self.latest.max(now);
        self.latest
    }

    /// Brings the concurrency integral up to `now`; returns `now` clamped to be monotonic.
    fn advance(&mut self, now: Nanos) -> Nanos {
        let now = self.clamp(now);
        let from = self.last_change;
        self.last_change = now;
        if self.in_flight == 0 || now <= from {
            return now;
        }
        let n = self.in_flight;
        self.curve[bucket(n)].time += now - from;
        self.control_busy += u128::from(n) * u128::from(now - from);
        // Only the slots still in the window matter for the ring.
        let mut t = from.max(self.oldest_epoch(now / self.slot_ns) * self.slot_ns);
        while t < now {
            let epoch = t / self.slot_ns;
            let end = ((epoch + 1) * self.slot_ns).min(now);
            self.slot(epoch).busy += u128::from(n) * u128::from(end - t);
            t = end;
        }
        now
    }

    fn slot(&mut self, epoch: u64) -> &mut Slot {
        slot_of(&mut self.ring, epoch)
    }

    fn purge(&mut self, now: Nanos) {
        let window_start = self.oldest_epoch(now / self.slot_ns) * self.slot_ns;
        while let Some(&(key, at)) = self.retired.front() {
            if at >= window_start {
                break;
            }
            self.retired.pop_front();
            self.records.try_remove(key);
        }
    }
}

/// A request's TPOT (ms) over its token events inside epochs `oldest..=newest`: `None`
/// unless it had at least two events there.
fn window_tpot(rec: &Record, oldest: u64, newest: u64) -> Option<f64> {
    let (mut first, mut last, mut tokens, mut events) = (u64::MAX, 0, 0u64, 0u32);
    for s in rec
        .segments
        .iter()
        .filter(|s| s.events > 0 && s.epoch >= oldest && s.epoch <= newest)
    {
        first = first.min(s.first);
        last = last.max(s.last);
        tokens += s.tokens;
        events += s.events;
    }
    (events >= 2 && tokens >= 2 && last > first).then(|| ms(last - first) / (tokens - 1) as f64)
}

/// The ring slot of `epoch`, emptied first if it last held an older epoch.
fn slot_of(ring: &mut [Slot], epoch: u64) -> &mut Slot {
    let slot = &mut ring[(epoch % SLOTS as u64) as usize];
    if slot.epoch != epoch {
        slot.epoch = epoch;
        slot.tokens = 0;
        slot.busy = 0;
        slot.itl.reset();
    }
    slot
}

/// A quantile as the middle of its histogram bucket (not its top, which reads high).
fn quantile_us(h: &Histogram<u32>, q: f64) -> f64 {
    h.median_equivalent(h.value_at_quantile(q)) as f64
}

fn hist_percentiles(h: &Histogram<u32>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let q = |p: f64| Some(quantile_us(h, p) / 1e3);
    Percentiles {
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
    }
}
