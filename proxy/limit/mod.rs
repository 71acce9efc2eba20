//! Concurrency caps: a per-upstream limit, a bounded queue for requests over it (fair
//! between tenants, strict between priorities: [`fair`]), and the adaptive controller that
//! moves the limit to hold a TPOT SLO ([`controller`]).
//!
//! A slot is a [`Permit`] kept in the request's ctx: however the request ends (done, client
//! gone, upstream error, a panic in a filter), dropping the permit frees the slot and hands
//! it straight to the request the queue serves next. A request that would not get a slot
//! within the queue's timeout — predicted from its place in the queue and the rate slots
//! have been freeing — is refused at once, not after waiting it out.
//!
//! A slot freed by a tenant the fair queue owes (served less than the tenant it would go
//! to, and with nothing waiting of its own) is held for that tenant for [`HOLD`], as an
//! anticipatory disk scheduler waits for a process's next read (Iyer and Druschel, SOSP
//! '01): a client sends its next request a moment after its last one ends, and engines
//! free slots in cohorts, so without the hold the light tenant's next request arrives just
//! after the cohort it could have had went to the heavy one's waiters.

pub mod controller;
mod fair;
pub mod fleet;
pub mod slo;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::tenant::Who;
use fair::{Fair, Waiter};

/// Why a request was refused a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// The queue already held `max_queue` requests.
    QueueFull,
    /// The request waited `queue_timeout` without getting a slot.
    QueueTimeout,
    /// Its predicted wait for a slot was past `queue_timeout`: refused at once.
    PredictedWait,
    /// Its tenant's output-token budget could not cover it (refused before it asked for a
    /// slot; counted here so that every 429 of the upstream is in one count).
    OutputTokenBudget,
}

impl Rejected {
    pub const ALL: [Rejected; 4] = [
        Rejected::QueueFull,
        Rejected::QueueTimeout,
        Rejected::PredictedWait,
        Rejected::OutputTokenBudget,
    ];

    /// The `reason` label, and the `code` of the 429 body.
    pub fn label(self) -> &'static str {
        match self {
            Rejected::QueueFull => "queue_full",
            Rejected::QueueTimeout => "queue_timeout",
            Rejected::PredictedWait => "predicted_wait",
            Rejected::OutputTokenBudget => "output_token_budget",
        }
    }
}

/// A refusal as the tenant book counts it (the same `code` either way).
impl From<Rejected> for crate::tenant::book::Cause {
    fn from(why: Rejected) -> Self {
        use crate::tenant::book::Cause;
        match why {
            Rejected::QueueFull => Cause::QueueFull,
            Rejected::QueueTimeout => Cause::QueueTimeout,
            Rejected::PredictedWait => Cause::PredictedWait,
            Rejected::OutputTokenBudget => Cause::Budget,
        }
    }
}

/// How a limiter is set up.
#[derive(Debug, Clone, Copy)]
pub struct LimitConfig {
    /// The starting limit of each endpoint; `None`: unlimited (no cap and no SLO).
    pub initial: Option<u64>,
    /// A cap on the whole pool (`max_concurrency_total`).
    pub total: Option<u64>,
    pub max_queue: usize,
    pub queue_timeout: Duration,
    /// A `normal` or `low` request that has waited this long goes first (`tenants.ageing_ms`).
    pub ageing: Duration,
}

/// The concurrency limit of one upstream: of each endpoint of its pool times the endpoints
/// that take requests, under the pool's own total; one FIFO queue for the pool.
pub struct Limiter {
    /// Each endpoint's limit; `u64::MAX` when unlimited.
    limit: AtomicU64,
    /// The endpoints that take requests now (their slots are the pool's).
    members: AtomicU64,
    /// The pool's own cap (`u64::MAX`: none).
    total: AtomicU64,
    /// The sum of its endpoints' own caps, when each has one (`balance = "slo_headroom"`;
    /// `u64::MAX`: each endpoint's is `limit`).
    sum: AtomicU64,
    state: Mutex<State>,
    rejected: [AtomicU64; 4],
    /// A request had to queue (or was refused) for the limit, not a share, since the
    /// controller last looked.
    binding: AtomicBool,
    waits: metrics::Histogram,
    /// A cap under the limit: this replica's share while its fleet's Redis is away
    /// (`u64::MAX`: none).
    share: AtomicU64,
}

struct State {
    in_flight: u64,
    queue: Fair,
    next_id: u64,
    max_queue: usize,
    queue_timeout: Duration,
    ageing: Duration,
    /// When the last slots were freed (at most [`FREED_KEPT`], within [`FREED_WINDOW`]):
    /// the rate a queue's wait is predicted by.
    freed: VecDeque<Instant>,
    /// Slots held for a tenant the queue owes, until then (counted in `in_flight`).
    held: Vec<(crate::tenant::Tenant, Instant)>,
}

/// How long a freed slot is held for the tenant the queue owes.
pub const HOLD: Duration = Duration::from_millis(10);

impl State {
    /// Takes the slot held for `who`'s tenant, if one is (it stays counted in flight).
    fn take_held(&mut self, who: &Who) -> bool {
        if self.held.is_empty() {
            return false;
        }
        let now = Instant::now();
        match (self.held.iter()).position(|(t, until)| *t == who.tenant && *until > now) {
            Some(i) => {
                self.held.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

/// Slot releases kept for the freeing rate, and how far back they count.
const FREED_KEPT: usize = 64;
const FREED_WINDOW: Duration = Duration::from_secs(10);
/// Releases needed before a wait is predicted (fewer: the request queues).
const FREED_MIN: usize = 4;

/// What `/stats` shows of a limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitStats {
    pub limit: Option<u64>,
    pub in_flight: u64,
    pub queued: u64,
    /// Refusals by why, in [`Rejected::ALL`]'s order.
    pub rejected: [u64; 4],
}

// === impl Limiter ===

impl Limiter {
    pub fn new(config: LimitConfig, waits: metrics::Histogram) -> Arc<Limiter> {
        Arc::new(Limiter {
            limit: AtomicU64::new(config.initial.unwrap_or(u64::MAX)),
            members: AtomicU64::new(1),
            total: AtomicU64::new(config.total.unwrap_or(u64::MAX)),
            sum: AtomicU64::new(u64::MAX),
            state: Mutex::new(State {
                in_flight: 0,
                queue: Fair::default(),
                next_id: 0,
                max_queue: config.max_queue,
                queue_timeout: config.queue_timeout,
                ageing: config.ageing,
                freed: VecDeque::with_capacity(FREED_KEPT),
                held: Vec::new(),
            }),
            rejected: Default::default(),
            binding: AtomicBool::new(false),
            waits,
            share: AtomicU64::new(u64::MAX),
        })
    }

    /// The pool's limit: each endpoint's times the endpoints (or the sum of their own
    /// caps), under the total.
    fn pool_limit(&self) -> u64 {
        let endpoints = match self.sum.load(Relaxed) {
            u64::MAX => (self.limit.load(Relaxed)).saturating_mul(self.members.load(Relaxed)),
            sum => sum,
        };
        endpoints.min(self.total.load(Relaxed))
    }

    /// The endpoints that take requests have caps of their own, `sum` together (`None`:
    /// each has the limiter's); waiting requests are let in at once when it grows.
    pub fn set_sum(&self, sum: Option<u64>) {
        let v = sum.unwrap_or(u64::MAX);
        if self.sum.swap(v, Relaxed) != v {
            let mut st = self.lock();
            self.grant_waiting(&mut st);
        }
    }

    /// The limit admitted against here: the pool's, or this replica's share of it.
    fn effective(&self) -> u64 {
        self.pool_limit().min(self.share.load(Relaxed))
    }

    /// `n` endpoints take requests now: the pool's limit follows (waiting requests are let
    /// in at once when it grows).
    pub fn set_members(&self, n: u64) {
        if self.members.swap(n, Relaxed) != n {
            let mut st = self.lock();
            self.grant_waiting(&mut st);
        }
    }

    /// What `who`'s request, waiting since `since`, asks of the fleet's fair share
    /// ([`fleet`]): its band (-1 past the ageing bound), its tenant's charge for a slot and
    /// whether more of its tenant's requests wait here.
    pub fn claim(&self, who: &Who, since: Instant) -> fleet::Claim {
        let mut st = self.lock();
        let (charge, more) = st.queue.claim(who);
        let now = Instant::now();
        let ageing = st.ageing;
        // Aged, it ranks before every band when this replica's trickle allows a jump.
        let aged = who.priority != crate::tenant::Priority::High
            && now.saturating_duration_since(since) >= ageing
            && st.queue.aged_turn(now, ageing);
        fleet::Claim {
            tenant: who.tenant.clone(),
            band: if aged { -1 } else { who.priority as i8 },
            charge,
            more,
        }
    }

    /// `who`'s tenant has been served `served` weighted output tokens by the whole fleet
    /// (with `[cluster]`): this replica's fair queue takes that as its counter.
    pub fn served_in_fleet(&self, who: &Who, served: f64) {
        self.lock().queue.served_in_fleet(who, served);
    }

    /// The endpoints the pool's limit counts.
    pub fn members(&self) -> u64 {
        self.members.load(Relaxed)
    }

    /// Each endpoint's limit, if any.
    pub fn each(&self) -> Option<u64> {
        Some(self.limit.load(Relaxed)).filter(|&l| l != u64::MAX)
    }

    /// Admits at most `share` from now on (`None`: the whole limit again).
    pub fn set_share(&self, share: Option<u64>) {
        let v = share.map_or(u64::MAX, |s| s.max(1));
        if self.share.swap(v, Relaxed) != v {
            let mut st = self.lock();
            self.grant_waiting(&mut st);
        }
    }

    /// Admits at most `share` from now on, unless a share is already in force (two callers
    /// finding Redis away at once: the first one's share stands).
    pub fn start_share(&self, share: u64) {
        if self
            .share
            .compare_exchange(u64::MAX, share.max(1), Relaxed, Relaxed)
            .is_ok()
        {
            let mut st = self.lock();
            self.grant_waiting(&mut st);
        }
    }

    /// The share in force, if any.
    pub fn share(&self) -> Option<u64> {
        Some(self.share.load(Relaxed)).filter(|&s| s != u64::MAX)
    }

    /// The fleet held a request back (for the adaptive controller).
    pub fn note_binding(&self) {
        self.binding.store(true, Relaxed);
    }

    /// The pool's limit in force (each endpoint's times the endpoints, under the total).
    pub fn limit(&self) -> Option<u64> {
        Some(self.pool_limit()).filter(|&l| l != u64::MAX)
    }

    /// Whether a request arriving now would get a slot without waiting.
    pub fn has_headroom(&self) -> bool {
        let st = self.lock();
        st.queue.is_empty() && st.in_flight < self.effective()
    }

    /// A slot now for `who`, if one is free and nobody waits.
    pub fn try_acquire(self: &Arc<Self>, who: &Who) -> Option<Permit> {
        let mut st = self.lock();
        // A held slot is counted in flight already.
        let held = st.take_held(who);
        if held || (st.queue.is_empty() && st.in_flight < self.effective()) {
            st.in_flight += u64::from(!held);
            st.queue.charge(who);
            return Some(self.permit(self.share().is_some(), who));
        }
        None
    }

    /// A slot for `who` now, or after waiting its turn; `Err` when the queue is full, when
    /// its wait is predicted past the queue's timeout, or when the wait runs out. Dropping
    /// the future (the client went away) leaves the queue at once.
    pub async fn acquire(self: &Arc<Self>, who: &Who) -> Result<Permit, Rejected> {
        let (id, rx, queue_timeout) = {
            let mut st = self.lock();
            if st.take_held(who) {
                st.queue.charge(who);
                return Ok(self.permit(self.share().is_some(), who));
            }
            if st.queue.is_empty() && st.in_flight < self.effective() {
                st.in_flight += 1;
                st.queue.charge(who);
                return Ok(self.permit(self.share().is_some(), who));
            }
            // The limit binds, not a share under it: a replica rejoining its fleet still
            // queues on its share for a period, which says nothing about the fleet's limit.
            if st.in_flight >= self.pool_limit() {
                self.binding.store(true, Relaxed);
            }
            if st.queue.len() >= st.max_queue {
                self.reject(Rejected::QueueFull);
                return Err(Rejected::QueueFull);
            }
            if self
                .predicted(&st, who, Instant::now())
                .is_some_and(|w| w > st.queue_timeout)
            {
                self.reject(Rejected::PredictedWait);
                return Err(Rejected::PredictedWait);
            }
            let (tx, rx) = oneshot::channel();
            let id = st.next_id;
            st.next_id += 1;
            let waiter = Waiter {
                id,
                since: Instant::now(),
                grant: tx,
            };
            st.queue.push(who, waiter);
            (id, rx, st.queue_timeout)
        };
        let started = std::time::Instant::now();
        let mut guard = QueueGuard {
            limiter: self,
            id,
            who,
            done: false,
        };
        let granted = tokio::time::timeout(queue_timeout, rx).await;
        guard.done = true;
        self.waits.record(started.elapsed().as_secs_f64());
        if let Ok(Ok(shared)) = granted {
            return Ok(self.permit(shared, who));
        }
        let mut st = self.lock();
        if st.queue.remove(id) {
            drop(st);
            self.reject(Rejected::QueueTimeout);
            Err(Rejected::QueueTimeout)
        } else {
            // Granted in the same instant the wait ran out: the slot is ours.
            Ok(self.permit(self.share().is_some(), who))
        }
    }

    /// How long `who` would wait for a slot, predicted at `now` from the requests served
    /// before it and the rate slots freed over the last [`FREED_WINDOW`]; `None`: no slot
    /// is awaited, or too few were freed lately to say. Below `high`, no longer than the
    /// ageing bound.
    fn predicted(&self, st: &State, who: &Who, now: Instant) -> Option<Duration> {
        // In the order they were freed: those in the window are the tail, found by halving
        // (this runs for every request that waits).
        let recent = match now.checked_sub(FREED_WINDOW) {
            Some(cutoff) => st.freed.len() - st.freed.partition_point(|&t| t < cutoff),
            None => st.freed.len(),
        };
        if recent < FREED_MIN {
            return None;
        }
        let oldest = st.freed[st.freed.len() - recent];
        let span = now
            .saturating_duration_since(oldest)
            .as_secs_f64()
            .max(1e-3);
        let rate = recent as f64 / span;
        // Slots it needs freed: one for each request ahead, one for itself, less those free.
        let free = self.effective().saturating_sub(st.in_flight) as usize;
        let needed = (st.queue.ahead(who) + 1).saturating_sub(free);
        let wait = needed as f64 / rate;
        Some(Duration::from_secs_f64(match who.priority {
            crate::tenant::Priority::High => wait,
            // Below `high`, no longer than its turn in the ageing trickle: the aged jump
            // oldest first, one a jump, a jump every `ageing` and every `JUMP_EVERY` slots.
            _ => {
                let ageing = st.ageing.as_secs_f64();
                let per_jump = ageing.max(fair::JUMP_EVERY as f64 / rate);
                wait.min(ageing + st.queue.below_high() as f64 * per_jump)
            }
        }))
    }

    /// What a refused request of `who` is told to wait before it tries again (`Retry-After`):
    /// its predicted wait now, at least a second.
    pub fn retry_after(&self, who: &Who) -> Duration {
        let st = self.lock();
        let wait = self.predicted(&st, who, Instant::now());
        wait.unwrap_or(Duration::ZERO).max(Duration::from_secs(1))
    }

    /// Sets each endpoint's limit; a higher one lets waiting requests in at once.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit.max(1), Relaxed);
        let mut st = self.lock();
        self.grant_waiting(&mut st);
    }

    /// Takes `config` on (a reload): the queue's bound and timeout for requests that queue
    /// from now on, and the limit. The in-flight count and the queue carry over: a lower
    /// limit admits nothing new until in-flight is under it, a higher one lets waiting
    /// requests in at once.
    pub fn reconfigure(&self, config: LimitConfig) {
        let mut st = self.lock();
        st.max_queue = config.max_queue;
        st.queue_timeout = config.queue_timeout;
        st.ageing = config.ageing;
        self.limit
            .store(config.initial.map_or(u64::MAX, |l| l.max(1)), Relaxed);
        self.total
            .store(config.total.map_or(u64::MAX, |l| l.max(1)), Relaxed);
        self.grant_waiting(&mut st);
    }

    /// Whether the limit held a request back since the last call, and resets that.
    pub fn take_binding(&self) -> bool {
        self.binding.swap(false, Relaxed)
    }

    pub fn stats(&self) -> LimitStats {
        let st = self.lock();
        LimitStats {
            limit: self.limit(),
            in_flight: st.in_flight,
            queued: st.queue.len() as u64,
            rejected: Rejected::ALL.map(|why| self.rejected[why as usize].load(Relaxed)),
        }
    }

    /// Counts a refusal of the upstream's (the limiter's own, or a budget's before it).
    pub fn reject(&self, why: Rejected) {
        self.rejected[why as usize].fetch_add(1, Relaxed);
    }

    /// A slot of `who`'s comes back (`anticipate`: its request ran, and the slot may be
    /// held for its tenant's next).
    /// `at`: when, if the caller has read the clock already.
    fn release(
        self: &Arc<Self>,
        who: &Who,
        anticipate: bool,
        tokens: Option<u64>,
        at: Option<Instant>,
    ) {
        let now = at.unwrap_or_else(Instant::now);
        let mut st = self.lock();
        // In the order they are freed, which the rate's read relies on: a time read before
        // the lock may be a moment older than one another thread gave back meanwhile.
        let now = st.freed.back().map_or(now, |&last| now.max(last));
        st.queue.ended(who, tokens);
        if st.freed.len() == FREED_KEPT {
            st.freed.pop_front();
        }
        st.freed.push_back(now);
        // One hold per request that ends (a cohort may end several of the tenant's).
        let hold = anticipate && st.in_flight <= self.effective() && st.queue.owes(who);
        let runtime = hold
            .then(|| tokio::runtime::Handle::try_current().ok())
            .flatten();
        match runtime {
            Some(rt) => {
                // The slot stays counted, now as its tenant's for HOLD, then the queue's.
                let held = (who.tenant.clone(), now + HOLD);
                st.held.push(held.clone());
                let limiter = Arc::clone(self);
                rt.spawn(async move {
                    tokio::time::sleep(HOLD).await;
                    let mut st = limiter.lock();
                    // Not taken: its slot goes back to the queue.
                    if let Some(i) = st.held.iter().position(|h| *h == held) {
                        st.held.swap_remove(i);
                        st.in_flight = st.in_flight.saturating_sub(1);
                    }
                    limiter.grant_waiting(&mut st);
                });
            }
            None => {
                st.in_flight = st.in_flight.saturating_sub(1);
                self.grant_waiting(&mut st);
            }
        }
    }

    /// Hands free slots to the requests the queue serves next, skipping waiters gone, once
    /// the holds that ran out have given theirs back.
    fn grant_waiting(&self, st: &mut State) {
        // Nothing held to run out and no one waiting: nothing to hand (and no clock read).
        if st.held.is_empty() && st.queue.is_empty() {
            return;
        }
        let limit = self.effective();
        let now = Instant::now();
        let before = st.held.len();
        st.held.retain(|(_, until)| *until > now);
        st.in_flight = st.in_flight.saturating_sub((before - st.held.len()) as u64);
        while st.in_flight < limit {
            let ageing = st.ageing;
            let Some(w) = st.queue.pop(now, ageing) else {
                break;
            };
            if w.grant.send(self.share().is_some()).is_ok() {
                st.in_flight += 1;
            }
        }
    }

    fn permit(self: &Arc<Self>, shared: bool, who: &Who) -> Permit {
        Permit {
            limiter: Arc::clone(self),
            shared,
            who: who.clone(),
            tokens: None,
            released: false,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Removes a waiter that stopped waiting (its future was dropped) from the queue; if it was
/// granted a slot it never took, the slot goes back.
struct QueueGuard<'a> {
    limiter: &'a Arc<Limiter>,
    id: u64,
    who: &'a Who,
    done: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.limiter.lock();
        if !st.queue.remove(self.id) {
            drop(st);
            self.limiter.release(self.who, false, None, None);
        }
    }
}

/// A concurrency slot; dropping it frees the slot.
pub struct Permit {
    limiter: Arc<Limiter>,
    /// Granted while a share was in force (else under the whole limit).
    shared: bool,
    /// Whose request holds it.
    who: Who,
    /// The output tokens its request was served, once it ended.
    tokens: Option<u64>,
    /// Given back already ([`Permit::release_at`]): dropping it does nothing more.
    released: bool,
}

impl Permit {
    /// Whether the slot was granted under this replica's share, not the whole limit.
    pub fn under_share(&self) -> bool {
        self.shared
    }

    /// Whose request holds it.
    pub fn who(&self) -> &Who {
        &self.who
    }

    /// Its request ended with `tokens` output tokens: its tenant's charge is made exact
    /// as the slot comes back (one lock for both).
    pub fn settle(&mut self, tokens: u64) {
        self.tokens = Some(tokens);
    }

    /// Gives the slot back as its request ended `at` (the clock read by the caller): as
    /// dropping it does, with no clock read of its own.
    pub fn release_at(mut self, at: Instant) {
        self.limiter.release(&self.who, true, self.tokens, Some(at));
        self.released = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.released {
            self.limiter.release(&self.who, true, self.tokens, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(limit: u64, max_queue: usize, timeout_ms: u64) -> Arc<Limiter> {
        Limiter::new(
            LimitConfig {
                initial: Some(limit),
                total: None,
                max_queue,
                queue_timeout: Duration::from_millis(timeout_ms),
                ageing: Duration::from_secs(5),
            },
            metrics::Histogram::noop(),
        )
    }

    /// A slot given back at a time the caller read is freed once, at that time: dropping
    /// the permit after does not free it again.
    #[test]
    fn a_permit_released_at_a_time_is_freed_once_then() {
        let l = limiter(2, 0, 100);
        let (a, b) = (
            l.try_acquire(&Who::default()),
            l.try_acquire(&Who::default()),
        );
        let at = Instant::now() - Duration::from_secs(3);
        a.unwrap().release_at(at);
        assert_eq!(l.stats().in_flight, 1);
        assert_eq!(l.lock().freed.back(), Some(&at));
        drop(b);
        assert_eq!(l.stats().in_flight, 0);
        assert_eq!(l.lock().freed.len(), 2);
        let last = *l.lock().freed.back().unwrap();
        assert!(last > at);
        // A time read before another slot came back is counted at that slot's: in order.
        l.try_acquire(&Who::default()).unwrap().release_at(at);
        assert_eq!(l.lock().freed.back(), Some(&last));
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_served_in_order_and_the_queue_is_bounded() {
        let l = limiter(2, 3, 60_000);
        let a = l.acquire(&Who::default()).await.unwrap();
        let _b = l.acquire(&Who::default()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (l, order) = (Arc::clone(&l), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let p = l.acquire(&Who::default()).await.unwrap();
                order.lock().unwrap().push(i);
                p
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(l.stats().queued, 3);
        assert_eq!(
            l.acquire(&Who::default()).await.err(),
            Some(Rejected::QueueFull)
        );
        drop(a);
        let first = tasks.remove(0).await.unwrap();
        assert_eq!(*order.lock().unwrap(), vec![0]);
        drop(first);
        let second = tasks.remove(0).await.unwrap();
        drop(second);
        let third = tasks.remove(0).await.unwrap();
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(l.stats().in_flight, 2);
        drop(third);
        assert_eq!(l.stats().rejected[Rejected::QueueFull as usize], 1);
        assert!(l.take_binding());
        assert!(!l.take_binding());
    }

    /// The controller hears of queueing the limit caused, not queueing on a share under it
    /// (a replica whose fleet's Redis is away, or that has just rejoined).
    #[tokio::test(start_paused = true)]
    async fn queueing_on_a_share_does_not_say_the_limit_binds() {
        let l = limiter(4, 10, 100);
        l.set_share(Some(1));
        let a = l.acquire(&Who::default()).await.unwrap();
        assert_eq!(
            l.acquire(&Who::default()).await.err(),
            Some(Rejected::QueueTimeout)
        );
        assert!(!l.take_binding());
        l.set_share(None);
        let _more: Vec<Permit> = [(); 3]
            .map(|_| l.try_acquire(&Who::default()).unwrap())
            .into();
        assert_eq!(
            l.acquire(&Who::default()).await.err(),
            Some(Rejected::QueueTimeout)
        );
        assert!(l.take_binding());
        drop(a);
    }

    /// A permit says whether a share was in force when it was granted, whether at once or
    /// from the queue.
    #[tokio::test(start_paused = true)]
    async fn a_permit_knows_whether_a_share_admitted_it() {
        let l = limiter(4, 10, 60_000);
        let whole = l.try_acquire(&Who::default()).unwrap();
        assert!(!whole.under_share());
        l.set_share(Some(2));
        let shared = l.acquire(&Who::default()).await.unwrap();
        assert!(shared.under_share());
        let l2 = Arc::clone(&l);
        let waiter =
            tokio::spawn(async move { l2.acquire(&Who::default()).await.unwrap().under_share() });
        tokio::task::yield_now().await;
        assert_eq!(l.stats().queued, 1);
        drop(whole);
        assert!(waiter.await.unwrap());
        drop(shared);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_runs_out() {
        let l = limiter(1, 10, 500);
        let _a = l.acquire(&Who::default()).await.unwrap();
        assert_eq!(
            l.acquire(&Who::default()).await.err(),
            Some(Rejected::QueueTimeout)
        );
        let s = l.stats();
        let timeouts = s.rejected[Rejected::QueueTimeout as usize];
        assert_eq!((s.queued, s.in_flight, timeouts), (0, 1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_leaves_the_queue_at_once_and_leaks_nothing() {
        let l = limiter(1, 10, 60_000);
        let a = l.acquire(&Who::default()).await.unwrap();
        let l2 = Arc::clone(&l);
        let waiter = tokio::spawn(async move { l2.acquire(&Who::default()).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(l.stats().queued, 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(l.stats().queued, 0);
        drop(a);
        assert_eq!(l.stats().in_flight, 0);
        // Granted but never taken: the slot comes back.
        let a = l.acquire(&Who::default()).await.unwrap();
        let l3 = Arc::clone(&l);
        let mut w = Box::pin(async move { l3.acquire(&Who::default()).await.map(|_| ()) });
        assert!(futures_poll_once(&mut w).await.is_none());
        drop(a); // grants the waiter, which is dropped before it runs
        drop(w);
        assert_eq!(l.stats().in_flight, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn raising_the_limit_admits_waiters_and_lowering_it_drains() {
        let l = limiter(1, 10, 60_000);
        let a = l.acquire(&Who::default()).await.unwrap();
        let l2 = Arc::clone(&l);
        let w = tokio::spawn(async move { l2.acquire(&Who::default()).await.map(|_| ()) });
        tokio::task::yield_now().await;
        l.set_limit(2);
        assert!(w.await.unwrap().is_ok());
        l.set_limit(1);
        let anyone = Who::default();
        let b = l.acquire(&anyone);
        drop(a);
        assert!(tokio::time::timeout(Duration::from_secs(1), b)
            .await
            .is_ok());
    }

    /// A slot freed by a tenant the queue owes is held for its next request for HOLD (the
    /// heavy tenant waiting meanwhile), then given to the queue.
    #[tokio::test(start_paused = true)]
    async fn a_slot_is_held_a_moment_for_the_tenant_the_queue_owes() {
        let l = limiter(2, 10, 60_000);
        let who = |t: &str| Who {
            tenant: Arc::from(t),
            ..Who::default()
        };
        let (heavy, light) = (who("heavy"), who("light"));
        let h1 = l.acquire(&heavy).await.unwrap();
        let mine = l.acquire(&light).await.unwrap();
        // The heavy tenant was served far more (as if a request of 1,000 had ended).
        l.lock().queue.ended(&heavy, Some(1000));
        l.lock().queue.charge(&heavy);
        let l2 = Arc::clone(&l);
        let waiter = tokio::spawn(async move { l2.acquire(&who("heavy")).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(l.stats().queued, 1);
        // The light tenant's request ends: its slot waits for its next one.
        drop(mine);
        tokio::task::yield_now().await;
        assert_eq!(l.stats().queued, 1);
        let again = l.try_acquire(&light).unwrap();
        assert_eq!((l.stats().queued, l.stats().in_flight), (1, 2));
        // Not coming back: after HOLD the queue has the slot.
        drop(again);
        tokio::time::sleep(HOLD * 2).await;
        assert!(waiter.await.unwrap().is_ok());
        // The waiter's slot was given back as it ended: only h1's remains, no hold leaked.
        assert_eq!(l.stats().in_flight, 1);
        drop(h1);
        assert_eq!(l.stats().in_flight, 0);
    }

    /// A pool's limit is each endpoint's times the endpoints that take requests, under its
    /// total; the queue waits for a freed slot of any of them, or for more endpoints.
    #[tokio::test(start_paused = true)]
    async fn a_pools_limit_follows_its_endpoints() {
        let l = limiter(2, 10, 60_000);
        l.set_members(3);
        assert_eq!((l.limit(), l.each()), (Some(6), Some(2)));
        let held: Vec<Permit> = (0..6)
            .map(|_| l.try_acquire(&Who::default()).unwrap())
            .collect();
        assert!(l.try_acquire(&Who::default()).is_none());
        let l2 = Arc::clone(&l);
        let w = tokio::spawn(async move { l2.acquire(&Who::default()).await.map(|_| ()) });
        tokio::task::yield_now().await;
        l.set_members(4);
        assert!(w.await.unwrap().is_ok());
        l.reconfigure(LimitConfig {
            initial: Some(2),
            total: Some(5),
            max_queue: 10,
            queue_timeout: Duration::from_secs(60),
            ageing: Duration::from_secs(5),
        });
        assert_eq!(l.limit(), Some(5));
        l.set_members(0);
        assert_eq!(l.limit(), Some(0));
        drop(held);
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut *f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
