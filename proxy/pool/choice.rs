//! Which endpoint a request goes to: the balance's choice among the endpoints that take
//! requests, a generation request's slot taken under its endpoint's cap or not at all (a
//! request that finds every endpoint full waits for one to free), and with `[cluster]` the
//! slot's lease in Redis.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use super::endpoint::Freed;
use super::{lock, Endpoint, Held, Keyed, Pool, Unplaced};
use crate::config::{Balance, EndpointAddr};
use crate::limit::fleet::Leased;
use crate::meter::Nanos;
use crate::prefix;

// === impl Pool ===

impl Pool {
    /// What of a request picks its endpoint: a header's value (`consistent_hash`), the
    /// prompt (`prefix`), or nothing (by load alone).
    pub fn keyed_by(&self) -> Keyed {
        match &self.settings.load().balance {
            Balance::ConsistentHash(name) => Keyed::Header(name.clone()),
            Balance::Prefix => Keyed::Prompt,
            Balance::LeastLoaded | Balance::RoundRobin | Balance::SloHeadroom => Keyed::Nothing,
        }
    }

    /// An endpoint for a request (`slot`: a generation request, which holds a slot there
    /// under its cap), by the pool's balance, never `avoid` (where its connect just
    /// failed). `key`: the hash header's value, with `consistent_hash`.
    pub fn pick(
        &self,
        now: Nanos,
        slot: bool,
        key: Option<&[u8]>,
        avoid: &[Arc<Endpoint>],
    ) -> Result<Held, Unplaced> {
        let members = self.members.load();
        let avoided = |e: &Endpoint| avoid.iter().any(|a| std::ptr::eq(&**a, e));
        // Panic mode when none takes requests: every endpoint that passes its checks.
        let panic = !members.iter().any(|e| !avoided(e) && e.eligible(now));
        let takes = |e: &Endpoint| {
            !avoided(e)
                && if panic {
                    e.healthy.load(Relaxed)
                } else {
                    e.eligible(now)
                }
        };
        let each = self.limiter.each();
        // A generation request takes a slot under the cap; others only go there.
        let room = |e: &Endpoint| !slot || e.take_slot(each);
        if !members.iter().any(|e| takes(e)) {
            return Err(Unplaced::NoEndpoint);
        }
        match self.choose(&members, (now, each), key, &takes, &room) {
            Some(e) => Ok(Held::new(Arc::clone(e), slot)),
            None => Err(Unplaced::Full),
        }
    }

    /// [`Pool::pick`], waiting up to `wait` for a slot when every endpoint is at its cap:
    /// woken when a slot frees (and at the pool's tick, when an ejection ends or a cap
    /// rises). The pool's limit makes that wait rare and short: the endpoints' slots never
    /// outnumber the pool's, except when a failover or a lowered cap moves requests.
    pub async fn pick_within(
        &self,
        slot: bool,
        key: Option<&[u8]>,
        avoid: &[Arc<Endpoint>],
        wait: Duration,
    ) -> Result<Held, Unplaced> {
        // The common case, with room: no waiting set up.
        match self.pick(self.clock.now(), slot, key, avoid) {
            Err(Unplaced::Full) => {}
            placed => return placed,
        }
        let deadline = tokio::time::Instant::now() + wait;
        let freed = &self.freed;
        loop {
            // Waiting is announced, and the wake-up armed, before the endpoints are looked
            // at: a slot freed after the look wakes it.
            freed
                .waiting
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _waiting = Waiting(freed);
            let mut woken = std::pin::pin!(freed.notify.notified());
            woken.as_mut().enable();
            match self.pick(self.clock.now(), slot, key, avoid) {
                Err(Unplaced::Full) => {
                    if tokio::time::timeout_at(deadline, woken).await.is_err() {
                        return Err(Unplaced::Full);
                    }
                }
                placed => return placed,
            }
        }
    }

    /// With `[cluster]` and a cap, the endpoint's slot as a lease in Redis too, so that
    /// each endpoint's cap holds across every tokentap of the fleet: `held`'s endpoint, or,
    /// when the fleet holds its cap there, the next the balance picks (the pool's own
    /// lease, taken first, says one has room). Redis away: the local caps hold alone.
    pub async fn lease(&self, mut held: Held, key: Option<&[u8]>) -> Held {
        let (Some(cluster), Some(each)) = (&self.cluster, self.limiter.each()) else {
            return held;
        };
        if !held.holds_slot() || self.members.load().len() < 2 {
            // One endpoint: the pool's lease is its lease.
            return held;
        }
        let mut tried = Vec::new();
        loop {
            let fleet = held.endpoint.fleet(cluster, &self.name);
            let cap = held.endpoint.cap(Some(each)).unwrap_or(each);
            // Boxed: a Redis call is a large future, and inline it would make every
            // request's preparing ~3 KiB larger, copied into its box each time.
            let leased = Box::pin(fleet.try_lease(cap));
            match leased.await {
                Leased::Held(lease) => {
                    held.lease = Some(lease);
                    return held;
                }
                Leased::Away => return held,
                Leased::Full => {
                    tried.push(Arc::clone(&held.endpoint));
                    match self.pick(self.clock.now(), true, key, &tried) {
                        Ok(next) => held = next,
                        // Every one full as far as Redis counts now (leases freed a moment
                        // ago elsewhere): this one, over the fleet's count.
                        Err(_) => return held,
                    }
                }
            }
        }
    }

    /// The endpoint `balance` picks among those `takes` allows, where `room` takes its slot;
    /// the least loaded with room when the balance's choice has none; `None` when none has.
    fn choose<'a>(
        &self,
        members: &'a [Arc<Endpoint>],
        (now, each): (Nanos, Option<u64>),
        key: Option<&[u8]>,
        takes: &dyn Fn(&Endpoint) -> bool,
        room: &dyn Fn(&Endpoint) -> bool,
    ) -> Option<&'a Arc<Endpoint>> {
        let n = members.iter().filter(|e| takes(e)).count();
        if n == 0 {
            return None;
        }
        let nth = |k: usize| members.iter().filter(|e| takes(e)).nth(k);
        let least = |candidates: Vec<&'a Arc<Endpoint>>| {
            let mut by_load = candidates;
            by_load.sort_by(|a, b| a.load(each).total_cmp(&b.load(each)));
            by_load.into_iter().find(|e| room(e))
        };
        let settings = self.settings.load();
        let picked = match (&settings.balance, key) {
            (Balance::RoundRobin, _) => {
                let start = self.next.fetch_add(1, Relaxed) % n;
                (0..n)
                    .filter_map(|i| nth((start + i) % n))
                    .find(|e| room(e))
            }
            (Balance::ConsistentHash(_), Some(key)) => {
                // Rendezvous: the endpoint whose hash with the key is highest, among those
                // under their cap (uncapped: under twice the pool's mean load): an endpoint
                // that leaves moves only its own keys.
                let total: u64 = (members.iter().filter(|e| takes(e)))
                    .map(|e| e.in_flight())
                    .sum();
                let bound = each.unwrap_or_else(|| (2 * (total + 1)).div_ceil(n as u64));
                let mut ranked: Vec<(u64, &Arc<Endpoint>)> = (members.iter())
                    .filter(|e| takes(e))
                    .map(|e| (rendezvous(key, &e.at), e))
                    .collect();
                ranked.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
                (ranked.into_iter())
                    .map(|(_, e)| e)
                    .find(|e| e.in_flight() < bound && room(e))
            }
            (Balance::Prefix, Some(prompt)) => self.by_prefix(members, each, prompt, takes, room),
            (Balance::SloHeadroom, _) => match &settings.headroom {
                Some(h) => self.by_headroom(h, members, now, takes, room),
                None => None,
            },
            (Balance::LeastLoaded | Balance::ConsistentHash(_) | Balance::Prefix, _) => {
                let first = if n == 1 {
                    nth(0)
                } else {
                    // Power of two choices: two distinct endpoints at random, the less
                    // loaded one.
                    let a = rand::random::<usize>() % n;
                    let b = (a + 1 + rand::random::<usize>() % (n - 1)) % n;
                    let (a, b) = (nth(a)?, nth(b)?);
                    Some(if b.load(each) < a.load(each) { b } else { a })
                };
                match first {
                    Some(e) if room(e) => Some(e),
                    // It had no room: the least loaded with room.
                    _ => least(members.iter().filter(|e| takes(e)).collect()),
                }
            }
        };
        picked.or_else(|| least(members.iter().filter(|e| takes(e)).collect()))
    }
}

// === impl Pool: prefix affinity ===

impl Pool {
    /// `balance = "prefix"`: the endpoint that most likely holds `prompt`'s prefix in its
    /// KV cache (the most leading blocks of it in the endpoint's index of the prompts it
    /// was sent), among those not far over the pool's mean in flight; a prefix none holds
    /// goes where the rendezvous hash of its first block says, the same in every tokentap
    /// of a fleet, so that replicas of tokentap agree without asking each other. The
    /// prompt's blocks are then kept in the chosen endpoint's index. `None`: none under the
    /// bound has room (the caller takes the least loaded).
    fn by_prefix<'a>(
        &self,
        members: &'a [Arc<Endpoint>],
        each: Option<u64>,
        prompt: &[u8],
        takes: &dyn Fn(&Endpoint) -> bool,
        room: &dyn Fn(&Endpoint) -> bool,
    ) -> Option<&'a Arc<Endpoint>> {
        let chain: Vec<u64> = prefix::blocks(prompt, PREFIX_BLOCK_BYTES, PREFIX_BLOCKS).collect();
        let first = *chain.first()?;
        let open: Vec<&Arc<Endpoint>> = members.iter().filter(|e| takes(e)).collect();
        let n = open.len() as u64;
        let total: u64 = open.iter().map(|e| e.in_flight()).sum();
        // Bounded load: a hot prefix spills over rather than piling onto one replica
        // (consistent hashing that ignored load drove one engine's hit rate from 98% to 5%),
        // past 1.5× the pool's mean in flight and two more: the random ups and downs of a
        // replica's share do not spill (each spill is a miss there, and evicts what it
        // held).
        let bound = (3 * (total + 1)).div_ceil(2 * n.max(1)) + 2;
        let bound = each.map_or(bound, |cap| bound.min(cap));
        let mut most = 0;
        let mut ranked: Vec<(usize, u64, &Arc<Endpoint>)> = (open.into_iter())
            .filter_map(|e| {
                let held = lock(&e.prefixes).leading(&chain);
                most = most.max(held);
                let tie = rendezvous(&first.to_le_bytes(), &e.at);
                (e.in_flight() < bound).then_some((held, tie, e))
            })
            .collect();
        ranked.sort_unstable_by_key(|&(held, tie, _)| std::cmp::Reverse((held, tie)));
        // A prefix none holds: of its two rendezvous choices, the one that holds less
        // (two choices spread the prefixes over the replicas far more evenly than one, and
        // every tokentap weighs the same two; with `[cluster]`, [`Pool::place`] has made
        // the fleet's choice one that holds it).
        if ranked.first().is_some_and(|r| r.0 == 0) {
            lighter_first(&mut ranked, |r| r.2);
        }
        let (held, _, chosen) = ranked.into_iter().find(|(_, _, e)| room(e))?;
        // A spill (another endpoint holds more of it) is not learnt: the prefix's home
        // stays where it was, the same in every tokentap (learnt, a spill to an endpoint
        // that ranks higher by rendezvous would move the prefix there for good in this
        // tokentap alone, and two tokentaps would split it over two replicas).
        if held == most {
            lock(&chosen.prefixes).admit(chain);
        }
        Some(chosen)
    }
}

// === impl Pool: prefix placement across the fleet ===

impl Pool {
    /// With `[cluster]`, under `balance = "prefix"` (the caller's: its key is the prompt):
    /// a prompt whose prefix no endpoint's
    /// index holds is placed where the fleet placed it, so that every tokentap in front of
    /// the pool sends it to one replica (each choosing alone, two could pick the two
    /// replicas of its two rendezvous choices). One Redis round trip, on this tokentap's
    /// first sight of a prefix; [`Pool::pick`] then finds it in that endpoint's index.
    /// Redis away: this tokentap places it alone.
    pub async fn place(&self, now: Nanos, prompt: &[u8]) {
        let Some(cluster) = &self.cluster else {
            return;
        };
        let Some(first) = prefix::blocks(prompt, PREFIX_BLOCK_BYTES, 1).next() else {
            return;
        };
        let members = self.members.load_full();
        let open: Vec<&Arc<Endpoint>> = members.iter().filter(|e| e.eligible(now)).collect();
        if open.len() < 2 || open.iter().any(|e| lock(&e.prefixes).leading(&[first]) > 0) {
            return;
        }
        // Its two rendezvous choices, as `by_prefix` ranks them; the fleet weighs the two.
        let mut ranked: Vec<(u64, &Arc<Endpoint>)> = (open.iter())
            .map(|e| (rendezvous(&first.to_le_bytes(), &e.at), *e))
            .collect();
        ranked.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
        let choices = [ranked[0].1.at.url.as_str(), ranked[1].1.at.url.as_str()];
        let urls: Vec<&str> = open.iter().map(|e| e.at.url.as_str()).collect();
        // Boxed, as leasing: a Redis call is a large future, and inline it would make every
        // request's preparing ~3 KiB larger, copied into its box each time.
        let placed = Box::pin(cluster.place_prefix(&self.name, first, choices, &urls));
        if let Ok(url) = placed.await {
            if let Some(e) = open.iter().find(|e| e.at.url == url) {
                lock(&e.prefixes).admit([first]);
            }
        }
    }
}

/// A prefix none holds goes to the one of its two rendezvous choices (`ranked`'s first
/// two, by rendezvous) that holds less: its index's blocks, then its requests in flight.
fn lighter_first<T>(ranked: &mut [T], endpoint: impl Fn(&T) -> &Endpoint) {
    let holds = |e: &Endpoint| (lock(&e.prefixes).len(), e.in_flight());
    if ranked.len() >= 2 && holds(endpoint(&ranked[1])) < holds(endpoint(&ranked[0])) {
        ranked.swap(0, 1);
    }
}

/// A prompt block: 256 bytes, about 64 tokens (the prompt's JSON as it came, so the same
/// client's same conversation is the same chain).
const PREFIX_BLOCK_BYTES: usize = 256;
/// Blocks of a prompt looked at, at most: its first 16 KiB, a system prompt and the first
/// turns of a conversation (telling a longer shared prefix apart gains no choice, and
/// hashing 32 KiB made the choice cost 2.3 µs; `cargo bench --bench prefix`).
const PREFIX_BLOCKS: usize = 64;

/// Counts a request out of a pool's waiters however its wait ends.
struct Waiting<'a>(&'a Freed);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0
            .waiting
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The rendezvous score of `key` on an endpoint: a fixed hash of both (the same in every
/// tokentap of a fleet).
fn rendezvous(key: &[u8], at: &EndpointAddr) -> u64 {
    let mut h = foldhash::fast::FixedState::with_seed(0x746f_6b65_6e74_6170).build_hasher();
    h.write(key);
    h.write(at.url.as_bytes());
    h.finish()
}
