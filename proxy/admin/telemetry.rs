//! Prometheus exposition through the `metrics` crate. Every metric is described here; names
//! are `tokentap_<thing>_<unit>`, labels are bounded (upstream name, outcome, curve bucket).
//!
//! The recorder is local to one proxy (not the process-global one), so several proxies in
//! one process — tests, the demo — never mix their figures. Counters and gauges are set from
//! the meter's snapshot at scrape time; the per-request histograms (TTFT, TPOT, queue wait)
//! are fed as requests end, and the per-event ones (ITL, tokens per event) are written here
//! from the meter's own histograms, so a token event feeds nothing shared between threads.

use std::fmt::Write as _;

use hdrhistogram::Histogram;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use super::ConnectionStats;
use crate::meter::{Distributions, Histograms, Outcome, UpstreamStats};

/// Histogram buckets for latencies, seconds: 1 ms to 5 min.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Histogram buckets for tokens per event.
const TOKEN_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];

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

    /// The exposition text, after setting counters and gauges from `stats`, with the
    /// per-event histograms of `distributions` (upstream name, distributions).
    pub fn render(
        &self,
        stats: &[UpstreamStats],
        connections: &ConnectionStats,
        distributions: &[(&str, Distributions)],
    ) -> String {
        metrics::with_local_recorder(&self.recorder, || {
            gauge!("tokentap_client_connections").set(connections.open as f64);
            gauge!("tokentap_client_connections_max").set(connections.max as f64);
            counter!("tokentap_client_connections_refused_total")
                .absolute(connections.refused_total);
            for s in stats {
                let up = s.name.clone();
                for o in Outcome::ALL {
                    let n = s.requests_by_status.get(o.label()).copied().unwrap_or(0);
                    counter!("tokentap_requests_total", "upstream" => up.clone(), "status" => o.label()).absolute(n);
                }
                counter!("tokentap_errors_total", "upstream" => up.clone())
                    .absolute(s.errors_total);
                // Which tokens rest on estimates is in the `counts` label.
                let estimated = s.estimated_output_tokens_total;
                counter!("tokentap_output_tokens_total", "upstream" => up.clone(), "counts" => "exact")
                    .absolute(s.output_tokens_total.saturating_sub(estimated));
                counter!("tokentap_output_tokens_total", "upstream" => up.clone(), "counts" => "estimated")
                    .absolute(estimated);
                if let Some(r) = s.estimate_to_exact_ratio {
                    gauge!("tokentap_estimate_to_exact_ratio", "upstream" => up.clone()).set(r);
                }
                counter!("tokentap_unparsed_events_total", "upstream" => up.clone())
                    .absolute(s.unparsed_events_total);
                gauge!("tokentap_in_flight_requests", "upstream" => up.clone())
                    .set(s.in_flight as f64);
                gauge!("tokentap_queued_requests", "upstream" => up.clone()).set(s.queued as f64);
                gauge!("tokentap_concurrency_limit", "upstream" => up.clone())
                    .set(s.limit.map_or(f64::NAN, |l| l as f64));
                for reason in ["queue_full", "queue_timeout"] {
                    let n = s.rejected_by_reason.get(reason).copied().unwrap_or(0);
                    counter!("tokentap_rejected_requests_total", "upstream" => up.clone(), "reason" => reason)
                        .absolute(n);
                }
                for arm in &s.arms {
                    gauge!("tokentap_upstream_arm_weight", "upstream" => up.clone(), "route" => arm.route.to_string())
                        .set(f64::from(arm.weight));
                }
                if let Some(slo) = &s.slo {
                    gauge!("tokentap_slo_tpot_seconds", "upstream" => up.clone())
                        .set(slo.tpot_ms / 1e3);
                    gauge!("tokentap_slo_current_tpot_seconds", "upstream" => up.clone())
                        .set(slo.current_tpot_ms.map_or(f64::NAN, |v| v / 1e3));
                    gauge!("tokentap_slo_bounded_system_tokens_per_second", "upstream" => up.clone())
                        .set(slo.slo_bounded_system_tps.unwrap_or(f64::NAN));
                }
                let or_nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
                gauge!("tokentap_system_tokens_per_second", "upstream" => up.clone())
                    .set(or_nan(s.system_tps));
                gauge!("tokentap_single_stream_tokens_per_second", "upstream" => up.clone())
                    .set(or_nan(s.single_stream_tps));
                gauge!("tokentap_concurrency", "upstream" => up.clone()).set(or_nan(s.concurrency));
                let exact = s.counts_exact.map(|e| if e { 1.0 } else { 0.0 });
                gauge!("tokentap_counts_exact", "upstream" => up.clone()).set(or_nan(exact));
                for p in &s.curve {
                    let c = p.concurrency.to_string();
                    gauge!("tokentap_curve_tpot_p50_seconds", "upstream" => up.clone(), "concurrency" => c.clone())
                        .set(or_nan(p.tpot_ms_p50.map(|v| v / 1e3)));
                    gauge!("tokentap_curve_tpot_p90_seconds", "upstream" => up.clone(), "concurrency" => c.clone())
                        .set(or_nan(p.tpot_ms_p90.map(|v| v / 1e3)));
                    gauge!("tokentap_curve_system_tokens_per_second", "upstream" => up.clone(), "concurrency" => c)
                        .set(or_nan(p.system_tps));
                }
            }
        });
        let mut text = self.handle.render();
        render_distributions(&mut text, distributions);
        text
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

/// `tokentap_itl_seconds` and `tokentap_tokens_per_event` in the text format, from the
/// meter's histograms. Their resolution is 1%: a sample is counted at the low end of its
/// 1% range, so one at most 1% above a bucket bound may count under it (and one exactly on
/// it always does).
fn render_distributions(text: &mut String, distributions: &[(&str, Distributions)]) {
    if distributions.is_empty() {
        return;
    }
    type Pick = fn(&Distributions) -> (&Histogram<u32>, f64);
    // (name, help, bucket bounds, recorded units per exposed unit, histogram and Σ in
    // exposed units)
    let families: [(&str, &str, &[f64], f64, Pick); 2] = [
        (
            "tokentap_itl_seconds",
            "Inter-token latency: the gap between token events divided by the tokens of the later one.",
            LATENCY_BUCKETS,
            1e6,
            |d| (&d.itl_us, d.itl_sum_us / 1e6),
        ),
        (
            "tokentap_tokens_per_event",
            "Tokens carried by each token-bearing fragment.",
            TOKEN_BUCKETS,
            1.0,
            |d| (&d.tokens_per_event, d.tokens_per_event.mean() * d.tokens_per_event.len() as f64),
        ),
    ];
    for (name, help, bounds, per_unit, pick) in families {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (upstream, d) in distributions {
            let (h, sum) = pick(d);
            let label = escape(upstream);
            let mut counts = vec![0u64; bounds.len()];
            for v in h.iter_recorded() {
                let value = h.lowest_equivalent(v.value_iterated_to()) as f64 / per_unit;
                if let Some(b) = bounds.iter().position(|&le| value <= le) {
                    counts[b] += u64::from(v.count_at_value());
                }
            }
            let mut cumulative = 0;
            for (le, n) in bounds.iter().zip(counts) {
                cumulative += n;
                let _ = writeln!(
                    text,
                    "{name}_bucket{{upstream=\"{label}\",le=\"{le}\"}} {cumulative}"
                );
            }
            let total = h.len();
            let _ = writeln!(
                text,
                "{name}_bucket{{upstream=\"{label}\",le=\"+Inf\"}} {total}"
            );
            let _ = writeln!(text, "{name}_sum{{upstream=\"{label}\"}} {sum}");
            let _ = writeln!(text, "{name}_count{{upstream=\"{label}\"}} {total}");
        }
    }
}

/// A label value with `\`, `"` and newlines escaped, as the text format wants.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn describe() {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hist() -> hdrhistogram::Histogram<u32> {
        hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 2)
            .unwrap_or_else(|_| unreachable!())
    }

    #[test]
    fn per_event_histograms_in_text_format() {
        let (mut itl, mut tpe) = (hist(), hist());
        let _ = itl.record_n(20_000, 100); // 20 ms
        let _ = itl.record_n(40_000, 10); // 40 ms
        let _ = tpe.record_n(1, 100);
        let _ = tpe.record_n(4, 10);
        let d = Distributions {
            itl_us: itl,
            itl_sum_us: 100.0 * 20_000.0 + 10.0 * 40_000.0,
            tokens_per_event: tpe,
        };
        let mut text = String::new();
        render_distributions(&mut text, &[("a\"b", d)]);
        for line in [
            "# TYPE tokentap_itl_seconds histogram",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.015\"} 0",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.02\"} 100",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.04\"} 110",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"+Inf\"} 110",
            "tokentap_itl_seconds_sum{upstream=\"a\\\"b\"} 2.4",
            "tokentap_itl_seconds_count{upstream=\"a\\\"b\"} 110",
            "# TYPE tokentap_tokens_per_event histogram",
            "tokentap_tokens_per_event_bucket{upstream=\"a\\\"b\",le=\"1\"} 100",
            "tokentap_tokens_per_event_bucket{upstream=\"a\\\"b\",le=\"3\"} 100",
            "tokentap_tokens_per_event_bucket{upstream=\"a\\\"b\",le=\"4\"} 110",
            "tokentap_tokens_per_event_sum{upstream=\"a\\\"b\"} 140",
            "tokentap_tokens_per_event_count{upstream=\"a\\\"b\"} 110",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
    }
}
