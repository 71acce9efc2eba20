//! The meter: per-request records and per-upstream sliding windows.
//!
//! Time enters every method as an argument ([`Nanos`] since the meter's [`Clock`] origin),
//! so the window and curve maths are tested with plain numbers. The service takes one
//! timestamp per upstream body fragment and hands the meter what the dialect found in it.
//!
//! Each upstream has one [`UpstreamMeter`]. A token event locks only the current worker
//! thread's shard of it (no lock or written cache line shared with other threads'
//! connections; the in-flight count it reads is its endpoint's, an atomic written only when
//! a request begins or ends: [`EndpointMeter`]). Beginning and ending a request take the upstream's own lock; the admin API and
//! the SLO controller take it and every shard's in turn to read.

mod clock;
mod curve;
mod endpoint;
mod goodput;
mod hist;
mod log;
mod records;
mod samples;
mod shard;
mod stats;
mod stream;
mod window;

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

pub use clock::{Clock, Nanos, Outcome};
pub use curve::{Bound, CurveTotals, SloBound};
pub use endpoint::{EndpointFigures, EndpointMeter, Finished};
pub use goodput::{Judged, Targets, Verdict};
pub use samples::{ControlSample, Gaps};
use shard::Shard;
pub use stats::{Broken, CurvePoint, Goodput, MeterStats, Percentiles, TokensPerEvent};
pub use stream::{Stream, Summary};
pub use window::SLOTS;
pub(crate) use window::{slot_ns, Span};
use window::{Sums, Windows};

/// The curve bucket (0 for 1, 1 for 2, 2 for 3–4, …; labelled `1 << bucket`) of a mean
/// concurrency.
pub fn bucket_of(concurrency: f64) -> usize {
    window::bucket(concurrency.round().max(1.0) as u64)
}

pub use crate::telemetry::Histograms;

/// An upstream's per-event distributions since start.
pub struct Distributions {
    /// Per-token gaps (ITL), µs, two significant figures.
    pub itl_us: hdrhistogram::Histogram<u64>,
    /// Σ of the per-token gaps, µs.
    pub itl_sum_us: f64,
    /// Tokens per token-bearing fragment.
    pub tokens_per_event: hdrhistogram::Histogram<u64>,
}

/// Requests and output tokens of one model on one upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelCount {
    pub requests: u64,
    pub output_tokens: u64,
}

/// Models that get their own name per upstream: the first this many seen. Later ones are
/// counted as `other`, and a request whose model could not be read as `unknown`. A name
/// once given is kept, so every per-model counter only ever grows.
pub const MODEL_LABELS: usize = 10;

/// One finished streamed request, as the A/B comparison sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSample {
    /// When it finished.
    pub at: Nanos,
    /// Mean requests in flight at the upstream as its tokens arrived.
    pub concurrency: f64,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// The most samples an upstream keeps for comparison.
const MAX_SAMPLES: usize = 200_000;

/// A shard on its own cache lines, so neighbouring shards' writes do not bounce them.
#[repr(align(128))]
struct Padded<T>(T);

/// This thread's shard number (modulo the shard count): worker threads are numbered as
/// they first meter something.
fn shard_of_thread(shards: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static ID: Cell<Option<usize>> = const { Cell::new(None) };
    }
    let id = ID.with(|id| match id.get() {
        Some(n) => n,
        None => {
            let n = NEXT.fetch_add(1, Relaxed);
            id.set(Some(n));
            n
        }
    });
    id % shards
}

/// The live figures of one upstream.
pub struct UpstreamMeter {
    name: Arc<str>,
    clock: Clock,
    /// What changes when requests begin and end.
    inner: Mutex<Windows>,
    /// What changes on every token event, per worker thread.
    shards: Box<[Padded<Mutex<Shard>>]>,
    hist: Histograms,
    /// Finished requests of the last `sample_window`, oldest first.
    samples: Mutex<log::ChunkLog<RequestSample>>,
    sample_window: AtomicU64,
    /// The output-token counter as last exported: it never goes back, though an exact
    /// count that lands below its estimate takes tokens away from the live sum.
    exported_output: AtomicU64,
    /// Per-model counts (`metrics.model_label`).
    models: Mutex<std::collections::HashMap<Box<str>, ModelCount>>,
    /// The backend's own running count while it is known and fresh (`backend_metrics`),
    /// else [`UNKNOWN`]: the curve is bucketed by it.
    backend_running: AtomicU64,
    /// Each curve bucket's tokens as last exported: an exact count below its estimate takes
    /// tokens away, and a counter must not go back.
    exported_curve: Mutex<[u64; curve::CURVE_BUCKETS]>,
    curve_window: Mutex<Duration>,
    /// The endpoint of requests begun without one ([`UpstreamMeter::begin`]).
    lone: Arc<EndpointMeter>,
    /// The last read's per-request sample buffers, emptied, for the next read.
    read_buffers: Mutex<Option<window::SampleBuffers>>,
    /// Where finished requests' GenAI histograms go (`metrics.semconv`).
    semconv: arc_swap::ArcSwapOption<crate::telemetry::Telemetry>,
}

pub(super) const UNKNOWN: u64 = u64::MAX;

/// `metrics.curve_window_secs`' default.
pub const DEFAULT_CURVE_WINDOW: Duration = Duration::from_secs(900);

// === impl UpstreamMeter ===

impl UpstreamMeter {
    /// A meter whose sliding window is `window` long, starting at `now`.
    pub fn new(name: &str, window: Duration, clock: Clock, hist: Histograms) -> Arc<Self> {
        let shards = std::thread::available_parallelism().map_or(1, usize::from);
        Self::with_shards(name, window, clock, hist, shards)
    }

    /// [`Self::new`] with `shards` per-thread shards (threads beyond that share them).
    pub fn with_shards(
        name: &str,
        window: Duration,
        clock: Clock,
        hist: Histograms,
        shards: usize,
    ) -> Arc<Self> {
        let now = clock.now();
        let shards = shards.max(1);
        Arc::new(UpstreamMeter {
            name: name.into(),
            clock,
            inner: Mutex::new(Windows::new(window, DEFAULT_CURVE_WINDOW, now)),
            shards: (0..shards)
                .map(|_| Padded(Mutex::new(Shard::new(window, DEFAULT_CURVE_WINDOW))))
                .collect(),
            hist,
            samples: Mutex::new(log::ChunkLog::default()),
            sample_window: AtomicU64::new(600_000_000_000),
            exported_output: AtomicU64::new(0),
            models: Mutex::new(std::collections::HashMap::new()),
            backend_running: AtomicU64::new(UNKNOWN),
            exported_curve: Mutex::new([0; curve::CURVE_BUCKETS]),
            curve_window: Mutex::new(DEFAULT_CURVE_WINDOW),
            lone: Arc::default(),
            read_buffers: Mutex::new(None),
            semconv: arc_swap::ArcSwapOption::empty(),
        })
    }

    /// How long finished-request samples are kept for comparison (default 600 s).
    pub fn set_sample_window(&self, window: Duration) {
        self.sample_window.store(
            u64::try_from(window.as_nanos()).unwrap_or(u64::MAX),
            Relaxed,
        );
    }

    /// The samples of requests that finished in the sample window before `now`. All but
    /// the newest are copied after the lock that each request's end takes is let go.
    pub fn samples(&self, now: Nanos) -> Vec<RequestSample> {
        let (sealed, open, n) = {
            let mut s = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
            self.trim(&mut s, now);
            (s.sealed(), s.open().copied().collect::<Vec<_>>(), s.len())
        };
        let mut all = Vec::with_capacity(n);
        all.extend(sealed.iter().copied());
        all.extend(open);
        all
    }

    /// Forgets every sample (`POST /compare/reset`).
    pub fn reset_samples(&self) {
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    fn push_sample(&self, sample: RequestSample) {
        let mut s = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        self.trim(&mut s, sample.at);
        if s.len() == MAX_SAMPLES {
            s.drop_oldest();
        }
        s.push(sample);
    }

    fn trim(&self, s: &mut log::ChunkLog<RequestSample>, now: Nanos) {
        let since = now.saturating_sub(self.sample_window.load(Relaxed));
        s.drop_while(|x| x.at < since);
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A generation request was sent to this upstream at `now`, its client's request having
    /// started at `t0`. It counts as in flight until the returned record is finished or
    /// dropped.
    pub fn begin(self: &Arc<Self>, t0: Nanos, now: Nanos) -> Stream {
        self.begin_on(t0, now, Arc::clone(&self.lone))
    }

    /// A request begun at `t0` and sent at `now` to the endpoint `on` meters.
    pub fn begin_on(self: &Arc<Self>, t0: Nanos, now: Nanos, on: Arc<EndpointMeter>) -> Stream {
        on.streams.fetch_add(1, Relaxed);
        self.lock().begin(now, &on);
        let shard = shard_of_thread(self.shards.len());
        let key = self.shard(shard).begin(t0, now);
        Stream::new(Arc::clone(self), shard, key, (t0, now), on)
    }

    /// The backend's running count, read from its own metrics (`None`: unknown or stale).
    /// While it is known, the curve is bucketed by it rather than by tokentap's own
    /// in-flight count, which is only this replica's part of the backend's batch.
    pub fn set_backend_running(&self, running: Option<u64>) {
        let v = running.map_or(UNKNOWN, |n| n.min(UNKNOWN - 1));
        if self.backend_running.swap(v, Relaxed) != v {
            let now = self.clock.now();
            self.lock().set_backend(now, running);
        }
    }

    /// The backend's running count on `endpoint` (its own metrics, `backend_metrics_path`):
    /// the time spent so far is booked at the count it replaces, then the new one holds.
    pub fn set_endpoint_backend(&self, endpoint: &EndpointMeter, running: Option<u64>) {
        let v = running.map_or(UNKNOWN, |n| n.min(UNKNOWN - 1));
        if endpoint.backend_running.load(Relaxed) != v {
            let now = self.clock.now();
            let mut windows = self.lock();
            windows.span(now);
            endpoint.backend_running.store(v, Relaxed);
        }
    }

    /// What the curve's concurrency axis counts now: `"backend"` or `"proxy"`.
    pub fn concurrency_source(&self) -> &'static str {
        if self.backend_running.load(Relaxed) == UNKNOWN {
            "proxy"
        } else {
            "backend"
        }
    }

    /// Output tokens since start, counted as they arrive: finished requests' totals
    /// (exact where reported) and the tokens of requests in flight so far. Never less than
    /// the last value returned.
    pub fn output_tokens_live(&self) -> u64 {
        // Finished first, then running: a request ends on its shard before it is added to
        // the finished total, so one that ends between the two reads is missed for one
        // scrape, never counted twice.
        let finished = self.lock().output_tokens();
        let running: u64 = (0..self.shards.len())
            .map(|i| self.shard(i).running_tokens())
            .sum();
        let live = finished + running;
        self.exported_output.fetch_max(live, Relaxed).max(live)
    }

    /// The curve since start, per concurrency bucket with the support of a point.
    pub fn curve_totals(&self) -> Vec<CurveTotals> {
        let mut sums = Sums::new();
        for i in 0..self.shards.len() {
            self.shard(i).add_curve(&mut sums, curve::Scope::All);
        }
        let now = self.clock.now();
        let mut totals = {
            let mut windows = self.lock();
            windows.span(now);
            windows.curve_totals(sums)
        };
        let mut exported = self
            .exported_curve
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for t in &mut totals {
            let i = t.concurrency.trailing_zeros() as usize;
            if let Some(e) = exported.get_mut(i) {
                *e = (*e).max(t.tokens);
                t.tokens = *e;
            }
        }
        totals
    }

    /// The curve covers the last `window` from now on (`metrics.curve_window_secs`); a
    /// new length starts the window afresh.
    pub fn set_curve_window(&self, window: Duration) {
        let mut current = self
            .curve_window
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *current != window {
            *current = window;
            drop(current);
            self.reset_curve();
        }
    }

    /// Forgets the curve's window (`POST /curve/reset`); `/metrics`' since-start counters
    /// keep counting.
    pub fn reset_curve(&self) {
        let window = *self
            .curve_window
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = self.clock.now();
        self.lock().reset_curve(now, window);
        for i in 0..self.shards.len() {
            self.shard(i).reset_curve(window);
        }
    }

    /// Requests and output tokens per model (at most [`MODEL_LABELS`] names, `other` and
    /// `unknown`), busiest first.
    pub fn models(&self) -> Vec<(String, ModelCount)> {
        let m = self.models.lock().unwrap_or_else(PoisonError::into_inner);
        let mut v: Vec<(String, ModelCount)> = m.iter().map(|(k, c)| (k.to_string(), *c)).collect();
        v.sort_by(|a, b| b.1.requests.cmp(&a.1.requests).then(a.0.cmp(&b.0)));
        v
    }

    /// Counts a request of `model` (its first `MODEL_LABELS` models by name, then
    /// `other`); the name it is counted under.
    fn count_model(&self, model: &str, output_tokens: u64) -> Box<str> {
        const SPECIAL: [&str; 2] = ["other", "unknown"];
        let mut m = self.models.lock().unwrap_or_else(PoisonError::into_inner);
        let named = m.keys().filter(|k| !SPECIAL.contains(&&***k)).count();
        let key: &str = if SPECIAL.contains(&model) || m.contains_key(model) || named < MODEL_LABELS
        {
            model
        } else {
            "other"
        };
        let key: Box<str> = key.into();
        let c = m.entry(key.clone()).or_default();
        c.requests += 1;
        c.output_tokens = c.output_tokens.saturating_add(output_tokens);
        key
    }

    /// Records each finished request's OpenTelemetry GenAI histograms into `telemetry`
    /// (`metrics.semconv`), or none.
    pub fn set_semconv(&self, telemetry: Option<Arc<crate::telemetry::Telemetry>>) {
        self.semconv.store(telemetry);
    }

    /// A generation request asked this upstream for a slot (its demand, served or not),
    /// having arrived at `at` (a reading of this meter's clock).
    pub fn arrived(&self, at: Nanos) {
        self.lock().arrived(at);
    }

    /// Counts a request that is not generation traffic (forwarded, not metered).
    pub fn count_plain(&self, outcome: Outcome) {
        self.lock().count(outcome);
    }

    /// Counts events skipped as unparsable or oversized.
    pub fn count_unparsed(&self, events: u64) {
        if events > 0 {
            self.lock().unparsed(events);
        }
    }

    /// The SLO controller's evidence since its previous call.
    pub fn control_sample(&self, now: Nanos, percentile: f64) -> ControlSample {
        let mut sums = Sums::new();
        for i in 0..self.shards.len() {
            self.shard(i).take_control_gaps(&mut sums);
        }
        self.lock().control_sample(now, percentile, &sums)
    }

    /// The latency SLOs requests finishing from now on are judged against
    /// (`[upstream.slo]`); none set, none are judged.
    pub fn set_slo_targets(&self, targets: Targets) {
        self.lock().set_targets(targets);
    }

    /// The SLO-bounded point of the curve (in its window) under `bound`: the highest system
    /// T/s of one endpoint among the supported points within the SLO.
    pub fn slo_bound(&self, bound: &Bound) -> Option<SloBound> {
        let now = self.clock.now();
        let mut sums = Sums::new();
        for i in 0..self.shards.len() {
            self.shard(i)
                .add_curve(&mut sums, curve::Scope::Window(now));
        }
        let mut windows = self.lock();
        let (now, _) = windows.span(now);
        windows.slo_bound(now, bound, &sums)
    }

    /// The per-event distributions since start, merged over the shards.
    pub fn distributions(&self) -> Distributions {
        let mut sums = Sums::new();
        for i in 0..self.shards.len() {
            let shard = self.shard(i);
            shard.add_curve(&mut sums, curve::Scope::All);
            shard.add_tokens_per_event(&mut sums);
        }
        sums.distributions()
    }

    /// The figures at `now`.
    pub fn stats(&self, now: Nanos) -> MeterStats {
        let (now, span) = self.lock().span(now);
        let mut sums = Sums::new();
        if let Some(kept) = self
            .read_buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            sums.reuse(kept);
        }
        for i in 0..self.shards.len() {
            // The shard's lock is let go before its sealed records are walked, and the
            // windows' lock is taken only once the percentiles are selected: a request
            // takes both, and the window may hold hundreds of thousands.
            let sealed = self.shard(i).add_to(&mut sums, now, span);
            shard::add_sealed(&mut sums, span, &sealed);
        }
        let selected = sums.select();
        let stats = self.lock().stats(&self.name, now, span, &sums, selected);
        self.keep_buffers(sums);
        stats
    }

    /// Keeps the read's sample buffers for the next: a window of hundreds of thousands
    /// of requests would otherwise take and give back megabytes every second, and the
    /// pages' mapping and unmapping stopped the workers' own allocations for milliseconds.
    fn keep_buffers(&self, sums: Sums) {
        let mut kept = self
            .read_buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if kept.is_none() {
            *kept = Some(sums.into_buffers().trimmed());
        }
    }

    fn lock(&self) -> MutexGuard<'_, Windows> {
        // A panic elsewhere cannot leave the windows half-updated in a way that matters more
        // than losing every figure, so a poisoned lock is used as is.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shard(&self, i: usize) -> MutexGuard<'_, Shard> {
        self.shards[i]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records held by all shards: in flight, or finished inside the window.
    #[cfg(test)]
    fn records_held(&self) -> usize {
        (0..self.shards.len())
            .map(|i| self.shard(i).records_held())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;
    const S: Nanos = 1_000 * MS;

    fn meter(window_secs: u64) -> Arc<UpstreamMeter> {
        UpstreamMeter::new(
            "u",
            Duration::from_secs(window_secs),
            Clock::new(),
            Histograms::noop(),
        )
    }

    /// `streams` requests decoding one token every `tpot` from `start` until `end`.
    fn steady(
        m: &Arc<UpstreamMeter>,
        streams: usize,
        tpot: Nanos,
        start: Nanos,
        end: Nanos,
    ) -> Vec<Stream> {
        let mut s: Vec<Stream> = (0..streams).map(|_| m.begin(start, start)).collect();
        let mut t = start + tpot;
        while t <= end {
            for st in &mut s {
                st.tokens(t, 1);
            }
            t += tpot;
        }
        s
    }

    fn close(a: Option<f64>, b: f64, tol: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() <= tol * b)
    }

    #[test]
    fn no_data_is_null() {
        let st = meter(10).stats(5 * S);
        assert_eq!(st.system_tps, None);
        assert_eq!(st.single_stream_tps, None);
        assert_eq!(st.concurrency, None);
        assert_eq!(st.tpot_ms, Percentiles::default());
        assert_eq!(st.counts_exact, None);
        assert!(st.curve.is_empty());
        let json = serde_json::to_string(&st).unwrap_or_default();
        assert!(json.contains(r#""system_tps":null"#), "{json}");
    }

    #[test]
    fn steady_streams_give_exact_rates() {
        let m = meter(10);
        let _s = steady(&m, 4, 20 * MS, 0, 30 * S);
        let st = m.stats(30 * S);
        assert!(close(st.system_tps, 200.0, 0.01), "{:?}", st.system_tps);
        assert!(
            close(st.single_stream_tps, 50.0, 0.001),
            "{:?}",
            st.single_stream_tps
        );
        assert!(close(st.concurrency, 4.0, 0.001), "{:?}", st.concurrency);
        assert!(close(st.tpot_ms.p50, 20.0, 0.001));
        assert!(close(st.itl_ms.p50, 20.0, 0.01), "{:?}", st.itl_ms);
        assert_eq!(st.in_flight, 4);
        assert_eq!(st.curve.len(), 1);
        assert_eq!(st.curve[0].concurrency, 4);
        assert!(close(st.curve[0].system_tps, 200.0, 0.01));
        assert!(close(st.curve[0].tpot_ms_p50, 20.0, 0.01));
    }

    #[test]
    fn young_proxy_divides_by_its_age() {
        let m = meter(10);
        let _s = steady(&m, 1, 10 * MS, 0, 2 * S);
        let st = m.stats(2 * S);
        assert!(close(st.system_tps, 100.0, 0.01), "{:?}", st.system_tps);
    }

    #[test]
    fn exact_total_replaces_the_estimate() {
        let m = meter(10);
        let mut s = m.begin(0, 0);
        for i in 1..=10 {
            s.tokens(i * 10 * MS, 1);
        }
        s.exact_total(12);
        s.exact_total(15); // cumulative usage: the last one wins
        s.finish(110 * MS, Outcome::Ok);
        let st = m.stats(S);
        assert_eq!(st.output_tokens_total, 15);
        assert_eq!(st.counts_exact, Some(true));
        // 15 tokens over the window's 1 s of life.
        assert!(close(st.system_tps, 15.0, 0.001), "{:?}", st.system_tps);
        // TPOT uses the exact count: 90 ms over 14 gaps.
        assert!(
            close(st.tpot_ms.p50, 90.0 / 14.0, 0.001),
            "{:?}",
            st.tpot_ms
        );

        let mut s = m.begin(S, S);
        s.tokens(S + MS, 1);
        s.finish(S + 2 * MS, Outcome::Ok);
        let st = m.stats(2 * S);
        assert_eq!(st.output_tokens_total, 16);
        assert_eq!(st.counts_exact, Some(false));
    }

    #[test]
    fn output_tokens_count_as_they_arrive() {
        let m = meter(10);
        let mut s = m.begin(0, 0);
        for i in 1..=10 {
            s.tokens(i * MS, 1);
        }
        // A long stream's tokens show while it runs…
        assert_eq!(m.output_tokens_live(), 10);
        // …its exact count lands at the end…
        s.exact_total(14);
        s.finish(20 * MS, Outcome::Ok);
        assert_eq!(m.output_tokens_live(), 14);
        // …and one below its estimate holds the counter still, never back.
        let mut s = m.begin(S, S);
        for i in 1..=10 {
            s.tokens(S + i * MS, 1);
        }
        assert_eq!(m.output_tokens_live(), 24);
        s.exact_total(6);
        s.finish(S + 20 * MS, Outcome::Ok);
        assert_eq!(m.output_tokens_live(), 24);
        let mut s = m.begin(2 * S, 2 * S);
        s.exact_total(10);
        s.input_tokens(33);
        s.finish(3 * S, Outcome::Ok);
        assert_eq!(m.output_tokens_live(), 30);
        assert_eq!(m.stats(3 * S).input_tokens_total, 33);
        // 18 gaps are too few for a point: left out of /metrics, sparse in /stats.
        assert!(m.curve_totals().is_empty());
        assert!(m.stats(3 * S).curve.iter().all(|p| p.sparse));
    }

    /// `streams` requests, each decoding one token every `tpot`, from `start` to `end`;
    /// finished there.
    fn run(m: &Arc<UpstreamMeter>, streams: usize, tpot: Nanos, start: Nanos, end: Nanos) {
        for s in steady(m, streams, tpot, start, end) {
            s.finish(end, Outcome::Ok);
        }
    }

    #[test]
    fn the_curve_covers_its_window_and_metrics_since_start() {
        let m = meter(10);
        m.set_curve_window(Duration::from_secs(60));
        run(&m, 1, 20 * MS, 0, 20 * S);
        run(&m, 16, 25 * MS, 100 * S, 130 * S);
        let curve = m.stats(130 * S).curve;
        assert_eq!(
            curve.len(),
            1,
            "the 1-stream phase left the window: {curve:?}"
        );
        assert_eq!(curve[0].concurrency, 16);
        assert!(!curve[0].sparse);
        let totals = m.curve_totals();
        let at = |c: u64| totals.iter().find(|t| t.concurrency == c).map(|t| t.tokens);
        assert_eq!(
            at(1),
            Some(1000),
            "since start: {:?}",
            totals.iter().map(|t| t.concurrency).collect::<Vec<_>>()
        );
        assert_eq!(at(16), Some(16 * 1200));
        m.reset_curve();
        assert!(m.stats(131 * S).curve.is_empty());
        assert_eq!(m.curve_totals().len(), 2, "the counters keep counting");
    }

    #[test]
    fn an_exact_count_lands_where_its_tokens_arrived() {
        let m = meter(10);
        // One stream alone for 10 s, then with 7 others for 10 s; its count is twice its
        // events (two tokens an event, counted one).
        let mut lone = m.begin(0, 0);
        for i in 1..=500 {
            lone.tokens(i * 20 * MS, 1);
        }
        let others: Vec<Stream> = (0..7).map(|_| m.begin(10 * S, 10 * S)).collect();
        for i in 501..=1000 {
            lone.tokens(i * 20 * MS, 1);
        }
        lone.exact_total(2000);
        lone.finish(20 * S, Outcome::Ok);
        let curve = m.stats(20 * S).curve;
        let tokens = |c: u64| {
            let p = curve.iter().find(|p| p.concurrency == c).expect("point");
            p.system_tps.unwrap_or(0.0) * p.mean_concurrency.map_or(0.0, |_| 10.0)
        };
        // 1000 tokens alone, 1000 while 8 ran: each where it arrived, none lumped at the end.
        assert!((tokens(1) - 1000.0).abs() < 5.0, "{curve:?}");
        assert!((tokens(8) - 1000.0).abs() < 5.0, "{curve:?}");
        drop(others);
    }

    #[test]
    fn every_point_is_its_mean_batch_times_its_stream_rate() {
        use rand::{Rng, SeedableRng};
        for seed in 0..20u64 {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let m = meter(10);
            // Waves of streams at random batch sizes, each at the TPOT its batch gives.
            let mut t = 0;
            for _ in 0..6 {
                let n = rng.gen_range(1..=40);
                let tpot = (10.0 + 0.5 * n as f64) as Nanos * MS;
                let secs = rng.gen_range(3..=8) * S;
                run(&m, n, tpot, t, t + secs);
                t += secs + rng.gen_range(0..=2) * S;
            }
            for p in m.stats(t).curve.iter().filter(|p| !p.sparse) {
                let (Some(sys), Some(single), Some(c)) =
                    (p.system_tps, p.single_stream_tps, p.mean_concurrency)
                else {
                    panic!("seed {seed}: a supported point without figures: {p:?}");
                };
                assert!(
                    (sys - c * single).abs() <= 0.05 * sys,
                    "seed {seed}: {sys:.0} T/s ≠ {c:.1} × {single:.1}: {p:?}"
                );
                // And never faster than the batch could run.
                assert!(
                    sys <= p.concurrency as f64 * single * 1.01,
                    "seed {seed}: {p:?}"
                );
            }
        }
    }

    /// A pool of three endpoints, eight streams each: the curve is one endpoint's (its
    /// batch of 8 at its own rate), not the pool's 24.
    #[test]
    fn a_pool_s_curve_is_one_endpoint_s() {
        let m = meter(10);
        let endpoints: Vec<Arc<EndpointMeter>> = (0..3).map(|_| Arc::default()).collect();
        let mut streams: Vec<Stream> = endpoints
            .iter()
            .flat_map(|e| (0..8).map(|_| m.begin_on(0, 0, Arc::clone(e))))
            .collect();
        let mut t = 0;
        while t < 20 * S {
            t += 20 * MS;
            for s in &mut streams {
                s.tokens(t, 1);
            }
        }
        let st = m.stats(20 * S);
        assert_eq!(st.curve.len(), 1, "{:?}", st.curve);
        let p = &st.curve[0];
        assert_eq!(p.concurrency, 8);
        assert!(!p.sparse);
        assert!(close(p.mean_concurrency, 8.0, 0.001), "{p:?}");
        assert!(close(p.system_tps, 400.0, 0.01), "{p:?}");
        // The window's figures are the pool's.
        assert!(close(st.system_tps, 1200.0, 0.01));
        assert!(close(st.concurrency, 24.0, 0.001));
        // A stream moved to another endpoint takes its time there.
        let other: Arc<EndpointMeter> = Arc::default();
        streams[0].move_to(Arc::clone(&other));
        for s in streams {
            s.finish(20 * S, Outcome::Ok);
        }
        assert_eq!(m.lock().active_endpoints(), 0, "no endpoint left active");
    }

    /// `n` requests of `tokens` tokens, one every `tpot` after a first at `ttft`, all at
    /// once from `at`.
    fn wave(m: &Arc<UpstreamMeter>, n: usize, at: Nanos, ttft: Nanos, tpot: Nanos, tokens: u64) {
        let mut s: Vec<Stream> = (0..n).map(|_| m.begin(at, at)).collect();
        for i in 0..tokens {
            for st in &mut s {
                st.tokens(at + ttft + i * tpot, 1);
            }
        }
        for st in s {
            st.finish(at + ttft + (tokens - 1) * tpot, Outcome::Ok);
        }
    }

    #[test]
    fn goodput_counts_the_requests_that_met_every_slo() {
        let m = meter(10);
        assert_eq!(m.stats(S).goodput, None, "no SLO, no goodput");
        m.set_slo_targets(Targets {
            ttft_ms: Some(100.0),
            tpot_ms: Some(25.0),
            e2e_ms: None,
        });
        for _ in 0..9 {
            m.arrived(m.clock.now());
        }
        // 4 good (TTFT 50, TPOT 20), 2 late (TTFT 150), 2 slow (TPOT 30), 1 abandoned by its
        // client before it broke any SLO (not judged).
        wave(&m, 4, 0, 50 * MS, 20 * MS, 51);
        wave(&m, 2, S, 150 * MS, 20 * MS, 51);
        wave(&m, 2, 2 * S, 50 * MS, 30 * MS, 51);
        drop(m.begin(3 * S, 3 * S));
        let st = m.stats(10 * S);
        let g = st.goodput.expect("goodput");
        assert_eq!((g.requests, g.good_requests, g.cancelled), (8, 4, 1));
        assert!(close(g.attainment_pct, 50.0, 1e-9), "{g:?}");
        // Over the window's 19 full slots of 0.5 s and the newest, empty one.
        assert!(close(g.requests_per_sec, 4.0 / 9.5, 1e-9), "{g:?}");
        assert!(
            close(g.output_tokens_per_sec, 4.0 * 51.0 / 9.5, 1e-9),
            "{g:?}"
        );
        // Demand: 9 arrivals, 51 tokens each from the 8 that completed (the aborted one's
        // count says nothing of what was asked).
        assert!(close(st.arrivals_per_sec, 9.0 / 9.5, 1e-9));
        assert!(close(st.mean_output_tokens, 51.0, 1e-9));
        assert_eq!(
            st.slo_requests_total,
            vec![
                ("good", 4),
                ("ttft", 2),
                ("tpot", 2),
                ("e2e", 0),
                ("error", 0)
            ]
        );
        // Each wave ran at its own batch: the curve says where the SLO held.
        let at = |c: u64| st.curve.iter().find(|p| p.concurrency == c).cloned();
        let four = at(4).expect("bucket 4");
        assert_eq!(
            (four.slo_requests, four.slo_attainment_pct),
            (4, Some(100.0))
        );
        let two = at(2).expect("bucket 2");
        assert_eq!((two.slo_requests, two.slo_attainment_pct), (4, Some(0.0)));
        // A request that waited 1 s in tokentap's queue breaks the TTFT SLO for its user,
        // not for its backend's curve bucket: the wait is the pool's capacity's business.
        let mut queued = m.begin_on(5 * S, 6 * S, Arc::default());
        for i in 0..5 {
            queued.tokens(6 * S + 50 * MS + i * 20 * MS, 1);
        }
        queued.finish(6 * S + 200 * MS, Outcome::Ok);
        let st2 = m.stats(10 * S);
        assert_eq!(st2.slo_requests_total[1], ("ttft", 3));
        let one = st2.curve.iter().find(|p| p.concurrency == 1).cloned();
        // Bucket 1 holds it (good); the aborted one is not judged there (its client left).
        assert_eq!(
            one.map(|p| (p.slo_requests, p.slo_attainment_pct)),
            Some((1, Some(100.0)))
        );
        // A client that left after waiting past the TTFT SLO for its first token: late.
        let late = m.begin(7 * S, 7 * S);
        late.finish(7 * S + 600 * MS, Outcome::Aborted);
        let st3 = m.stats(10 * S);
        assert_eq!(st3.slo_requests_total[1], ("ttft", 4));
        assert_eq!(st3.goodput.map(|g| g.cancelled), Some(1));
        // The window slides; the totals stay.
        let later = m.stats(40 * S);
        assert_eq!(
            later.goodput.map(|g| (g.requests, g.cancelled)),
            Some((0, 0))
        );
        assert_eq!(later.slo_requests_total[0], ("good", 4));
    }

    #[test]
    fn the_slo_bound_is_the_highest_supported_point_within_it() {
        let m = meter(10);
        m.set_curve_window(Duration::from_secs(600));
        // TPOT grows with the batch: 20 ms at 1, 24 at 4, 40 at 16.
        run(&m, 1, 20 * MS, 0, 20 * S);
        run(&m, 4, 24 * MS, 30 * S, 50 * S);
        let tpot30 = Bound {
            tpot_ms: Some(30.0),
            percentile: 90.0,
            attainment_pct: None,
        };
        let b = m.slo_bound(&tpot30).expect("a bound");
        assert_eq!(b.concurrency, 4);
        assert!((b.system_tps - 4000.0 / 24.0).abs() < 2.0, "{b:?}");
        // Nothing above it seen yet, and 24 ms is 80% of 30: near.
        assert!(!b.bracketed && b.near && b.highest_supported == 4, "{b:?}");
        let loose = Bound {
            tpot_ms: Some(100.0),
            ..tpot30
        };
        let far = m.slo_bound(&loose).expect("a bound");
        assert!(!far.near && !far.bracketed, "{far:?}");
        run(&m, 16, 40 * MS, 60 * S, 80 * S);
        let b = m.slo_bound(&tpot30).expect("a bound");
        assert_eq!(b.concurrency, 4);
        assert!(b.bracketed && b.highest_supported == 16, "{b:?}");
        let tight = Bound {
            tpot_ms: Some(10.0),
            ..tpot30
        };
        assert_eq!(m.slo_bound(&tight), None);
    }

    #[test]
    fn the_first_models_keep_their_names() {
        let m = meter(10);
        let run = |model: &str, n: usize| {
            for _ in 0..n {
                let mut s = m.begin(0, 0);
                s.set_model(Some(model.to_owned()));
                s.exact_total(2);
                s.finish(MS, Outcome::Ok);
            }
        };
        for i in 0..MODEL_LABELS {
            run(&format!("m{i}"), 1);
        }
        // A later, busier model is `other`: the ten names stay, so no counter goes back.
        run("late", 5);
        run("unknown", 2);
        run("m3", 1);
        let models: std::collections::HashMap<String, ModelCount> =
            m.models().into_iter().collect();
        assert_eq!(models.len(), MODEL_LABELS + 2, "{models:?}");
        assert_eq!(
            models["other"],
            ModelCount {
                requests: 5,
                output_tokens: 10
            }
        );
        assert_eq!(models["unknown"].requests, 2);
        assert_eq!(models["m3"].requests, 2);
        assert!(!models.contains_key("late"));
    }

    #[test]
    fn ttft_and_non_streaming() {
        let m = meter(10);
        let mut s = m.begin(0, MS);
        s.tokens(50 * MS, 1);
        s.tokens(70 * MS, 1);
        s.finish(80 * MS, Outcome::Ok);
        let mut n = m.begin(0, 0);
        n.exact_total(100);
        n.finish(400 * MS, Outcome::Ok);
        let st = m.stats(S);
        assert!(close(st.ttft_ms.p50, 50.0, 0.001), "{:?}", st.ttft_ms);
        assert_eq!(st.e2e_ms.p90, Some(400.0));
        assert_eq!(st.output_tokens_total, 102);
    }

    #[test]
    fn curve_buckets_by_concurrency() {
        let m = meter(10);
        let s1 = steady(&m, 1, 20 * MS, 0, 20 * S);
        for s in s1 {
            s.finish(20 * S, Outcome::Ok);
        }
        let _s16 = steady(&m, 16, 22 * MS, 20 * S, 40 * S);
        let st = m.stats(40 * S);
        let at = |c| st.curve.iter().find(|p| p.concurrency == c).cloned();
        let one = at(1).expect("bucket 1");
        let sixteen = at(16).expect("bucket 16");
        assert!(close(one.tpot_ms_p50, 20.0, 0.01));
        assert!(close(one.system_tps, 50.0, 0.01), "{:?}", one.system_tps);
        assert!(close(sixteen.tpot_ms_p90, 22.0, 0.01));
        assert!(close(sixteen.single_stream_tps, 1000.0 / 22.0, 0.01));
        assert!(
            close(sixteen.system_tps, 16.0 * 1000.0 / 22.0, 0.01),
            "{:?}",
            sixteen.system_tps
        );
        // The live window only sees the 16-stream phase.
        assert!(close(st.concurrency, 16.0, 0.001));
    }

    #[test]
    fn window_slides_and_forgets() {
        let m = meter(10);
        for s in steady(&m, 2, 20 * MS, 0, 5 * S) {
            s.finish(5 * S, Outcome::Ok);
        }
        let st = m.stats(30 * S);
        assert_eq!(st.system_tps, Some(0.0));
        assert_eq!(st.single_stream_tps, None);
        assert_eq!(st.concurrency, Some(0.0));
        assert_eq!(st.in_flight, 0);
        assert_eq!(st.requests_total, 2);
        assert_eq!(
            m.records_held(),
            0,
            "finished records leave with the window"
        );
    }

    #[test]
    fn dropped_stream_is_aborted_and_frees_its_slot() {
        let m = meter(10);
        {
            let mut s = m.begin(0, 0);
            s.tokens(MS, 1);
        }
        let st = m.stats(S);
        assert_eq!(st.in_flight, 0);
        assert_eq!(st.requests_by_status.get("aborted"), Some(&1));
        assert_eq!(st.errors_total, 0);
    }

    #[test]
    fn multi_token_events_spread_the_gap() {
        let m = meter(10);
        let mut s = m.begin(0, 0);
        for i in 1..=50 {
            s.tokens(i * 80 * MS, 4);
        }
        let st = m.stats(4 * S);
        assert!(close(st.itl_ms.p50, 20.0, 0.01), "{:?}", st.itl_ms);
    }

    /// Three streams whose fragments carry bursts of events (of 1 and 2 tokens), one of
    /// them corrected by an exact count; `flush` after every event or only when the
    /// proxy does (once a fragment is read).
    fn bursts(m: &Arc<UpstreamMeter>, flush_each: bool) -> Vec<Summary> {
        let mut streams: Vec<Stream> = (0..3).map(|i| m.begin(i * MS, 2 * i * MS)).collect();
        let burst = [1, 1, 1, 2, 2, 1, 1];
        for f in 1..=40u64 {
            for (i, s) in streams.iter_mut().enumerate() {
                let now = f * 30 * MS + i as u64 * 7 * MS;
                let events = &burst[..(f as usize + i) % burst.len() + 1];
                for &n in events {
                    s.tokens(now, n);
                    if flush_each {
                        s.flush();
                    }
                }
                s.flush();
            }
        }
        streams[1].exact_total(150);
        let summaries = streams.iter().map(Stream::summary).collect();
        for (i, s) in streams.into_iter().enumerate() {
            s.finish(1300 * MS + i as u64 * MS, Outcome::Ok);
        }
        summaries
    }

    #[test]
    fn a_fragment_s_burst_records_what_its_events_one_at_a_time_would() {
        // A 1 s window, read once it is full: a young meter's rates divide by its age.
        // Both meters read one frozen clock for themselves (their start, the curve's
        // window), so nothing depends on when, or how far apart, they were made.
        let frozen = || {
            UpstreamMeter::new(
                "u",
                Duration::from_secs(1),
                Clock::frozen(0),
                Histograms::noop(),
            )
        };
        let (one_by_one, together) = (frozen(), frozen());
        assert_eq!(bursts(&one_by_one, true), bursts(&together, false));
        // The curve's points are in the stats (too few gaps for /metrics' since-start
        // totals, which leave out sparse points).
        assert!(!together.stats(1250 * MS).curve.is_empty());
        for now in [1100 * MS, 1250 * MS, 1400 * MS, 5 * S] {
            let a = serde_json::to_value(one_by_one.stats(now)).unwrap_or_default();
            let b = serde_json::to_value(together.stats(now)).unwrap_or_default();
            assert_eq!(a, b);
        }
        let (a, b) = (one_by_one.distributions(), together.distributions());
        assert_eq!(a.itl_us, b.itl_us);
        assert_eq!(a.itl_sum_us, b.itl_sum_us);
        assert_eq!(a.tokens_per_event, b.tokens_per_event);
        // Every event counted as its own.
        let events: u64 = (1..=40u64)
            .flat_map(|f| (0..3).map(move |i| (f + i) % 7 + 1))
            .sum();
        assert_eq!(b.tokens_per_event.len(), events);
        assert_eq!(one_by_one.samples(5 * S), together.samples(5 * S));
    }

    #[test]
    fn events_held_back_are_recorded_when_the_stream_ends() {
        let m = meter(10);
        let mut s = m.begin(0, 0);
        s.tokens(10 * MS, 1);
        s.tokens(10 * MS, 1); // held back: no flush before the end
        assert_eq!(s.counted_tokens(), 2);
        s.finish(20 * MS, Outcome::Ok);
        assert_eq!(m.distributions().tokens_per_event.len(), 2);
        assert_eq!(m.output_tokens_live(), 2);
    }

    #[test]
    fn shards_of_many_threads_add_up() {
        let m = UpstreamMeter::with_shards(
            "u",
            Duration::from_secs(10),
            Clock::new(),
            Histograms::noop(),
            3,
        );
        // Four threads (one shard shared by two) run two 20 ms streams each, in step as on
        // one clock; their streams end on another thread, as a task moved by work stealing
        // would.
        let step = std::sync::Barrier::new(4);
        let streams: Vec<Stream> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = vec![m.begin(0, 0), m.begin(0, 0)];
                        let mut t = 0;
                        while t < 30 * S {
                            step.wait();
                            t += 20 * MS;
                            for st in &mut mine {
                                st.tokens(t, 1);
                            }
                        }
                        mine
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let st = m.stats(30 * S);
        assert_eq!(st.in_flight, 8);
        assert!(close(st.system_tps, 400.0, 0.01), "{:?}", st.system_tps);
        assert!(close(st.single_stream_tps, 50.0, 0.001));
        assert!(close(st.concurrency, 8.0, 0.001), "{:?}", st.concurrency);
        assert!(close(st.itl_ms.p50, 20.0, 0.01), "{:?}", st.itl_ms);
        assert_eq!(st.curve.len(), 1);
        assert_eq!(st.curve[0].concurrency, 8);
        assert!(close(st.curve[0].system_tps, 400.0, 0.01));
        assert_eq!(st.tokens_per_event.p50, Some(1));
        let sample = m.control_sample(30 * S, 90.0);
        assert!(
            sample.tpot_ms.is_some_and(|t| (t - 20.0).abs() < 0.3),
            "{sample:?}"
        );
        let tpot25 = Bound {
            tpot_ms: Some(25.0),
            percentile: 90.0,
            attainment_pct: None,
        };
        assert!(m.slo_bound(&tpot25).is_some());
        for s in streams {
            s.finish(30 * S, Outcome::Ok);
        }
        let st = m.stats(45 * S);
        assert_eq!(st.in_flight, 0);
        assert_eq!(st.requests_by_status.get("ok"), Some(&8));
        assert_eq!(st.output_tokens_total, 8 * 1500);
        assert_eq!(m.records_held(), 0);
    }

    #[test]
    fn out_of_order_timestamps_are_clamped() {
        let m = meter(10);
        let mut a = m.begin(0, 0);
        a.tokens(2 * S, 1);
        let mut b = m.begin(0, 0);
        b.tokens(S, 1); // taken before a's, locked after
        a.finish(3 * S, Outcome::Ok);
        b.finish(3 * S, Outcome::Ok);
        assert_eq!(m.stats(4 * S).in_flight, 0);
    }
}
