//! The queue of a capped upstream: strict priority bands (`high`, `normal`, `low`), and
//! within a band the waiting tenant served the fewest weighted tokens goes next — the
//! virtual token counter of "Fairness in Serving Large Language Models" (Sheng et al.,
//! OSDI '24) — each tenant's own requests in arrival order. Without tenants every request
//! is one tenant's in one band: a FIFO.
//!
//! - A tenant's counter grows by the output tokens its requests are served, over its
//!   weight: an estimate when a request gets its slot (the tenant's recent mean), the
//!   difference when it ends ([`Fair::settle`]).
//! - A tenant that starts waiting with nothing in flight is lifted to the least counter of
//!   those already waiting, so that a tenant idle for a while cannot bank credit and then
//!   take every slot; one whose requests are running keeps its place (its queue emptying
//!   between two of its requests is not idleness).
//! - Ageing, a trickle: a `normal` or `low` request that has waited `ageing` may go before
//!   the bands above it (the oldest first), but at most one such jump every `ageing` and
//!   every [`JUMP_EVERY`] slots handed out. A lower band is never starved (one of its
//!   requests is served within about `ageing`, or [`JUMP_EVERY`] slots, whichever is
//!   longer), and under a flood of higher requests it takes at most one slot in
//!   [`JUMP_EVERY`] + 1: had every aged request jumped, a band that waits `ageing`
//!   behind a flood would take every slot that comes free after `ageing`, a third of them
//!   and more.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::tenant::{Tenant, Who};

/// Counters kept for tenants not waiting, at most (the waiting ones are always kept).
const COUNTERS: usize = 4096;

/// One request waiting for a slot.
pub(super) struct Waiter {
    pub(super) id: u64,
    pub(super) since: Instant,
    /// Sent whether the slot was granted under a share.
    pub(super) grant: oneshot::Sender<bool>,
}

/// The waiting requests of one pool, and the tenants' counters.
#[derive(Default)]
pub(super) struct Fair {
    bands: [Band; 3],
    len: usize,
    counters: HashMap<Tenant, Counter, foldhash::fast::RandomState>,
    /// The last aged request's jump over the bands, and the slots handed out since.
    jumped: Option<Instant>,
    since_jump: u64,
}

#[derive(Default)]
struct Band {
    /// Tenants with requests waiting in this band, in the order they started waiting.
    tenants: Vec<(Tenant, f64, VecDeque<Waiter>)>,
}

#[derive(Debug, Clone, Copy)]
struct Counter {
    /// Weighted output tokens served.
    served: f64,
    /// Mean output tokens of its recent requests (what a slot is charged up front).
    mean: f64,
    /// Its requests holding a slot.
    running: u32,
}

/// What a tenant's slot is charged before any of its requests has ended.
const FIRST_MEAN: f64 = 64.0;

/// Slots handed out in band order between two aged requests' jumps, at least.
pub(super) const JUMP_EVERY: u64 = 16;

impl Default for Counter {
    fn default() -> Self {
        Counter {
            served: 0.0,
            mean: FIRST_MEAN,
            running: 0,
        }
    }
}

impl Fair {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `who`'s request waits.
    pub(super) fn push(&mut self, who: &Who, waiter: Waiter) {
        let band = &mut self.bands[who.priority as usize];
        self.len += 1;
        if let Some((_, _, q)) = band.tenants.iter_mut().find(|(t, ..)| *t == who.tenant) {
            q.push_back(waiter);
            return;
        }
        // It starts waiting: lifted to the least counter of those waiting, unless its
        // requests are running.
        let floor = (self.bands.iter())
            .flat_map(|b| b.tenants.iter())
            .filter_map(|(t, ..)| self.counters.get(t).map(|c| c.served))
            .reduce(f64::min);
        let c = self.counters.entry(who.tenant.clone()).or_default();
        if let Some(floor) = floor.filter(|_| c.running == 0) {
            c.served = c.served.max(floor);
        }
        let band = &mut self.bands[who.priority as usize];
        band.tenants
            .push((who.tenant.clone(), who.weight, VecDeque::from([waiter])));
    }

    /// The requests waiting below `high` (those an aged request's jump is in turn with).
    pub(super) fn below_high(&self) -> usize {
        (self.bands[1..].iter())
            .flat_map(|b| b.tenants.iter())
            .map(|(_, _, q)| q.len())
            .sum()
    }

    /// Whether an aged request may jump the bands at `now` (see the module doc).
    fn jump_due(&self, now: Instant, ageing: Duration) -> bool {
        self.jumped.is_none_or(|at| {
            now.saturating_duration_since(at) >= ageing && self.since_jump >= JUMP_EVERY
        })
    }

    /// An aged request of a lower band asks the fleet for its slot at `now` (its band then
    /// ranks before every band there): whether it may, counted as this queue's jump.
    pub(super) fn aged_turn(&mut self, now: Instant, ageing: Duration) -> bool {
        let due = self.jump_due(now, ageing);
        if due {
            self.jumped = Some(now);
            self.since_jump = 0;
        }
        due
    }

    /// The request to serve next at `now`, charged to its tenant.
    pub(super) fn pop(&mut self, now: Instant, ageing: Duration) -> Option<Waiter> {
        if self.len == 0 {
            return None;
        }
        let b = self.bands.iter().position(|b| !b.tenants.is_empty())?;
        // The tenant served least; on a tie, the one waiting longest.
        let counters = &self.counters;
        let served = |t: &Tenant| counters.get(t).map_or(0.0, |c| c.served);
        let i = (0..self.bands[b].tenants.len()).min_by(|&x, &y| {
            let (tx, ty) = (&self.bands[b].tenants[x], &self.bands[b].tenants[y]);
            served(&tx.0).total_cmp(&served(&ty.0))
        })?;
        // The oldest of the lower bands' heads, when it has waited past the bound and a
        // jump is due.
        let aged = (self.jump_due(now, ageing))
            .then(|| {
                (b + 1..3)
                    .flat_map(|b| {
                        (self.bands[b].tenants.iter().enumerate())
                            .filter_map(move |(i, (_, _, q))| q.front().map(|w| (w.since, b, i)))
                    })
                    .filter(|(since, ..)| now.saturating_duration_since(*since) >= ageing)
                    .min_by_key(|(since, ..)| *since)
            })
            .flatten();
        let (b, i) = match aged {
            Some((_, b, i)) => {
                self.jumped = Some(now);
                self.since_jump = 0;
                (b, i)
            }
            None => {
                self.since_jump += 1;
                (b, i)
            }
        };
        let band = &mut self.bands[b];
        let (tenant, weight, q) = &mut band.tenants[i];
        let w = q.pop_front()?;
        let c = self.counters.entry(tenant.clone()).or_default();
        c.served += c.mean / *weight;
        c.running += 1;
        if q.is_empty() {
            band.tenants.remove(i);
        }
        self.len -= 1;
        Some(w)
    }

    /// A request of `who` got a slot without waiting: charged as one that waited.
    pub(super) fn charge(&mut self, who: &Who) {
        let c = self.counters.entry(who.tenant.clone()).or_default();
        c.served += c.mean / who.weight;
        c.running += 1;
        self.prune();
    }

    /// Whether the queue owes `who`'s tenant a slot: others wait, none of its own does, and
    /// it was served less than the tenant served next (in a band no higher than its own).
    pub(super) fn owes(&self, who: &Who) -> bool {
        let Some(b) = self.bands.iter().position(|b| !b.tenants.is_empty()) else {
            return false;
        };
        let waits = |band: &Band| band.tenants.iter().any(|(t, ..)| *t == who.tenant);
        if (who.priority as usize) > b || self.bands.iter().any(waits) {
            return false;
        }
        let served = |t: &Tenant| self.counters.get(t).map_or(0.0, |c| c.served);
        let next = (self.bands[b].tenants.iter())
            .map(|(t, ..)| served(t))
            .fold(f64::INFINITY, f64::min);
        served(&who.tenant) < next
    }

    /// What a slot costs `who`'s tenant (its mean output tokens over its weight), and
    /// whether more of its requests wait.
    pub(super) fn claim(&self, who: &Who) -> (f64, bool) {
        let mean = self
            .counters
            .get(&who.tenant)
            .map_or(FIRST_MEAN, |c| c.mean);
        let waits = (self.bands.iter()).any(|b| b.tenants.iter().any(|(t, ..)| *t == who.tenant));
        (mean / who.weight, waits)
    }

    /// `who`'s tenant's counter as the fleet keeps it.
    pub(super) fn served_in_fleet(&mut self, who: &Who, served: f64) {
        if let Some(c) = self.counters.get_mut(&who.tenant) {
            c.served = served;
        }
    }

    /// A request of `who` gave its slot back, `tokens` output tokens served (when counted):
    /// its charge made exact, and its tenant's mean moved.
    pub(super) fn ended(&mut self, who: &Who, tokens: Option<u64>) {
        if let Some(c) = self.counters.get_mut(&who.tenant) {
            c.running = c.running.saturating_sub(1);
            if let Some(tokens) = tokens.map(|t| t as f64) {
                c.served += (tokens - c.mean) / who.weight;
                c.mean += (tokens - c.mean) / 8.0;
            }
        }
    }

    /// Takes request `id` out (its wait ran out, or its client left); whether it was there.
    pub(super) fn remove(&mut self, id: u64) -> bool {
        for band in &mut self.bands {
            for i in 0..band.tenants.len() {
                let q = &mut band.tenants[i].2;
                if let Some(at) = q.iter().position(|w| w.id == id) {
                    q.remove(at);
                    if q.is_empty() {
                        band.tenants.remove(i);
                    }
                    self.len -= 1;
                    return true;
                }
            }
        }
        false
    }

    /// The requests that would be served before one more of `who`'s, about: those of the
    /// bands above it, its own tenant's, and of each other tenant of its band as many as
    /// it would be served while `who` waits its turn (by weight).
    pub(super) fn ahead(&self, who: &Who) -> usize {
        let b = who.priority as usize;
        let above: usize = (self.bands[..b].iter())
            .flat_map(|band| band.tenants.iter())
            .map(|(_, _, q)| q.len())
            .sum();
        let band = &self.bands[b];
        let own = (band.tenants.iter())
            .find(|(t, ..)| *t == who.tenant)
            .map_or(0, |(_, _, q)| q.len());
        let turns = (own + 1) as f64 / who.weight;
        let others: usize = (band.tenants.iter())
            .filter(|(t, ..)| *t != who.tenant)
            .map(|(_, w, q)| q.len().min((turns * w).ceil() as usize))
            .sum();
        above + own + others
    }

    /// Forgets the counters of tenants not waiting past [`COUNTERS`] (a tenant that comes
    /// back is lifted to those waiting, as a new one is).
    fn prune(&mut self) {
        if self.counters.len() <= COUNTERS {
            return;
        }
        let waiting: std::collections::HashSet<Tenant> = (self.bands.iter())
            .flat_map(|b| b.tenants.iter().map(|(t, ..)| t.clone()))
            .collect();
        self.counters
            .retain(|t, c| c.running > 0 || waiting.contains(t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::Priority;
    use std::sync::Arc;

    fn who(t: &str, p: Priority, weight: f64) -> Who {
        Who {
            tenant: Arc::from(t),
            priority: p,
            weight,
            budget: None,
        }
    }

    fn waiter(id: u64, since: Instant) -> (Waiter, oneshot::Receiver<bool>) {
        let (grant, rx) = oneshot::channel();
        (Waiter { id, since, grant }, rx)
    }

    fn drain(f: &mut Fair, now: Instant, n: usize) -> Vec<u64> {
        (0..n)
            .filter_map(|_| f.pop(now, Duration::from_secs(5)).map(|w| w.id))
            .collect()
    }

    #[test]
    fn one_tenant_is_a_fifo() {
        let (mut f, now) = (Fair::default(), Instant::now());
        let w = Who::default();
        let mut rx = Vec::new();
        for id in 0..5 {
            let (x, r) = waiter(id, now);
            f.push(&w, x);
            rx.push(r);
        }
        assert_eq!(f.ahead(&w), 5);
        assert!(f.remove(2));
        assert_eq!(drain(&mut f, now, 9), [0, 1, 3, 4]);
        assert!(f.is_empty());
    }

    /// A flooding tenant and a light one: slots alternate while both wait, and the light
    /// one's request, arriving behind twenty, is among the next two served.
    #[test]
    fn the_tenant_served_least_goes_next_and_weights_share_by_tokens() {
        let (mut f, now) = (Fair::default(), Instant::now());
        let (a, b) = (
            who("a", Priority::Normal, 1.0),
            who("b", Priority::Normal, 1.0),
        );
        let mut rx = Vec::new();
        for id in 0..20 {
            let (x, r) = waiter(id, now);
            f.push(&a, x);
            rx.push(r);
        }
        // a was served a lot before: its counter is ahead.
        for _ in 0..3 {
            f.charge(&a);
        }
        // Served before it: one of a's (a tie, a waiting longer), not a's twenty.
        assert_eq!(f.ahead(&b), 1);
        let (x, r) = waiter(100, now);
        f.push(&b, x);
        rx.push(r);
        let first = drain(&mut f, now, 2);
        assert!(first.contains(&100), "{first:?}");
        // Weights: c (weight 3) gets three slots for each of d's.
        let (mut f, c, d) = (
            Fair::default(),
            who("c", Priority::Normal, 3.0),
            who("d", Priority::Normal, 1.0),
        );
        for id in 0..40 {
            let (x, r) = waiter(id, now);
            f.push(if id % 2 == 0 { &c } else { &d }, x);
            rx.push(r);
        }
        let served = drain(&mut f, now, 20);
        let of_c = served.iter().filter(|id| *id % 2 == 0).count();
        assert!((14..=16).contains(&of_c), "{served:?}");
    }

    #[test]
    fn bands_are_strict_and_ageing_serves_the_starved() {
        let (mut f, now) = (Fair::default(), Instant::now());
        let (high, low) = (who("h", Priority::High, 1.0), who("l", Priority::Low, 1.0));
        let mut rx = Vec::new();
        let (x, r) = waiter(1, now - Duration::from_secs(1));
        f.push(&low, x);
        rx.push(r);
        for id in 10..13 {
            let (x, r) = waiter(id, now);
            f.push(&high, x);
            rx.push(r);
        }
        assert_eq!(f.len(), 4);
        assert_eq!(f.ahead(&low), 4);
        assert_eq!(drain(&mut f, now, 1), [10]);
        // Past the ageing bound the low request goes before the high ones.
        let later = now + Duration::from_secs(5);
        assert_eq!(drain(&mut f, later, 3), [1, 11, 12]);
    }

    /// Aged requests jump the bands as a trickle: one at a time, at most one every
    /// `ageing` and every `JUMP_EVERY` slots, so a flood of `high` keeps the lion's share
    /// and `low` is still served.
    #[test]
    fn aged_requests_jump_as_a_trickle() {
        let (mut f, t0) = (Fair::default(), Instant::now());
        let (high, low) = (who("h", Priority::High, 1.0), who("l", Priority::Low, 1.0));
        let ageing = Duration::from_secs(5);
        let mut rx = Vec::new();
        // 20 low requests waiting since long before; high ones keep coming.
        for id in 0..20 {
            let (x, r) = waiter(id, t0);
            f.push(&low, x);
            rx.push(r);
        }
        let mut next_high = 1000;
        let mut served = Vec::new();
        // A slot a second for 60 s, the queue never out of high requests.
        for s in 0..60u64 {
            let now = t0 + Duration::from_secs(6 + s);
            while f.len() < 40 {
                let (x, r) = waiter(next_high, now);
                f.push(&high, x);
                rx.push(r);
                next_high += 1;
            }
            served.push((s, f.pop(now, ageing).unwrap().id));
        }
        let lows: Vec<u64> = (served.iter())
            .filter(|(_, id)| *id < 1000)
            .map(|(s, _)| *s)
            .collect();
        // The first at once (it waited past the bound), then one every JUMP_EVERY + 1.
        assert_eq!(lows, [0, 17, 34, 51], "{served:?}");
        // Oldest first among the aged.
        let ids: Vec<u64> = (served.iter())
            .filter(|(_, id)| *id < 1000)
            .map(|(_, id)| *id)
            .collect();
        assert_eq!(ids, [0, 1, 2, 3]);
        // Without high requests waiting, the low band is served in its own turn: no jump.
        let mut f = Fair::default();
        for id in 0..3 {
            let (x, r) = waiter(id, t0);
            f.push(&low, x);
            rx.push(r);
        }
        assert_eq!(drain(&mut f, t0 + Duration::from_secs(10), 3), [0, 1, 2]);
        assert_eq!(f.jumped, None);
    }
}
