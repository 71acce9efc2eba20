//! Caps that hold across replicas (`[cluster] redis_url`): every slot of a capped upstream
//! is a lease in Redis, a member of the sorted set `tokentap:UPSTREAM:leases` scored by its
//! expiry. Taking one is one Lua script (drop the expired, count, add if under the limit),
//! freeing one a `ZREM`: two round trips per request. Redis's own clock times the leases,
//! so replicas' clocks do not matter.
//!
//! Each replica renews the leases it holds every `lease_secs / 3` (one script per upstream;
//! it re-adds them too, so a Redis restarted empty learns them again), and says it is alive
//! in `tokentap:replicas`. A replica that dies stops renewing: its slots are free within
//! `lease_secs`.
//!
//! Each replica keeps its own FIFO queue (the local [`Limiter`], set to the fleet limit);
//! the request at its head waits for a fleet slot, asking again every 20 ms, in turn.
//!
//! Redis unreachable: each replica holds a local share, the limit ÷ the replicas seen in
//! the last minute (at least 1), says so once in the log and in
//! `tokentap_cluster_degraded`, and rejoins when Redis answers again. The share starts at
//! what the replica held when Redis went away, plus one, and grows by one a renewal period
//! up to limit ÷ replicas, so the fleet exceeds its limit by at most one slot per replica
//! while replicas that held more than their share drain. Slots taken meanwhile get leases
//! too, registered on rejoining, so none is lost and none leaks.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;

use super::{Limiter, Permit, Rejected};

/// How often the request at the head of the queue asks again for a fleet slot.
const RETRY: Duration = Duration::from_millis(20);
/// The longest one Redis call may take before the fleet counts as unreachable (a Redis
/// that is down fails at once; this is for one that hangs).
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

const ACQUIRE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  return 1
end
return 0
";

const RENEW: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
end
return #ARGV - 1
";

const ALIVE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
return redis.call('ZCARD', KEYS[1])
";

/// This replica's link to the fleet.
pub struct Cluster {
    client: redis::Client,
    conn: Mutex<Option<ConnectionManager>>,
    /// This replica's name in Redis.
    replica: String,
    lease: Duration,
    degraded: AtomicBool,
    replicas: AtomicU64,
    next_lease: AtomicU64,
    acquire: redis::Script,
    renew: redis::Script,
    alive: redis::Script,
}

/// One capped upstream's part of the fleet.
pub struct Fleet {
    cluster: Arc<Cluster>,
    key: String,
    /// The leases this replica holds.
    held: Mutex<HashSet<u64>>,
    /// The request whose turn it is to ask Redis (FIFO: tokio's mutex is fair).
    turn: tokio::sync::Mutex<()>,
}

/// A fleet slot: the local permit and its lease; dropping it frees both.
pub struct Slot {
    lease: Option<(Arc<Fleet>, u64)>,
    _permit: Permit,
}

impl Slot {
    pub fn local(permit: Permit) -> Slot {
        Slot {
            lease: None,
            _permit: permit,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((fleet, id)) = self.lease.take() {
            fleet.release(id);
        }
    }
}

// === impl Cluster ===

impl Cluster {
    pub fn new(url: &str, lease: Duration) -> anyhow::Result<Arc<Cluster>> {
        use rand::Rng;
        let replica = format!("{:016x}", rand::thread_rng().gen::<u64>());
        Ok(Arc::new(Cluster {
            client: redis::Client::open(url)?,
            conn: Mutex::new(None),
            replica,
            lease,
            degraded: AtomicBool::new(false),
            replicas: AtomicU64::new(1),
            next_lease: AtomicU64::new(0),
            acquire: redis::Script::new(ACQUIRE),
            renew: redis::Script::new(RENEW),
            alive: redis::Script::new(ALIVE),
        }))
    }

    pub fn degraded(&self) -> bool {
        self.degraded.load(Relaxed)
    }

    /// Replicas seen alive in the last minute (this one included).
    pub fn replicas(&self) -> u64 {
        self.replicas.load(Relaxed).max(1)
    }

    fn conn(&self) -> Option<ConnectionManager> {
        self.conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Redis failed: each replica holds its share until it answers again.
    /// `grow`: one renewal period has passed (the share may grow by one).
    fn degrade(&self, why: &str, fleets: &[(&Fleet, &Limiter)], grow: bool) {
        if !self.degraded.swap(true, Relaxed) {
            tracing::warn!(
                cause = why,
                replicas = self.replicas(),
                "cluster: Redis unreachable; each replica now holds its share of every cap (the limit / the replicas seen in the last minute)"
            );
        }
        for (fleet, limiter) in fleets {
            let fair = self.fair_share(limiter);
            let share = match limiter.share() {
                // Growing by one a period, to the fair share.
                Some(s) if grow => (s + 1).min(fair),
                Some(s) => s,
                // Starting from what this replica runs, plus one.
                None => (fleet.held_count() + 1).min(fair),
            };
            limiter.set_share(Some(share));
        }
    }

    fn fair_share(&self, limiter: &Limiter) -> u64 {
        limiter
            .limit()
            .map_or(u64::MAX, |l| (l / self.replicas()).max(1))
    }

    /// Every `lease / 3`: says this replica is alive, renews (and re-registers) the leases
    /// it holds, and rejoins the fleet when Redis is back. `fleets` gives the fleet part
    /// and limiter of every capped upstream in force.
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
            match self.renew_all(&fleets).await {
                Ok(replicas) => {
                    self.replicas.store(replicas.max(1), Relaxed);
                    if self.degraded.swap(false, Relaxed) {
                        tracing::info!(
                            replicas,
                            "cluster: Redis answers again; the fleet's caps hold again"
                        );
                    }
                    for (_, l) in &parts {
                        l.set_share(None);
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

    async fn renew_all(&self, fleets: &[(Arc<Fleet>, Arc<Limiter>)]) -> anyhow::Result<u64> {
        let mut conn = match self.conn() {
            Some(c) => c,
            None => {
                let c = tokio::time::timeout(
                    Duration::from_secs(2),
                    ConnectionManager::new(self.client.clone()),
                )
                .await
                .map_err(|_| anyhow::anyhow!("connecting timed out"))??;
                *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(c.clone());
                c
            }
        };
        let replicas: u64 = timed(
            self.alive
                .key("tokentap:replicas")
                .arg(&self.replica)
                .invoke_async(&mut conn),
        )
        .await?;
        for (fleet, _) in fleets {
            let held: Vec<u64> = fleet
                .held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .copied()
                .collect();
            if held.is_empty() {
                continue;
            }
            let mut call = self.renew.key(&fleet.key);
            call.arg(self.lease_ms());
            for id in held {
                call.arg(self.member(id));
            }
            let _: u64 = timed(call.invoke_async(&mut conn)).await?;
        }
        Ok(replicas)
    }

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX)
    }

    fn member(&self, id: u64) -> String {
        format!("{}:{id}", self.replica)
    }
}

/// A Redis call with [`CALL_TIMEOUT`].
async fn timed<T>(
    call: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => Ok(r?),
        Err(_) => anyhow::bail!("no answer in {CALL_TIMEOUT:?}"),
    }
}

// === impl Fleet ===

impl Fleet {
    pub fn new(cluster: &Arc<Cluster>, upstream: &str) -> Arc<Fleet> {
        Arc::new(Fleet {
            cluster: Arc::clone(cluster),
            key: format!("tokentap:{upstream}:leases"),
            held: Mutex::new(HashSet::new()),
            turn: tokio::sync::Mutex::new(()),
        })
    }

    /// A fleet slot for a request holding a local `permit`, waiting its turn until
    /// `deadline`. Degraded, the local permit (under the local share) is the slot.
    pub async fn slot(
        self: &Arc<Self>,
        limiter: &Arc<Limiter>,
        permit: Permit,
        deadline: Instant,
    ) -> Result<Slot, Rejected> {
        let c = &self.cluster;
        let id = c.next_lease.fetch_add(1, Relaxed);
        if !c.degraded() {
            let Some(mut conn) = c.conn() else {
                c.degrade("not connected yet", &[(self, limiter)], false);
                return self.share(limiter, permit, id).await;
            };
            let turn = self.turn.lock().await;
            // Redis went away while this request waited its turn.
            if c.degraded() {
                drop(turn);
                return self.share(limiter, permit, id).await;
            }
            loop {
                let limit = limiter.limit().unwrap_or(u64::MAX);
                let got: anyhow::Result<u64> = timed(
                    c.acquire
                        .key(&self.key)
                        .arg(limit)
                        .arg(c.lease_ms())
                        .arg(c.member(id))
                        .invoke_async(&mut conn),
                )
                .await;
                match got {
                    Ok(1) => return Ok(self.held(id, permit)),
                    Ok(_) if Instant::now() + RETRY < deadline => {
                        limiter.note_binding();
                        tokio::time::sleep(RETRY).await;
                    }
                    Ok(_) => {
                        limiter.note_binding();
                        return Err(Rejected::QueueTimeout);
                    }
                    Err(e) => {
                        c.degrade(&format!("{e:#}"), &[(self, limiter)], false);
                        drop(turn);
                        return self.share(limiter, permit, id).await;
                    }
                }
            }
        }
        Ok(self.held(id, permit))
    }

    /// Redis is away: the request gives back the local slot it took under the whole
    /// limit (many wait holding one) and takes one under this replica's share, in line.
    async fn share(
        self: &Arc<Self>,
        limiter: &Arc<Limiter>,
        permit: Permit,
        id: u64,
    ) -> Result<Slot, Rejected> {
        drop(permit);
        let permit = limiter.acquire().await?;
        Ok(self.held(id, permit))
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
            lease: Some((Arc::clone(self), id)),
            _permit: permit,
        }
    }

    fn release(self: &Arc<Self>, id: u64) {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        let c = &self.cluster;
        let (Some(mut conn), Ok(rt)) = (c.conn(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let (key, member) = (self.key.clone(), c.member(id));
        // Not waited for: if it fails, the lease is no longer renewed and expires.
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
}
