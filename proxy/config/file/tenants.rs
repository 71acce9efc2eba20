//! `[tenants]`: who a request belongs to, its priority, its weight in the fair queue, and
//! its output-token budget; `[[tenants.override]]` for one tenant.

use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use crate::config::Problems;
use crate::tenant::{Priority, TenantsConfig, Terms, AGEING_MS};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsFile {
    /// `header:NAME`: the header that names a request's tenant (`authorization`, an API
    /// key, or any header holding a secret is reduced to a stable hash, `key-…`). No header
    /// on a request: the tenant `default`. Default: none (every request one tenant, FIFO).
    #[serde(default)]
    pub key: Option<String>,
    /// `header:NAME`: the header that gives a request's priority, `high`, `normal` or `low`
    /// (another value: `normal`, counted). Default: none (the tenant's, else `normal`).
    #[serde(default)]
    pub priority: Option<String>,
    /// Each tenant's weight in the fair queue. Default 1.
    #[serde(default)]
    pub weight: Option<f64>,
    /// Each tenant's output tokens a minute, a token bucket. Default: none (no budget).
    #[serde(default)]
    pub output_tokens_per_minute: Option<u64>,
    /// A `normal` or `low` request that has waited this long may go before the bands above
    /// it: one such jump at most every `ageing_ms` and every 16 slots. Default 5000.
    #[serde(default)]
    pub ageing_ms: Option<u64>,
    /// One tenant's own weight, priority and budget.
    #[serde(default)]
    pub r#override: Vec<OverrideFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverrideFile {
    /// The tenant as `/stats` names it: the header's value, or `key-…` for a secret.
    pub tenant: String,
    #[serde(default)]
    pub weight: Option<f64>,
    /// `high`, `normal` or `low`: its requests' priority when they give none.
    #[serde(default)]
    pub priority: Option<String>,
    #[serde(default)]
    pub output_tokens_per_minute: Option<u64>,
}

impl TenantsFile {
    /// `[tenants]` checked.
    pub(super) fn tenants(&self, p: &mut Problems) -> TenantsConfig {
        let header = |p: &mut Problems, key: &str, v: &Option<String>| -> Option<HeaderName> {
            let v = v.as_deref()?;
            let name = v.strip_prefix("header:").and_then(|n| n.parse().ok());
            if name.is_none() {
                p.add(
                    format!("tenants.{key}"),
                    format!("must be header:NAME, like header:x-api-key, not `{v}`"),
                );
            }
            name
        };
        let key = header(p, "key", &self.key);
        let priority = header(p, "priority", &self.priority);
        let weight = |p: &mut Problems, at: &str, w: Option<f64>| {
            let w = w.unwrap_or(1.0);
            if !(w.is_finite() && w > 0.0 && w <= 1e6) {
                p.add(at, format!("must be above 0 and at most 1000000, not {w}"));
            }
            w
        };
        let budget = |p: &mut Problems, at: &str, b: Option<u64>| {
            if b == Some(0) {
                p.add(at, "must be at least 1");
            }
            b
        };
        let default = Terms {
            weight: weight(p, "tenants.weight", self.weight),
            priority: None,
            output_tokens_per_minute: budget(
                p,
                "tenants.output_tokens_per_minute",
                self.output_tokens_per_minute,
            ),
        };
        let ageing_ms = self.ageing_ms.unwrap_or(AGEING_MS);
        if !(10..=3_600_000).contains(&ageing_ms) {
            p.add("tenants.ageing_ms", "must be between 10 and 3600000");
        }
        let mut overrides = Vec::new();
        for (i, o) in self.r#override.iter().enumerate() {
            let at = |k: &str| format!("tenants.override[{i}].{k}");
            if o.tenant.is_empty() || o.tenant.len() > crate::tenant::MAX_NAME {
                p.add(
                    at("tenant"),
                    format!("must be 1 to {} bytes", crate::tenant::MAX_NAME),
                );
            }
            if o.tenant.eq_ignore_ascii_case("other") {
                p.add(
                    at("tenant"),
                    "`other` is reserved: /metrics folds the tenants past metrics.tenant_labels under it",
                );
            }
            if self.r#override[..i].iter().any(|e| e.tenant == o.tenant) {
                p.add(at("tenant"), format!("`{}` is overridden twice", o.tenant));
            }
            let priority = o.priority.as_deref().and_then(|v| {
                let parsed = Priority::parse(v.as_bytes());
                if parsed.is_none() {
                    p.add(
                        at("priority"),
                        format!("must be high, normal or low, not `{v}`"),
                    );
                }
                parsed
            });
            overrides.push((
                o.tenant.clone(),
                Terms {
                    weight: o
                        .weight
                        .map_or(default.weight, |w| weight(p, &at("weight"), Some(w))),
                    priority,
                    output_tokens_per_minute: budget(
                        p,
                        &at("output_tokens_per_minute"),
                        o.output_tokens_per_minute,
                    )
                    .or(default.output_tokens_per_minute),
                },
            ));
        }
        if key.is_none() && !overrides.is_empty() {
            p.add(
                "tenants.override",
                "names tenants: give tenants.key, the header that names them",
            );
        }
        TenantsConfig {
            key,
            priority,
            default,
            overrides,
            ageing: Duration::from_millis(ageing_ms),
        }
    }
}
