//! `/metrics`: counters and gauges set from the `/stats` reports at scrape time, and the
//! per-event histograms (ITL, tokens per event) written from the meter's own histograms, so
//! a token event feeds nothing shared between threads.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use metrics::{counter, gauge};

use super::{ConnectionStats, UpstreamReport};
use crate::meter::{Distributions, Outcome};
use crate::state::Process;
use crate::telemetry::{Telemetry, LATENCY_BUCKETS, TOKEN_BUCKETS};

/// The exposition text, after setting counters and gauges from the reports, with the
/// per-event histograms of `distributions` (upstream name, distributions).
pub fn render(
    telemetry: &Telemetry,
    stats: &[UpstreamReport],
    connections: &ConnectionStats,
    distributions: &[(&str, Distributions)],
    process: &Process,
) -> String {
    let mut text = telemetry.scrape(|| {
        counter!("tokentap_config_reloads_total", "result" => "success")
            .absolute(process.reloads_ok);
        counter!("tokentap_config_reloads_total", "result" => "failure")
            .absolute(process.reloads_failed);
        gauge!("tokentap_config_last_reload_success_timestamp_seconds")
            .set(process.last_reload_success as f64);
        counter!("tokentap_access_log_dropped_lines_total").absolute(process.access_dropped);
        gauge!("tokentap_client_connections").set(connections.open as f64);
        gauge!("tokentap_client_connections_max").set(connections.max as f64);
        counter!("tokentap_client_connections_refused_total")
            .absolute(connections.refused_total);
        for report in stats {
            let s = &report.meter;
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
            gauge!("tokentap_queued_requests", "upstream" => up.clone()).set(report.queued as f64);
            gauge!("tokentap_concurrency_limit", "upstream" => up.clone())
                .set(report.limit.map_or(f64::NAN, |l| l as f64));
            for reason in ["queue_full", "queue_timeout"] {
                let n = report.rejected_by_reason.get(reason).copied().unwrap_or(0);
                counter!("tokentap_rejected_requests_total", "upstream" => up.clone(), "reason" => reason)
                    .absolute(n);
            }
            for arm in &report.arms {
                gauge!("tokentap_upstream_arm_weight", "upstream" => up.clone(), "route" => arm.route.to_string())
                    .set(f64::from(arm.weight));
            }
            if let Some(slo) = &report.slo {
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
    render_distributions(&mut text, distributions);
    text
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
