//! The per-event half of an upstream's meter, one per worker thread: a token event locks
//! only its own thread's shard. It holds the ring of slots (tokens and per-token gaps), the
//! records of the requests begun on this thread, and the curve's per-event part.

use std::time::Duration;

use hdrhistogram::Histogram;
use slab::Slab;

use super::curve::{Events, Scope, CURVE_BUCKETS};
use super::hist::{histogram, histogram64, HIST_MAX_US};
use super::log::{ChunkLog, Sealed};
use super::records::{into_slot_us, window_tpot, InFlight, Retired, Segment};
use super::window::{bucket, ms, slot_ns, Span, Sums, SLOTS};
use super::Nanos;

/// Finished requests a shard keeps for the window's TTFT, TPOT and e2e figures, at most
/// (64 MiB): past it, the newest. Tokens and rates are counted in the ring's slots
/// and hold every request whatever the window.
pub(super) const MAX_RETIRED: usize = 1 << 20;

/// One slot of a shard's ring: its tokens and per-token gaps.
struct RingSlot {
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
    ring: Vec<RingSlot>,
    /// The requests in flight.
    records: Slab<InFlight>,
    /// Finished requests in finishing order, dropped once they leave the window (or past
    /// [`MAX_RETIRED`]); a read walks all but the newest without the shard's lock.
    retired: ChunkLog<Retired>,
    /// The window held more than [`MAX_RETIRED`] finished requests at some point.
    full: bool,
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
                .map(|_| RingSlot {
                    epoch: u64::MAX,
                    tokens: 0,
                    itl: histogram(),
                })
                .collect(),
            records: Slab::new(),
            retired: ChunkLog::default(),
            full: false,
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
        self.records.insert(InFlight {
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
    /// an `exact` total replaces that estimate (see [`Self::correct`]). True the first
    /// time the window holds more finished requests than [`MAX_RETIRED`].
    #[must_use = "the window's first overflow is logged"]
    pub(super) fn finish(
        &mut self,
        key: usize,
        now: Nanos,
        estimated: u64,
        exact: Option<u64>,
    ) -> bool {
        let now = self.clamp(now);
        self.running = self.running.saturating_sub(estimated);
        if let Some(total) = exact {
            self.correct(key, now, estimated, total);
        }
        self.purge(now);
        let mut first_overflow = false;
        if let Some(rec) = self.records.try_remove(key) {
            if self.retired.len() >= MAX_RETIRED {
                self.retired.drop_oldest();
                first_overflow = !std::mem::replace(&mut self.full, true);
            }
            self.retired.push(Retired::of(rec, now, self.slot_ns));
        }
        first_overflow
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

    /// Adds this shard's part of the window `span` to `sums`, but for its sealed retired
    /// records, which it returns for [`add_sealed`] to add once the lock is let go.
    #[must_use = "the sealed retired records are not in `sums` until `add_sealed` adds them"]
    pub(super) fn add_to(&mut self, sums: &mut Sums, now: Nanos, span: Span) -> Sealed<Retired> {
        self.purge(now);
        for slot in self.ring.iter().filter(|s| span.contains(s.epoch)) {
            sums.tokens += slot.tokens;
            let _ = sums.itl.add(&slot.itl);
        }
        for (_, rec) in &self.records {
            let tpot = window_tpot(rec.epoch0, &rec.segments, span);
            add_request(sums, span, rec.t0, rec.first, None, tpot);
        }
        for r in self.retired.open() {
            add_retired(sums, span, r);
        }
        self.add_curve(sums, Scope::Window(now));
        self.add_tokens_per_event(sums);
        self.retired.sealed()
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
        let start = Span::of(now, self.slot_ns).start();
        self.retired.drop_while(|r| r.finished_at < start);
    }
}

/// Adds a shard's sealed retired records (all inside the window that [`Shard::add_to`]
/// was given: it dropped the others) to `sums`, without the shard's lock.
pub(super) fn add_sealed(sums: &mut Sums, span: Span, sealed: &Sealed<Retired>) {
    for r in sealed.iter() {
        add_retired(sums, span, r);
    }
}

fn add_retired(sums: &mut Sums, span: Span, r: &Retired) {
    let tpot = r.tpot_in(span);
    add_request(sums, span, r.t0, r.first(), Some(r.finished_at), tpot);
}

/// One request's TTFT, end to end time and TPOT, each if it was inside `span`.
fn add_request(
    sums: &mut Sums,
    span: Span,
    t0: Nanos,
    first: Option<Nanos>,
    end: Option<Nanos>,
    tpot: Option<f64>,
) {
    let window_start = span.start();
    if let Some(first) = first.filter(|&f| f >= window_start) {
        sums.ttft.push(ms(first.saturating_sub(t0)));
    }
    if let Some(end) = end.filter(|&f| f >= window_start) {
        sums.e2e.push(ms(end.saturating_sub(t0)));
    }
    if let Some(t) = tpot {
        sums.tpot.push(t);
    }
}

/// The ring slot of `epoch`, emptied first if it last held an older epoch.
fn slot_of(ring: &mut [RingSlot], epoch: u64) -> &mut RingSlot {
    let slot = &mut ring[(epoch % SLOTS as u64) as usize];
    if slot.epoch != epoch {
        slot.epoch = epoch;
        slot.tokens = 0;
        slot.itl.reset();
    }
    slot
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::records::Segments;

    /// A retired request's TPOT in a window, read from its whole TPOT when every event is
    /// inside, is the one its segments give, bit for bit: requests of one event to many
    /// slots, without tokens, and every 50th longer than the window (its first segments
    /// overwritten in the ring), read at 14 later times; half of them begin with reads
    /// whose clock is behind the request's end, as a reader racing a worker's can be.
    #[test]
    fn a_retired_requests_tpot_in_a_window_is_its_segments_one() {
        use rand::{Rng, SeedableRng};
        const MS: Nanos = 1_000_000;
        let mut rng = rand::rngs::SmallRng::seed_from_u64(63);
        let mut shard = Shard::new(Duration::from_secs(10), Duration::from_secs(900));
        let mut now = 0;
        for i in 0..2_000 {
            now += rng.gen_range(0..3_000) * MS;
            let key = shard.begin(now, now);
            let long = i % 50 == 0;
            for _ in 0..(if long { 8 } else { rng.gen_range(0..6) }) {
                let most = match (long, rng.gen_bool(0.2)) {
                    (true, _) => 3_000,
                    (false, true) => 4_000,
                    (false, false) => 60,
                };
                now += rng.gen_range(1..most) * MS;
                shard.tokens(key, now, rng.gen_range(1..4), rng.gen_range(1..3), 1);
            }
            now += rng.gen_range(0..50) * MS;
            let _ = shard.finish(key, now, 0, None);
            let sealed = shard.retired.sealed();
            let r = shard.retired.open().last();
            let r = r.or_else(|| sealed.iter().last()).unwrap();
            let mut read = now.saturating_sub(rng.gen_range(0..2) * 700 * MS);
            for _ in 0..14 {
                let span = Span::of(read, shard.slot_ns);
                let want = window_tpot(r.epoch0, r.segments.as_slice(), span);
                assert_eq!(r.tpot_in(span).map(f64::to_bits), want.map(f64::to_bits));
                read += rng.gen_range(1..1_500) * MS;
            }
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
        assert!(!shard.finish(key, 120 * MS, 16, None));
        assert_eq!((shard.records.len(), shard.retired.len()), (0, 1));
        let retired = shard.retired.open().next().unwrap();
        assert_eq!(retired.segments.as_slice().len(), 1);
        assert!(matches!(retired.segments, Segments::One(_))); // no allocation
        assert!(std::mem::size_of::<Retired>() <= 64);
        let mut sums = Sums::new();
        let now = 200 * MS;
        let span = Span::of(now, shard.slot_ns);
        let sealed = shard.add_to(&mut sums, now, span);
        add_sealed(&mut sums, span, &sealed);
        assert_eq!(sums.ttft, vec![101.0]);
        assert_eq!(sums.e2e, vec![120.0]);
        assert_eq!(sums.tpot, vec![1.0]);
        // 10 s later it has left the window, and nothing is held.
        let late = shard.begin(11_000 * MS, 11_000 * MS);
        assert!(!shard.finish(late, 11_000 * MS, 0, None));
        assert_eq!(shard.records_held(), 1);
    }

    /// More finished requests in the window than a shard keeps: the newest
    /// [`MAX_RETIRED`] are kept for the percentiles, the first overflow is said once, and
    /// the window's tokens still count every request.
    #[test]
    fn a_window_of_more_requests_than_kept_holds_the_newest() {
        const MS: Nanos = 1_000_000;
        let mut shard = Shard::new(Duration::from_secs(3_600), Duration::from_secs(900));
        let n = MAX_RETIRED + 1_000;
        let mut overflows = 0;
        for i in 0..n as Nanos {
            let key = shard.begin(i, i);
            shard.tokens(key, i + MS, 1, 1, 1);
            // The last thousand end 6 ms later than the others: e2e 8 ms, not 2.
            let late = if i >= MAX_RETIRED as Nanos { 6 * MS } else { 0 };
            shard.tokens(key, i + MS + late, 1, 1, 1);
            overflows += usize::from(shard.finish(key, i + 2 * MS + late, 2, None));
        }
        assert_eq!(overflows, 1);
        assert_eq!(shard.records_held(), MAX_RETIRED);
        let mut sums = Sums::new();
        let now = n as Nanos + 10 * MS;
        let span = Span::of(now, shard.slot_ns);
        let sealed = shard.add_to(&mut sums, now, span);
        add_sealed(&mut sums, span, &sealed);
        assert_eq!(sums.e2e.len(), MAX_RETIRED);
        assert_eq!(sums.e2e.iter().filter(|&&e| e == 8.0).count(), 1_000);
        assert_eq!(sums.tokens, 2 * n as u64);
    }
}
