//! The sliding windows of one upstream: a ring of time slots, the records of the requests
//! active inside the window, and the cumulative concurrency curve.
//!
//! The window is the last [`SLOTS`] slots of `window / SLOTS` each, the newest one still
//! filling, so it spans between `(SLOTS-1)/SLOTS` and all of `window` and rates are exact for
//! steady traffic: tokens counted over exactly the time they were counted in. Per-request
//! figures (TTFT, TPOT, single-stream T/s) are computed at read time from each request's
//! per-slot segments, which is what DESIGN §1 asks: each request's TPOT over its own token
//! events inside the window.
//!
//! The state is split by how often it changes. [`Windows`] holds what changes when a request
//! begins or ends (in flight, the concurrency integrals, totals): one per upstream. A
//! [`Shard`] holds what changes on every token event (slot tokens and gaps, the records, the
//! curve's tokens and gaps): one per upstream per worker thread, so a token event touches
//! only its own thread's shard. A read merges them into [`Sums`].

use std::collections::VecDeque;
use std::time::Duration;

use hdrhistogram::Histogram;
use slab::Slab;

use super::curve::{self, Bucket as CurveBucket, Events, Scope, Times, CURVE_BUCKETS};
use super::stats::{CurvePoint, MeterStats, Percentiles, TokensPerEvent};
use super::{Nanos, Outcome};

/// Slots per window.
pub const SLOTS: usize = 20;
/// Histogram range: 1 µs to one hour, two significant figures (1% resolution).
const HIST_MAX_US: u64 = 3_600_000_000;

/// A request's token events inside one slot: 20 bytes, as every open stream holds
/// [`SLOTS`] of them. The slot is counted from the record's first one, and the times are
/// microseconds into the slot (a slot is at most 3600 s / [`SLOTS`]).
#[derive(Clone, Copy, Default)]
struct Segment {
    /// The slot's epoch less the record's `epoch0`.
    epoch: u32,
    first_us: u32,
    last_us: u32,
    tokens: u32,
    events: u32,
}

impl Segment {
    /// Its first and last event, in nanoseconds.
    fn span(&self, epoch0: u64, slot_ns: Nanos) -> (Nanos, Nanos) {
        let start = (epoch0 + u64::from(self.epoch)) * slot_ns;
        (
            start + u64::from(self.first_us) * 1000,
            start + u64::from(self.last_us) * 1000,
        )
    }
}

/// Microseconds from the start of its slot to `now`.
fn into_slot_us(now: Nanos, slot_ns: Nanos) -> u32 {
    ((now % slot_ns) / 1000).try_into().unwrap_or(u32::MAX)
}

/// A request in flight.
struct Record {
    t0: Nanos,
    first: Option<Nanos>,
    last: Nanos,
    /// The epoch its segments count from: the slot it began in.
    epoch0: u64,
    segments: [Segment; SLOTS],
    /// Its tokens by the curve bucket they arrived in, so an exact count that replaces
    /// them is spread over the same buckets.
    by_bucket: [u32; CURVE_BUCKETS],
}

/// A finished request still inside the window: what `/stats` reads of it, without the
/// room an open one keeps (its segments without events, its tokens by curve bucket). At
/// thousands of short requests a second the window holds tens of thousands of them.
struct Retired {
    t0: Nanos,
    first: Option<Nanos>,
    finished_at: Nanos,
    epoch0: u64,
    segments: Segments,
}

impl Retired {
    fn of(rec: Record, finished_at: Nanos) -> Retired {
        let mut with_events = rec.segments.into_iter().filter(|s| s.events > 0);
        let segments = match (with_events.next(), with_events.next()) {
            (Some(only), None) => Segments::One(only),
            (None, _) => Segments::Many(Box::default()),
            (Some(a), Some(b)) => Segments::Many([a, b].into_iter().chain(with_events).collect()),
        };
        Retired {
            t0: rec.t0,
            first: rec.first,
            finished_at,
            epoch0: rec.epoch0,
            segments,
        }
    }
}

/// A retired request's segments with events: a reply shorter than a slot (the short ones
/// that come by the thousand a second) has one, kept without an allocation of its own.
enum Segments {
    One(Segment),
    Many(Box<[Segment]>),
}

impl Segments {
    fn as_slice(&self) -> &[Segment] {
        match self {
            Segments::One(one) => std::slice::from_ref(one),
            Segments::Many(many) => many,
        }
    }
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
    /// Prompt tokens, of the requests whose stream reported them.
    input_tokens: u64,
}

/// One controller tick's evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlSample {
    /// The asked percentile of per-token gaps, ms; `None` without gaps.
    pub tpot_ms: Option<f64>,
    /// Time-weighted mean in flight.
    pub concurrency: f64,
    /// The tick's per-token gaps, to be merged with other replicas' (`[cluster]`).
    pub gaps: Gaps,
}

/// Per-token gaps as (µs, count) pairs at the meter's resolution (2 significant digits):
/// a histogram that travels, and merges exactly with others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gaps(Vec<(u64, u64)>);

impl Gaps {
    fn of(h: &Histogram<u32>) -> Gaps {
        Gaps(
            h.iter_recorded()
                .map(|v| {
                    (
                        h.median_equivalent(v.value_iterated_to()),
                        u64::from(v.count_at_value()),
                    )
                })
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The gaps of `parts` together.
    pub fn merged<'a>(parts: impl IntoIterator<Item = &'a Gaps>) -> Gaps {
        let mut h = histogram();
        for part in parts {
            for &(v, n) in &part.0 {
                let _ = h.record_n(
                    v.clamp(1, HIST_MAX_US),
                    u32::try_from(n).unwrap_or(u32::MAX),
                );
            }
        }
        Gaps::of(&h)
    }

    /// The `percentile` (0–100) of the gaps, ms.
    pub fn percentile_ms(&self, percentile: f64) -> Option<f64> {
        let total: u64 = self.0.iter().map(|p| p.1).sum();
        if total == 0 {
            return None;
        }
        // The hdrhistogram rule: the lowest value with at least q·n at or below it.
        let want = ((percentile / 100.0).clamp(0.0, 1.0) * total as f64)
            .ceil()
            .max(1.0) as u64;
        let mut seen = 0;
        self.0
            .iter()
            .find(|&&(_, n)| {
                seen += n;
                seen >= want
            })
            .map(|&(v, _)| v as f64 / 1e3)
    }

    /// `µs:count` pairs, comma-separated.
    pub fn encode(&self) -> String {
        let mut s = String::with_capacity(self.0.len() * 10);
        for (i, (v, n)) in self.0.iter().enumerate() {
            use std::fmt::Write;
            let _ = write!(s, "{}{v}:{n}", if i > 0 { "," } else { "" });
        }
        s
    }

    /// What [`Gaps::encode`] wrote; `None` for anything else.
    pub fn decode(s: &str) -> Option<Gaps> {
        if s.is_empty() {
            return Some(Gaps::default());
        }
        s.split(',')
            .map(|pair| {
                let (v, n) = pair.split_once(':')?;
                Some((v.parse().ok()?, n.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()
            .map(Gaps)
    }
}

fn histogram() -> Histogram<u32> {
    // The bounds are constants that hdrhistogram accepts; the fallback is unreachable.
    Histogram::new_with_bounds(1, HIST_MAX_US, 2)
        .unwrap_or_else(|_| Histogram::new(2).unwrap_or_else(|_| unreachable!()))
}

/// A histogram kept since start: 64-bit counts, which a busy upstream cannot fill (32-bit
/// ones would, in about ten days at 5,000 events a second).
pub(super) fn histogram64() -> Histogram<u64> {
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

/// The epochs `oldest..=newest` of the window that ends at `now`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    oldest: u64,
    newest: u64,
    slot_ns: Nanos,
}

impl Span {
    fn of(now: Nanos, slot_ns: Nanos) -> Span {
        let newest = now / slot_ns;
        Span {
            oldest: newest.saturating_sub(SLOTS as u64 - 1),
            newest,
            slot_ns,
        }
    }

    fn contains(self, epoch: u64) -> bool {
        epoch != u64::MAX && epoch >= self.oldest && epoch <= self.newest
    }

    fn start(self) -> Nanos {
        self.oldest * self.slot_ns
    }
}

/// What the shards hold for one read, merged.
pub(super) struct Sums {
    tokens: u64,
    itl: Histogram<u32>,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    e2e: Vec<f64>,
    curve: Vec<CurveBucket>,
    tokens_per_event: Histogram<u64>,
    control_gaps: Histogram<u32>,
}

impl Sums {
    /// The curve's gaps over all buckets (every per-token gap since start) and the tokens
    /// per event.
    pub(super) fn distributions(self) -> super::Distributions {
        let mut itl_us = histogram64();
        let mut itl_sum_us = 0.0;
        for b in &self.curve {
            if let Some(g) = &b.gaps {
                let _ = itl_us.add(g);
            }
            itl_sum_us += b.gap_sum_us;
        }
        super::Distributions {
            itl_us,
            itl_sum_us,
            tokens_per_event: self.tokens_per_event,
        }
    }

    pub(super) fn new() -> Sums {
        Sums {
            tokens: 0,
            itl: histogram(),
            ttft: Vec::new(),
            tpot: Vec::new(),
            e2e: Vec::new(),
            curve: (0..CURVE_BUCKETS).map(|_| CurveBucket::default()).collect(),
            tokens_per_event: histogram64(),
            control_gaps: histogram(),
        }
    }
}

// ===== the per-event half =====

/// One slot of a shard's ring: its tokens and per-token gaps.
struct Slot {
    epoch: u64,
    tokens: u64,
    /// Per-token gaps (ITL), µs.
    itl: Histogram<u32>,
}

/// The per-event state of one upstream on one worker thread.
pub(super) struct Shard {
    slot_ns: Nanos,
    /// The latest time seen: timestamps taken just before the lock may arrive out of order.
    latest: Nanos,
    ring: Vec<Slot>,
    /// The requests in flight.
    records: Slab<Record>,
    /// Finished requests in finishing order, dropped once they leave the window.
    retired: VecDeque<Retired>,
    curve: Events,
    /// Per-token gaps since the SLO controller's last read.
    control_gaps: Histogram<u32>,
    /// Tokens per token-bearing fragment, since start.
    tokens_per_event: Histogram<u64>,
    /// Tokens counted so far by this shard's requests in flight.
    running: u64,
}

// === impl Shard ===

impl Shard {
    pub(super) fn new(window: Duration, curve_window: Duration) -> Self {
        Shard {
            slot_ns: slot_ns(window),
            latest: 0,
            ring: (0..SLOTS)
                .map(|_| Slot {
                    epoch: u64::MAX,
                    tokens: 0,
                    itl: histogram(),
                })
                .collect(),
            records: Slab::new(),
            retired: VecDeque::new(),
            curve: Events::new(curve_window),
            control_gaps: histogram(),
            tokens_per_event: histogram64(),
            running: 0,
        }
    }

    /// Tokens counted so far by requests in flight.
    pub(super) fn running_tokens(&self) -> u64 {
        self.running
    }

    /// The record of a request whose client started it at `t0`, sent upstream at `now`.
    pub(super) fn begin(&mut self, t0: Nanos, now: Nanos) -> usize {
        let now = self.clamp(now);
        self.records.insert(Record {
            t0,
            first: None,
            last: now,
            epoch0: now / self.slot_ns,
            segments: [Segment::default(); SLOTS],
            by_bucket: [0; CURVE_BUCKETS],
        })
    }

    /// Records `events` token events of `n` tokens each of request `key`, all at `now`, the
    /// curve's concurrency being `in_flight` (tokentap's, or the backend's own count).
    /// Exactly what `events` calls for one event each would record: the first event's gap
    /// is the time since the request's previous event, the others' gaps are 0. Returns the
    /// first event's gap (`None` for the request's first event).
    pub(super) fn tokens(
        &mut self,
        key: usize,
        now: Nanos,
        n: u32,
        events: u32,
        in_flight: u64,
    ) -> Option<Nanos> {
        let now = self.clamp(now);
        let epoch = now / self.slot_ns;
        let rec = self.records.get_mut(key)?;
        let tokens = n.saturating_mul(events);
        let all = u64::from(n) * u64::from(events);
        let b = bucket(in_flight);
        rec.by_bucket[b] = rec.by_bucket[b].saturating_add(tokens);
        let gap = rec.first.map(|_| now.saturating_sub(rec.last));
        if rec.first.is_none() {
            rec.first = Some(now);
        }
        rec.last = now;
        let seg = &mut rec.segments[(epoch % SLOTS as u64) as usize];
        let rel = u32::try_from(epoch.saturating_sub(rec.epoch0)).unwrap_or(u32::MAX);
        let at = into_slot_us(now, self.slot_ns);
        if seg.epoch != rel || seg.events == 0 {
            *seg = Segment {
                epoch: rel,
                first_us: at,
                last_us: at,
                tokens: 0,
                events: 0,
            };
        }
        seg.last_us = at;
        seg.tokens = seg.tokens.saturating_add(tokens);
        seg.events = seg.events.saturating_add(events);

        let _ = self
            .tokens_per_event
            .record_n(u64::from(n), u64::from(events));
        self.running += all;
        let slot = slot_of(&mut self.ring, epoch);
        slot.tokens += all;
        let curve = self.curve.at(now, b);
        curve.tokens += all;
        // The first event's gap; each later one's is 0, which the histograms hold as their
        // lowest value (1 µs per token) and which adds nothing to the sum.
        let rest = n.saturating_mul(events.saturating_sub(1));
        let gaps = [gap.map(|gap| (gap, n)), (rest > 0).then_some((0, rest))];
        for (gap, tokens) in gaps.into_iter().flatten() {
            let per_token_us = gap as f64 / 1e3 / f64::from(n);
            let v = (per_token_us.round() as u64).clamp(1, HIST_MAX_US);
            let _ = slot.itl.record_n(v, tokens);
            let _ = self.control_gaps.record_n(v, tokens);
            let _ = curve
                .gaps
                .get_or_insert_with(histogram64)
                .record_n(v, u64::from(tokens));
            curve.gap_sum_us += per_token_us * f64::from(tokens);
        }
        gap
    }

    /// Ends request `key`'s record at `now`. `estimated` is the tokens its events counted;
    /// an `exact` total replaces that estimate (see [`Self::correct`]).
    pub(super) fn finish(&mut self, key: usize, now: Nanos, estimated: u64, exact: Option<u64>) {
        let now = self.clamp(now);
        self.running = self.running.saturating_sub(estimated);
        if let Some(total) = exact {
            self.correct(key, now, estimated, total);
        }
        if let Some(rec) = self.records.try_remove(key) {
            self.retired.push_back(Retired::of(rec, now));
        }
        self.purge(now);
    }

    /// Replaces a request's estimated tokens by its exact total. Streamed: each of its
    /// segments still in the window is scaled by exact/estimated, and so is the slot it
    /// counted in, so rates and its TPOT stay right without a jump at the end. Not
    /// streamed: the tokens arrive whole, in the slot where the response ended.
    /// The curve's buckets are corrected the same way: each bucket the request's tokens
    /// arrived in gets its share of the difference, never the bucket it finished in.
    fn correct(&mut self, key: usize, now: Nanos, estimated: u64, exact: u64) {
        let epoch = now / self.slot_ns;
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
        for (b, &counted) in rec.by_bucket.iter().enumerate().filter(|(_, &t)| t > 0) {
            let scaled = (f64::from(counted) * ratio).round() as u64;
            let bucket = self.curve.at(now, b);
            bucket.tokens = (bucket.tokens + scaled).saturating_sub(u64::from(counted));
        }
        for seg in rec.segments.iter_mut().filter(|s| s.events > 0) {
            let scaled = (f64::from(seg.tokens) * ratio).round() as u64;
            let epoch = rec.epoch0 + u64::from(seg.epoch);
            let slot = &mut self.ring[(epoch % SLOTS as u64) as usize];
            if slot.epoch == epoch {
                slot.tokens = (slot.tokens + scaled).saturating_sub(u64::from(seg.tokens));
            }
            seg.tokens = u32::try_from(scaled).unwrap_or(u32::MAX);
        }
    }

    /// Adds this shard's part of the window `span` to `sums`.
    pub(super) fn add_to(&mut self, sums: &mut Sums, now: Nanos, span: Span) {
        self.purge(now);
        for slot in self.ring.iter().filter(|s| span.contains(s.epoch)) {
            sums.tokens += slot.tokens;
            let _ = sums.itl.add(&slot.itl);
        }
        let window_start = span.start();
        let mut add = |t0: Nanos, first: Option<Nanos>, end: Option<Nanos>, tpot: Option<f64>| {
            if let Some(first) = first.filter(|&f| f >= window_start) {
                sums.ttft.push(ms(first.saturating_sub(t0)));
            }
            if let Some(end) = end.filter(|&f| f >= window_start) {
                sums.e2e.push(ms(end.saturating_sub(t0)));
            }
            if let Some(t) = tpot {
                sums.tpot.push(t);
            }
        };
        for (_, rec) in &self.records {
            add(
                rec.t0,
                rec.first,
                None,
                window_tpot(rec.epoch0, &rec.segments, span),
            );
        }
        for r in &self.retired {
            let tpot = window_tpot(r.epoch0, r.segments.as_slice(), span);
            add(r.t0, r.first, Some(r.finished_at), tpot);
        }
        self.add_curve(sums, Scope::Window(now));
        self.add_tokens_per_event(sums);
    }

    /// Moves the per-token gaps since the last call into `sums`.
    pub(super) fn take_control_gaps(&mut self, sums: &mut Sums) {
        let _ = sums.control_gaps.add(&self.control_gaps);
        self.control_gaps.reset();
    }

    /// Adds this shard's curve of `scope` to `sums`.
    pub(super) fn add_curve(&self, sums: &mut Sums, scope: Scope) {
        self.curve.add(&mut sums.curve, scope);
    }

    /// The curve's window starts afresh, `curve_window` long.
    pub(super) fn reset_curve(&mut self, curve_window: Duration) {
        self.curve.reset(curve_window);
    }

    /// Adds this shard's tokens-per-event histogram to `sums`.
    pub(super) fn add_tokens_per_event(&self, sums: &mut Sums) {
        let _ = sums.tokens_per_event.add(&self.tokens_per_event);
    }

    /// Records held: in flight, or finished inside the window.
    #[cfg(test)]
    pub(super) fn records_held(&self) -> usize {
        self.records.len() + self.retired.len()
    }

    fn clamp(&mut self, now: Nanos) -> Nanos {
        self.latest = self.latest.max(now);
        self.latest
    }

    fn purge(&mut self, now: Nanos) {
        let window_start = Span::of(now, self.slot_ns).start();
        while self
            .retired
            .front()
            .is_some_and(|r| r.finished_at < window_start)
        {
            self.retired.pop_front();
        }
    }
}

// ===== the per-request half =====

/// One slot of the concurrency ring: ∫ in_flight dt over the slot, in request·ns.
#[derive(Clone, Copy)]
struct BusySlot {
    epoch: u64,
    busy: u128,
}

/// The per-request state of one upstream.
pub(super) struct Windows {
    slot_ns: Nanos,
    started: Nanos,
    /// The latest time seen: timestamps taken just before the lock may arrive out of order.
    latest: Nanos,
    ring: [BusySlot; SLOTS],
    in_flight: u64,
    last_change: Nanos,
    /// Time spent at each curve bucket's concurrency (while this tokentap had requests in
    /// flight), ∫ concurrency dt there, and the part of that time counted by the backend.
    times: Times,
    /// The backend's running count, when the curve is bucketed by it.
    backend: Option<u64>,
    totals: Totals,
    metered: bool,
    /// What the SLO controller reads each tick: ∫ in_flight dt since the last read.
    control_busy: u128,
    control_since: Nanos,
}

fn slot_ns(window: Duration) -> Nanos {
    let window_ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
    (window_ns / SLOTS as u64).max(1)
}

// === impl Windows ===

impl Windows {
    pub(super) fn new(window: Duration, curve_window: Duration, now: Nanos) -> Self {
        Windows {
            slot_ns: slot_ns(window),
            started: now,
            latest: now,
            ring: [BusySlot {
                epoch: u64::MAX,
                busy: 0,
            }; SLOTS],
            in_flight: 0,
            last_change: now,
            times: Times::new(curve_window),
            backend: None,
            totals: Totals::default(),
            metered: false,
            control_busy: 0,
            control_since: now,
        }
    }

    /// A request was sent upstream at `now`; returns the requests now in flight.
    pub(super) fn begin(&mut self, now: Nanos) -> u64 {
        self.advance(now);
        self.in_flight += 1;
        self.metered = true;
        self.in_flight
    }

    /// A request ended at `now`, having counted `estimated` tokens from its events (none
    /// when its body was `unread`) and reported an `exact` total or not; returns the
    /// requests still in flight.
    pub(super) fn finish(
        &mut self,
        now: Nanos,
        outcome: Outcome,
        (estimated, unread): (u64, bool),
        exact: Option<u64>,
        input: Option<u64>,
    ) -> u64 {
        self.advance(now);
        self.in_flight = self.in_flight.saturating_sub(1);
        self.count(outcome);
        // Sums saturate: a count is bounded (dialect::MAX_COUNT), its sum over a long life
        // is not.
        let t = &mut self.totals;
        let add = |sum: &mut u64, n: u64| *sum = sum.saturating_add(n);
        add(&mut t.input_tokens, input.unwrap_or(0));
        match exact {
            Some(total) => {
                add(&mut t.exact_requests, 1);
                add(&mut t.output_tokens, total);
                if estimated > 0 {
                    add(&mut t.estimate_before_exact, estimated);
                    add(&mut t.exact_after_estimate, total);
                }
            }
            // A stream cut short never gets its exact count: it does not make the counts
            // of completed generations inexact.
            None if (estimated > 0 || unread) && outcome == Outcome::Ok => {
                add(&mut t.estimated_requests, 1);
                add(&mut t.output_tokens, estimated);
                add(&mut t.estimated_tokens, estimated);
            }
            None => {
                add(&mut t.output_tokens, estimated);
                add(&mut t.estimated_tokens, estimated);
            }
        }
        self.in_flight
    }

    /// From `now` on, the curve counts the backend's `running` (or, `None`, tokentap's own
    /// in-flight count).
    pub(super) fn set_backend(&mut self, now: Nanos, running: Option<u64>) {
        self.advance(now);
        self.backend = running;
    }

    /// Output tokens of finished requests.
    pub(super) fn output_tokens(&self) -> u64 {
        self.totals.output_tokens
    }

    /// The curve since start, the shards' part being in `sums`: the buckets with the
    /// support of a point (once a bucket has it, it always has).
    pub(super) fn curve_totals(&self, sums: Sums) -> Vec<super::CurveTotals> {
        let times = self.times.sum(Scope::All);
        sums.curve
            .into_iter()
            .zip(times)
            .enumerate()
            .filter(|(_, (b, t))| !sparse(b, t))
            .map(|(i, (b, t))| super::CurveTotals {
                concurrency: 1 << i,
                tokens: b.tokens,
                seconds: t.ns as f64 / 1e9,
                gaps_us: b.gaps,
                gap_sum_us: b.gap_sum_us,
            })
            .collect()
    }

    /// The curve's window starts afresh, `curve_window` long.
    pub(super) fn reset_curve(&mut self, now: Nanos, curve_window: Duration) {
        self.advance(now);
        self.times.reset(curve_window);
    }

    pub(super) fn count(&mut self, outcome: Outcome) {
        self.totals.by_outcome[outcome.index()] += 1;
    }

    pub(super) fn unparsed(&mut self, events: u64) {
        self.totals.unparsed_events += events;
    }

    /// Brings the integrals up to `now` (clamped to be monotonic) and returns the window
    /// that ends there, for the shards to add their part to.
    pub(super) fn span(&mut self, now: Nanos) -> (Nanos, Span) {
        let now = self.advance(now);
        (now, Span::of(now, self.slot_ns))
    }

    /// The figures of the window `span` ending at `now`, the shards' part being `sums`.
    pub(super) fn stats(&self, name: &str, now: Nanos, span: Span, mut sums: Sums) -> MeterStats {
        let elapsed = now - span.start().max(self.started);
        let busy: u128 = self
            .ring
            .iter()
            .filter(|s| span.contains(s.epoch))
            .map(|s| s.busy)
            .sum();
        let tpot = &sums.tpot;
        let mean_tpot = (!tpot.is_empty()).then(|| tpot.iter().sum::<f64>() / tpot.len() as f64);
        let metered = self.metered;
        let rate = |x: f64| (metered && elapsed > 0).then(|| x / (elapsed as f64 / 1e9));

        let t = &self.totals;
        let finished_generations = t.exact_requests + t.estimated_requests;
        MeterStats {
            name: name.to_owned(),
            in_flight: self.in_flight,
            requests_total: t.by_outcome.iter().sum(),
            errors_total: Outcome::ALL
                .iter()
                .filter(|o| o.is_error())
                .map(|o| t.by_outcome[o.index()])
                .sum(),
            output_tokens_total: t.output_tokens,
            input_tokens_total: t.input_tokens,
            counts_exact: (finished_generations > 0).then_some(t.estimated_requests == 0),
            estimated_output_tokens_total: t.estimated_tokens,
            estimated_tokens_share_pct: (t.output_tokens > 0)
                .then(|| 100.0 * t.estimated_tokens as f64 / t.output_tokens as f64),
            estimate_to_exact_ratio: (t.exact_after_estimate > 0)
                .then(|| t.estimate_before_exact as f64 / t.exact_after_estimate as f64),
            tokens_per_event: TokensPerEvent::of(&sums.tokens_per_event),
            requests_by_status: Outcome::ALL
                .iter()
                .map(|o| (o.label(), t.by_outcome[o.index()]))
                .filter(|(_, n)| *n > 0)
                .collect(),
            unparsed_events_total: t.unparsed_events,
            system_tps: rate(sums.tokens as f64),
            single_stream_tps: mean_tpot.filter(|m| *m > 0.0).map(|m| 1000.0 / m),
            concurrency: rate(busy as f64 / 1e9),
            ttft_ms: Percentiles::of(&mut sums.ttft),
            tpot_ms: Percentiles::of(&mut sums.tpot),
            itl_ms: hist_percentiles(&sums.itl),
            e2e_ms: Percentiles::of(&mut sums.e2e),
            curve: self.curve(&sums, now),
        }
    }

    /// The controller's evidence since its last call (the shards' gaps being in `sums`), and
    /// a fresh start.
    pub(super) fn control_sample(
        &mut self,
        now: Nanos,
        percentile: f64,
        sums: &Sums,
    ) -> ControlSample {
        let now = self.advance(now);
        let span = now.saturating_sub(self.control_since);
        let gaps = &sums.control_gaps;
        let sample = ControlSample {
            tpot_ms: (!gaps.is_empty()).then(|| quantile_us(gaps, percentile / 100.0) / 1e3),
            concurrency: if span > 0 {
                self.control_busy as f64 / span as f64
            } else {
                0.0
            },
            gaps: Gaps::of(gaps),
        };
        self.control_busy = 0;
        self.control_since = now;
        sample
    }

    /// The highest system T/s among curve buckets whose `percentile` of per-token gaps meets
    /// `tpot_ms`, the shards' curve being in `sums`.
    pub(super) fn slo_bounded_system_tps(
        &self,
        now: Nanos,
        tpot_ms: f64,
        percentile: f64,
        sums: &Sums,
    ) -> Option<f64> {
        let meets = |b: &CurveBucket| {
            b.gaps.as_ref().is_some_and(|h| {
                !h.is_empty() && quantile_us(h, percentile / 100.0) / 1e3 <= tpot_ms
            })
        };
        self.curve(sums, now)
            .into_iter()
            .filter(|p| !p.sparse)
            .filter(|p| meets(&sums.curve[p.concurrency.trailing_zeros() as usize]))
            .filter_map(|p| p.system_tps)
            .max_by(f64::total_cmp)
    }

    /// The curve of the window ending at `now`: every bucket with tokens, `sparse` when it
    /// lacks the support of a point.
    fn curve(&self, sums: &Sums, now: Nanos) -> Vec<CurvePoint> {
        let times = self.times.sum(Scope::Window(now));
        sums.curve
            .iter()
            .zip(times)
            .enumerate()
            .filter(|(_, (b, _))| b.tokens > 0)
            .map(|(i, (b, t))| {
                let samples = b.gaps.as_ref().map_or(0, Histogram::len);
                let q = |p: f64| {
                    b.gaps
                        .as_ref()
                        .filter(|h| !h.is_empty())
                        .map(|h| quantile_us(h, p) / 1e3)
                };
                let mean_ms = (samples > 0).then(|| b.gap_sum_us / samples as f64 / 1e3);
                let single = mean_ms.filter(|m| *m > 0.0).map(|m| 1000.0 / m);
                let mean_concurrency = (t.ns > 0).then(|| t.busy as f64 / t.ns as f64);
                // Counted by the backend, this tokentap's tokens are only its share of the
                // batch: the backend's rate is its mean batch × the per-stream rate.
                let by_backend = t.backend_ns * 2 > t.ns;
                let system_tps = match (t.ns > 0, by_backend) {
                    (false, _) => None,
                    (true, true) => single.zip(mean_concurrency).map(|(s, c)| s * c),
                    (true, false) => Some(b.tokens as f64 / (t.ns as f64 / 1e9)),
                };
                CurvePoint {
                    concurrency: 1 << i,
                    tpot_ms_p50: q(0.5),
                    tpot_ms_p90: q(0.9),
                    single_stream_tps: single,
                    system_tps,
                    mean_concurrency,
                    samples,
                    sparse: sparse(b, &t),
                }
            })
            .collect()
    }

    /// Brings the concurrency integrals up to `now`; returns `now` clamped to be monotonic.
    fn advance(&mut self, now: Nanos) -> Nanos {
        self.latest = self.latest.max(now);
        let now = self.latest;
        let from = self.last_change;
        self.last_change = now;
        if self.in_flight == 0 || now <= from {
            return now;
        }
        let n = self.in_flight;
        let c = self.backend.unwrap_or(n);
        self.times
            .add(from, now, bucket(c), c, self.backend.is_some());
        self.control_busy += u128::from(n) * u128::from(now - from);
        // Only the slots still in the window matter for the ring.
        let mut t = from.max(Span::of(now, self.slot_ns).start());
        while t < now {
            let epoch = t / self.slot_ns;
            let end = ((epoch + 1) * self.slot_ns).min(now);
            let slot = &mut self.ring[(epoch % SLOTS as u64) as usize];
            if slot.epoch != epoch {
                *slot = BusySlot { epoch, busy: 0 };
            }
            slot.busy += u128::from(n) * u128::from(end - t);
            t = end;
        }
        now
    }
}

/// Whether a bucket lacks the support of a point: [`curve::MIN_SECS`] spent there and
/// [`curve::MIN_GAPS`] per-token gaps.
fn sparse(b: &CurveBucket, t: &curve::Time) -> bool {
    let gaps = b.gaps.as_ref().map_or(0, Histogram::len);
    (t.ns as f64 / 1e9) < curve::MIN_SECS || gaps < curve::MIN_GAPS
}

/// A request's TPOT (ms) over its token events inside the window `span`: `None` unless it
/// had at least two events there.
fn window_tpot(epoch0: u64, segments: &[Segment], span: Span) -> Option<f64> {
    let (mut first, mut last, mut tokens, mut events) = (u64::MAX, 0, 0u64, 0u32);
    for s in segments.iter().filter(|s| s.events > 0) {
        let epoch = epoch0 + u64::from(s.epoch);
        if epoch < span.oldest || epoch > span.newest {
            continue;
        }
        let (f, l) = s.span(epoch0, span.slot_ns);
        first = first.min(f);
        last = last.max(l);
        tokens += u64::from(s.tokens);
        events = events.saturating_add(s.events);
    }
    (events >= 2 && tokens >= 2 && last > first).then(|| ms(last - first) / (tokens - 1) as f64)
}

/// The ring slot of `epoch`, emptied first if it last held an older epoch.
fn slot_of(ring: &mut [Slot], epoch: u64) -> &mut Slot {
    let slot = &mut ring[(epoch % SLOTS as u64) as usize];
    if slot.epoch != epoch {
        slot.epoch = epoch;
        slot.tokens = 0;
        slot.itl.reset();
    }
    slot
}

/// A quantile as the middle of its histogram bucket (not its top, which reads high).
fn quantile_us<T: hdrhistogram::Counter>(h: &Histogram<T>, q: f64) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(values: impl IntoIterator<Item = u64>) -> Histogram<u32> {
        let mut h = histogram();
        for v in values {
            h.record(v).unwrap();
        }
        h
    }

    #[test]
    fn gaps_merged_give_the_percentiles_of_the_whole() {
        let a: Vec<u64> = (0..500).map(|i| 18_000 + i * 13).collect();
        let b: Vec<u64> = (0..300).map(|i| 25_000 + i * 71).collect();
        let whole = recorded(a.iter().chain(&b).copied());
        let merged = Gaps::merged([&Gaps::of(&recorded(a)), &Gaps::of(&recorded(b))]);
        for p in [1.0, 50.0, 90.0, 99.0, 99.9] {
            assert_eq!(
                merged.percentile_ms(p),
                Some(quantile_us(&whole, p / 100.0) / 1e3),
                "p{p}"
            );
        }
        assert_eq!(Gaps::default().percentile_ms(90.0), None);
    }

    #[test]
    fn gaps_travel_as_text_and_refuse_garbage() {
        let g = Gaps::of(&recorded([20_000, 20_000, 31_000, 2_000_000]));
        assert_eq!(Gaps::decode(&g.encode()), Some(g.clone()));
        assert_eq!(Gaps::decode(""), Some(Gaps::default()));
        for bad in ["1:2,", "x:1", "1:-1", "1", "1:2:3"] {
            assert_eq!(Gaps::decode(bad), None, "{bad}");
        }
    }

    /// A finished request leaves the open records at once, and keeps only its segments
    /// with events (one, for a short reply) until it leaves the window; its figures are
    /// read from that as from an open one.
    #[test]
    fn a_finished_request_keeps_a_small_record_until_it_leaves_the_window() {
        const MS: Nanos = 1_000_000;
        let mut shard = Shard::new(Duration::from_secs(10), Duration::from_secs(900));
        let key = shard.begin(0, 0);
        for i in 1..=16 {
            shard.tokens(key, 100 * MS + i * MS, 1, 1, 1);
        }
        shard.finish(key, 120 * MS, 16, None);
        assert_eq!((shard.records.len(), shard.retired.len()), (0, 1));
        assert_eq!(shard.retired[0].segments.as_slice().len(), 1);
        assert!(matches!(shard.retired[0].segments, Segments::One(_))); // no allocation
        assert!(std::mem::size_of::<Retired>() <= 64);
        let mut sums = Sums::new();
        let now = 200 * MS;
        shard.add_to(&mut sums, now, Span::of(now, shard.slot_ns));
        assert_eq!(sums.ttft, vec![101.0]);
        assert_eq!(sums.e2e, vec![120.0]);
        assert_eq!(sums.tpot, vec![1.0]);
        // 10 s later it has left the window, and nothing is held.
        let late = shard.begin(11_000 * MS, 11_000 * MS);
        shard.finish(late, 11_000 * MS, 0, None);
        assert_eq!(shard.records_held(), 1);
    }
}
