//! `[metrics]` and `[compare]`: the live windows, the curve's, the labels, and the A/B
//! comparison's window.

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsFile {
    /// The sliding window of the live figures, seconds. Default 10.
    pub window_secs: u64,
    /// Largest SSE event metered, bytes; larger ones are forwarded and counted as unparsed.
    /// Default 1 MiB.
    pub max_event_bytes: usize,
    /// Count requests and output tokens per model (`tokentap_model_*`): the first 10
    /// models of each upstream get their name as the `model` label, later ones `other`.
    /// Default false.
    pub model_label: bool,
    /// How much recent time the concurrency→TPOT curve of `/stats` covers, seconds.
    /// Default 900.
    pub curve_window_secs: u64,
    /// Per-endpoint series on `/metrics` (an `endpoint` label) for pools of at most this
    /// many endpoints; a larger pool gets its pool series only. 0: none. Default 64.
    pub endpoint_labels: usize,
    /// Tenants with a `tenant` label of their own on `/metrics` (those with the most output
    /// tokens); the others are summed as `other`. Default 20.
    pub tenant_labels: usize,
    /// The OpenTelemetry GenAI histograms too (`gen_ai_server_time_to_first_token_seconds`,
    /// `…_time_per_output_token_seconds`, `…_request_duration_seconds`,
    /// `gen_ai_client_token_usage`). Default false.
    pub semconv: bool,
}

impl Default for MetricsFile {
    fn default() -> Self {
        MetricsFile {
            window_secs: 10,
            max_event_bytes: 1 << 20,
            model_label: false,
            curve_window_secs: 900,
            endpoint_labels: 64,
            tenant_labels: 20,
            semconv: false,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompareFile {
    /// How far back `/compare` looks, seconds. Default 600.
    pub window_secs: u64,
}

impl Default for CompareFile {
    fn default() -> Self {
        CompareFile { window_secs: 600 }
    }
}
