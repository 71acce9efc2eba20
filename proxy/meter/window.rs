//! The sliding window of one upstream: a ring of time slots, the requests in flight and
//! the concurrency integrals, the totals since start, and the read that merges every
//! shard's part into the figures of `/stats`.
//!
//! The window is the last [`SLOTS`] slots of `window / SLOTS` each, the newest one still
//! filling, so it spans between `(SLOTS-1)/SLOTS` and all of `window` and rates are exact for
//! steady traffic: tokens counted over exactly the time they were counted in.
//!
//! The state is split by how often it changes. [`Windows`] holds what changes when a request
//! begins or ends (in flight, the concurrency integrals, totals): one per upstream. A
//! [`Shard`](super::shard::Shard) holds what changes on every token event: one per upstream
//! per worker thread. A read merges them into [`Sums`].

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;

use super::curve::{self, Bucket as CurveBucket, Scope, Times, Verdicts, CURVE_BUCKETS};
use super::goodput::{self, Judged, Targets};
use super::hist::{hist_percentiles, histogram, histogram64, quantile_us};
use super::samples::{ControlSample, Gaps};
use super::stats::{Broken, CurvePoint, Goodput, MeterStats, Percentiles, TokensPerEvent};
use super::{EndpointMeter, Nanos, Outcome, UNKNOWN};

/// Slots per window.
pub const SLOTS: usize = 20;

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
    /// Of those, read from the backend's prefix cache (where it said).
    cached_input_tokens: u64,
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

pub(super) fn ms(ns: Nanos) -> f64 {
    ns as f64 / 1e6
}

/// The epochs `oldest..=newest` of the window that ends at `now`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(super) oldest: u64,
    pub(crate) newest: u64,
    pub(super) slot_ns: Nanos,
}

impl Span {
    pub(crate) fn of(now: Nanos, slot_ns: Nanos) -> Span {
        let newest = now / slot_ns;
        Span {
            oldest: newest.saturating_sub(SLOTS as u64 - 1),
            newest,
            slot_ns,
        }
    }

    pub(crate) fn contains(self, epoch: u64) -> bool {
        epoch != u64::MAX && epoch >= self.oldest && epoch <= self.newest
    }

    pub(super) fn start(self) -> Nanos {
        self.oldest * self.slot_ns
    }
}

/// The window's per-request figures, selected from [`Sums`].
pub(super) struct Selected {
    mean_tpot: Option<f64>,
    ttft: Percentiles,
    tpot: Percentiles,
    e2e: Percentiles,
    itl: Percentiles,
    tokens_per_event: TokensPerEvent,
}

/// A read's buffers of per-request samples (TTFT, TPOT, end to end), kept for the next.
pub(super) struct SampleBuffers([Vec<f64>; 3]);

impl SampleBuffers {
    /// The buffers with at most twice the room this read used: a burst's window is not
    /// kept for good.
    pub(super) fn trimmed(mut self) -> SampleBuffers {
        for v in &mut self.0 {
            if v.capacity() > 4 * v.len() {
                v.shrink_to(2 * v.len());
            }
        }
        self
    }
}

/// What the shards hold for one read, merged.
pub(super) struct Sums {
    pub(super) tokens: u64,
    pub(super) itl: Histogram<u32>,
    pub(super) ttft: Vec<f64>,
    pub(super) tpot: Vec<f64>,
    pub(super) e2e: Vec<f64>,
    pub(super) curve: Vec<CurveBucket>,
    pub(super) tokens_per_event: Histogram<u64>,
    pub(super) control_gaps: Histogram<u32>,
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

    /// The window's percentiles, mean TPOT and tokens per event (the samples reordered),
    /// taken apart from [`Windows::stats`] so that they need not be under the windows' lock.
    pub(super) fn select(&mut self) -> Selected {
        let tpot = &self.tpot;
        Selected {
            mean_tpot: (!tpot.is_empty()).then(|| tpot.iter().sum::<f64>() / tpot.len() as f64),
            ttft: Percentiles::of(&mut self.ttft),
            tpot: Percentiles::of(&mut self.tpot),
            e2e: Percentiles::of(&mut self.e2e),
            itl: hist_percentiles(&self.itl),
            tokens_per_event: TokensPerEvent::of(&self.tokens_per_event),
        }
    }

    /// Gathers the per-request samples into `kept`'s buffers (emptied) rather than new ones.
    pub(super) fn reuse(&mut self, kept: SampleBuffers) {
        let SampleBuffers([mut ttft, mut tpot, mut e2e]) = kept;
        for v in [&mut ttft, &mut tpot, &mut e2e] {
            v.clear();
        }
        (self.ttft, self.tpot, self.e2e) = (ttft, tpot, e2e);
    }

    /// The per-request samples' buffers, to keep for the next read.
    pub(super) fn into_buffers(self) -> SampleBuffers {
        SampleBuffers([self.ttft, self.tpot, self.e2e])
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

// ===== the per-request half =====

/// One slot of the request ring: ∫ in_flight dt over the slot, in request·ns; the
/// generation requests that arrived (asked for a slot); those that finished, and their
/// output tokens.
#[derive(Clone, Copy)]
struct BusySlot {
    epoch: u64,
    busy: u128,
    arrivals: u64,
    finished: u64,
    finished_tokens: u64,
    /// The prompt tokens of the requests that finished here saying how many were cached,
    /// and those cached: the window's cache hit rate.
    cache_reported_input: u64,
    cached_input: u64,
}

impl BusySlot {
    const EMPTY: BusySlot = BusySlot {
        epoch: u64::MAX,
        busy: 0,
        arrivals: 0,
        finished: 0,
        finished_tokens: 0,
        cache_reported_input: 0,
        cached_input: 0,
    };
}

/// An endpoint with requests in flight, and how many: the curve's time is spent per
/// endpoint, at its batch.
struct Active {
    endpoint: Arc<EndpointMeter>,
    in_flight: u64,
}

/// How a request ended, for the totals and its SLO verdict.
pub(super) struct Ended {
    pub(super) outcome: Outcome,
    /// Tokens counted from its events (none when its body was `unread`).
    pub(super) estimated: u64,
    pub(super) unread: bool,
    pub(super) exact: Option<u64>,
    pub(super) input: Option<u64>,
    /// Of its prompt's tokens, those its backend said it read from its prefix cache.
    pub(super) cached: Option<u64>,
    /// Its figures as the client saw them (from the request's start), for goodput…
    pub(super) judged: Judged,
    /// …and as the backend served them (from when it was sent, tokentap's queue left
    /// out), for its curve bucket: the curve is the backend's, a wait for a slot is the
    /// pool's capacity's to answer.
    pub(super) at_backend: Judged,
    /// The curve bucket it ran in: the mean batch its tokens arrived at.
    pub(super) bucket: usize,
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
    /// The endpoints with requests in flight.
    active: Vec<Active>,
    /// Time each endpoint spent at each curve bucket's concurrency (while this tokentap
    /// had requests in flight on it), ∫ concurrency dt there, and the part of that time
    /// counted by the backend: endpoint-seconds, so a point's system T/s is one
    /// endpoint's.
    times: Times,
    /// The latency SLOs finished requests are judged against, their verdicts in the live
    /// window and since start, and by curve bucket.
    targets: Targets,
    goodput: goodput::Ring<SLOTS>,
    verdicts: Verdicts,
    /// The backend's running count, when the curve is bucketed by it.
    backend: Option<u64>,
    totals: Totals,
    metered: bool,
    /// What the SLO controller reads each tick: ∫ in_flight dt since the last read.
    control_busy: u128,
    control_since: Nanos,
}

pub(crate) fn slot_ns(window: Duration) -> Nanos {
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
            ring: [BusySlot::EMPTY; SLOTS],
            in_flight: 0,
            last_change: now,
            active: Vec::new(),
            times: Times::new(curve_window),
            targets: Targets::default(),
            goodput: goodput::Ring::new(),
            verdicts: Verdicts::new(curve_window),
            backend: None,
            totals: Totals::default(),
            metered: false,
            control_busy: 0,
            control_since: now,
        }
    }

    /// A request was sent upstream at `now`, to `endpoint`.
    pub(super) fn begin(&mut self, now: Nanos, endpoint: &Arc<EndpointMeter>) {
        self.advance(now);
        self.in_flight += 1;
        self.metered = true;
        self.join(endpoint);
    }

    /// A request moved from one endpoint to another at `now` (its connect failed).
    pub(super) fn moved(&mut self, now: Nanos, from: &Arc<EndpointMeter>, to: &Arc<EndpointMeter>) {
        self.advance(now);
        self.leave(from);
        self.join(to);
    }

    fn join(&mut self, endpoint: &Arc<EndpointMeter>) {
        match self
            .active
            .iter_mut()
            .find(|a| Arc::ptr_eq(&a.endpoint, endpoint))
        {
            Some(a) => a.in_flight += 1,
            None => self.active.push(Active {
                endpoint: Arc::clone(endpoint),
                in_flight: 1,
            }),
        }
    }

    fn leave(&mut self, endpoint: &Arc<EndpointMeter>) {
        if let Some(i) = self
            .active
            .iter()
            .position(|a| Arc::ptr_eq(&a.endpoint, endpoint))
        {
            self.active[i].in_flight -= 1;
            if self.active[i].in_flight == 0 {
                self.active.swap_remove(i);
            }
        }
    }

    /// Endpoints with requests in flight.
    #[cfg(test)]
    pub(super) fn active_endpoints(&self) -> usize {
        self.active.len()
    }

    /// The latency SLOs requests finishing from now on are judged against.
    pub(super) fn set_targets(&mut self, targets: Targets) {
        if self.targets != targets {
            // Judgements against the old SLOs would mix with the new ones: the window and
            // the curve's buckets start afresh (the totals since start keep counting).
            self.goodput.clear();
            self.verdicts.clear();
        }
        self.targets = targets;
    }

    /// A request on `endpoint` ended at `now`.
    pub(super) fn finish(&mut self, now: Nanos, endpoint: &Arc<EndpointMeter>, end: Ended) {
        let now = self.advance(now);
        self.in_flight = self.in_flight.saturating_sub(1);
        self.leave(endpoint);
        let Ended {
            outcome,
            estimated,
            unread,
            exact,
            input,
            cached,
            judged,
            at_backend,
            bucket,
        } = end;
        self.count(outcome);
        // The demand's mean output: completed generations only (a cut or failed one's
        // partial count would lower it just when clients give up).
        if outcome == Outcome::Ok {
            let slot = self.slot(now / self.slot_ns);
            slot.finished += 1;
            slot.finished_tokens = slot
                .finished_tokens
                .saturating_add(exact.unwrap_or(estimated));
        }
        if self.targets.any() {
            let tokens = exact.unwrap_or(estimated);
            match self.targets.judge(&judged) {
                Some(verdict) => self.goodput.add(now / self.slot_ns, verdict, tokens),
                None => self.goodput.cancelled(now / self.slot_ns),
            }
            // A client that left gives no evidence of what its backend does at this
            // batch: not judged in the curve's bucket.
            if outcome != Outcome::Aborted {
                let served = self.targets.judge(&at_backend) == Some(goodput::Verdict::Good);
                self.verdicts.add(now, bucket, served);
            }
        }
        // A cached count above the prompt's is the backend's to explain: capped.
        let cached = input
            .zip(cached)
            .map(|(input, cached)| (input, cached.min(input)));
        if let Some((input, cached)) = cached {
            let slot = self.slot(now / self.slot_ns);
            slot.cache_reported_input = slot.cache_reported_input.saturating_add(input);
            slot.cached_input = slot.cached_input.saturating_add(cached);
        }
        // Sums saturate: a count is bounded (dialect::MAX_COUNT), its sum over a long life
        // is not.
        let t = &mut self.totals;
        let add = |sum: &mut u64, n: u64| *sum = sum.saturating_add(n);
        add(&mut t.input_tokens, input.unwrap_or(0));
        add(&mut t.cached_input_tokens, cached.map_or(0, |(_, c)| c));
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
    pub(super) fn curve_totals(&self, sums: Sums) -> Vec<curve::CurveTotals> {
        curve::totals(sums.curve, self.times.sum(Scope::All))
    }

    /// The curve's window starts afresh, `curve_window` long.
    pub(super) fn reset_curve(&mut self, now: Nanos, curve_window: Duration) {
        self.advance(now);
        self.times.reset(curve_window);
        self.verdicts.reset(curve_window);
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
    pub(super) fn stats(
        &self,
        name: &str,
        now: Nanos,
        span: Span,
        sums: &Sums,
        selected: Selected,
    ) -> MeterStats {
        let elapsed = now - span.start().max(self.started);
        let inside = || self.ring.iter().filter(|s| span.contains(s.epoch));
        let busy: u128 = inside().map(|s| s.busy).sum();
        let arrivals: u64 = inside().map(|s| s.arrivals).sum();
        let finished: u64 = inside().map(|s| s.finished).sum();
        let finished_tokens: u64 = inside().map(|s| s.finished_tokens).sum();
        let cache_reported: u64 = inside().map(|s| s.cache_reported_input).sum();
        let cached: u64 = inside().map(|s| s.cached_input).sum();
        let mean_tpot = selected.mean_tpot;
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
            cached_input_tokens_total: t.cached_input_tokens,
            cache_hit_rate_pct: (cache_reported > 0)
                .then(|| 100.0 * cached as f64 / cache_reported as f64),
            counts_exact: (finished_generations > 0).then_some(t.estimated_requests == 0),
            estimated_output_tokens_total: t.estimated_tokens,
            estimated_tokens_share_pct: (t.output_tokens > 0)
                .then(|| 100.0 * t.estimated_tokens as f64 / t.output_tokens as f64),
            estimate_to_exact_ratio: (t.exact_after_estimate > 0)
                .then(|| t.estimate_before_exact as f64 / t.exact_after_estimate as f64),
            tokens_per_event: selected.tokens_per_event,
            requests_by_status: Outcome::ALL
                .iter()
                .map(|o| (o.label(), t.by_outcome[o.index()]))
                .filter(|(_, n)| *n > 0)
                .collect(),
            unparsed_events_total: t.unparsed_events,
            system_tps: rate(sums.tokens as f64),
            single_stream_tps: mean_tpot.filter(|m| *m > 0.0).map(|m| 1000.0 / m),
            concurrency: rate(busy as f64 / 1e9),
            ttft_ms: selected.ttft,
            tpot_ms: selected.tpot,
            itl_ms: selected.itl,
            e2e_ms: selected.e2e,
            arrivals_per_sec: rate(arrivals as f64),
            mean_output_tokens: (finished > 0).then(|| finished_tokens as f64 / finished as f64),
            curve: self.curve(sums, now),
            goodput: self.targets.any().then(|| {
                let w = self.goodput.window(|epoch| span.contains(epoch));
                Goodput {
                    requests_per_sec: rate(w.good as f64),
                    output_tokens_per_sec: rate(w.good_tokens as f64),
                    attainment_pct: (w.judged > 0).then(|| 100.0 * w.good as f64 / w.judged as f64),
                    requests: w.judged,
                    good_requests: w.good,
                    cancelled: w.cancelled,
                    broken: Broken::from(w.broken),
                }
            }),
            slo_requests_total: goodput::Verdict::ALL
                .iter()
                .map(|v| (v.label(), self.goodput.totals[v.index()]))
                .collect(),
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

    /// The SLO-bounded point of the curve under `bound`, the shards' curve being in `sums`.
    pub(super) fn slo_bound(
        &self,
        now: Nanos,
        bound: &curve::Bound,
        sums: &Sums,
    ) -> Option<curve::SloBound> {
        let points = self.curve(sums, now);
        curve::slo_bound(&points, &sums.curve, bound)
    }

    /// The curve of the window ending at `now`, the shards' part being in `sums`.
    fn curve(&self, sums: &Sums, now: Nanos) -> Vec<CurvePoint> {
        let scope = Scope::Window(now);
        curve::points(&sums.curve, self.times.sum(scope), self.verdicts.sum(scope))
    }

    /// The ring's slot of `epoch`, emptied first if it last held an older one.
    fn slot(&mut self, epoch: u64) -> &mut BusySlot {
        let slot = &mut self.ring[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            *slot = BusySlot {
                epoch,
                ..BusySlot::EMPTY
            };
        }
        slot
    }

    /// A generation request asked for a slot at `now`.
    pub(super) fn arrived(&mut self, now: Nanos) {
        let now = self.advance(now);
        self.slot(now / self.slot_ns).arrivals += 1;
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
        for a in &self.active {
            // The batch the endpoint's tokens are bucketed by (as `Stream` buckets them):
            // the upstream's backend count, the endpoint's own, or its requests here.
            let (c, by_backend) = match (self.backend, a.endpoint.backend_running.load(Relaxed)) {
                (Some(b), _) => (b, true),
                (None, UNKNOWN) => (a.in_flight, false),
                (None, b) => (b, true),
            };
            self.times.add(from, now, bucket(c), c, by_backend);
        }
        self.control_busy += u128::from(n) * u128::from(now - from);
        // Only the slots still in the window matter for the ring.
        let mut t = from.max(Span::of(now, self.slot_ns).start());
        while t < now {
            let epoch = t / self.slot_ns;
            let end = ((epoch + 1) * self.slot_ns).min(now);
            self.slot(epoch).busy += u128::from(n) * u128::from(end - t);
            t = end;
        }
        now
    }
}
