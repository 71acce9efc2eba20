//! A request's record while it counts in the window: its token events kept per slot
//! ([`Segment`]s, 20 bytes each, so an open stream holds little), and once it ends, only
//! the segments with events ([`Retired`]) until it leaves the window. Per-request figures
//! (TTFT, TPOT, single-stream T/s) are computed from them at read time: each request's TPOT
//! over its own token events inside the window.

use std::collections::VecDeque;
use std::sync::Arc;

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
    pub(super) first: Option<Nanos>,
    pub(super) finished_at: Nanos,
    pub(super) epoch0: u64,
    pub(super) segments: Segments,
}

impl Retired {
    pub(super) fn of(rec: InFlight, finished_at: Nanos) -> Retired {
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

/// Retired records in a sealed chunk: a reader takes a chunk by its count.
pub(super) const CHUNK: usize = 512;

/// The retired records in finishing order, until they leave the window. All but the newest
/// are sealed in chunks of [`CHUNK`] that a reader holds by reference count and walks after
/// letting go of the shard's lock: at tens of thousands of short requests a second, the
/// window holds hundreds of thousands, and a walk of them all under the lock stopped that
/// thread's requests for milliseconds once a second. The newest, fewer than a chunk, are
/// walked under the lock.
#[derive(Default)]
pub(super) struct RetiredLog {
    sealed: VecDeque<Arc<Vec<Retired>>>,
    /// Of the oldest sealed chunk, the records that already left the window.
    gone: usize,
    open: VecDeque<Retired>,
}

impl RetiredLog {
    pub(super) fn push(&mut self, r: Retired) {
        self.open.push_back(r);
        if self.open.len() == CHUNK {
            let open = std::mem::replace(&mut self.open, VecDeque::with_capacity(CHUNK));
            let chunk = Vec::from(open);
            self.sealed.push_back(Arc::new(chunk));
        }
    }

    /// Drops the records that finished before `start`: a sealed chunk once all of its
    /// records have.
    pub(super) fn purge(&mut self, start: Nanos) {
        while let Some(front) = self.sealed.front() {
            match front[self.gone..]
                .iter()
                .position(|r| r.finished_at >= start)
            {
                Some(i) => {
                    self.gone += i;
                    return;
                }
                None => {
                    self.sealed.pop_front();
                    self.gone = 0;
                }
            }
        }
        while self.open.front().is_some_and(|r| r.finished_at < start) {
            self.open.pop_front();
        }
    }

    /// The sealed chunks, to walk without the lock (their records that left the window
    /// included: skip those that finished before its start).
    pub(super) fn sealed(&self) -> Vec<Arc<Vec<Retired>>> {
        self.sealed.iter().cloned().collect()
    }

    /// The newest records, not yet sealed.
    pub(super) fn open(&self) -> impl Iterator<Item = &Retired> {
        self.open.iter()
    }

    /// Every record still in the window, oldest first.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = &Retired> {
        let mut skip = self.gone;
        self.sealed
            .iter()
            .flat_map(move |c| c[std::mem::take(&mut skip)..].iter())
            .chain(self.open.iter())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn retired(finished_at: Nanos) -> Retired {
        Retired {
            t0: 0,
            first: None,
            finished_at,
            epoch0: 0,
            segments: Segments::Many(Box::default()),
        }
    }

    /// The log keeps what a plain queue purged in order would: the records that finished
    /// at the window's start or after, oldest first, whether sealed or not, and a sealed
    /// chunk is let go once all of its records have left.
    #[test]
    fn the_log_holds_what_a_purged_queue_would() {
        let mut log = RetiredLog::default();
        let n = 3 * CHUNK as u64 + 7;
        let mut start = 0;
        for t in 0..n {
            log.push(retired(t));
            if t % 97 == 0 {
                start = t.saturating_sub(2 * CHUNK as u64 - 13);
                log.purge(start);
            }
            let want: Vec<Nanos> = (start..=t).collect();
            let got: Vec<Nanos> = log.iter().map(|r| r.finished_at).collect();
            assert_eq!(got, want, "at {t}");
            // A reader's view: the sealed chunks less what left the window, then the open.
            let sealed = log.sealed();
            let read: Vec<Nanos> = sealed
                .iter()
                .flat_map(|c| c.iter())
                .chain(log.open())
                .map(|r| r.finished_at)
                .filter(|&f| f >= start)
                .collect();
            assert_eq!(read, want, "read at {t}");
            // No sealed chunk is wholly out of the window.
            assert!(sealed
                .first()
                .is_none_or(|c| c.last().unwrap().finished_at >= start));
        }
        log.purge(n);
        assert_eq!((log.iter().count(), log.sealed().len()), (0, 0));
    }
}
