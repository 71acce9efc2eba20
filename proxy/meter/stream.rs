//! One request's metering handle ([`Stream`]): begun when the request is sent upstream,
//! fed each fragment's token events (those of one fragment recorded together), corrected by
//! an exact count, and finished with its outcome — or, dropped unfinished, finished as
//! aborted, so no request is left in flight.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::goodput::Judged;
use super::window::{bucket, Ended};
use super::{EndpointMeter, Nanos, Outcome, RequestSample, UpstreamMeter, UNKNOWN};

/// One metered request: its in-flight slot and its record. Finish it with
/// [`Stream::finish`]; dropped unfinished (a panic, a path that forgot), it ends as
/// [`Outcome::Aborted`], so the slot is never leaked.
pub struct Stream {
    meter: Arc<UpstreamMeter>,
    /// The endpoint of the pool that serves it: the curve's concurrency is its batch.
    endpoint: Arc<EndpointMeter>,
    /// The shard holding its record: the one of the thread it began on.
    shard: usize,
    key: usize,
    t0: Nanos,
    /// When it was sent upstream (after any wait in tokentap's queue).
    sent: Nanos,
    first: Option<Nanos>,
    last: Nanos,
    tokens: u64,
    exact: Option<u64>,
    done: bool,
    /// Σ in-flight over its token events, Σ the curve's concurrency (the batch), and their
    /// number.
    concurrency_sum: u64,
    curve_sum: u64,
    events: u64,
    /// Events held back by [`Stream::tokens`]: `held` more of `held_n` tokens each, at
    /// `last`, to be recorded together by [`Stream::flush`].
    held: u32,
    held_n: u32,
    /// Prompt tokens, when the stream reported them.
    input: Option<u64>,
    cached: Option<u64>,
    /// The request's model, counted per model at the end (`metrics.model_label`).
    model: Option<Box<str>>,
    /// Its GenAI operation and provider names (`metrics.semconv`).
    gen_ai: Option<(&'static str, &'static str)>,
    /// Its body could not be read (a content or transfer coding): its tokens are unknown.
    unread: bool,
}

/// One request's figures, for the access log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub output_tokens: u64,
    /// The stream reported its count; else it is estimated.
    pub exact: bool,
    /// TTFT from when it was sent upstream (a wait in tokentap's queue left out), and the
    /// time from then to its last token.
    pub sent_ttft_ms: Option<f64>,
    pub sent_to_last_ms: f64,
    /// Mean requests in flight on its endpoint as its tokens arrived.
    pub concurrency: Option<f64>,
    /// Its body could not be read (a coding tokentap does not undo, a body past what it
    /// reads): `output_tokens` says nothing of what was generated.
    pub unread: bool,
}

// === impl Stream ===

impl Stream {
    /// A request's record, `key` in `shard` of `meter`, its client's request begun at `t0`.
    pub(super) fn new(
        meter: Arc<UpstreamMeter>,
        shard: usize,
        key: usize,
        (t0, sent): (Nanos, Nanos),
        endpoint: Arc<EndpointMeter>,
    ) -> Stream {
        Stream {
            meter,
            endpoint,
            shard,
            key,
            t0,
            sent,
            first: None,
            last: 0,
            tokens: 0,
            exact: None,
            done: false,
            concurrency_sum: 0,
            curve_sum: 0,
            events: 0,
            held: 0,
            held_n: 0,
            input: None,
            cached: None,
            model: None,
            gen_ai: None,
            unread: false,
        }
    }

    /// The request goes to another endpoint (its first one refused the connection).
    pub fn move_to(&mut self, endpoint: Arc<EndpointMeter>) {
        if !self.done {
            endpoint.streams.fetch_add(1, Relaxed);
            self.endpoint.streams.fetch_sub(1, Relaxed);
            let now = self.meter.clock.now();
            self.meter.lock().moved(now, &self.endpoint, &endpoint);
        }
        self.endpoint = endpoint;
    }

    /// An event carrying `n` tokens arrived at `now`.
    ///
    /// Events that arrive at the same instant as the one before them (those of one upstream
    /// fragment) and carry as many tokens as each other are held back and recorded
    /// together by [`Stream::flush`], which the proxy calls once a fragment is read: one
    /// meter update for a fragment's burst, counting each of its events as its own.
    pub fn tokens(&mut self, now: Nanos, n: u32) {
        if n == 0 || self.done {
            return;
        }
        let same_instant = self.first.is_some() && now == self.last;
        if same_instant && (self.held == 0 || n == self.held_n) && self.held < u32::MAX {
            self.held += 1;
            self.held_n = n;
            self.tokens += u64::from(n);
            return;
        }
        self.flush();
        self.record(now, n, 1);
        self.tokens += u64::from(n);
    }

    /// Records the events [`Stream::tokens`] held back (also done when the stream ends).
    pub fn flush(&mut self) {
        if self.held > 0 && !self.done {
            let (n, events) = (self.held_n, self.held);
            self.held = 0;
            self.record(self.last, n, events);
        }
    }

    /// `events` events of `n` tokens each at `now`, in the shard and the histograms (the
    /// caller counts their tokens).
    fn record(&mut self, now: Nanos, n: u32, events: u32) {
        // The batch of the endpoint that serves it: the backend's own count (its metrics
        // scraped, per endpoint or for the upstream), else tokentap's requests on it.
        let in_flight = self.endpoint.streams.load(Relaxed);
        let curve_at = self.curve_at(in_flight);
        self.endpoint.add_tokens(u64::from(n) * u64::from(events));
        let gap = self
            .meter
            .shard(self.shard)
            .tokens(self.key, now, n, events, curve_at);
        self.concurrency_sum += in_flight * u64::from(events);
        self.curve_sum = self
            .curve_sum
            .saturating_add(curve_at.saturating_mul(u64::from(events)));
        self.events += u64::from(events);
        if gap.is_none() {
            self.first = Some(now);
            self.meter
                .hist
                .ttft
                .record(secs(now.saturating_sub(self.t0)));
        }
        self.last = now;
    }

    /// The batch the curve buckets its tokens by: the upstream's backend count, the
    /// endpoint's own, or tokentap's `in_flight` on the endpoint.
    fn curve_at(&self, in_flight: u64) -> u64 {
        match self.meter.backend_running.load(Relaxed) {
            UNKNOWN => self.endpoint.batch(in_flight),
            backend => backend,
        }
    }

    /// The stream reported an exact output-token count (cumulative: the last one wins).
    pub fn exact_total(&mut self, total: u64) {
        self.exact = Some(total);
    }

    /// Its body cannot be read (a coding tokentap does not undo): a generation that
    /// completes counts as not counted exactly, with whatever was estimated (nothing).
    pub fn unreadable(&mut self) {
        self.unread = true;
    }

    /// The stream reported its prompt tokens (the last report wins).
    pub fn input_tokens(&mut self, n: u64) {
        self.input = Some(n);
    }

    /// The stream reported how many of its prompt's tokens were read from the backend's
    /// prefix cache (the last report wins).
    pub fn cached_input_tokens(&mut self, n: u64) {
        self.cached = Some(n);
    }

    /// Records its GenAI histograms when it ends (`metrics.semconv`): its operation
    /// (`chat`, `text_completion`) and provider (the API) names.
    pub fn set_gen_ai(&mut self, operation: &'static str, provider: &'static str) {
        self.gen_ai = Some((operation, provider));
    }

    /// Counts this request under `model` when it ends.
    pub fn set_model(&mut self, model: Option<String>) {
        self.model = model.map(String::into_boxed_str);
    }

    /// Tokens recorded from events so far (estimated, or from a running exact count).
    pub fn counted_tokens(&self) -> u64 {
        self.tokens
    }

    /// Tokens counted so far (the exact count once one arrived).
    pub fn output_tokens(&self) -> u64 {
        self.exact.unwrap_or(self.tokens)
    }

    /// What the request's record says so far: TTFT, TPOT, output tokens and whether they
    /// are exact.
    pub fn summary(&self) -> Summary {
        let total = self.output_tokens();
        Summary {
            ttft_ms: self.first.map(|f| f.saturating_sub(self.t0) as f64 / 1e6),
            tpot_ms: self
                .first
                .filter(|&f| total >= 2 && self.last > f)
                .map(|f| (self.last - f) as f64 / 1e6 / (total - 1) as f64),
            output_tokens: total,
            exact: self.exact.is_some(),
            sent_ttft_ms: self.first.map(|f| f.saturating_sub(self.sent) as f64 / 1e6),
            sent_to_last_ms: self.last.max(self.sent).saturating_sub(self.sent) as f64 / 1e6,
            concurrency: (self.events > 0)
                .then(|| self.concurrency_sum as f64 / self.events as f64),
            unread: self.unread,
        }
    }

    /// The response ended at `now`.
    pub fn finish(mut self, now: Nanos, outcome: Outcome) {
        self.end(now, outcome);
    }

    fn end(&mut self, now: Nanos, outcome: Outcome) {
        if self.done {
            return;
        }
        self.flush();
        self.done = true;
        self.endpoint.streams.fetch_sub(1, Relaxed);
        let total = self.output_tokens();
        let full = (self.meter.shard(self.shard)).finish(self.key, now, self.tokens, self.exact);
        if full {
            tracing::warn!(
                upstream = %self.meter.name(),
                "meter: the window holds more than {} finished requests on this worker thread; \
                 its TTFT, TPOT and e2e figures are of the newest (rates count every request)",
                super::shard::MAX_RETIRED
            );
        }
        let summary = self.summary();
        // The batch it ran in: the mean over its token events, or (none: not streamed) the
        // endpoint's as it ends.
        let batch = if self.events > 0 {
            (self.curve_sum as f64 / self.events as f64).round() as u64
        } else {
            self.curve_at(self.endpoint.streams.load(Relaxed) + 1)
        };
        let ended = Ended {
            outcome,
            estimated: self.tokens,
            unread: self.unread,
            exact: self.exact,
            input: self.input,
            cached: self.cached,
            judged: Judged {
                outcome,
                ttft_ms: summary.ttft_ms,
                tpot_ms: summary.tpot_ms,
                e2e_ms: now.saturating_sub(self.t0) as f64 / 1e6,
            },
            // The backend's part: from the moment it was sent, tokentap's queue left out.
            at_backend: Judged {
                outcome,
                ttft_ms: self.first.map(|f| f.saturating_sub(self.sent) as f64 / 1e6),
                tpot_ms: summary.tpot_ms,
                e2e_ms: now.saturating_sub(self.sent) as f64 / 1e6,
            },
            bucket: bucket(batch),
        };
        self.meter.lock().finish(now, &self.endpoint, ended);
        self.meter
            .hist
            .e2e
            .record(secs(now.saturating_sub(self.t0)));
        let counted = self
            .model
            .take()
            .map(|model| self.meter.count_model(&model, total));
        self.endpoint.done(super::Finished {
            at: now,
            ttft_ms: summary.ttft_ms,
            tpot_ms: summary.tpot_ms,
            sent_ttft_ms: self.first.map(|f| f.saturating_sub(self.sent) as f64 / 1e6),
            batch,
        });
        if let Some(input) = self.input {
            self.endpoint.prompt(input, self.cached);
        }
        if let (Some((operation, provider)), Some(telemetry)) =
            (self.gen_ai, self.meter.semconv.load_full())
        {
            // The same figures, and the same requests, as the histograms above and below.
            let tpot = self
                .first
                .filter(|&f| total >= 2 && self.last > f)
                .map(|f| secs(self.last - f) / (total - 1) as f64);
            telemetry.gen_ai(
                &crate::telemetry::GenAi {
                    operation,
                    provider,
                    model: counted.as_deref().unwrap_or("unknown"),
                    server: &self.meter.name,
                },
                &crate::telemetry::GenAiFigures {
                    ttft: self.first.map(|f| secs(f.saturating_sub(self.t0))),
                    tpot,
                    duration: secs(now.saturating_sub(self.t0)),
                    input_tokens: self.input,
                    output_tokens: total,
                },
            );
        }
        if let Some(first) = self.first {
            if total >= 2 && self.last > first {
                let tpot = secs(self.last - first) / (total - 1) as f64;
                self.meter.hist.tpot.record(tpot);
                if outcome == Outcome::Ok {
                    self.meter.push_sample(RequestSample {
                        at: now,
                        concurrency: self.concurrency_sum as f64 / self.events.max(1) as f64,
                        ttft_ms: first.saturating_sub(self.t0) as f64 / 1e6,
                        tpot_ms: tpot * 1e3,
                    });
                }
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.done {
            let now = self.meter.clock.now();
            self.end(now, Outcome::Aborted);
        }
    }
}

fn secs(ns: Nanos) -> f64 {
    ns as f64 / 1e9
}
