//! Every metric tokentap exports, described in one place, and the recorder they are kept
//! in (`metrics` with the Prometheus exporter). Names are `tokentap_<thing>_<unit>`; labels
//! are bounded (upstream name, outcome, curve bucket).
//!
//! The recorder is local to one proxy (not the process-global one), so several proxies in
//! one process — tests, the demo — never mix their figures. The per-request histograms
//! (TTFT, TPOT, queue wait) are fed as requests end through the handles made here; counters
//! and gauges are set from snapshots at scrape time (`admin::metrics`).

use metrics::{describe_counter, describe_gauge, describe_histogram, histogram, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::meter::Histograms;

/// Histogram buckets for latencies, seconds: 1 ms to 5 min.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Histogram buckets for tokens per event.
pub const TOKEN_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];

pub struct Telemetry {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

// === impl Telemetry ===

impl Telemetry {
    pub fn new() -> Self {
        // Only an empty bucket list is refused; ours are non-empty constants.
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("tokentap_tokens_per_event".into()),
                    TOKEN_BUCKETS,
                )
            })
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, describe);
        Telemetry { recorder, handle }
    }

    /// The histogram handles an upstream's meter records into.
    pub fn histograms(&self, upstream: &str) -> Histograms {
        let name = upstream.to_owned();
        metrics::with_local_recorder(&self.recorder, || Histograms {
            ttft: histogram!("tokentap_ttft_seconds", "upstream" => name.clone()),
            tpot: histogram!("tokentap_tpot_seconds", "upstream" => name.clone()),
        })
    }

    /// The queue-wait histogram of an upstream's limiter.
    pub fn queue_wait(&self, upstream: &str) -> metrics::Histogram {
        let name = upstream.to_owned();
        metrics::with_local_recorder(
            &self.recorder,
            || histogram!("tokentap_queue_wait_seconds", "upstream" => name),
        )
    }

    /// Runs `set` (which sets counters and gauges) against this recorder, then renders
    /// the exposition text.
    pub fn scrape(&self, set: impl FnOnce()) -> String {
        metrics::with_local_recorder(&self.recorder, set);
        self.handle.render()
    }

    /// Drains histogram samples into their buckets; call every few seconds so memory stays
    /// bounded between scrapes.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

fn describe() {
    describe_counter!(
        "tokentap_config_reloads_total",
        "Config reloads (SIGHUP, POST /reload), by result: success or failure (the file was refused and the running config kept)."
    );
    describe_counter!(
        "tokentap_access_log_dropped_lines_total",
        "Access-log lines dropped because the writer could not keep up (its queue was full)."
    );
    describe_gauge!(
        "tokentap_config_last_reload_success_timestamp_seconds",
        Unit::Seconds,
        "Unix time of the last successful reload (of the start before any)."
    );
    describe_gauge!("tokentap_client_connections", "Open client connections.");
    describe_gauge!(
        "tokentap_client_connections_max",
        "server.max_connections: more open client connections are closed at once."
    );
    describe_counter!(
        "tokentap_client_connections_refused_total",
        "Client connections closed at once because server.max_connections were open."
    );
    describe_gauge!(
        "tokentap_estimate_to_exact_ratio",
        "Σ one-per-event estimate / Σ exact count, over requests that had both."
    );
    describe_gauge!(
        "tokentap_upstream_arm_weight",
        "The upstream's weight in each route's split (route = its index in the config)."
    );
    describe_counter!("tokentap_requests_total", "Requests by upstream and outcome (ok, 4xx, 5xx, aborted, upstream_error, truncated, stream_error).");
    describe_counter!(
        "tokentap_errors_total",
        "Requests the upstream failed: 5xx, upstream_error, truncated, stream_error."
    );
    describe_counter!(
        "tokentap_output_tokens_total",
        Unit::Count,
        "Output tokens of finished requests, by counts=exact (the stream reported them) or counts=estimated (one per token-bearing event)."
    );
    describe_counter!(
        "tokentap_unparsed_events_total",
        "Stream events that could not be metered (broken JSON, over the size bound)."
    );
    describe_gauge!(
        "tokentap_in_flight_requests",
        "Generation requests in flight at the upstream."
    );
    describe_gauge!(
        "tokentap_system_tokens_per_second",
        "All output tokens of the upstream over the sliding window, per second."
    );
    describe_gauge!(
        "tokentap_single_stream_tokens_per_second",
        "1000 / mean TPOT (ms) of requests with two or more token events in the window."
    );
    describe_gauge!(
        "tokentap_concurrency",
        "Time-weighted mean of in-flight requests over the window."
    );
    describe_gauge!(
        "tokentap_counts_exact",
        "1 when every finished generation was counted exactly, 0 when some rest on estimates."
    );
    describe_gauge!(
        "tokentap_curve_tpot_p50_seconds",
        Unit::Seconds,
        "Per-token gap p50 by the concurrency bucket the tokens arrived at, since start."
    );
    describe_gauge!(
        "tokentap_curve_tpot_p90_seconds",
        Unit::Seconds,
        "Per-token gap p90 by concurrency bucket, since start."
    );
    describe_gauge!(
        "tokentap_curve_system_tokens_per_second",
        "Tokens per second while the upstream was in the concurrency bucket, since start."
    );
    describe_gauge!(
        "tokentap_queued_requests",
        "Requests waiting for a concurrency slot."
    );
    describe_gauge!(
        "tokentap_concurrency_limit",
        "The concurrency cap in force (NaN: none)."
    );
    describe_counter!(
        "tokentap_rejected_requests_total",
        "Requests refused a slot with 429, by reason (queue_full, queue_timeout)."
    );
    describe_gauge!(
        "tokentap_slo_tpot_seconds",
        Unit::Seconds,
        "The TPOT SLO the adaptive cap holds."
    );
    describe_gauge!(
        "tokentap_slo_current_tpot_seconds",
        Unit::Seconds,
        "The SLO percentile of per-token gaps over the last controller tick."
    );
    describe_gauge!(
        "tokentap_slo_bounded_system_tokens_per_second",
        "The highest system T/s among curve buckets that meet the SLO."
    );
    describe_histogram!(
        "tokentap_queue_wait_seconds",
        Unit::Seconds,
        "Time requests waited for a concurrency slot."
    );
    describe_histogram!(
        "tokentap_ttft_seconds",
        Unit::Seconds,
        "Time to first token."
    );
    describe_histogram!(
        "tokentap_tpot_seconds",
        Unit::Seconds,
        "Time per output token of finished requests: (t_last - t_first) / (N - 1)."
    );
}
