//! Per-tenant figures: requests, tokens in and out, output T/s over the live window, TTFT
//! and TPOT of recent requests, goodput, queue wait and refusals by cause — what `/stats`
//! `tenants[]` and `/metrics` `tokentap_tenant_*` show. At most [`TENANTS`] tenants are
//! kept; past it the one seen least recently is folded into `other`, so 100,000 distinct
//! tenants cost what 1,024 do.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::Tenant;
use crate::limit::Rejected;
use crate::meter::Percentiles;

/// Tenants kept apart, at most.
pub const TENANTS: usize = 1024;
/// Recent requests each tenant's TTFT and TPOT percentiles are over.
const RECENT: usize = 256;
/// Finished requests `other` keeps for its rate, at most.
const OTHER_FINISHED: usize = 4096;

/// Why a tenant's request was refused (`refused_by_cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    QueueFull,
    QueueTimeout,
    PredictedWait,
    Budget,
    NoEndpoint,
}

impl Cause {
    pub const ALL: [Cause; 5] = [
        Cause::QueueFull,
        Cause::QueueTimeout,
        Cause::PredictedWait,
        Cause::Budget,
        Cause::NoEndpoint,
    ];

    /// The refusal's `code` (and `reason` label): the limiter's own for a slot refused.
    pub fn label(self) -> &'static str {
        match self {
            Cause::QueueFull => Rejected::QueueFull.label(),
            Cause::QueueTimeout => Rejected::QueueTimeout.label(),
            Cause::PredictedWait => Rejected::PredictedWait.label(),
            Cause::Budget => "output_token_budget",
            Cause::NoEndpoint => "no_healthy_endpoint",
        }
    }
}

impl From<Rejected> for Cause {
    fn from(why: Rejected) -> Cause {
        match why {
            Rejected::QueueFull => Cause::QueueFull,
            Rejected::QueueTimeout => Cause::QueueTimeout,
            Rejected::PredictedWait => Cause::PredictedWait,
        }
    }
}

/// One finished request of a tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Served {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub queue_ms: f64,
    /// Judged against its upstream's SLO: `Some(true)` good.
    pub good: Option<bool>,
}

/// Every tenant's figures.
#[derive(Debug, Default)]
pub struct Book {
    inner: Mutex<Inner>,
    /// Requests whose priority header was not one of the three (kept across reloads).
    pub invalid_priority: AtomicU64,
}

#[derive(Debug, Default)]
struct Inner {
    tenants: HashMap<Tenant, Figures, foldhash::fast::RandomState>,
    /// Tenants folded in past [`TENANTS`].
    other: Figures,
}

#[derive(Debug, Clone, Default)]
struct Figures {
    requests: u64,
    input_tokens: u64,
    output_tokens: u64,
    good: u64,
    judged: u64,
    queue_ms: f64,
    refused: [u64; 5],
    /// (when, output tokens) of recent requests, for the window's rate.
    finished: VecDeque<(Instant, u64)>,
    recent: VecDeque<Latency>,
    seen: Option<Instant>,
}

/// A recent request's TTFT and TPOT, ms.
type Latency = (Option<f64>, Option<f64>);

/// What `/stats` shows of a tenant.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantStats {
    pub tenant: String,
    pub requests_total: u64,
    pub input_tokens_total: u64,
    pub output_tokens_total: u64,
    /// Its share of all tenants' output tokens, percent (its share of the cost).
    pub output_share_pct: f64,
    /// Its output tokens a second over the live window (by when its requests finished).
    pub output_tps: f64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    /// Its requests judged good against their upstream's SLO, percent (`null`: none
    /// judged).
    pub goodput_pct: Option<f64>,
    /// Mean wait for a slot, ms.
    pub queue_wait_ms: f64,
    pub refused_total: u64,
    pub refused_by_cause: std::collections::BTreeMap<&'static str, u64>,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.requests += o.requests;
        self.input_tokens += o.input_tokens;
        self.output_tokens += o.output_tokens;
        self.good += o.good;
        self.judged += o.judged;
        self.queue_ms += o.queue_ms;
        for (a, b) in self.refused.iter_mut().zip(o.refused) {
            *a += b;
        }
        self.finished.extend(o.finished.iter().copied());
    }

    fn stats(&self, tenant: &str, now: Instant, window: Duration, all_out: u64) -> TenantStats {
        // (`other`'s are several tenants' together, not in one order.)
        let cutoff = now.checked_sub(window);
        let in_window: u64 = (self.finished.iter())
            .filter(|(at, _)| cutoff.is_none_or(|c| *at >= c))
            .map(|(_, n)| n)
            .sum();
        let pct = |f: fn(&Latency) -> Option<f64>| {
            let mut v: Vec<f64> = self.recent.iter().filter_map(f).collect();
            Percentiles::of(&mut v)
        };
        TenantStats {
            tenant: tenant.to_owned(),
            requests_total: self.requests,
            input_tokens_total: self.input_tokens,
            output_tokens_total: self.output_tokens,
            output_share_pct: if all_out == 0 {
                0.0
            } else {
                (1000.0 * self.output_tokens as f64 / all_out as f64).round() / 10.0
            },
            output_tps: (in_window as f64 / window.as_secs_f64().max(1.0) * 10.0).round() / 10.0,
            ttft_ms: pct(|r| r.0),
            tpot_ms: pct(|r| r.1),
            goodput_pct: (self.judged > 0)
                .then(|| (1000.0 * self.good as f64 / self.judged as f64).round() / 10.0),
            queue_wait_ms: if self.requests == 0 {
                0.0
            } else {
                (self.queue_ms / self.requests as f64 * 10.0).round() / 10.0
            },
            refused_total: self.refused.iter().sum(),
            refused_by_cause: (Cause::ALL.iter())
                .zip(self.refused)
                .filter(|(_, n)| *n > 0)
                .map(|(c, n)| (c.label(), n))
                .collect(),
        }
    }
}

impl Book {
    /// A request of `tenant` finished at `now`.
    pub fn served(&self, tenant: &Tenant, now: Instant, window: Duration, s: Served) {
        let mut inner = self.lock();
        let f = inner.figures(tenant, now);
        f.requests += 1;
        f.input_tokens += s.input_tokens;
        f.output_tokens += s.output_tokens;
        f.queue_ms += s.queue_ms;
        if let Some(good) = s.good {
            f.judged += 1;
            f.good += u64::from(good);
        }
        // Older than the window: one subtraction, then comparisons.
        let cutoff = now.checked_sub(window);
        while (f.finished.front()).is_some_and(|(at, _)| cutoff.is_some_and(|c| *at < c)) {
            f.finished.pop_front();
        }
        f.finished.push_back((now, s.output_tokens));
        if f.recent.len() == RECENT {
            f.recent.pop_front();
        }
        f.recent.push_back((s.ttft_ms, s.tpot_ms));
    }

    /// A request of `tenant` was refused for `cause`.
    pub fn refused(&self, tenant: &Tenant, now: Instant, cause: Cause) {
        self.lock().figures(tenant, now).refused[cause as usize] += 1;
    }

    /// The figures of the `top` tenants by output tokens (then by requests), and of all the
    /// others together as `other` (when there are any).
    pub fn stats(&self, now: Instant, window: Duration, top: usize) -> Vec<TenantStats> {
        let inner = self.lock();
        let all_out: u64 = inner.tenants.values().map(|f| f.output_tokens).sum::<u64>()
            + inner.other.output_tokens;
        let mut ranked: Vec<(&Tenant, &Figures)> = inner.tenants.iter().collect();
        ranked.sort_by(|a, b| {
            (b.1.output_tokens, b.1.requests, b.0).cmp(&(a.1.output_tokens, a.1.requests, a.0))
        });
        let mut out: Vec<TenantStats> = (ranked.iter().take(top))
            .map(|(t, f)| f.stats(t, now, window, all_out))
            .collect();
        let mut rest = inner.other.clone();
        for (_, f) in ranked.iter().skip(top) {
            rest.add(f);
        }
        if rest.requests > 0 || rest.refused.iter().any(|&n| n > 0) {
            out.push(rest.stats("other", now, window, all_out));
        }
        out
    }

    /// Tenants kept apart now.
    pub fn len(&self) -> usize {
        self.lock().tenants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Inner {
    /// `tenant`'s figures, made room for past [`TENANTS`] by folding the one seen least
    /// recently into `other`.
    fn figures(&mut self, tenant: &Tenant, now: Instant) -> &mut Figures {
        // (The length first: under the bound one lookup, not two.)
        if self.tenants.len() >= TENANTS && !self.tenants.contains_key(tenant) {
            let oldest = (self.tenants.iter())
                .min_by_key(|(_, f)| f.seen)
                .map(|(t, _)| t.clone());
            if let Some(f) = oldest.and_then(|t| self.tenants.remove(&t)) {
                self.other.add(&f);
                // Bounded: under heavy churn its rate counts the latest only.
                let excess = self.other.finished.len().saturating_sub(OTHER_FINISHED);
                self.other.finished.drain(..excess);
            }
        }
        let f = self.tenants.entry(tenant.clone()).or_default();
        f.seen = Some(now);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn figures_per_tenant_and_the_rest_as_other() {
        let (b, now, w) = (Book::default(), Instant::now(), Duration::from_secs(10));
        let (a, c): (Tenant, Tenant) = (Arc::from("a"), Arc::from("c"));
        for i in 0..4 {
            b.served(
                &a,
                now,
                w,
                Served {
                    input_tokens: 10,
                    output_tokens: 30,
                    ttft_ms: Some(10.0 * f64::from(i + 1)),
                    tpot_ms: Some(20.0),
                    queue_ms: 4.0,
                    good: Some(i < 3),
                },
            );
        }
        b.served(
            &c,
            now,
            w,
            Served {
                output_tokens: 10,
                ..Served::default()
            },
        );
        b.refused(&c, now, Cause::Budget);
        let s = b.stats(now, w, 1);
        assert_eq!(s.len(), 2);
        let (first, other) = (&s[0], &s[1]);
        assert_eq!(first.tenant, "a");
        assert_eq!((first.requests_total, first.output_tokens_total), (4, 120));
        assert_eq!(first.output_share_pct, 92.3);
        assert_eq!(first.output_tps, 12.0);
        assert_eq!(first.goodput_pct, Some(75.0));
        assert_eq!(first.queue_wait_ms, 4.0);
        assert_eq!(other.tenant, "other");
        assert_eq!(other.refused_by_cause.get("output_token_budget"), Some(&1));
    }

    #[test]
    fn a_hundred_thousand_tenants_keep_the_book_at_its_bound() {
        let (b, now, w) = (Book::default(), Instant::now(), Duration::from_secs(10));
        for i in 0..100_000u64 {
            let t: Tenant = Arc::from(format!("t{i}"));
            b.served(
                &t,
                now + Duration::from_nanos(i),
                w,
                Served {
                    output_tokens: 1,
                    ..Served::default()
                },
            );
        }
        assert_eq!(b.len(), TENANTS);
        let s = b.stats(now, w, 20);
        assert_eq!(s.len(), 21);
        let total: u64 = s.iter().map(|t| t.output_tokens_total).sum();
        assert_eq!(total, 100_000);
    }
}
