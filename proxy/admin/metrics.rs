//! `/metrics`: the per-request histograms of the recorder (TTFT, TPOT, end to end, queue
//! wait), then every other family written here at scrape time from the `/stats` reports
//! and the meters: counters, gauges, and the histograms the meter keeps itself (ITL, tokens
//! per event, the curve's gaps), so a token event feeds nothing shared between threads.
//!
//! A figure without a value (no cap, no traffic yet) is left out, never exported as NaN;
//! every label is bounded (upstream and route names from the config, outcome, reason, the
//! concurrency bucket, at most `meter::MODEL_LABELS` models).

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use indexmap::IndexMap;

use super::{ConnectionStats, UpstreamReport};
use crate::meter::{CurveTotals, Distributions, ModelCount, Outcome};
use crate::state::Process;
use crate::telemetry::{Telemetry, FAMILIES, TOKEN_BUCKETS, TOKEN_GAP_BUCKETS};

/// What one upstream's meter adds to the scrape beyond its report.
pub struct MeterParts<'a> {
    pub name: &'a str,
    pub distributions: Distributions,
    pub curve: Vec<CurveTotals>,
    pub output_tokens: u64,
    /// Per model, busiest first; empty unless `metrics.model_label`.
    pub models: Vec<(String, ModelCount)>,
}

/// The exposition text.
pub fn render(
    telemetry: &Telemetry,
    stats: &[UpstreamReport],
    connections: &ConnectionStats,
    meters: &[MeterParts<'_>],
    process: &Process,
    (endpoint_labels, tenants, rollouts): (
        usize,
        Option<&[crate::tenant::book::TenantStats]>,
        &[crate::rollout::RolloutSummary],
    ),
) -> String {
    let mut text = telemetry.scrape(|| {});
    let mut x = Exposition::default();
    x.add(
        "tokentap_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    for (result, n) in [
        ("success", process.reloads_ok),
        ("failure", process.reloads_failed),
    ] {
        x.add(
            "tokentap_config_reloads_total",
            &[("result", result)],
            n as f64,
        );
    }
    for r in rollouts {
        x.add(
            "tokentap_rollout_percent",
            &[("route", &r.route)],
            r.percent,
        );
        for state in crate::rollout::State::ALL {
            let on = f64::from(u8::from(r.state == state));
            x.add(
                "tokentap_rollout_state",
                &[("route", &r.route), ("state", state.label())],
                on,
            );
        }
    }
    x.add(
        "tokentap_config_last_reload_success_timestamp_seconds",
        &[],
        process.last_reload_success as f64,
    );
    x.add(
        "tokentap_access_log_dropped_lines_total",
        &[],
        process.access_dropped as f64,
    );
    if let Some(c) = &process.cluster {
        x.add(
            "tokentap_cluster_degraded",
            &[],
            f64::from(u8::from(c.degraded)),
        );
        x.add("tokentap_cluster_replicas", &[], c.replicas as f64);
        x.add(
            "tokentap_cluster_unsettled_budget_calls",
            &[],
            c.unsettled as f64,
        );
    }
    x.add("tokentap_client_connections", &[], connections.open as f64);
    x.add(
        "tokentap_client_connections_max",
        &[],
        connections.max as f64,
    );
    x.add(
        "tokentap_client_connections_refused_total",
        &[],
        connections.refused_total as f64,
    );
    x.add(
        "tokentap_client_connections_parked",
        &[],
        connections.parked as f64,
    );
    x.add(
        "tokentap_client_connections_evicted_total",
        &[],
        connections.evicted_total as f64,
    );
    for report in stats {
        upstream(&mut x, report);
        endpoints(&mut x, report, endpoint_labels);
    }
    for t in tenants.unwrap_or_default() {
        tenant(&mut x, t);
    }
    for m in meters {
        let up = [("upstream", m.name)];
        x.add("tokentap_output_tokens_total", &up, m.output_tokens as f64);
        for b in &m.curve {
            let c = b.concurrency.to_string();
            let labels = [("upstream", m.name), ("concurrency", c.as_str())];
            x.add("tokentap_curve_tokens_total", &labels, b.tokens as f64);
            x.add("tokentap_curve_seconds_total", &labels, b.seconds);
            if let Some(h) = &b.gaps_us {
                x.histogram(
                    "tokentap_curve_gap_seconds",
                    &labels,
                    &TOKEN_GAP_BUCKETS,
                    h,
                    1e6,
                    b.gap_sum_us / 1e6,
                );
            }
        }
        let d = &m.distributions;
        x.histogram(
            "tokentap_itl_seconds",
            &up,
            &TOKEN_GAP_BUCKETS,
            &d.itl_us,
            1e6,
            d.itl_sum_us / 1e6,
        );
        let tpe = &d.tokens_per_event;
        let sum = tpe.mean() * tpe.len() as f64;
        x.histogram(
            "tokentap_tokens_per_event",
            &up,
            TOKEN_BUCKETS,
            tpe,
            1.0,
            sum,
        );
        models(&mut x, m.name, &m.models);
    }
    x.write(&mut text);
    text
}

/// One upstream's figures from its `/stats` report.
fn upstream(x: &mut Exposition, report: &UpstreamReport) {
    let s = &report.meter;
    let name = s.name.as_str();
    let up = [("upstream", name)];
    for o in Outcome::ALL {
        let n = s.requests_by_status.get(o.label()).copied().unwrap_or(0);
        x.add(
            "tokentap_requests_total",
            &[("upstream", name), ("status", o.label())],
            n as f64,
        );
    }
    x.add("tokentap_errors_total", &up, s.errors_total as f64);
    x.add(
        "tokentap_estimated_output_tokens_total",
        &up,
        s.estimated_output_tokens_total as f64,
    );
    x.add(
        "tokentap_input_tokens_total",
        &up,
        s.input_tokens_total as f64,
    );
    x.add(
        "tokentap_cached_input_tokens_total",
        &up,
        s.cached_input_tokens_total as f64,
    );
    x.opt(
        "tokentap_estimate_to_exact_ratio",
        &up,
        s.estimate_to_exact_ratio,
    );
    x.add(
        "tokentap_unparsed_events_total",
        &up,
        s.unparsed_events_total as f64,
    );
    x.add("tokentap_in_flight_requests", &up, s.in_flight as f64);
    x.add("tokentap_queued_requests", &up, report.queued as f64);
    x.opt(
        "tokentap_concurrency_limit",
        &up,
        report.limit.map(|l| l as f64),
    );
    for reason in crate::limit::Rejected::ALL.map(crate::limit::Rejected::label) {
        let n = report.rejected_by_reason.get(reason).copied().unwrap_or(0);
        x.add(
            "tokentap_rejected_requests_total",
            &[("upstream", name), ("reason", reason)],
            n as f64,
        );
    }
    for arm in &report.arms {
        x.add(
            "tokentap_upstream_arm_weight",
            &[("upstream", name), ("route", arm.route.as_str())],
            f64::from(arm.weight),
        );
    }
    if let Some(slo) = &report.slo {
        x.opt(
            "tokentap_slo_tpot_seconds",
            &up,
            slo.tpot_ms.map(|v| v / 1e3),
        );
        x.opt(
            "tokentap_slo_ttft_seconds",
            &up,
            slo.ttft_ms.map(|v| v / 1e3),
        );
        x.opt("tokentap_slo_e2e_seconds", &up, slo.e2e_ms.map(|v| v / 1e3));
        x.add(
            "tokentap_slo_attainment_target_ratio",
            &up,
            slo.attainment_pct / 100.0,
        );
        for &(result, n) in &s.slo_requests_total {
            x.add(
                "tokentap_slo_requests_total",
                &[("upstream", name), ("result", result)],
                n as f64,
            );
        }
        if let Some(g) = &s.goodput {
            x.opt(
                "tokentap_slo_attainment_ratio",
                &up,
                g.attainment_pct.map(|a| a / 100.0),
            );
            x.opt(
                "tokentap_goodput_requests_per_second",
                &up,
                g.requests_per_sec,
            );
            x.opt(
                "tokentap_goodput_output_tokens_per_second",
                &up,
                g.output_tokens_per_sec,
            );
        }
        x.opt(
            "tokentap_slo_current_tpot_seconds",
            &up,
            slo.current_tpot_ms.map(|v| v / 1e3),
        );
        x.opt(
            "tokentap_slo_bounded_system_tokens_per_second",
            &up,
            slo.slo_bounded_system_tps,
        );
        if let Some(role) = slo.controller.filter(|&r| r != "local") {
            let leads = role == "fleet_leader";
            x.add("tokentap_slo_fleet_leader", &up, f64::from(u8::from(leads)));
        }
    }
    if let Some(c) = &report.cost {
        let currency = c.currency.as_deref().unwrap_or("");
        let l = [("upstream", name), ("currency", currency)];
        x.add("tokentap_cost_per_hour", &l, c.per_hour);
        x.opt(
            "tokentap_cost_per_million_output_tokens",
            &l,
            c.per_million_output_tokens,
        );
        x.opt(
            "tokentap_cost_per_million_output_tokens_at_slo_bounded",
            &l,
            c.per_million_at_slo_bounded,
        );
    }
    if let Some(r) = &report.roofline {
        x.add(
            "tokentap_roofline_single_stream_tokens_per_second",
            &up,
            r.single_stream_ceiling_tps,
        );
        x.opt(
            "tokentap_model_bandwidth_utilization_ratio",
            &up,
            r.mbu_pct.map(|m| m / 100.0),
        );
    }
    if let Some(sh) = &report.shadow {
        x.add(
            "tokentap_mirror_in_flight_requests",
            &up,
            sh.in_flight as f64,
        );
        for (reason, n) in &sh.skipped_total {
            x.add(
                "tokentap_mirror_skipped_total",
                &[("upstream", name), ("reason", reason)],
                *n as f64,
            );
        }
    }
    let c = &report.capacity;
    x.opt(
        "tokentap_capacity_demand_tokens_per_second",
        &up,
        c.demand_tps,
    );
    x.opt(
        "tokentap_capacity_endpoints_needed",
        &up,
        c.endpoints_needed.map(|n| n as f64),
    );
    if let Some(b) = &report.backend {
        x.opt("tokentap_backend_running_requests", &up, b.running);
        x.opt("tokentap_backend_waiting_requests", &up, b.waiting);
        x.opt("tokentap_backend_kv_cache_percent", &up, b.kv_cache_pct);
        x.opt(
            "tokentap_backend_scrape_age_seconds",
            &up,
            b.age_ms.map(|a| a as f64 / 1e3),
        );
        x.add(
            "tokentap_backend_scrape_failures_total",
            &up,
            b.scrape_failures_total as f64,
        );
    }
    x.opt("tokentap_system_tokens_per_second", &up, s.system_tps);
    x.opt(
        "tokentap_single_stream_tokens_per_second",
        &up,
        s.single_stream_tps,
    );
    x.opt("tokentap_concurrency", &up, s.concurrency);
    x.opt(
        "tokentap_counts_exact",
        &up,
        s.counts_exact.map(|e| f64::from(u8::from(e))),
    );
}

/// A pool's endpoints by state, and each endpoint's series when the pool has at most
/// `labels` endpoints (`metrics.endpoint_labels`: the `endpoint` label stays bounded).
fn endpoints(x: &mut Exposition, report: &UpstreamReport, labels: usize) {
    let name = report.meter.name.as_str();
    let eps = &report.endpoints;
    let ejected = eps
        .iter()
        .filter(|e| e.health_checks_pass && !e.healthy)
        .count();
    let unhealthy = eps.iter().filter(|e| !e.health_checks_pass).count();
    let healthy = eps.len() - ejected - unhealthy;
    for (state, n) in [
        ("healthy", healthy),
        ("ejected", ejected),
        ("unhealthy", unhealthy),
    ] {
        x.add(
            "tokentap_endpoints",
            &[("upstream", name), ("state", state)],
            n as f64,
        );
    }
    if eps.len() > labels {
        return;
    }
    for e in eps {
        let l = [("upstream", name), ("endpoint", e.address.as_str())];
        x.add(
            "tokentap_endpoint_healthy",
            &l,
            f64::from(u8::from(e.healthy)),
        );
        x.add(
            "tokentap_endpoint_in_flight_requests",
            &l,
            e.in_flight as f64,
        );
        x.opt(
            "tokentap_endpoint_concurrency_limit",
            &l,
            e.limit.map(|v| v as f64),
        );
        x.add(
            "tokentap_endpoint_requests_total",
            &l,
            e.requests_total as f64,
        );
        x.add("tokentap_endpoint_errors_total", &l, e.errors_total as f64);
        x.add(
            "tokentap_endpoint_ejections_total",
            &l,
            e.ejections_total as f64,
        );
        x.add(
            "tokentap_endpoint_output_tokens_total",
            &l,
            e.output_tokens_total as f64,
        );
        x.opt(
            "tokentap_endpoint_system_tokens_per_second",
            &l,
            e.system_tps,
        );
        x.opt(
            "tokentap_endpoint_single_stream_tokens_per_second",
            &l,
            e.single_stream_tps,
        );
    }
}

/// One tenant's series (`metrics.tenant_labels` of them by name, the rest as `other`).
fn tenant(x: &mut Exposition, t: &crate::tenant::book::TenantStats) {
    let l = [("tenant", t.tenant.as_str())];
    x.add(
        "tokentap_tenant_requests_total",
        &l,
        t.requests_total as f64,
    );
    x.add(
        "tokentap_tenant_input_tokens_total",
        &l,
        t.input_tokens_total as f64,
    );
    x.add(
        "tokentap_tenant_output_tokens_total",
        &l,
        t.output_tokens_total as f64,
    );
    x.add("tokentap_tenant_output_tokens_per_second", &l, t.output_tps);
    x.opt("tokentap_tenant_ttft_p50_ms", &l, t.ttft_ms.p50);
    x.opt("tokentap_tenant_tpot_p50_ms", &l, t.tpot_ms.p50);
    x.add("tokentap_tenant_queue_wait_mean_ms", &l, t.queue_wait_ms);
    for (cause, n) in &t.refused_by_cause {
        let l = [("tenant", t.tenant.as_str()), ("reason", cause)];
        x.add("tokentap_tenant_rejected_total", &l, *n as f64);
    }
}

/// The per-model counters, as the meter keeps them (its first `meter::MODEL_LABELS` models by
/// name, then `other`, and `unknown`).
fn models(x: &mut Exposition, upstream: &str, models: &[(String, ModelCount)]) {
    for (model, c) in models {
        let labels = [("upstream", upstream), ("model", model.as_str())];
        x.add("tokentap_model_requests_total", &labels, c.requests as f64);
        x.add(
            "tokentap_model_output_tokens_total",
            &labels,
            c.output_tokens as f64,
        );
    }
}

/// Samples gathered by family, written with their `# HELP` and `# TYPE` in
/// [`FAMILIES`]' order.
#[derive(Default)]
struct Exposition {
    samples: IndexMap<&'static str, String>,
}

impl Exposition {
    fn add(&mut self, family: &'static str, labels: &[(&str, &str)], value: f64) {
        self.line(family, "", labels, None, value);
    }

    fn opt(&mut self, family: &'static str, labels: &[(&str, &str)], value: Option<f64>) {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            self.add(family, labels, v);
        }
    }

    fn line(
        &mut self,
        family: &'static str,
        suffix: &str,
        labels: &[(&str, &str)],
        le: Option<&str>,
        value: f64,
    ) {
        let out = self.samples.entry(family).or_default();
        let _ = write!(out, "{family}{suffix}");
        let mut sep = '{';
        for (k, v) in labels {
            let _ = write!(out, "{sep}{k}=\"{}\"", escape(v));
            sep = ',';
        }
        if let Some(le) = le {
            let _ = write!(out, "{sep}le=\"{le}\"");
            sep = ',';
        }
        if sep == ',' {
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }

    /// A histogram from one of the meter's: `per_unit` recorded units per exposed unit.
    /// Its resolution is 1%: a sample is counted at the low end of its 1% range, so one at
    /// most 1% above a bucket bound may count under it (and one exactly on it always does).
    fn histogram(
        &mut self,
        family: &'static str,
        labels: &[(&str, &str)],
        bounds: &[f64],
        h: &Histogram<u64>,
        per_unit: f64,
        sum: f64,
    ) {
        let mut counts = vec![0u64; bounds.len()];
        for v in h.iter_recorded() {
            let value = h.lowest_equivalent(v.value_iterated_to()) as f64 / per_unit;
            if let Some(b) = bounds.iter().position(|&le| value <= le) {
                counts[b] += v.count_at_value();
            }
        }
        let mut cumulative = 0;
        for (le, n) in bounds.iter().zip(counts) {
            cumulative += n;
            self.line(
                family,
                "_bucket",
                labels,
                Some(&le.to_string()),
                cumulative as f64,
            );
        }
        let total = h.len() as f64;
        self.line(family, "_bucket", labels, Some("+Inf"), total);
        self.line(family, "_sum", labels, None, sum);
        self.line(family, "_count", labels, None, total);
    }

    fn write(self, text: &mut String) {
        for (name, kind, help) in FAMILIES {
            if let Some(samples) = self.samples.get(name) {
                let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}");
                text.push_str(samples);
            }
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

    fn hist() -> hdrhistogram::Histogram<u64> {
        hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 2)
            .unwrap_or_else(|_| unreachable!())
    }

    #[test]
    fn meter_histograms_in_text_format() {
        let (mut itl, mut tpe) = (hist(), hist());
        let _ = itl.record_n(20_000, 100); // 20 ms
        let _ = itl.record_n(40_000, 10); // 40 ms
        let _ = tpe.record_n(1, 100);
        let _ = tpe.record_n(4, 10);
        let mut x = Exposition::default();
        let up = [("upstream", "a\"b")];
        x.histogram(
            "tokentap_itl_seconds",
            &up,
            &TOKEN_GAP_BUCKETS,
            &itl,
            1e6,
            2.4,
        );
        x.histogram(
            "tokentap_tokens_per_event",
            &up,
            TOKEN_BUCKETS,
            &tpe,
            1.0,
            140.0,
        );
        x.opt("tokentap_concurrency_limit", &up, None);
        x.opt("tokentap_concurrency", &up, Some(f64::NAN));
        let mut text = String::new();
        x.write(&mut text);
        for line in [
            "# TYPE tokentap_itl_seconds histogram",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.018\"} 0",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.022\"} 100",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.039\"} 100",
            "tokentap_itl_seconds_bucket{upstream=\"a\\\"b\",le=\"0.047\"} 110",
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
        assert!(
            !text.contains("NaN") && !text.contains("concurrency"),
            "{text}"
        );
    }
}
