//! Per-tenant figures: requests, tokens in and out, output T/s over the live window, TTFT
//! and TPOT of recent requests, goodput, queue wait and refusals by cause — what `/stats`
//! `tenants[]` and `/metrics` `tokentap_tenant_*` show. At most [`TENANTS`] tenants are
//! kept; past it the one seen least recently is folded into `other`, so 100,000 distinct
//! tenants cost what 1,024 do. A tenant's rate is counted in the window's slots, as the
//! meter counts an upstream's: a tenant costs the same at 10 requests a second as at
//! 100,000, over a window of 10 s as of an hour.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::Tenant;
use crate::meter::Percentiles;

/// Tenants kept apart, at most.
pub const TENANTS: usize = 1024;
/// Recent requests each tenant's TTFT and TPOT percentiles are over.
const RECENT: usize = 256;
use crate::meter::{slot_ns, Nanos, Span, SLOTS};

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

    /// The refusal's `code` (and `reason` label): the limiter's own for a slot refused
    /// (`limit::Rejected`'s, which maps onto these).
    pub fn label(self) -> &'static str {
        match self {
            Cause::QueueFull => "queue_full",
            Cause::QueueTimeout => "queue_timeout",
            Cause::PredictedWait => "predicted_wait",
            Cause::Budget => "output_token_budget",
            Cause::NoEndpoint => "no_healthy_endpoint",
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
#[derive(Debug)]
pub struct Book {
    inner: Mutex<Inner>,
    /// Where the window's slots are counted from.
    epoch: Instant,
    /// Requests whose priority header was not one of the three (kept across reloads).
    pub invalid_priority: AtomicU64,
}

impl Default for Book {
    fn default() -> Self {
        Book::new(Instant::now())
    }
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
    /// Output tokens of the requests that finished in the window.
    rate: Rate,
    recent: VecDeque<Latency>,
    seen: Option<Instant>,
}

/// A recent request's TTFT and TPOT, ms.
type Latency = (Option<f64>, Option<f64>);

/// Output tokens by when their requests finished, in the window's slots as the meter
/// keeps them ([`slot_ns`], [`Span`]): the newest filling, the rate over the time they
/// cover (between 19/20 of the window and all of it), so a steady rate reads as it is.
#[derive(Debug, Clone, Default)]
struct Rate {
    /// Each slot's length (zero until the first request); a reload that changes the
    /// window starts the count afresh.
    slot_ns: Nanos,
    /// Each slot's number since the book's epoch, and its tokens; slot `n` at `n % SLOTS`.
    slots: [(u64, u64); SLOTS],
}

impl Rate {
    fn add(&mut self, now: Nanos, window: Duration, tokens: u64) {
        let slot_ns = slot_ns(window);
        if slot_ns != self.slot_ns {
            *self = Rate {
                slot_ns,
                ..Rate::default()
            };
        }
        let n = now / slot_ns;
        let s = &mut self.slots[n as usize % SLOTS];
        if s.0 != n {
            *s = (n, 0);
        }
        s.1 += tokens;
    }

    /// Another tenant's count folded in: slot by slot, the newer slot's kept where they
    /// differ (the older one has left the window).
    fn merge(&mut self, o: &Rate) {
        if self.slot_ns == 0 {
            self.clone_from(o);
            return;
        }
        if o.slot_ns != self.slot_ns {
            return;
        }
        for (mine, theirs) in self.slots.iter_mut().zip(o.slots) {
            match mine.0.cmp(&theirs.0) {
                std::cmp::Ordering::Equal => mine.1 += theirs.1,
                std::cmp::Ordering::Less => *mine = theirs,
                std::cmp::Ordering::Greater => {}
            }
        }
    }

    /// Output tokens a second over the window ending `now`.
    fn per_second(&self, now: Nanos, window: Duration) -> f64 {
        let slot_ns = slot_ns(window);
        if slot_ns != self.slot_ns {
            return 0.0;
        }
        let span = Span::of(now, slot_ns);
        let tokens: u64 = (self.slots.iter())
            .filter(|(k, _)| span.contains(*k))
            .map(|(_, t)| t)
            .sum();
        let covered = (SLOTS as u64 - 1) * slot_ns + (now - span.newest * slot_ns);
        tokens as f64 / (covered as f64 / 1e9)
    }
}

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
        self.rate.merge(&o.rate);
    }

    fn stats(&self, tenant: &str, now: Nanos, window: Duration, all_out: u64) -> TenantStats {
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
            output_tps: (self.rate.per_second(now, window) * 10.0).round() / 10.0,
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
    /// A book whose window's slots are counted from `epoch`.
    pub fn new(epoch: Instant) -> Book {
        Book {
            inner: Mutex::default(),
            epoch,
            invalid_priority: AtomicU64::new(0),
        }
    }

    /// A request of `tenant` finished at `now`.
    pub fn served(&self, tenant: &Tenant, now: Instant, window: Duration, s: Served) {
        let at = self.at(now);
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
        f.rate.add(at, window, s.output_tokens);
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
        let at = self.at(now);
        let inner = self.lock();
        let all_out: u64 = inner.tenants.values().map(|f| f.output_tokens).sum::<u64>()
            + inner.other.output_tokens;
        let mut ranked: Vec<(&Tenant, &Figures)> = inner.tenants.iter().collect();
        ranked.sort_by(|a, b| {
            (b.1.output_tokens, b.1.requests, b.0).cmp(&(a.1.output_tokens, a.1.requests, a.0))
        });
        let mut out: Vec<TenantStats> = (ranked.iter().take(top))
            .map(|(t, f)| f.stats(t, at, window, all_out))
            .collect();
        let mut rest = inner.other.clone();
        for (_, f) in ranked.iter().skip(top) {
            rest.add(f);
        }
        if rest.requests > 0 || rest.refused.iter().any(|&n| n > 0) {
            out.push(rest.stats("other", at, window, all_out));
        }
        out
    }

    /// `now` on the slots' clock: nanoseconds since the epoch (584 years of them).
    fn at(&self, now: Instant) -> Nanos {
        now.saturating_duration_since(self.epoch).as_nanos() as Nanos
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
        let (now, w) = (Instant::now(), Duration::from_secs(10));
        let b = Book::new(now);
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
        // 120 tokens in the first instant of the newest slot: over 19 slots of 0.5 s.
        assert_eq!(first.output_tps, 12.6);
        assert_eq!(first.goodput_pct, Some(75.0));
        assert_eq!(first.queue_wait_ms, 4.0);
        assert_eq!(other.tenant, "other");
        assert_eq!(other.refused_by_cause.get("output_token_budget"), Some(&1));
    }

    /// 10 tokens every 100 ms, read at any moment: 100 a second, over windows of 10 s and
    /// of an hour (a million requests, in 20 slots), and nothing once the window has
    /// passed; folded into `other`, a tenant's rate goes with it.
    #[test]
    fn a_tenant_s_rate_is_counted_in_the_window_s_slots() {
        let epoch = Instant::now();
        let t: Tenant = std::sync::Arc::from("a");
        for (window, requests) in [(10, 600), (3_600, 1_000_000)] {
            let (b, w) = (Book::new(epoch), Duration::from_secs(window));
            let at = |i: u64| epoch + Duration::from_millis(100 * i);
            let one = Served {
                output_tokens: 10,
                ..Served::default()
            };
            for i in 0..requests {
                b.served(&t, at(i), w, one);
            }
            for late in [0, 30, 99] {
                let now = at(requests - 1) + Duration::from_millis(late);
                let tps = b.stats(now, w, 1)[0].output_tps;
                assert!((tps - 100.0).abs() <= 1.0, "{window} s, +{late} ms: {tps}");
            }
            let gone = at(requests) + w + Duration::from_secs(1);
            assert_eq!(b.stats(gone, w, 1)[0].output_tps, 0.0);
            // A reload to another window starts the count afresh.
            assert_eq!(b.stats(at(requests), w * 2, 1)[0].output_tps, 0.0);
        }
        // Folded into `other` with the others, its rate goes with it.
        let (b, w) = (Book::new(epoch), Duration::from_secs(10));
        for i in 0..=TENANTS as u64 {
            let name: Tenant = std::sync::Arc::from(format!("t{i}"));
            for k in 0..100 {
                let at = epoch + Duration::from_millis(100 * k);
                b.served(
                    &name,
                    at,
                    w,
                    Served {
                        output_tokens: 1,
                        ..Served::default()
                    },
                );
            }
        }
        let now = epoch + Duration::from_millis(9_950);
        let s = b.stats(now, w, 0);
        assert_eq!(s[0].tenant, "other");
        let tps = |tokens: f64| (tokens / 9.95 * 10.0).round() / 10.0;
        assert_eq!(s[0].output_tps, tps((TENANTS + 1) as f64 * 100.0));
        // Shown apart from the top ones, with nothing folded yet: as it is.
        let (b, two) = (Book::new(epoch), [Tenant::from("x"), Tenant::from("y")]);
        for k in 0..100 {
            let at = epoch + Duration::from_millis(100 * k);
            for (t, n) in two.iter().zip([2, 1]) {
                b.served(
                    t,
                    at,
                    w,
                    Served {
                        output_tokens: n,
                        ..Served::default()
                    },
                );
            }
        }
        let s = b.stats(now, w, 1);
        assert_eq!((s[0].output_tps, s[1].output_tps), (tps(200.0), tps(100.0)));
        assert_eq!(s[1].tenant, "other");
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
