//! A request's record while it counts in the window: its token events kept per slot
//! ([`Segment`]s, 20 bytes each, so an open stream holds little), and once it ends, only
//! the segments with events ([`Retired`]) until it leaves the window. Per-request figures
//! (TTFT, TPOT, single-stream T/s) are computed from them at read time: each request's TPOT
//! over its own token events inside the window (a retired request wholly inside it gives
//! the TPOT it kept as it retired).

use super::curve::CURVE_BUCKETS;
use super::window::{ms, Span, SLOTS};
use super::Nanos;

/// A request's token events inside one slot: 20 bytes, as every open stream holds
/// [`SLOTS`] of them. The slot is counted from the record's first one, and the times are
/// microseconds into the slot (a slot is at most 3600 s / [`SLOTS`]).
#[derive(Clone, Copy, Default)]
pub(super) struct Segment {
    /// The slot's epoch less the record's `epoch0`.
    pub(super) epoch: u32,
    pub(super) first_us: u32,
    pub(super) last_us: u32,
    pub(super) tokens: u32,
    pub(super) events: u32,
}

impl Segment {
    /// Its first and last event, in nanoseconds.
    pub(super) fn span(&self, epoch0: u64, slot_ns: Nanos) -> (Nanos, Nanos) {
        let start = (epoch0 + u64::from(self.epoch)) * slot_ns;
        (
            start + u64::from(self.first_us) * 1000,
            start + u64::from(self.last_us) * 1000,
        )
    }
}

/// Microseconds from the start of its slot to `now`.
pub(super) fn into_slot_us(now: Nanos, slot_ns: Nanos) -> u32 {
    ((now % slot_ns) / 1000).try_into().unwrap_or(u32::MAX)
}

/// A request in flight.
pub(super) struct InFlight {
    pub(super) t0: Nanos,
    pub(super) first: Option<Nanos>,
    pub(super) last: Nanos,
    /// The epoch its segments count from: the slot it began in.
    pub(super) epoch0: u64,
    pub(super) segments: [Segment; SLOTS],
    /// Its tokens by the curve bucket they arrived in, so an exact count that replaces
    /// them is spread over the same buckets.
    pub(super) by_bucket: [u32; CURVE_BUCKETS],
}

/// A finished request still inside the window: what `/stats` reads of it, without the
/// room an open one keeps (its segments without events, its tokens by curve bucket). At
/// thousands of short requests a second the window holds tens of thousands of them.
pub(super) struct Retired {
    pub(super) t0: Nanos,
    /// Its first token, [`NO_TOKEN`] without one (as an `Option`, 8 bytes more a record).
    first: Nanos,
    pub(super) finished_at: Nanos,
    pub(super) epoch0: u64,
    /// Its TPOT over all its events, ms, NaN without one: what [`window_tpot`] reads of a
    /// window that holds them all, read once rather than at each read of the window.
    whole_tpot: f64,
    pub(super) segments: Segments,
}

/// [`Retired::first`] of a request without a token.
const NO_TOKEN: Nanos = Nanos::MAX;

impl Retired {
    pub(super) fn of(rec: InFlight, finished_at: Nanos, slot_ns: Nanos) -> Retired {
        let mut with_events = rec.segments.into_iter().filter(|s| s.events > 0);
        let segments = match (with_events.next(), with_events.next()) {
            (Some(only), None) => Segments::One(only),
            (None, _) => Segments::Many(Box::default()),
            (Some(a), Some(b)) => Segments::Many([a, b].into_iter().chain(with_events).collect()),
        };
        let all = Span {
            oldest: 0,
            newest: u64::MAX,
            slot_ns,
        };
        Retired {
            t0: rec.t0,
            first: rec.first.unwrap_or(NO_TOKEN),
            finished_at,
            epoch0: rec.epoch0,
            whole_tpot: window_tpot(rec.epoch0, segments.as_slice(), all).unwrap_or(f64::NAN),
            segments,
        }
    }

    pub(super) fn first(&self) -> Option<Nanos> {
        (self.first != NO_TOKEN).then_some(self.first)
    }

    /// Its TPOT over its token events inside the window `span`: [`window_tpot`], but for
    /// a request whose every event is inside (its first token at or after the window's
    /// start, its end no later than the window's newest slot: every segment with events
    /// lies between), whose TPOT is its whole one.
    #[inline]
    pub(super) fn tpot_in(&self, span: Span) -> Option<f64> {
        let end = span.newest.saturating_add(1).saturating_mul(span.slot_ns);
        // One without a token reads as inside (NO_TOKEN is past every start): it has no
        // segment with events, and no TPOT either way.
        if self.first >= span.start() && self.finished_at < end {
            (!self.whole_tpot.is_nan()).then_some(self.whole_tpot)
        } else {
            window_tpot(self.epoch0, self.segments.as_slice(), span)
        }
    }
}

/// A retired request's segments with events: a reply shorter than a slot (the short ones
/// that come by the thousand a second) has one, kept without an allocation of its own.
pub(super) enum Segments {
    One(Segment),
    Many(Box<[Segment]>),
}

impl Segments {
    pub(super) fn as_slice(&self) -> &[Segment] {
        match self {
            Segments::One(one) => std::slice::from_ref(one),
            Segments::Many(many) => many,
        }
    }
}

/// A request's TPOT (ms) over its token events inside the window `span`: `None` unless it
/// had at least two events there.
pub(super) fn window_tpot(epoch0: u64, segments: &[Segment], span: Span) -> Option<f64> {
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
