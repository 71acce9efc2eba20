//! Caps that hold across replicas (`[cluster] redis_url`): every slot of a capped upstream
//! is a lease in Redis, a member of the sorted set `tokentap:UPSTREAM:leases` scored by its
//! expiry. Taking one is one Lua script (drop the expired, count, add if under the limit),
//! freeing one a `ZREM`: two round trips per request, timed by Redis's own clock.
//!
//! Each replica renews the leases it holds every `lease_secs / 3` (one script per upstream;
//! it re-adds them too, so a Redis restarted empty learns them again), and says it is alive
//! in `tokentap:replicas`. A replica that dies stops renewing: its slots are free within
//! `lease_secs`.
//!
//! Each replica keeps its own queue (the local [`Limiter`], set to the fleet limit); the
//! request it serves next waits for a fleet slot, asking again every 20 ms, in turn.
//!
//! An adaptive cap is one limit for the fleet, moved by one replica from every replica's
//! evidence ([`control`]); a tenant's output-token budget one bucket ([`budget`]).
//!
//! Redis unreachable: each replica holds a local share, the limit ÷ the replicas seen in
//! the last minute (at least 1), says so once in the log and in
//! `tokentap_cluster_degraded`, and rejoins when Redis answers again. The share starts at
//! what the replica held when Redis went away, plus one, and grows by one a renewal period
//! up to limit ÷ replicas, so the fleet exceeds its limit by at most one slot per replica
//! while replicas that held more than their share drain. Slots taken meanwhile get leases
//! too, registered on rejoining, so none is lost and none leaks. Budget takes and
//! settlements Redis did not confirm are kept and replayed, each exactly once, before the
//! replica rejoins ([`budget`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;

use super::{Limiter, Permit, Rejected};

mod budget;
mod control;
mod endpoint;
mod fair;
mod placement;
mod wire;
use control::Control;
pub use control::Steer;
pub use fair::Claim;
use wire::{ACQUIRE, ALIVE, RENEW};

/// How often the request at the head of the queue asks again for a fleet slot.
const RETRY: Duration = Duration::from_millis(20);
/// The longest one Redis call may take before the fleet counts as unreachable (a Redis
/// that is down fails at once; this is for one that hangs).
const CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// How long `spill` trusts that the fleet was full without hearing it again (slots free on
/// other replicas without this one knowing); after that, requests try, and a refused one
/// says so again.
const FULL_FOR: Duration = Duration::from_secs(2);
/// This replica's link to the fleet.
pub struct FleetLink {
    client: redis::Client,
    conn: Mutex<Option<ConnectionManager>>,
    /// This replica's name in Redis.
    replica: String,
    lease: Duration,
    degraded: AtomicBool,
    /// Redis answered again: the shares stay one more period, so that replicas which have
    /// not yet re-registered their slots are counted before anyone takes more.
    rejoining: AtomicBool,
    replicas: AtomicU64,
    /// Whether `replicas` was ever read from Redis (before that the fleet's size is
    /// unknown, and a degraded share does not grow).
    replicas_known: AtomicBool,
    next_lease: AtomicU64,
    /// Every fleet part made, so leases are renewed for as long as any is held, across
    /// reloads that rename or uncap an upstream.
    fleets: Mutex<Vec<std::sync::Weak<Fleet>>>,
    connecting: tokio::sync::Mutex<()>,
    /// Connection attempts that failed (see [`FleetLink::connect`]).
    connect_failures: AtomicU64,
    started: Instant,
    /// The next budget call's id (its mark in Redis: [`budget`]).
    next_op: AtomicU64,
    /// Budget calls Redis has not confirmed, replayed by the keeper ([`budget`]).
    unsettled: Mutex<budget::Kept>,
    acquire: redis::Script,
    fair_acquire: redis::Script,
    renew: redis::Script,
    alive: redis::Script,
    report: redis::Script,
    set_limit: redis::Script,
}

/// One capped upstream's part of the fleet.
pub struct Fleet {
    cluster: Arc<FleetLink>,
    key: String,
    /// The leases this replica holds.
    held: Mutex<HashSet<u64>>,
    /// The request whose turn it is to ask Redis (FIFO: tokio's mutex is fair).
    turn: tokio::sync::Mutex<()>,
    /// Under an adaptive cap, admitted against the fleet's one limit (`limit_key`).
    adaptive: AtomicBool,
    /// The limit in force (for a renewal's `full`).
    limit: AtomicU64,
    /// The fleet held every slot when last asked (a refused lease, or a renewal's count):
    /// `spill` then looks elsewhere, for at most [`FULL_FOR`] unless told again. Cleared by
    /// a lease taken or a renewal that counts room.
    full: AtomicBool,
    /// When `full` was last set, ms since the cluster's start.
    full_at: AtomicU64,
    evidence_key: String,
    leader_key: String,
    limit_key: String,
    control: Mutex<Control>,
    /// With tenants: the fair share's keys, and each tenant's requests here waiting to ask.
    fair: fair::FairPart,
}

/// A lease being taken: dropped before it was (the request's future dropped mid-call, a
/// call timed out), it is taken back from Redis, where the script may have added it.
struct Pending<'a> {
    fleet: &'a Arc<Fleet>,
    id: u64,
    armed: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.fleet.forget(self.id);
        }
    }
}

/// What asking for one endpoint's lease found.
pub enum Leased {
    Held(Lease),
    /// The fleet holds the limit there.
    Full,
    /// Redis is away: the local cap holds alone.
    Away,
}

/// A lease on one endpoint of a pool, freed when dropped.
pub struct Lease {
    fleet: Arc<Fleet>,
    id: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.fleet.release(self.id);
    }
}

/// A fleet slot: its lease (freed first) and the local permit; dropping it frees both.
pub struct Slot {
    _lease: Option<Lease>,
    permit: Permit,
}

impl Slot {
    pub fn local(permit: Permit) -> Slot {
        Slot {
            _lease: None,
            permit,
        }
    }

    /// Its request ended with `tokens` output tokens (its tenant's charge made exact).
    pub fn settle(&mut self, tokens: u64) {
        self.permit.settle(tokens);
    }

    /// Given back as its request ended `at` ([`Permit::release_at`]), its lease first.
    pub fn release_at(self, at: Instant) {
        drop(self._lease);
        self.permit.release_at(at);
    }
}

// === impl FleetLink ===

impl FleetLink {
    pub fn new(url: &str, lease: Duration) -> anyhow::Result<Arc<FleetLink>> {
        use rand::Rng;
        let replica = format!("{:016x}", rand::thread_rng().gen::<u64>());
        Ok(Arc::new(FleetLink {
            client: redis::Client::open(url)?,
            conn: Mutex::new(None),
            replica,
            lease,
            degraded: AtomicBool::new(false),
            rejoining: AtomicBool::new(false),
            replicas: AtomicU64::new(1),
            replicas_known: AtomicBool::new(false),
            next_lease: AtomicU64::new(0),
            fleets: Mutex::new(Vec::new()),
            connecting: tokio::sync::Mutex::new(()),
            connect_failures: AtomicU64::new(0),
            started: Instant::now(),
            next_op: AtomicU64::new(0),
            unsettled: Mutex::default(),
            acquire: redis::Script::new(ACQUIRE),
            fair_acquire: redis::Script::new(fair::FAIR_ACQUIRE),
            renew: redis::Script::new(RENEW),
            alive: redis::Script::new(ALIVE),
            report: redis::Script::new(control::REPORT),
            set_limit: redis::Script::new(control::SET_LIMIT),
        }))
    }

    fn since_start(&self) -> u64 {
        millis(self.started.elapsed())
    }

    pub fn degraded(&self) -> bool {
        self.degraded.load(Relaxed)
    }

    /// Replicas seen alive in the last minute (this one included).
    pub fn replicas(&self) -> u64 {
        self.replicas.load(Relaxed).max(1)
    }

    /// The fleet parts still alive (held by the state in force or by running requests).
    fn all_fleets(&self) -> Vec<Arc<Fleet>> {
        let mut fleets = self.fleets.lock().unwrap_or_else(PoisonError::into_inner);
        fleets.retain(|f| f.strong_count() > 0);
        fleets.iter().filter_map(std::sync::Weak::upgrade).collect()
    }

    /// Redis failed: each replica holds its share until it answers again.
    /// `grow`: one renewal period has passed (the share may grow by one).
    fn degrade(&self, why: &str, fleets: &[(&Fleet, &Limiter)], grow: bool) {
        if !self.degraded.swap(true, Relaxed) {
            tracing::warn!(
                cause = why,
                replicas = self.replicas(),
                "cluster: Redis unreachable; each replica now holds its share of every cap and tenant budget (the limit / the replicas seen in the last minute)"
            );
        }
        self.rejoining.store(false, Relaxed);
        // Until the fleet's size has been read once, a share does not grow: a replica that
        // starts while Redis is away cannot know how many others hold slots.
        let grow = grow && self.replicas_known.load(Relaxed);
        for (fleet, limiter) in fleets {
            let fair = self.fair_share(limiter);
            match limiter.share() {
                // Growing by one a period, to the fair share.
                Some(s) if grow => limiter.set_share(Some((s + 1).min(fair))),
                Some(_) => {}
                // Starting from what this replica runs, plus one.
                None => limiter.start_share((fleet.held_count() + 1).min(fair)),
            }
        }
    }

    fn fair_share(&self, limiter: &Limiter) -> u64 {
        limiter
            .limit()
            .map_or(u64::MAX, |l| (l / self.replicas()).max(1))
    }

    /// Every `lease / 3`: says this replica is alive, renews (and re-registers) the leases
    /// it holds, replays the budget calls Redis has not confirmed, and rejoins the fleet
    /// when Redis is back. `fleets` gives the fleet part and limiter of every capped
    /// upstream in force.
    pub async fn keep(
        self: &Arc<Self>,
        fleets: impl Fn() -> Vec<(Arc<Fleet>, Arc<Limiter>)>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.lease / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let fleets = fleets();
            let parts: Vec<(&Fleet, &Limiter)> = fleets.iter().map(|(f, l)| (&**f, &**l)).collect();
            for (f, l) in &parts {
                f.limit.store(l.limit().unwrap_or(u64::MAX), Relaxed);
            }
            // The kept budget calls go in before the replica rejoins, so the fleet's buckets
            // are whole again before its requests spend them.
            let renewed = match self.renew_all().await {
                Ok(replicas) => self.replay().await.map(|()| replicas),
                Err(e) => Err(e),
            };
            match renewed {
                Ok(replicas) => {
                    self.replicas.store(replicas.max(1), Relaxed);
                    self.replicas_known.store(true, Relaxed);
                    if self.degraded.swap(false, Relaxed) {
                        tracing::info!(
                            replicas,
                            "cluster: Redis answers again; the fleet's caps and budgets hold again"
                        );
                        // The shares stay one more period (see `rejoining`).
                        self.rejoining.store(true, Relaxed);
                    } else if self.rejoining.swap(false, Relaxed)
                        || parts.iter().any(|(_, l)| l.share().is_some())
                    {
                        for (_, l) in &parts {
                            l.set_share(None);
                        }
                    }
                }
                Err(e) => {
                    // A fresh connection next time: the manager's own reconnection backs
                    // off for seconds, longer than a lease.
                    *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = None;
                    self.degrade(&format!("{e:#}"), &parts, true);
                }
            }
        }
    }

    async fn renew_all(&self) -> anyhow::Result<u64> {
        let mut conn = self.connect().await?;
        let replicas: u64 = timed(
            self.alive
                .key("tokentap:replicas")
                .arg(&self.replica)
                .invoke_async(&mut conn),
        )
        .await?;
        for fleet in self.all_fleets() {
            let held: Vec<u64> = fleet
                .held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .copied()
                .collect();
            // Holding none, it still learns whether the fleet has room (for `spill`).
            let mut call = self.renew.key(&fleet.key);
            call.arg(self.lease_ms());
            for &id in &held {
                call.arg(self.member(id));
            }
            let leases: u64 = timed(call.invoke_async(&mut conn)).await?;
            fleet.set_full(leases >= fleet.limit.load(Relaxed));
            // A lease freed while the renewal was on its way was added back by it.
            let freed: Vec<String> = {
                let now = fleet.held.lock().unwrap_or_else(PoisonError::into_inner);
                held.iter()
                    .filter(|id| !now.contains(id))
                    .map(|&id| self.member(id))
                    .collect()
            };
            if !freed.is_empty() {
                let _: u64 = timed(
                    redis::cmd("ZREM")
                        .arg(&fleet.key)
                        .arg(freed)
                        .query_async(&mut conn),
                )
                .await?;
            }
        }
        Ok(replicas)
    }

    fn lease_ms(&self) -> u64 {
        millis(self.lease)
    }

    fn member(&self, id: u64) -> String {
        format!("{}:{id}", self.replica)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A Redis call with [`CALL_TIMEOUT`].
async fn timed<T>(
    call: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> anyhow::Result<T> {
    // The shortest lease is 3 s, renewed every second: no call may take longer.
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => Ok(r?),
        Err(_) => anyhow::bail!("no answer in {CALL_TIMEOUT:?}"),
    }
}

// === impl Fleet ===

impl Fleet {
    pub fn new(cluster: &Arc<FleetLink>, upstream: &str) -> Arc<Fleet> {
        let fleet = Arc::new(Fleet {
            cluster: Arc::clone(cluster),
            key: format!("tokentap:{upstream}:leases"),
            held: Mutex::new(HashSet::new()),
            turn: tokio::sync::Mutex::new(()),
            adaptive: AtomicBool::new(false),
            full: AtomicBool::new(false),
            full_at: AtomicU64::new(0),
            limit: AtomicU64::new(u64::MAX),
            evidence_key: format!("tokentap:{upstream}:evidence"),
            leader_key: format!("tokentap:{upstream}:leader"),
            limit_key: format!("tokentap:{upstream}:limit"),
            control: Mutex::new(Control::default()),
            fair: fair::FairPart::new(upstream),
        });
        cluster
            .fleets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&fleet));
        fleet
    }

    /// A fleet slot for a request holding a local `permit`, waiting its turn until
    /// `deadline`; `fair`: with `[tenants]`, when the request arrived (the fleet's slots
    /// then go fairly between tenants: [`fair`]). Degraded, the local permit (under the
    /// local share) is the slot.
    pub async fn slot(
        self: &Arc<Self>,
        limiter: &Arc<Limiter>,
        permit: Permit,
        deadline: Instant,
        fair: Option<Instant>,
    ) -> Result<Slot, Rejected> {
        let c = &self.cluster;
        let id = c.next_lease.fetch_add(1, Relaxed);
        if c.degraded() {
            // A fleet the keeper has not given a share yet (another upstream's request
            // found Redis away, or a reload made it): it takes one now.
            if limiter.share().is_none() {
                c.degrade("unreachable", &[(self, limiter)], false);
            }
            // A permit taken under the whole limit before the share was set is not a slot
            // of the share: it queues again under it.
            if !permit.under_share() {
                return self.share(limiter, permit, id, deadline).await;
            }
            return Ok(self.held(id, permit));
        }
        let mut conn = match c.connect().await {
            Ok(conn) => conn,
            Err(e) => {
                c.degrade(&format!("{e:#}"), &[(self, limiter)], false);
                return self.share(limiter, permit, id, deadline).await;
            }
        };
        let _asking = fair.map(|_| self.fair.enter(&permit.who().tenant));
        let Ok(mut turn) = tokio::time::timeout_at(deadline.into(), self.turn.lock()).await else {
            limiter.note_binding();
            return Err(Rejected::QueueTimeout);
        };
        // Redis went away while this request waited its turn.
        if c.degraded() {
            drop(turn);
            return self.share(limiter, permit, id, deadline).await;
        }
        // Should this future be dropped mid-call (the client left), the script may have
        // added the lease: it is taken back.
        let mut pending = Pending {
            fleet: self,
            id,
            armed: true,
        };
        loop {
            let limit = limiter.limit().unwrap_or(u64::MAX);
            self.limit.store(limit, Relaxed);
            let mut call = match fair {
                Some(_) => c.fair_acquire.key(&self.key),
                None => c.acquire.key(&self.key),
            };
            call.key(&self.limit_key);
            // With `adaptive`, the fleet's limit as it is now, when its leader has set one.
            (call.arg(limit).arg(c.lease_ms()).arg(c.member(id)))
                .arg(limiter.members().max(1))
                .arg(u8::from(self.adaptive.load(Relaxed)));
            let got: anyhow::Result<u64> = match fair {
                Some(since) => {
                    self.ask_fair(call, &mut conn, limiter, permit.who(), since)
                        .await
                }
                None => timed(call.invoke_async(&mut conn)).await,
            };
            self.set_full(matches!(got, Ok(0)));
            match got {
                Ok(1) => {
                    pending.armed = false;
                    return Ok(self.held(id, permit));
                }
                // With tenants, a refused request passes the turn on (another tenant is
                // owed the slot, or the fleet is full: every tenant waiting here then asks,
                // so the fleet knows who wants one) and asks again after.
                Ok(n) if fair.is_some() && Instant::now() + RETRY < deadline => {
                    if n == 0 {
                        limiter.note_binding();
                    }
                    drop(turn);
                    tokio::time::sleep(RETRY).await;
                    let next = tokio::time::timeout_at(deadline.into(), self.turn.lock());
                    let Ok(next) = next.await else {
                        pending.armed = false;
                        limiter.note_binding();
                        return Err(Rejected::QueueTimeout);
                    };
                    turn = next;
                }
                Ok(_) if Instant::now() + RETRY < deadline => {
                    limiter.note_binding();
                    tokio::time::sleep(RETRY).await;
                }
                Ok(_) => {
                    pending.armed = false;
                    limiter.note_binding();
                    return Err(Rejected::QueueTimeout);
                }
                Err(e) => {
                    // Timed out, the script may still have run: `pending` frees it.
                    c.degrade(&format!("{e:#}"), &[(self, limiter)], false);
                    drop(turn);
                    drop(pending);
                    return self.share(limiter, permit, id, deadline).await;
                }
            }
        }
    }

    /// Whether a request here would find a fleet slot, as far as this replica last heard
    /// (degraded: its share decides, locally).
    pub fn has_room(&self) -> bool {
        let c = &self.cluster;
        c.degraded()
            || !self.full.load(Relaxed)
            || c.since_start() > self.full_at.load(Relaxed) + millis(FULL_FOR)
    }

    fn set_full(&self, full: bool) {
        if full {
            self.full_at.store(self.cluster.since_start(), Relaxed);
        }
        self.full.store(full, Relaxed);
    }

    /// Whether the upstream holds an adaptive cap (its limit is then the fleet's one).
    pub fn set_adaptive(&self, adaptive: bool) {
        self.adaptive.store(adaptive, Relaxed);
    }

    /// Redis is away: the request gives back the local slot it took under the whole
    /// limit (many wait holding one) and takes one under this replica's share, in line.
    async fn share(
        self: &Arc<Self>,
        limiter: &Arc<Limiter>,
        permit: Permit,
        id: u64,
        deadline: Instant,
    ) -> Result<Slot, Rejected> {
        let who = permit.who().clone();
        drop(permit);
        match tokio::time::timeout_at(deadline.into(), limiter.acquire(&who)).await {
            Ok(permit) => Ok(self.held(id, permit?)),
            Err(_) => Err(Rejected::QueueTimeout),
        }
    }

    /// Frees lease `id` in Redis, in the background (also one a request may have been
    /// added without getting).
    fn forget(self: &Arc<Self>, id: u64) {
        let c = &self.cluster;
        let (Some(mut conn), Ok(rt)) = (c.conn(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let (key, member) = (self.key.clone(), c.member(id));
        rt.spawn(async move {
            let _: anyhow::Result<u64> = timed(
                redis::cmd("ZREM")
                    .arg(key)
                    .arg(member)
                    .query_async(&mut conn),
            )
            .await;
        });
    }

    fn held_count(&self) -> u64 {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len() as u64
    }

    fn held(self: &Arc<Self>, id: u64, permit: Permit) -> Slot {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id);
        Slot {
            _lease: Some(Lease {
                fleet: Arc::clone(self),
                id,
            }),
            permit,
        }
    }

    /// A request ended: its lease is no longer renewed, and is freed in Redis (not waited
    /// for: if that fails, the lease expires).
    fn release(self: &Arc<Self>, id: u64) {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        self.forget(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::LimitConfig;

    /// Requests that took a local slot under the whole limit before Redis was found away
    /// queue again under the share: the share admits one, not every request that was
    /// already on its way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slots_taken_before_the_share_queue_again_under_it() {
        // Nothing listens here: Redis is away from the start.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster =
            FleetLink::new(&format!("redis://127.0.0.1:{port}"), Duration::from_secs(3)).unwrap();
        let fleet = Fleet::new(&cluster, "u");
        let limiter = Limiter::new(
            LimitConfig {
                total: None,
                initial: Some(16),
                max_queue: 10,
                queue_timeout: Duration::from_secs(30),
                ageing: Duration::from_secs(5),
            },
            metrics::Histogram::noop(),
        );
        let mut permits: Vec<Permit> = (0..3)
            .map(|_| limiter.try_acquire(&crate::tenant::Who::default()).unwrap())
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        let slot = |permit: Permit| {
            let (fleet, limiter) = (Arc::clone(&fleet), Arc::clone(&limiter));
            tokio::spawn(async move { fleet.slot(&limiter, permit, deadline, None).await })
        };
        // The first finds Redis away and sets the share; the other two arrive after it.
        let mut tasks = vec![slot(permits.remove(0))];
        let settled = Instant::now() + Duration::from_secs(10);
        while !cluster.degraded() {
            assert!(Instant::now() < settled, "Redis never found away");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tasks.extend(permits.into_iter().map(slot));
        loop {
            let s = limiter.stats();
            let done = tasks.iter().filter(|t| t.is_finished()).count() as u64;
            // Settled: every request holds a slot (finished) or waits for one.
            if s.queued + done == 3 && s.in_flight == done {
                assert_eq!((s.in_flight, s.queued), (1, 2), "the share is 1");
                break;
            }
            assert!(Instant::now() < settled, "never settled: {s:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(cluster.degraded());
        assert_eq!(limiter.share(), Some(1));
        for t in tasks {
            t.abort();
        }
    }
}
