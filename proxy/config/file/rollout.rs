//! A route's `rollout` (a progressive rollout from one upstream of its split to another,
//! stepped on the measured comparison) and `[rollouts]` (where their state is kept).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{Problems, RolloutConfig};

/// The default of `rollout.steps`: `to`'s share of the route's requests at each step.
pub(crate) const STEPS: [f64; 3] = [10.0, 50.0, 100.0];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutFile {
    /// The upstream of the split traffic moves from. Required.
    #[serde(default)]
    pub from: String,
    /// The upstream of the split traffic moves to. Required.
    #[serde(default)]
    pub to: String,
    /// `to`'s percent of the route's requests at each step, increasing, the last 100.
    /// Default [10, 50, 100].
    #[serde(default)]
    pub steps: Option<Vec<f64>>,
    /// Seconds between evaluations. Default 60.
    #[serde(default)]
    pub every_secs: Option<u64>,
    /// `to` advances only while its TPOT is within this ratio of `from`'s with 95%
    /// confidence, at matched concurrency; past it with 95% confidence, it is rolled back.
    /// Default 1.05.
    #[serde(default)]
    pub max_tpot_ratio: Option<f64>,
    /// The same for TTFT. Default: none (TTFT not judged).
    #[serde(default)]
    pub max_ttft_ratio: Option<f64>,
    /// `to`'s error rate may exceed `from`'s by this many points; past it, rolled back.
    /// Default 1.
    #[serde(default)]
    pub max_error_pct: Option<f64>,
    /// Requests of each upstream since the step began before an evaluation judges.
    /// Default 50.
    #[serde(default)]
    pub min_requests: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutsFile {
    /// A file the rollouts' state is written to at each transition and resumed from at
    /// start. Default: none (a restart starts each rollout afresh).
    #[serde(default)]
    pub state_file: Option<PathBuf>,
}

/// `at` (`route[i].rollout`) checked against the route's split and made the runtime's.
pub(super) fn rollout(
    at: &str,
    r: &RolloutFile,
    split: &[(usize, u32)],
    index: &impl Fn(&str) -> Option<usize>,
    p: &mut Problems,
) -> Option<RolloutConfig> {
    let key = |f: &str| format!("{at}.{f}");
    let before = p.len();
    let mut arm = |f: &str, name: &str| match index(name) {
        _ if name.is_empty() => {
            p.add(key(f), "is required: an upstream of the route's split");
            None
        }
        None => {
            p.add(key(f), format!("unknown upstream `{name}`"));
            None
        }
        Some(u) if !split.iter().any(|&(s, _)| s == u) => {
            p.add(
                key(f),
                format!("`{name}` is not in the route's split: a rollout moves traffic between two of its upstreams"),
            );
            None
        }
        Some(u) => Some(u),
    };
    let (from, to) = (arm("from", &r.from), arm("to", &r.to));
    if from.is_some() && from == to {
        p.add(
            key("to"),
            "is `from`: a rollout moves traffic between two upstreams",
        );
    }
    let steps = r.steps.clone().unwrap_or_else(|| STEPS.to_vec());
    if steps.is_empty() {
        p.add(key("steps"), "names no step");
    } else if steps.iter().any(|&s| !(s > 0.0 && s <= 100.0)) {
        p.add(
            key("steps"),
            "each step must be above 0 and at most 100 (percent)",
        );
    } else if steps.windows(2).any(|w| w[1] <= w[0]) {
        p.add(key("steps"), format!("must increase: {steps:?}"));
    } else if steps.last() != Some(&100.0) {
        p.add(
            key("steps"),
            "must end at 100: a rollout ends with `to` serving everything",
        );
    } else if steps.len() == 1 {
        p.add(
            key("steps"),
            "needs a step below 100 first: `from` must serve a share for `to` to be compared with",
        );
    }
    let every = r.every_secs.unwrap_or(60);
    if every == 0 {
        p.add(key("every_secs"), "must be at least 1");
    }
    let ratio = |f: &str, v: Option<f64>, p: &mut Problems| {
        if let Some(v) = v.filter(|v| !(*v >= 1.0 && *v <= 10.0)) {
            p.add(
                key(f),
                format!("must be between 1 and 10 (a ratio of to's to from's), not {v}"),
            );
        }
    };
    ratio("max_tpot_ratio", r.max_tpot_ratio, p);
    ratio("max_ttft_ratio", r.max_ttft_ratio, p);
    let max_error_pct = r.max_error_pct.unwrap_or(1.0);
    if !(0.0..=100.0).contains(&max_error_pct) {
        p.add(key("max_error_pct"), "must be between 0 and 100 (points)");
    }
    let min_requests = r.min_requests.unwrap_or(50);
    if min_requests == 0 {
        p.add(key("min_requests"), "must be at least 1");
    }
    let (from, to) = (from?, to?);
    (p.len() == before).then(|| RolloutConfig {
        from,
        to,
        steps,
        every: Duration::from_secs(every),
        max_tpot_ratio: r.max_tpot_ratio.unwrap_or(1.05),
        max_ttft_ratio: r.max_ttft_ratio,
        max_error_pct,
        min_requests,
    })
}
