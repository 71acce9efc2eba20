//! The concurrency→TPOT curve's state: per concurrency bucket, the tokens that arrived
//! there, their per-token gaps, and the time spent there, kept in [`EPOCHS`] epochs of
//! `curve_window / EPOCHS` each. `/stats` reads the epochs of the last window, so the curve
//! stays current (after a backend upgrade the old backend leaves it within the window);
//! `/metrics` reads everything since start (the epochs that left the window are added into
//! `retired`), so its counters only grow.
//!
//! [`Events`] is the per-event half, one per shard; [`Times`] the per-request half (time
//! and ∫ concurrency dt per bucket), one per upstream. A read merges the shards' buckets
//! and hands them here with the times, for the points of `/stats` ([`points`]), the totals
//! of `/metrics` ([`totals`]) and the SLO-bounded throughput.

use std::collections::VecDeque;
use std::time::Duration;

use hdrhistogram::Histogram;

use super::hist::quantile_us;
use super::stats::CurvePoint;
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
                .get_or_insert_with(super::hist::histogram64)
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

/// A cell kept per bucket that epochs add up into.
trait Cell {
    fn merge(&mut self, other: &Self);
}

impl Cell for Bucket {
    fn merge(&mut self, other: &Bucket) {
        self.add(other);
    }
}

impl Cell for Attain {
    fn merge(&mut self, other: &Attain) {
        self.judged += other.judged;
        self.good += other.good;
    }
}

impl Cell for Time {
    fn merge(&mut self, other: &Time) {
        self.ns += other.ns;
        self.busy += other.busy;
        self.backend_ns += other.backend_ns;
    }
}

fn merge_all<C: Cell>(into: &mut [C], from: &[C]) {
    for (sum, c) in into.iter_mut().zip(from) {
        sum.merge(c);
    }
}

/// The epochs of one kind of cell, by bucket: the live ones, and the sum of those that
/// left the window.
struct Epochs<C> {
    epoch_ns: Nanos,
    live: VecDeque<(u64, Vec<C>)>,
    retired: Vec<C>,
}

fn cells<C: Default>() -> Vec<C> {
    (0..CURVE_BUCKETS).map(|_| C::default()).collect()
}

impl<C: Cell + Default> Epochs<C> {
    fn new(window: Duration) -> Self {
        Epochs {
            epoch_ns: epoch_ns(window),
            live: VecDeque::new(),
            retired: cells(),
        }
    }

    /// The cells of epoch `id` (a new epoch retires those out of the window). Timestamps
    /// arrive clamped to be monotonic, so an older `id` gets the newest epoch.
    fn epoch(&mut self, id: u64) -> &mut [C] {
        if self.live.back().is_none_or(|(last, _)| *last < id) {
            while self
                .live
                .front()
                .is_some_and(|(first, _)| first + EPOCHS <= id)
            {
                if let Some((_, old)) = self.live.pop_front() {
                    merge_all(&mut self.retired, &old);
                }
            }
            self.live.push_back((id, cells()));
        }
        let last = self.live.len() - 1;
        &mut self.live[last].1
    }

    /// Adds the cells of `scope` to `into`.
    fn add_into(&self, into: &mut [C], scope: Scope) {
        if matches!(scope, Scope::All) {
            merge_all(into, &self.retired);
        }
        for (id, epoch) in &self.live {
            if inside(scope, *id, self.epoch_ns) {
                merge_all(into, epoch);
            }
        }
    }

    /// The window starts afresh, `window` long; what it held stays in the since-start sum.
    fn reset(&mut self, window: Duration) {
        for (_, old) in std::mem::take(&mut self.live) {
            merge_all(&mut self.retired, &old);
        }
        self.epoch_ns = epoch_ns(window);
    }
}

/// One shard's tokens and gaps by bucket.
pub(super) struct Events(Epochs<Bucket>);

impl Events {
    pub(super) fn new(window: Duration) -> Events {
        Events(Epochs::new(window))
    }

    /// Bucket `b` of the epoch of `now`.
    pub(super) fn at(&mut self, now: Nanos, b: usize) -> &mut Bucket {
        let id = now / self.0.epoch_ns;
        &mut self.0.epoch(id)[b.min(CURVE_BUCKETS - 1)]
    }

    /// Adds this shard's buckets of `scope` to `into`.
    pub(super) fn add(&self, into: &mut [Bucket], scope: Scope) {
        self.0.add_into(into, scope);
    }

    /// The window starts afresh (`POST /curve/reset`, a new `curve_window_secs`); what
    /// it held stays in the since-start totals.
    pub(super) fn reset(&mut self, window: Duration) {
        self.0.reset(window);
    }
}

/// Time in one bucket: how long, ∫ concurrency dt, and how long the backend counted it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Time {
    pub(super) ns: Nanos,
    pub(super) busy: u128,
    pub(super) backend_ns: Nanos,
}

/// The time spent in each bucket, by epoch.
pub(super) struct Times(Epochs<Time>);

impl Times {
    pub(super) fn new(window: Duration) -> Times {
        Times(Epochs::new(window))
    }

    /// `from..to` spent in bucket `b` at concurrency `c` (counted by the backend or not),
    /// split at epoch edges.
    pub(super) fn add(&mut self, from: Nanos, to: Nanos, b: usize, c: u64, backend: bool) {
        let epoch_ns = self.0.epoch_ns;
        let mut t = from;
        while t < to {
            let id = t / epoch_ns;
            let end = ((id + 1) * epoch_ns).min(to);
            let slot = &mut self.0.epoch(id)[b.min(CURVE_BUCKETS - 1)];
            let dt = end - t;
            slot.ns += dt;
            slot.busy += u128::from(c) * u128::from(dt);
            if backend {
                slot.backend_ns += dt;
            }
            t = end;
        }
    }

    /// The time of `scope`, by bucket.
    pub(super) fn sum(&self, scope: Scope) -> [Time; CURVE_BUCKETS] {
        let mut out = [Time::default(); CURVE_BUCKETS];
        self.0.add_into(&mut out, scope);
        out
    }

    pub(super) fn reset(&mut self, window: Duration) {
        self.0.reset(window);
    }
}

/// The requests judged against the SLOs in one bucket (by the mean batch their tokens
/// arrived at), and the good ones.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Attain {
    pub(super) judged: u64,
    pub(super) good: u64,
}

/// The judgements by bucket, by epoch.
pub(super) struct Verdicts(Epochs<Attain>);

impl Verdicts {
    pub(super) fn new(window: Duration) -> Verdicts {
        Verdicts(Epochs::new(window))
    }

    /// A request judged `good` or not finished at `now` in bucket `b`.
    pub(super) fn add(&mut self, now: Nanos, b: usize, good: bool) {
        let id = now / self.0.epoch_ns;
        let cell = &mut self.0.epoch(id)[b.min(CURVE_BUCKETS - 1)];
        cell.judged += 1;
        cell.good += u64::from(good);
    }

    /// Forgets every judgement (the SLOs changed), the window's length kept.
    pub(super) fn clear(&mut self) {
        let window = Duration::from_nanos(self.0.epoch_ns.saturating_mul(EPOCHS));
        self.0.reset(window);
    }

    pub(super) fn sum(&self, scope: Scope) -> [Attain; CURVE_BUCKETS] {
        let mut out = [Attain::default(); CURVE_BUCKETS];
        self.0.add_into(&mut out, scope);
        out
    }

    pub(super) fn reset(&mut self, window: Duration) {
        self.0.reset(window);
    }
}

// === export ===

/// One concurrency bucket of the curve, since start, in a form that adds up across
/// replicas: its tokens, the time spent in it and its per-token gaps.
pub struct CurveTotals {
    /// The bucket's upper bound (1, 2, 4, …).
    pub concurrency: u64,
    pub tokens: u64,
    pub seconds: f64,
    /// Per-token gaps, µs, two significant figures; `None` before the bucket's first gap.
    pub gaps_us: Option<Histogram<u64>>,
    pub gap_sum_us: f64,
}

/// The curve's points from the shards' `buckets`, the `times` spent in each and the
/// requests judged there: every bucket with tokens, `sparse` when it lacks the support of
/// a point.
pub(super) fn points(
    buckets: &[Bucket],
    times: [Time; CURVE_BUCKETS],
    verdicts: [Attain; CURVE_BUCKETS],
) -> Vec<CurvePoint> {
    buckets
        .iter()
        .zip(times)
        .zip(verdicts)
        .enumerate()
        .filter(|(_, ((b, _), _))| b.tokens > 0)
        .map(|(i, ((b, t), v))| {
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
                slo_requests: v.judged,
                slo_attainment_pct: (v.judged > 0).then(|| 100.0 * v.good as f64 / v.judged as f64),
            }
        })
        .collect()
}

/// The curve since start: the buckets with the support of a point (once a bucket has it,
/// it always has).
pub(super) fn totals(buckets: Vec<Bucket>, times: [Time; CURVE_BUCKETS]) -> Vec<CurveTotals> {
    buckets
        .into_iter()
        .zip(times)
        .enumerate()
        .filter(|(_, (b, t))| !sparse(b, t))
        .map(|(i, (b, t))| CurveTotals {
            concurrency: 1 << i,
            tokens: b.tokens,
            seconds: t.ns as f64 / 1e9,
            gaps_us: b.gaps,
            gap_sum_us: b.gap_sum_us,
        })
        .collect()
}

/// Requests a point needs judged before its attainment counts.
pub const MIN_JUDGED: u64 = 20;

/// What a curve point must meet to be within the SLO.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    /// Its `percentile` of per-token gaps at most this, when set.
    pub tpot_ms: Option<f64>,
    pub percentile: f64,
    /// At least this share of its requests good ([`MIN_JUDGED`] of them at least), when
    /// set: with a TTFT or e2e SLO, which per-token gaps cannot show.
    pub attainment_pct: Option<f64>,
}

/// The SLO-bounded point: the highest system T/s among supported points within the SLO,
/// and how sure it is to be the edge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloBound {
    pub concurrency: u64,
    pub system_tps: f64,
    /// The bound's percentile of per-token gaps there, ms.
    pub tpot_ms: Option<f64>,
    /// A supported point above the highest concurrency within the SLO breaks it: the edge
    /// lies between.
    pub bracketed: bool,
    /// The curve has come near its SLO: bracketed, or its highest point within the SLO
    /// runs at 80% of the TPOT SLO or more, or keeps no more than halfway from the
    /// attainment target to 100%. Otherwise the edge lies past the highest concurrency seen.
    pub near: bool,
    /// The highest concurrency with a supported point.
    pub highest_supported: u64,
}

/// The SLO-bounded point of `points` (their buckets' gaps in `buckets`) under `bound`.
pub(super) fn slo_bound(
    points: &[CurvePoint],
    buckets: &[Bucket],
    bound: &Bound,
) -> Option<SloBound> {
    let gaps_at = |p: &CurvePoint| {
        buckets[p.concurrency.trailing_zeros() as usize]
            .gaps
            .as_ref()
            .filter(|h| !h.is_empty())
            .map(|h| quantile_us(h, bound.percentile / 100.0) / 1e3)
    };
    // Some(true) within, Some(false) broken, None: not enough requests to say.
    let within = |p: &CurvePoint| -> Option<bool> {
        let tpot = bound
            .tpot_ms
            .map(|slo| gaps_at(p).is_some_and(|t| t <= slo));
        let requests = bound.attainment_pct.map(|target| {
            (p.slo_requests >= MIN_JUDGED)
                .then(|| p.slo_attainment_pct.is_some_and(|a| a >= target))
        });
        match (tpot, requests) {
            (Some(false), _) | (_, Some(Some(false))) => Some(false),
            (_, Some(None)) => None,
            (None, None) => None,
            _ => Some(true),
        }
    };
    let supported: Vec<&CurvePoint> = points.iter().filter(|p| !p.sparse).collect();
    let highest_supported = supported.iter().map(|p| p.concurrency).max()?;
    let best = supported
        .iter()
        .filter(|p| within(p) == Some(true))
        .filter_map(|p| p.system_tps.map(|tps| (*p, tps)))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    let (p, system_tps) = best;
    let tpot_ms = gaps_at(p);
    // The edge: the highest concurrency within the SLO (the best rate may lie below it
    // on a curve that is flat there).
    let edge = supported
        .iter()
        .filter(|q| within(q) == Some(true))
        .max_by_key(|q| q.concurrency)
        .copied()
        .unwrap_or(p);
    let bracketed = supported
        .iter()
        .any(|q| q.concurrency > edge.concurrency && within(q) == Some(false));
    let near_tpot = bound
        .tpot_ms
        .zip(gaps_at(edge))
        .is_some_and(|(slo, t)| t >= 0.8 * slo);
    // Near a request SLO: the edge keeps no more than halfway from the target to all
    // (one bad request in a thousand is not near a 90% target).
    let near_requests = bound.attainment_pct.is_some_and(|target| {
        edge.slo_attainment_pct
            .is_some_and(|a| a < target + (100.0 - target) / 2.0)
    });
    Some(SloBound {
        concurrency: p.concurrency,
        system_tps,
        tpot_ms,
        bracketed,
        near: bracketed || near_tpot || near_requests,
        highest_supported,
    })
}

/// Whether a bucket lacks the support of a point: [`MIN_SECS`] spent there and
/// [`MIN_GAPS`] per-token gaps.
fn sparse(b: &Bucket, t: &Time) -> bool {
    let gaps = b.gaps.as_ref().map_or(0, Histogram::len);
    (t.ns as f64 / 1e9) < MIN_SECS || gaps < MIN_GAPS
}
