//! Every metric tokentap exports, described in one place, and the recorder they are kept
//! in (`metrics` with the Prometheus exporter). Names are `tokentap_<thing>_<unit>`; labels
//! are bounded (upstream name, outcome, curve bucket).
//!
//! The recorder is local to one proxy (not the process-global one), so several proxies in
//! one process — tests, the demo — never mix their figures. The per-request histograms
//! (TTFT, TPOT, queue wait) are fed as requests end through the handles made here; counters
//! and gauges are set from snapshots at scrape time (`admin::metrics`).

use std::sync::LazyLock;

use metrics::{describe_histogram, histogram, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

/// Prometheus histogram handles an upstream's finished requests feed (no-ops in unit
/// tests). The per-event distributions (ITL, tokens per event) are not among them: they are
/// read from the meter's shards at scrape time (`UpstreamMeter::distributions`), so a
/// token event writes nothing shared with other threads.
#[derive(Clone)]
pub struct Histograms {
    pub ttft: metrics::Histogram,
    pub tpot: metrics::Histogram,
    pub e2e: metrics::Histogram,
}

impl Histograms {
    pub fn noop() -> Self {
        Histograms {
            ttft: metrics::Histogram::noop(),
            tpot: metrics::Histogram::noop(),
            e2e: metrics::Histogram::noop(),
        }
    }
}

/// The E12 series: neighbouring values 18–25% apart, so a `histogram_quantile` read
/// between two edges is off by at most half that.
const E12: [u32; 12] = [10, 12, 15, 18, 22, 27, 33, 39, 47, 56, 68, 82];

/// The E12 values from `from` up to the first at or above `to`, seconds; exact decimals
/// (`0.0012`, not `0.0012000000000000001`) so the `le` labels read as written.
fn e12(from: f64, to: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for exp in -4..4 {
        for m in E12 {
            // m × 10^(exp-1), by division for negative powers so the decimal is exact.
            let p = exp - 1;
            let v = if p < 0 {
                f64::from(m) / 10f64.powi(-p)
            } else {
                f64::from(m) * 10f64.powi(p)
            };
            if v >= from * 0.999 {
                out.push(v);
                if v >= to {
                    return out;
                }
            }
        }
    }
    out
}

/// TTFT buckets: 10 ms to 68 s.
pub static TTFT_BUCKETS: LazyLock<Vec<f64>> = LazyLock::new(|| e12(0.01, 60.0));
/// Per-token buckets (TPOT, ITL, the curve's gaps): 1 ms to 2.2 s.
pub static TOKEN_GAP_BUCKETS: LazyLock<Vec<f64>> = LazyLock::new(|| e12(0.001, 2.0));
/// Whole-request buckets (end to end, queue wait): 1 ms to 6.8 min.
pub static REQUEST_BUCKETS: LazyLock<Vec<f64>> = LazyLock::new(|| e12(0.001, 400.0));

/// `gen_ai.client.token.usage` buckets: the semantic conventions' own (powers of 4).
pub const GEN_AI_TOKEN_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// The OpenTelemetry GenAI histograms `metrics.semconv` adds, under their Prometheus names.
/// Their time buckets are tokentap's own (the conventions' are advisory): TPOT from 1 ms in
/// steps of 18–25% where the conventions start at 10 ms and then step 2.5×, too coarse for
/// a decode of 5–50 ms a token; and one set of edges lets each agree with tokentap's
/// histogram of the same thing bucket for bucket.
pub const GEN_AI_TTFT: &str = "gen_ai_server_time_to_first_token_seconds";
pub const GEN_AI_TPOT: &str = "gen_ai_server_time_per_output_token_seconds";
pub const GEN_AI_DURATION: &str = "gen_ai_server_request_duration_seconds";
pub const GEN_AI_TOKENS: &str = "gen_ai_client_token_usage";

/// The attributes of one request's GenAI figures.
pub struct GenAi<'a> {
    /// `gen_ai.operation.name`: `chat` or `text_completion`.
    pub operation: &'static str,
    /// `gen_ai.provider.name`: the API the upstream speaks.
    pub provider: &'static str,
    /// `gen_ai.request.model`, bounded as `metrics.model_label` bounds it.
    pub model: &'a str,
    /// `server.address`: the upstream's name.
    pub server: &'a str,
}

/// One request's GenAI figures, seconds and tokens.
pub struct GenAiFigures {
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
    pub duration: f64,
    pub input_tokens: Option<u64>,
    pub output_tokens: u64,
}

/// Histogram buckets for tokens per event.
pub const TOKEN_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];

/// The families `/metrics` writes itself at scrape time (name, type, help); the
/// per-request histograms of the recorder are described in [`describe`].
pub const FAMILIES: &[(&str, &str, &str)] = &[
    ("tokentap_build_info", "gauge", "Always 1; the version of tokentap serving."),
    ("tokentap_config_reloads_total", "counter", "Config reloads (SIGHUP, POST /reload), by result: success or failure (the file was refused and the running config kept)."),
    ("tokentap_config_last_reload_success_timestamp_seconds", "gauge", "Unix time of the last successful reload (of the start before any)."),
    ("tokentap_access_log_dropped_lines_total", "counter", "Access-log lines dropped because the writer could not keep up (its queue was full)."),
    ("tokentap_cluster_degraded", "gauge", "1 while the fleet's Redis is unreachable and each replica holds its share of every cap ([cluster])."),
    ("tokentap_cluster_replicas", "gauge", "Replicas of the fleet seen alive in the last minute, this one included."),
    ("tokentap_cluster_unsettled_budget_calls", "gauge", "Tenant-budget takes and settlements Redis has not confirmed, kept to be replayed (each exactly once) when it answers again ([cluster])."),
    ("tokentap_client_connections", "gauge", "Open client connections."),
    ("tokentap_client_connections_max", "gauge", "server.max_connections: more open client connections are closed at once."),
    ("tokentap_client_connections_refused_total", "counter", "Client connections closed at once because server.max_connections were open and none was idle."),
    ("tokentap_client_connections_parked", "gauge", "Idle keep-alive client connections idle over a second, parked with no task of their own."),
    ("tokentap_client_connections_evicted_total", "counter", "Idle keep-alive client connections closed to make room for a new client at server.max_connections."),
    ("tokentap_requests_total", "counter", "Requests by upstream and outcome (ok, 4xx, 5xx, aborted, upstream_error, truncated, stream_error, proxy_error)."),
    ("tokentap_errors_total", "counter", "Requests the upstream failed: 5xx, upstream_error, truncated, stream_error."),
    ("tokentap_output_tokens_total", "counter", "Output tokens, counted as they arrive; a stream's exact count (usage) replaces its estimate when it ends."),
    ("tokentap_estimated_output_tokens_total", "counter", "Output tokens of finished requests that rest on the one-per-event estimate (no exact count arrived)."),
    ("tokentap_input_tokens_total", "counter", "Prompt tokens, of the requests whose stream reported them."),
    ("tokentap_cached_input_tokens_total", "counter", "Of those, the prompt tokens the backend read from its prefix cache, where it reported them (usage.prompt_tokens_details.cached_tokens, Anthropic's cache_read_input_tokens)."),
    ("tokentap_estimate_to_exact_ratio", "gauge", "Σ one-per-event estimate / Σ exact count, over requests that had both."),
    ("tokentap_unparsed_events_total", "counter", "Stream events that could not be metered (broken JSON, over the size bound)."),
    ("tokentap_in_flight_requests", "gauge", "Generation requests in flight at the upstream."),
    ("tokentap_queued_requests", "gauge", "Requests waiting for a concurrency slot."),
    ("tokentap_concurrency_limit", "gauge", "The concurrency cap in force (absent when there is none)."),
    ("tokentap_rejected_requests_total", "counter", "Requests refused with 429, by reason (queue_full, queue_timeout, predicted_wait, output_token_budget)."),
    ("tokentap_upstream_arm_weight", "gauge", "The upstream's weight in each route's split (route = the route's name)."),
    ("tokentap_slo_tpot_seconds", "gauge", "The TPOT SLO ([upstream.slo] tpot_ms): the adaptive cap holds it, each request is judged by it."),
    ("tokentap_slo_ttft_seconds", "gauge", "The TTFT SLO ([upstream.slo] ttft_ms) each request is judged by."),
    ("tokentap_slo_e2e_seconds", "gauge", "The end-to-end latency SLO ([upstream.slo] e2e_ms) each request is judged by."),
    ("tokentap_slo_requests_total", "counter", "Finished generation requests judged against [upstream.slo], by result: good (every SLO held), the first SLO broken (ttft, tpot, e2e), or error (failed or abandoned)."),
    ("tokentap_slo_attainment_target_ratio", "gauge", "[upstream.slo] attainment_pct / 100: the share of requests that must be good."),
    ("tokentap_slo_attainment_ratio", "gauge", "Good requests among those judged over the sliding window (0–1)."),
    ("tokentap_goodput_requests_per_second", "gauge", "Requests that met every SLO, over the sliding window, per second."),
    ("tokentap_goodput_output_tokens_per_second", "gauge", "Output tokens of the requests that met every SLO, over the sliding window, per second."),
    ("tokentap_slo_current_tpot_seconds", "gauge", "The SLO percentile of per-token gaps over the last controller tick (on a fleet's leader, all replicas' gaps)."),
    ("tokentap_slo_fleet_leader", "gauge", "1 on the replica whose controller moves the upstream's fleet-wide adaptive limit, 0 on the others ([cluster])."),
    ("tokentap_slo_bounded_system_tokens_per_second", "gauge", "One endpoint's highest system T/s among the curve's supported points within the SLO."),
    ("tokentap_cost_per_hour", "gauge", "upstream[].cost_per_hour: the pool's price per hour (currency = cost_currency); a fleet's cost per token is this over the fleet's output tokens per hour."),
    ("tokentap_cost_per_million_output_tokens", "gauge", "cost_per_hour / (system T/s × 3600) × 10⁶ at the sliding window's load (currency = cost_currency)."),
    ("tokentap_cost_per_million_output_tokens_at_slo_bounded", "gauge", "The same at the pool's SLO-bounded system T/s (one endpoint's × the endpoints taking requests)."),
    ("tokentap_roofline_single_stream_tokens_per_second", "gauge", "The decode roofline: HBM bandwidth × tensor_parallel / the model's weight bytes."),
    ("tokentap_model_bandwidth_utilization_ratio", "gauge", "MBU at the lowest supported curve point: its single-stream T/s / the roofline (absent when it would exceed 1: a configuration problem)."),
    ("tokentap_mirror_in_flight_requests", "gauge", "Copies of primaries' requests in flight on this mirror upstream (route[].mirror): their own slots, under max_in_flight."),
    ("tokentap_mirror_skipped_total", "counter", "Sampled requests not copied to this mirror, by reason: max_in_flight (that many copies were running), body_unread (over the 64 KiB read-ahead), no_endpoint, cap (no slot free under the upstream's own cap)."),
    ("tokentap_capacity_demand_tokens_per_second", "gauge", "Tokens per second asked of the pool: delivered over the window plus what the queue holds back."),
    ("tokentap_capacity_endpoints_needed", "gauge", "Endpoints the demand needs at the SLO with capacity.headroom_pct to spare, held steady for an autoscaler: the median need of the last three metrics windows (30 s), with hysteresis (absent while the curve has no point near the SLO)."),
    ("tokentap_backend_running_requests", "gauge", "Requests the backend itself says it runs (backend_metrics: vllm:num_requests_running, sglang:num_running_reqs, tgi_batch_current_size, llamacpp:requests_processing)."),
    ("tokentap_backend_waiting_requests", "gauge", "Requests the backend itself says wait in its queue."),
    ("tokentap_backend_kv_cache_percent", "gauge", "The backend's KV-cache use, percent (vLLM)."),
    ("tokentap_backend_scrape_age_seconds", "gauge", "Since the last successful scrape of backend_metrics."),
    ("tokentap_backend_scrape_failures_total", "counter", "Scrapes of backend_metrics that failed (the curve falls back to tokentap's own in-flight count)."),
    ("tokentap_rollout_percent", "gauge", "The share of the route's requests its rollout sends to `to`, percent (route[].rollout)."),
    ("tokentap_rollout_state", "gauge", "1 for the state the route's rollout is in: running, paused, promoted or rolled_back."),
    ("tokentap_endpoints", "gauge", "The upstream's endpoints by state: healthy (taking requests), ejected (passively, for a while), unhealthy (failing active checks)."),
    ("tokentap_endpoint_healthy", "gauge", "1 while the endpoint takes requests (its checks pass and it is not ejected); endpoint = its URL (metrics.endpoint_labels)."),
    ("tokentap_endpoint_in_flight_requests", "gauge", "Generation requests on the endpoint."),
    ("tokentap_endpoint_concurrency_limit", "gauge", "The endpoint's concurrency cap (absent when there is none)."),
    ("tokentap_endpoint_requests_total", "counter", "Requests sent to the endpoint."),
    ("tokentap_endpoint_errors_total", "counter", "Requests the endpoint failed: 5xx, a failed connection, a stream cut or truncated."),
    ("tokentap_endpoint_ejections_total", "counter", "Times the endpoint was ejected (a failed connect, a reset before the response, eject_after 5xx in a row)."),
    ("tokentap_endpoint_output_tokens_total", "counter", "Output tokens the endpoint streamed, counted as they arrive (estimates not corrected)."),
    ("tokentap_endpoint_system_tokens_per_second", "gauge", "The endpoint's output tokens over the sliding window, per second."),
    ("tokentap_endpoint_single_stream_tokens_per_second", "gauge", "1000 / mean TPOT (ms) of the endpoint's requests that finished in the window."),
    ("tokentap_tenant_requests_total", "counter", "Finished generation requests of the tenant ([tenants]; metrics.tenant_labels tenants by name, the rest as other)."),
    ("tokentap_tenant_input_tokens_total", "counter", "Prompt tokens of the tenant's requests that reported them."),
    ("tokentap_tenant_output_tokens_total", "counter", "Output tokens of the tenant's finished requests."),
    ("tokentap_tenant_output_tokens_per_second", "gauge", "The tenant's output tokens over the sliding window, per second."),
    ("tokentap_tenant_ttft_p50_ms", "gauge", "Median TTFT of the tenant's last 256 requests, ms."),
    ("tokentap_tenant_tpot_p50_ms", "gauge", "Median TPOT of the tenant's last 256 requests, ms."),
    ("tokentap_tenant_queue_wait_mean_ms", "gauge", "Mean wait of the tenant's requests for a concurrency slot, ms."),
    ("tokentap_tenant_rejected_total", "counter", "The tenant's requests refused, by reason: queue_full, queue_timeout, predicted_wait, output_token_budget, no_healthy_endpoint."),
    ("tokentap_system_tokens_per_second", "gauge", "All output tokens of the upstream over the sliding window, per second."),
    ("tokentap_single_stream_tokens_per_second", "gauge", "1000 / mean TPOT (ms) of requests with two or more token events in the window."),
    ("tokentap_concurrency", "gauge", "Time-weighted mean of in-flight requests over the window."),
    ("tokentap_counts_exact", "gauge", "1 when every finished generation was counted exactly, 0 when some rest on estimates."),
    ("tokentap_curve_tokens_total", "counter", "Output tokens that arrived while the upstream's in-flight count was in the concurrency bucket (1, 2, 3–4 as 4, 5–8 as 8, …)."),
    ("tokentap_curve_seconds_total", "counter", "Seconds the upstream's in-flight count spent in the concurrency bucket; tokens / seconds is the bucket's system T/s."),
    ("tokentap_curve_gap_seconds", "histogram", "Per-token gaps by the concurrency bucket they arrived at: the concurrency→TPOT curve."),
    ("tokentap_itl_seconds", "histogram", "Inter-token latency: the gap between token events divided by the tokens of the later one."),
    ("tokentap_tokens_per_event", "histogram", "Tokens carried by each token-bearing fragment."),
    ("tokentap_model_requests_total", "counter", "Finished generation requests by model (metrics.model_label): the first 10 models of each upstream by name, later ones as other, unreadable ones as unknown."),
    ("tokentap_model_output_tokens_total", "counter", "Output tokens of finished requests by model (metrics.model_label)."),
];

pub struct Telemetry {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

// === impl Telemetry ===

impl Telemetry {
    pub fn new() -> Self {
        // Only an empty bucket list is refused; ours are never empty.
        let buckets = |name: &str, b: &[f64]| (Matcher::Full(name.into()), b.to_vec());
        let builder = [
            buckets("tokentap_ttft_seconds", &TTFT_BUCKETS),
            buckets("tokentap_tpot_seconds", &TOKEN_GAP_BUCKETS),
            buckets("tokentap_e2e_seconds", &REQUEST_BUCKETS),
            buckets("tokentap_queue_wait_seconds", &REQUEST_BUCKETS),
            buckets(GEN_AI_TTFT, &TTFT_BUCKETS),
            buckets(GEN_AI_TPOT, &TOKEN_GAP_BUCKETS),
            buckets(GEN_AI_DURATION, &REQUEST_BUCKETS),
            buckets(GEN_AI_TOKENS, GEN_AI_TOKEN_BUCKETS),
        ]
        .into_iter()
        .try_fold(PrometheusBuilder::new(), |b, (m, v)| {
            b.set_buckets_for_metric(m, &v)
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
            e2e: histogram!("tokentap_e2e_seconds", "upstream" => name.clone()),
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

    /// Records one finished request's GenAI histograms (`metrics.semconv`).
    pub fn gen_ai(&self, a: &GenAi<'_>, f: &GenAiFigures) {
        metrics::with_local_recorder(&self.recorder, || {
            let labels = |extra: Option<&'static str>| {
                let mut l = vec![
                    ("gen_ai_operation_name", a.operation.to_owned()),
                    ("gen_ai_provider_name", a.provider.to_owned()),
                    ("gen_ai_request_model", a.model.to_owned()),
                    ("server_address", a.server.to_owned()),
                ];
                if let Some(kind) = extra {
                    l.push(("gen_ai_token_type", kind.to_owned()));
                }
                l
            };
            if let Some(t) = f.ttft {
                histogram!(GEN_AI_TTFT, &labels(None)).record(t);
            }
            if let Some(t) = f.tpot {
                histogram!(GEN_AI_TPOT, &labels(None)).record(t);
            }
            histogram!(GEN_AI_DURATION, &labels(None)).record(f.duration);
            if let Some(n) = f.input_tokens {
                histogram!(GEN_AI_TOKENS, &labels(Some("input"))).record(n as f64);
            }
            histogram!(GEN_AI_TOKENS, &labels(Some("output"))).record(f.output_tokens as f64);
        });
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
    describe_histogram!(
        GEN_AI_TTFT,
        Unit::Seconds,
        "gen_ai.server.time_to_first_token (metrics.semconv): time to first token, as tokentap_ttft_seconds."
    );
    describe_histogram!(
        GEN_AI_TPOT,
        Unit::Seconds,
        "gen_ai.server.time_per_output_token (metrics.semconv): time per output token after the first, as tokentap_tpot_seconds."
    );
    describe_histogram!(
        GEN_AI_DURATION,
        Unit::Seconds,
        "gen_ai.server.request.duration (metrics.semconv): a generation request end to end, as tokentap_e2e_seconds."
    );
    describe_histogram!(
        GEN_AI_TOKENS,
        "gen_ai.client.token.usage (metrics.semconv): tokens per request, by gen_ai_token_type (input where the stream reports it, output)."
    );
    describe_histogram!(
        "tokentap_e2e_seconds",
        Unit::Seconds,
        "End-to-end latency of generation requests: from the request's first byte to the response's end."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_fine_and_exact() {
        for b in [&*TTFT_BUCKETS, &*TOKEN_GAP_BUCKETS, &*REQUEST_BUCKETS] {
            for w in b.windows(2) {
                let step = w[1] / w[0];
                assert!((1.10..=1.2501).contains(&step), "{} → {}", w[0], w[1]);
            }
        }
        assert_eq!(TTFT_BUCKETS.first(), Some(&0.01));
        assert_eq!(TTFT_BUCKETS.last(), Some(&68.0));
        assert_eq!(TOKEN_GAP_BUCKETS.first(), Some(&0.001));
        assert_eq!(TOKEN_GAP_BUCKETS.last(), Some(&2.2));
        assert!(TOKEN_GAP_BUCKETS.iter().any(|v| v.to_string() == "0.0012"));
        assert_eq!(REQUEST_BUCKETS.last(), Some(&470.0));
    }
}
