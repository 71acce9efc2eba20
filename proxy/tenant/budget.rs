//! Output-token budgets (`output_tokens_per_minute`): a token bucket per tenant, as large as
//! a minute's budget and refilled at its rate. A request reserves what it may generate when
//! it is admitted (its `max_tokens`, else its tenant's recent mean; at most the bucket) and
//! gives back what it did not use when it ends, on the exact count; one that finds too
//! little left is refused with 429, `Retry-After` and OpenAI's `x-ratelimit-*-tokens`
//! headers. The bucket may go below zero (a request that ran past its reservation): the
//! debt is paid before the next request of that tenant is let in.
//!
//! With `[cluster]` the bucket is the fleet's, in Redis ([`crate::limit::fleet`]): every
//! tokentap spends one budget. With Redis away each spends its share (the budget over the
//! replicas seen) in a bucket of its own, and the fleet's again when Redis answers; a
//! settlement of the fleet's bucket that could not reach Redis is kept and applied then,
//! exactly once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{Tenant, Who};

/// Buckets kept before full ones are forgotten (a full bucket says nothing a new one does
/// not).
const BUCKETS: usize = 16_384;

/// Every tenant's bucket.
#[derive(Default)]
pub struct Budgets {
    buckets: Mutex<HashMap<Tenant, Bucket, foldhash::fast::RandomState>>,
    /// The fleet's Redis, with `[cluster]`.
    fleet: Option<Arc<dyn FleetBuckets>>,
}

/// The fleet's buckets, one a tenant in Redis, as the budgets spend them. The Redis wire
/// implements it (`limit::fleet`) and calls down here for what a budget is, never the
/// other way.
#[async_trait::async_trait]
pub trait FleetBuckets: Send + Sync {
    /// Redis is away: each replica spends its share of every budget locally.
    fn degraded(&self) -> bool;
    /// Replicas seen alive in the last minute (this one included).
    fn replicas(&self) -> u64;
    /// Takes `want` of `tenant`'s bucket of `per_minute` tokens a minute; `Err`: Redis is
    /// away (the fleet is marked degraded).
    async fn take(&self, tenant: &str, per_minute: u64, want: u64) -> anyhow::Result<Taken>;
    /// Gives `amount` back to `tenant`'s bucket (negative: takes it), exactly once, now or
    /// when Redis answers again.
    fn give(self: Arc<Self>, tenant: &str, per_minute: u64, amount: i64);
}

/// What the fleet's bucket said to a reservation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Taken {
    pub granted: bool,
    /// Tokens left in the bucket after it.
    pub left: f64,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
    per_minute: u64,
    /// Mean output tokens of its recent requests (what a request without `max_tokens`
    /// reserves).
    mean: f64,
    /// Reservations not yet settled.
    open: u32,
}

/// A request's reservation, settled when it ends ([`Reservation::settle`]; dropped
/// unsettled, as if it generated nothing).
pub struct Reservation {
    budgets: Arc<Budgets>,
    tenant: Tenant,
    reserved: u64,
    /// Taken from the fleet's bucket (of this size a minute), else from the local one.
    fleet: Option<u64>,
    settled: bool,
}

impl Reservation {
    /// Its request ended with `tokens` output tokens.
    pub fn settle(mut self, tokens: u64) {
        self.settled = true;
        self.give_back(tokens);
    }

    /// Its request ended with a body tokentap could not read: what it generated is
    /// unknown, so the reservation is spent, not given back (at least `tokens`, what was
    /// counted before the body became unreadable).
    pub fn keep(self, tokens: u64) {
        let spent = self.reserved.max(tokens);
        self.settle(spent);
    }

    fn give_back(&self, tokens: u64) {
        let b = &self.budgets;
        match (self.fleet, &b.fleet) {
            (Some(per_minute), Some(link)) => {
                b.learn(&self.tenant, tokens);
                // In the background; kept until Redis confirms it, replayed once.
                let back = self.reserved as i64 - tokens as i64;
                if back != 0 {
                    Arc::clone(link).give(&self.tenant, per_minute, back);
                }
            }
            _ => b.settle(&self.tenant, self.reserved, tokens),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.give_back(0);
        }
    }
}

/// A request refused for its tenant's budget: what the headers say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusal {
    /// `x-ratelimit-limit-tokens`: the budget a minute.
    pub limit: u64,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining: u64,
    /// `x-ratelimit-reset-tokens` and `Retry-After`: until the reservation fits.
    pub reset: Duration,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let cap = self.per_minute as f64;
        let secs = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + secs * cap / 60.0).min(cap);
        self.at = now;
    }
}

impl Budgets {
    /// The budgets of a tokentap, spent in the fleet's Redis with `fleet`.
    pub fn new(fleet: Option<Arc<dyn FleetBuckets>>) -> Budgets {
        Budgets {
            buckets: Mutex::default(),
            fleet,
        }
    }

    /// Reserves `max_tokens` (or the tenant's mean) of `who`'s budget: in the fleet's
    /// bucket with `[cluster]` (this replica's share of it, locally, while Redis is away);
    /// `Ok(None)`: it has none.
    pub async fn reserve(
        self: &Arc<Self>,
        who: &Who,
        max_tokens: Option<u64>,
    ) -> Result<Option<Reservation>, Refusal> {
        let Some(per_minute) = who.budget else {
            return Ok(None);
        };
        let Some(link) = &self.fleet else {
            return self.reserve_here(who, per_minute, max_tokens, Instant::now());
        };
        if !link.degraded() {
            let want = self.want(who, per_minute, max_tokens);
            match link.take(&who.tenant, per_minute, want).await {
                Ok(t) if t.granted => {
                    return Ok(Some(Reservation {
                        budgets: Arc::clone(self),
                        tenant: who.tenant.clone(),
                        reserved: want,
                        fleet: Some(per_minute),
                        settled: false,
                    }))
                }
                Ok(t) => return Err(Refusal::short(per_minute, t.left, want)),
                // Redis away: degraded (logged); this replica's share from now on.
                Err(_) => {}
            }
        }
        let share = (per_minute / link.replicas()).max(1);
        self.reserve_here(who, share, max_tokens, Instant::now())
    }

    /// [`Budgets::reserve`] when it needs no Redis (no `[cluster]`): answered at once;
    /// `None`: the fleet's bucket is to be asked.
    pub fn reserve_now(
        self: &Arc<Self>,
        who: &Who,
        max_tokens: Option<u64>,
    ) -> Option<Result<Option<Reservation>, Refusal>> {
        let Some(per_minute) = who.budget else {
            return Some(Ok(None));
        };
        (self.fleet.is_none())
            .then(|| self.reserve_here(who, per_minute, max_tokens, Instant::now()))
    }

    /// What a request of `who` reserves: its `max_tokens`, else its tenant's recent mean;
    /// at most the bucket.
    fn want(&self, who: &Who, per_minute: u64, max_tokens: Option<u64>) -> u64 {
        let mean = || {
            let buckets = self.lock();
            buckets.get(&who.tenant).map_or(64.0, |b| b.mean).ceil() as u64
        };
        max_tokens.unwrap_or_else(mean).clamp(1, per_minute)
    }

    /// A request of `tenant` produced `tokens`: its mean moves (the fleet's bucket is
    /// settled in Redis).
    fn learn(&self, tenant: &Tenant, tokens: u64) {
        if let Some(b) = self.lock().get_mut(tenant) {
            b.mean += (tokens as f64 - b.mean) / 8.0;
        }
    }

    /// [`Budgets::reserve`] in this tokentap's own bucket of `per_minute`, at `now`.
    fn reserve_here(
        self: &Arc<Self>,
        who: &Who,
        per_minute: u64,
        max_tokens: Option<u64>,
        now: Instant,
    ) -> Result<Option<Reservation>, Refusal> {
        let mut buckets = self.lock();
        if buckets.len() >= BUCKETS && !buckets.contains_key(&who.tenant) {
            buckets.retain(|_, b| {
                b.refill(now);
                b.open > 0 || b.tokens < b.per_minute as f64
            });
        }
        let b = buckets.entry(who.tenant.clone()).or_insert(Bucket {
            tokens: per_minute as f64,
            at: now,
            per_minute,
            mean: 64.0,
            open: 0,
        });
        if b.per_minute != per_minute {
            // A reload changed it: the bucket keeps its share of the new size.
            b.tokens *= per_minute as f64 / b.per_minute as f64;
            b.per_minute = per_minute;
        }
        b.refill(now);
        let want = max_tokens
            .unwrap_or(b.mean.ceil() as u64)
            .clamp(1, per_minute);
        if b.tokens >= want as f64 {
            b.tokens -= want as f64;
            b.open += 1;
            return Ok(Some(Reservation {
                budgets: Arc::clone(self),
                tenant: who.tenant.clone(),
                reserved: want,
                fleet: None,
                settled: false,
            }));
        }
        Err(Refusal::short(per_minute, b.tokens, want))
    }

    /// A request of `tenant` that reserved `reserved` ended with `tokens` output tokens:
    /// the rest of its reservation back (or what it ran past taken).
    fn settle(&self, tenant: &Tenant, reserved: u64, tokens: u64) {
        if let Some(b) = self.lock().get_mut(tenant) {
            b.tokens += reserved as f64 - tokens as f64;
            b.tokens = b.tokens.min(b.per_minute as f64);
            b.mean += (tokens as f64 - b.mean) / 8.0;
            b.open = b.open.saturating_sub(1);
        }
    }

    /// Buckets kept now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Tenant, Bucket, foldhash::fast::RandomState>> {
        self.buckets.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Refusal {
    /// A bucket of `per_minute` holding `left`, short of `want`.
    fn short(per_minute: u64, left: f64, want: u64) -> Refusal {
        Refusal {
            limit: per_minute,
            remaining: left.max(0.0).floor() as u64,
            reset: Duration::from_secs_f64((want as f64 - left) * 60.0 / per_minute as f64),
        }
    }

    /// `x-ratelimit-reset-tokens` as OpenAI writes it: `1.5s`, `2m0s`.
    pub fn reset_text(&self) -> String {
        let secs = self.reset.as_secs_f64();
        let tenths = (secs * 10.0).ceil();
        if tenths < 600.0 {
            format!("{}s", tenths / 10.0)
        } else {
            // Whole seconds, rounded up before they are split: 119.2 s is `2m0s`, never
            // `1m60s`.
            let whole = secs.ceil() as u64;
            format!("{}m{}s", whole / 60, whole % 60)
        }
    }

    /// `Retry-After`: whole seconds, at least one.
    pub fn retry_after_secs(&self) -> u64 {
        self.reset.as_secs_f64().ceil().max(1.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn who(budget: u64) -> Who {
        Who {
            tenant: Arc::from("t"),
            budget: Some(budget),
            ..Who::default()
        }
    }

    /// `x-ratelimit-reset-tokens` as OpenAI writes it, each unit carried: `2m0s`, never
    /// `1m60s`.
    #[test]
    fn the_reset_is_written_with_its_units_carried() {
        let text = |secs: f64| {
            Refusal {
                limit: 1,
                remaining: 0,
                reset: Duration::from_secs_f64(secs),
            }
            .reset_text()
        };
        for (secs, want) in [
            (0.04, "0.1s"),
            (1.5, "1.5s"),
            (59.9, "59.9s"),
            (59.95, "1m0s"),
            (60.0, "1m0s"),
            (60.2, "1m1s"),
            (119.2, "2m0s"),
            (120.0, "2m0s"),
            (179.99, "3m0s"),
        ] {
            assert_eq!(text(secs), want, "{secs}");
        }
    }

    /// A body that could not be read keeps its reservation: nothing comes back.
    #[test]
    fn an_unread_body_keeps_its_reservation() {
        let (b, t0) = (Arc::new(Budgets::default()), Instant::now());
        let w = who(600);
        let r = b.reserve_here(&w, 600, Some(500), t0).unwrap().unwrap();
        r.keep(0);
        let Err(no) = b.reserve_here(&w, 600, Some(101), t0) else {
            panic!("not refused")
        };
        assert_eq!(no.remaining, 100);
        // Counted past its reservation before it became unreadable: that much is spent.
        let r = b.reserve_here(&w, 600, Some(100), t0).unwrap().unwrap();
        r.keep(150);
        assert!(b.reserve_here(&w, 600, Some(1), t0).is_err());
    }

    #[test]
    fn a_bucket_reserves_settles_refills_and_refuses_with_its_reset() {
        let (b, t0) = (Arc::new(Budgets::default()), Instant::now());
        let w = who(600); // 10 a second
        let r1 = b.reserve_here(&w, 600, Some(400), t0).unwrap().unwrap();
        let r2 = b.reserve_here(&w, 600, Some(150), t0).unwrap().unwrap();
        let Err(no) = b.reserve_here(&w, 600, Some(100), t0) else {
            panic!("not refused")
        };
        assert_eq!((no.limit, no.remaining), (600, 50));
        assert_eq!(no.reset, Duration::from_secs(5));
        assert_eq!(
            (no.reset_text(), no.retry_after_secs()),
            ("5s".to_owned(), 5)
        );
        // 400 reserved, 100 used: 300 back.
        r1.settle(100);
        assert!(b.reserve_here(&w, 600, Some(100), t0).unwrap().is_some());
        // Ran past its reservation: a debt, paid by the refill.
        r2.settle(500);
        assert!(b.reserve_here(&w, 600, Some(100), t0).is_err());
        let later = t0 + Duration::from_secs(60);
        assert!(b.reserve_here(&w, 600, Some(600), later).unwrap().is_some());
        // No budget: nothing reserved.
        let none = tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(b.reserve(&Who::default(), Some(1)));
        assert!(none.unwrap().is_none());
    }

    #[test]
    fn full_buckets_are_forgotten_past_the_bound() {
        let (b, t0) = (Arc::new(Budgets::default()), Instant::now());
        for i in 0..BUCKETS + 10 {
            let w = Who {
                tenant: Arc::from(format!("t{i}")),
                budget: Some(60),
                ..Who::default()
            };
            let r = b
                .reserve_here(&w, 60, Some(1), t0 + Duration::from_secs(i as u64))
                .unwrap();
            r.unwrap().settle(1);
        }
        assert!(b.len() <= BUCKETS, "{}", b.len());
    }
}
