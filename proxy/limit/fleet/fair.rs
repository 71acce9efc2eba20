//! Fair shares across the fleet (`[tenants]` with `[cluster]`): each replica's queue is
//! fair between the tenants it sees ([`crate::limit`]'s fair queue), and the fleet's slots
//! go to the tenant the fleet has served least, whichever replica its requests wait at.
//!
//! The request whose turn it is to ask for a lease names its tenant, its band and its
//! tenant's charge for a slot (its mean output tokens over its weight). The script keeps,
//! per upstream:
//! - `tokentap:UPSTREAM:served`, each tenant's weighted output tokens served by the fleet
//!   (charged at each lease; a hash, dropped when it passes [`SERVED_KEPT`] tenants or
//!   idles 10 minutes, as every counter then starts again from the fleet's virtual time);
//! - `tokentap:UPSTREAM:vtime`, the counter of the tenant served last: a tenant that starts
//!   waiting is lifted to it (VTC's lift, so one idle a while does not take every slot);
//! - `tokentap:UPSTREAM:asked`, when each tenant last asked: one silent for 2 s is idle,
//!   and lifted when it asks again (a backlogged tenant's requests can be held a few
//!   hundred ms behind others at its replica: it must not be lifted then);
//! - `tokentap:UPSTREAM:wanting`, the tenants with requests still to serve (refused, or
//!   granted with more waiting), ranked by band then counter; one silent for 200 ms (its
//!   replica gone, its requests served) is dropped.
//!
//! The answer carries the tenant's counter in the fleet, which the replica's own fair
//! queue takes as its tenant's: a tenant served much elsewhere waits here behind one that
//! was not.
//!
//! A lease goes to the asker unless a tenant ranked before it is wanting: then the asker
//! is refused (2) and asks again in 20 ms, as when the fleet is full, and the slot waits
//! for the owed tenant's replica, at most one retry period. A request past the ageing bound
//! ranks before every band.

use super::wire::lease_head;
use super::{timed, Limiter};
use crate::tenant::{Tenant, Who};

/// How many tenants' counters the fleet keeps before it starts them all again.
const SERVED_KEPT: u64 = 16_384;

/// `KEYS`: leases, the fleet's limit, wanting, asked, served, vtime. `ARGV`: limit,
/// lease ms, member, endpoints, adaptive, then tenant, band (-1 aged, 0 high … 2 low),
/// charge, whether more of the tenant's requests wait at the asker's replica (1/0), and
/// the counters kept. `{1, counter}`: leased; `{0, counter}`: the fleet is full; `{2,
/// counter}`: another tenant is owed it (the counter: the tenant's in the fleet, after).
pub(super) const FAIR_ACQUIRE: &str = concat!(
    lease_head!(),
    r"
local tenant = ARGV[6]
local rank = (tonumber(ARGV[7]) + 1) * 1e13
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - 200)) do
  redis.call('ZREM', KEYS[3], m)
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - 2000)
if redis.call('HLEN', KEYS[5]) > tonumber(ARGV[10]) then
  redis.call('DEL', KEYS[5])
end
local served = tonumber(redis.call('HGET', KEYS[5], tenant) or '0')
local vtime = tonumber(redis.call('GET', KEYS[6]) or '0')
if not redis.call('ZSCORE', KEYS[4], tenant) and served < vtime then
  served = vtime
end
redis.call('ZADD', KEYS[4], now, tenant)
local function want(s)
  redis.call('ZADD', KEYS[3], rank + s, tenant)
  redis.call('HSET', KEYS[5], tenant, tostring(s))
end
local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
if first[1] and first[1] ~= tenant and tonumber(first[2]) < rank + served then
  want(served)
  return {2, tostring(served)}
end
if redis.call('ZCARD', KEYS[1]) >= limit then
  want(served)
  return {0, tostring(served)}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
if served > vtime then
  redis.call('SET', KEYS[6], tostring(served), 'PX', 600000)
end
served = served + tonumber(ARGV[8])
if ARGV[9] == '1' then
  want(served)
else
  redis.call('HSET', KEYS[5], tenant, tostring(served))
  redis.call('ZREM', KEYS[3], tenant)
end
redis.call('PEXPIRE', KEYS[5], 600000)
return {1, tostring(served)}
"
);

/// What a request's tenant asks of the fleet with its lease (see [`crate::limit::Limiter::claim`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    pub tenant: Tenant,
    /// -1 past the ageing bound, else its priority's band (0 high, 1 normal, 2 low).
    pub band: i8,
    /// What a slot costs its tenant's counter: its mean output tokens over its weight.
    pub charge: f64,
    /// More of its tenant's requests wait at this replica.
    pub more: bool,
}

impl super::Fleet {
    /// Asks [`FAIR_ACQUIRE`] (`call`: its leases' and limit's part) for `who`'s request,
    /// waiting since `since`; the fleet's counter for its tenant handed to `limiter`'s fair
    /// queue. 1: leased; 0: full; 2: another tenant is owed the slot.
    pub(super) async fn ask_fair(
        &self,
        mut call: redis::ScriptInvocation<'_>,
        conn: &mut redis::aio::ConnectionManager,
        limiter: &Limiter,
        who: &Who,
        since: std::time::Instant,
    ) -> anyhow::Result<u64> {
        for k in &self.fair.keys {
            call.key(k);
        }
        let mut claim = limiter.claim(who, since);
        claim.more |= self.fair.others(&who.tenant);
        (call.arg(&*claim.tenant).arg(claim.band).arg(claim.charge))
            .arg(u8::from(claim.more))
            .arg(SERVED_KEPT);
        let (code, served): (u64, String) = timed(call.invoke_async(conn)).await?;
        limiter.served_in_fleet(who, served.parse().unwrap_or(0.0));
        Ok(code)
    }
}

/// An upstream's part of the fleet's fair share: the keys of [`FAIR_ACQUIRE`] after the
/// leases' and the limit's, and each tenant's requests at this replica waiting to ask for
/// a fleet slot (one asks at a time).
pub(super) struct FairPart {
    keys: [String; 4],
    asking: std::sync::Mutex<std::collections::HashMap<Tenant, u32>>,
}

/// One request counted in [`FairPart`] until dropped.
pub(super) struct Entered<'a>(&'a FairPart, Tenant);

impl FairPart {
    pub(super) fn new(upstream: &str) -> FairPart {
        FairPart {
            keys: ["wanting", "asked", "served", "vtime"]
                .map(|k| format!("tokentap:{upstream}:{k}")),
            asking: std::sync::Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<Tenant, u32>> {
        self.asking
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn enter(&self, tenant: &Tenant) -> Entered<'_> {
        *self.lock().entry(tenant.clone()).or_default() += 1;
        Entered(self, tenant.clone())
    }

    /// Whether requests of `tenant` other than the one asking wait here.
    pub(super) fn others(&self, tenant: &Tenant) -> bool {
        self.lock().get(tenant).is_some_and(|&n| n > 1)
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut map = self.0.lock();
        if let Some(n) = map.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.1);
            }
        }
    }
}
