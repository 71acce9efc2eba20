//! What a rollout's shadow costs and what it serves: the copies that match `to`'s load to
//! `from`'s at a share (and what they cost `to`, as `tokentap check` says it), and the
//! traffic counts `GET /rollout` reads its served share and copies a second from.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;

use super::{RolloutConfig, State};
use crate::config::Route;
use crate::meter::Nanos;

/// The rollout's traffic since it began: live requests sent to each arm, and copies sent
/// to `to` or not sent.
#[derive(Default)]
pub(super) struct Traffic {
    pub(super) from: AtomicU64,
    pub(super) to: AtomicU64,
    pub(super) copies: AtomicU64,
    pub(super) skipped: AtomicU64,
}

/// [`Traffic`] read at one tick.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Seen {
    pub(super) at: Nanos,
    pub(super) from: u64,
    pub(super) to: u64,
    pub(super) copies: u64,
}

/// The copies that bring `to`'s load to `from`'s at a share of `p` percent: `to` serves
/// p, `from` 100 − p, so copies of (100 − 2p) ÷ (100 − p) of `from`'s requests.
pub(super) fn shadow(state: State, p: f64) -> f64 {
    if state.done() || p >= 50.0 {
        return 0.0;
    }
    (100.0 * (100.0 - 2.0 * p) / (100.0 - p) * 10.0).round() / 10.0
}

/// What the copies cost `to` at a share of `p` percent, in copies per request the two arms
/// serve: `from` serves 100 − p of each 100 and `to` is sent (100 − 2p) ÷ (100 − p) of
/// those as copies, so 100 − 2p of each 100 (0.8 at 10%: 80 copies a second for every 100
/// requests a second the pair serves). `mirror_percent` caps them (a mirror to `to` that
/// is the shadow).
pub fn copies_per_request(p: f64, mirror_percent: f64) -> f64 {
    if !(0.0..50.0).contains(&p) {
        return 0.0;
    }
    let of_from = ((100.0 - 2.0 * p) / (100.0 - p)).min(mirror_percent / 100.0);
    of_from * (100.0 - p) / 100.0
}

/// What a rollout's shadow copies cost its `to`, in requests a second, as `tokentap check`
/// says it: per 100 requests a second the two arms serve, at each step under half
/// (`copies to b: 80 requests a second at 10%, …`); and the cap that bounds them, if `to`
/// has one.
pub fn copies_cost(config: &crate::config::Config, r: &Route, ro: &RolloutConfig) -> String {
    let to = &config.upstreams[ro.to];
    let percent = (r.mirrors.iter())
        .find(|m| m.upstream == ro.to)
        .map_or(100.0, |m| m.percent);
    let steps: Vec<String> = (ro.steps.iter())
        .filter(|&&p| p < 50.0)
        .map(|&p| {
            let copies = 100.0 * copies_per_request(p, percent);
            format!("{copies:.0} requests a second at {p}%")
        })
        .collect();
    let cost = if steps.is_empty() {
        format!("no copies: every step gives {} half or more", to.name)
    } else {
        format!(
            "copies to {}: {}, for every 100 a second that {} and {} serve (none from 50%)",
            to.name,
            steps.join(", "),
            config.upstreams[ro.from].name,
            to.name,
        )
    };
    let cap = match (to.max_concurrency, &to.slo) {
        (_, Some(_)) => format!(
            "; they take slots of {}'s adaptive cap, or are not sent",
            to.name
        ),
        (Some(n), None) => format!(
            "; they take slots of {}'s max_concurrency = {n} when free at once, or are not sent",
            to.name
        ),
        (None, None) => String::new(),
    };
    format!("{cost}{cap}")
}

/// Over the readings `seen` (oldest first): `to`'s share of the live requests the two arms
/// were sent, percent, and the copies sent a second; `None` where there is nothing to say
/// (fewer than two readings, no live request).
pub(super) fn rates(seen: &VecDeque<Seen>) -> (Option<f64>, Option<f64>) {
    let (Some(first), Some(last)) = (seen.front(), seen.back()) else {
        return (None, None);
    };
    let secs = last.at.saturating_sub(first.at) as f64 / 1e9;
    if secs <= 0.0 {
        return (None, None);
    }
    let from = last.from.saturating_sub(first.from);
    let to = last.to.saturating_sub(first.to);
    let served = (from + to > 0).then(|| {
        let pct = 100.0 * to as f64 / (from + to) as f64;
        (pct * 10.0).round() / 10.0
    });
    let rps = last.copies.saturating_sub(first.copies) as f64 / secs;
    (served, Some((rps * 10.0).round() / 10.0))
}
