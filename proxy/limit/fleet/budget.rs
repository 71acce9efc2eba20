//! Output-token budgets across the fleet (`[tenants] output_tokens_per_minute` with
//! `[cluster]`): each tenant's token bucket is one hash in Redis
//! (`tokentap:budget:TENANT`), taken from and given back to by Lua scripts on Redis's own
//! clock, so every tokentap of the fleet spends one budget. A call that fails marks the
//! fleet degraded (one log line, as the caps do): each replica then spends its share of the
//! budget locally until the keeper hears Redis again.
//!
//! Every take and every settlement runs exactly once, however Redis goes away. Each call
//! carries an id (`tokentap:budget:op:REPLICA:ID`) that its script marks in the same
//! script: a call whose mark is already there is a no-op. A settlement Redis has not
//! confirmed (no answer in time, no connection, or the fleet already degraded) is kept in
//! the [`FleetLink`] and replayed under its own id by the keeper, oldest first, once a
//! renewal succeeds and before the replica rejoins: a call that timed out here may still
//! run on Redis (a paused Redis runs what was written to it when it resumes), and the mark
//! makes the replay and the late copy one settlement, whichever runs first. A take that got
//! no answer is cancelled the same way (the request went on under the local share): a
//! cancel that runs first marks the take cancelled, so a late take takes nothing; one that
//! runs after gives back what the take took. Still one round trip per take and per
//! settlement; Redis keeps at most two small keys per request, each for `lease_secs` + 60 s
//! (a replay's for [`REPLAYED_MARK`]).
//!
//! Not covered: a call Redis ran whose answer was lost, Redis then away for longer than
//! that mark lives, counts twice; kept settlements live in the replica's memory, so one that
//! exits while Redis is away loses them (the buckets refill within a minute); past
//! [`UNSETTLED`] kept calls, new ones are dropped (logged).

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, LazyLock, PoisonError};
use std::time::Duration;

use super::{millis, timed, FleetLink};
use crate::tenant::budget::{FleetBuckets, Taken};

/// How long a replay's mark lives: longer than TCP goes on retransmitting a call written
/// before Redis went away (Linux gives up after about 15 minutes), so a late copy of it is
/// a no-op too.
const REPLAYED_MARK: Duration = Duration::from_secs(20 * 60);
/// Calls kept unconfirmed at most (they number the budget calls in flight when Redis went
/// away and the reservations then open, each once).
const UNSETTLED: usize = 65_536;
/// Kept calls replayed at most per renewal period (one round trip each), so that the
/// leases' renewal is never held up long.
const REPLAY: usize = 1_024;

/// The head of a bucket script: Redis's clock in `now`, the bucket of `ARGV[1]` (`cap`)
/// tokens a minute in `KEYS[1]` as `tokens` left at its last use, and what has dripped in
/// since as `refill`.
macro_rules! bucket_head {
    () => {
        r"
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARGV[1])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1]) or cap
local refill = (now - (tonumber(b[2]) or now)) * cap / 60000
"
    };
}

/// Stores the bucket's `tokens` at `now`, kept two minutes from its last use.
macro_rules! bucket_tail {
    () => {
        r"
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
"
    };
}

/// Refills the bucket to now, then takes `ARGV[2]` if it holds that much: `{1 or 0,
/// tokens left}`. A take granted marks `KEYS[2]` with what it took for `ARGV[3]` ms (what
/// a cancel gives back); one already marked was cancelled before it ran, and takes nothing.
const TAKE: &str = concat!(
    bucket_head!(),
    r"
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, tostring(tokens)}
end
tokens = math.min(cap, tokens + refill)
local ok = 0
if tokens >= tonumber(ARGV[2]) then
  tokens = tokens - tonumber(ARGV[2])
  ok = 1
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
",
    bucket_tail!(),
    "return {ok, tostring(tokens)}\n"
);

/// Once per mark `KEYS[2]` (kept `ARGV[3]` ms): refills the bucket to now, then adds
/// `ARGV[2]` (negative: a request that ran past its reservation), at most full. 1, or 0 if
/// it had run before.
const GIVE: &str = concat!(
    bucket_head!(),
    r"
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[3]) then
  return 0
end
tokens = math.min(cap, tokens + refill + tonumber(ARGV[2]))
",
    bucket_tail!(),
    "return 1\n"
);

/// Cancels the take marked `KEYS[2]`: gives back what it took, if it ran and was not
/// cancelled already, and marks it cancelled for `ARGV[2]` ms (a take that runs after finds
/// the mark and takes nothing). What it gave back.
const CANCEL: &str = concat!(
    bucket_head!(),
    r"
local took = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
redis.call('SET', KEYS[2], 'x', 'PX', ARGV[2])
if took <= 0 then
  return 0
end
tokens = math.min(cap, tokens + refill + took)
",
    bucket_tail!(),
    "return took\n"
);

static TAKE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(TAKE));
static GIVE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(GIVE));
static CANCEL_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(CANCEL));

/// A budget call Redis has not confirmed: kept, and replayed under its id.
#[derive(Debug, Clone)]
pub(super) struct Unsettled {
    tenant: Box<str>,
    per_minute: u64,
    id: u64,
    call: Call,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    /// A settlement: this much back to the bucket (negative: taken).
    Give(i64),
    /// The take of the same id, undone.
    Cancel,
}

/// The calls kept, oldest first.
#[derive(Debug, Default)]
pub(super) struct Kept {
    calls: VecDeque<Unsettled>,
    /// Dropped past [`UNSETTLED`] (said once in the log).
    dropped: u64,
}

/// A take on its way: dropped before its answer came (timed out, or the request's future
/// dropped mid-call), it is cancelled, since the script may yet run.
struct Asking<'a> {
    link: &'a FleetLink,
    cancel: Option<Unsettled>,
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        if let Some(cancel) = self.cancel.take() {
            self.link.keep_unsettled(cancel);
        }
    }
}

// === impl FleetLink ===

impl FleetLink {
    /// Takes `want` of `tenant`'s bucket of `per_minute` tokens a minute; `Err`: Redis is
    /// away (the fleet is marked degraded; should the take still run there, it is
    /// cancelled).
    pub async fn budget_take(
        &self,
        tenant: &str,
        per_minute: u64,
        want: u64,
    ) -> anyhow::Result<Taken> {
        let id = self.next_op.fetch_add(1, Relaxed);
        let mut conn = match self.connect().await {
            Ok(conn) => conn,
            Err(e) => {
                self.lost(&e);
                return Err(e);
            }
        };
        let mut asking = Asking {
            link: self,
            cancel: Some(Unsettled {
                tenant: tenant.into(),
                per_minute,
                id,
                call: Call::Cancel,
            }),
        };
        let mut call = TAKE_SCRIPT.key(key(tenant));
        call.key(self.op_key(id))
            .arg(per_minute)
            .arg(want)
            .arg(self.mark_ms());
        let got: anyhow::Result<(u64, String)> = timed(call.invoke_async(&mut conn)).await;
        match got {
            Ok((ok, left)) => {
                asking.cancel = None;
                Ok(Taken {
                    granted: ok == 1,
                    left: left.parse().unwrap_or(0.0),
                })
            }
            Err(e) => {
                drop(asking);
                self.lost(&e);
                Err(e)
            }
        }
    }

    /// Gives `amount` back to `tenant`'s bucket (negative: takes it), in the background.
    /// With Redis away, or no answer, it is kept and replayed when Redis answers again.
    pub fn budget_give(self: &Arc<Self>, tenant: &str, per_minute: u64, amount: i64) {
        let give = Unsettled {
            tenant: tenant.into(),
            per_minute,
            id: self.next_op.fetch_add(1, Relaxed),
            call: Call::Give(amount),
        };
        let runtime = tokio::runtime::Handle::try_current();
        let (false, Ok(rt)) = (self.degraded(), runtime) else {
            self.keep_unsettled(give);
            return;
        };
        let link = Arc::clone(self);
        rt.spawn(async move {
            let given = link.run(&give, Duration::from_millis(link.mark_ms())).await;
            if let Err(e) = given {
                link.keep_unsettled(give);
                link.lost(&e);
            }
        });
    }

    /// Budget calls kept until Redis confirms them.
    pub fn unsettled(&self) -> u64 {
        self.kept().calls.len() as u64
    }

    /// Replays the kept calls, oldest first ([`REPLAY`] at most); `Err`: Redis failed one
    /// (it stays kept, and so do those after it).
    pub(super) async fn replay(&self) -> anyhow::Result<()> {
        for _ in 0..REPLAY {
            // Only the keeper takes calls off the front: the one read is still there.
            let Some(call) = self.kept().calls.front().cloned() else {
                return Ok(());
            };
            match self.run(&call, REPLAYED_MARK).await {
                Ok(()) => {}
                // Redis ran it and refused it (a script error): it never will do better.
                Err(e) if refused(&e) => {
                    tracing::warn!(
                        cause = %format!("{e:#}"),
                        "cluster: Redis refused a kept budget settlement; dropped"
                    );
                }
                Err(e) => return Err(e),
            }
            self.kept().calls.pop_front();
        }
        Ok(())
    }

    /// Runs a give or a cancel, its mark kept `mark`.
    async fn run(&self, u: &Unsettled, mark: Duration) -> anyhow::Result<()> {
        let mut conn = self.connect().await?;
        let mut call = match u.call {
            Call::Give(_) => GIVE_SCRIPT.key(key(&u.tenant)),
            Call::Cancel => CANCEL_SCRIPT.key(key(&u.tenant)),
        };
        call.key(self.op_key(u.id)).arg(u.per_minute);
        if let Call::Give(amount) = u.call {
            call.arg(amount);
        }
        call.arg(millis(mark));
        let _: i64 = timed(call.invoke_async(&mut conn)).await?;
        Ok(())
    }

    /// Keeps `u` for the keeper to replay.
    fn keep_unsettled(&self, u: Unsettled) {
        let mut kept = self.kept();
        if kept.calls.len() < UNSETTLED {
            kept.calls.push_back(u);
            return;
        }
        kept.dropped += 1;
        if kept.dropped == 1 {
            tracing::warn!(
                kept = UNSETTLED,
                "cluster: too many budget settlements wait for Redis; newer ones are dropped"
            );
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.unsettled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The mark of call `id` of this replica.
    fn op_key(&self, id: u64) -> String {
        format!("tokentap:budget:op:{}:{id}", self.replica)
    }

    /// How long a call's mark lives: past the keeper's replay once Redis answers again (a
    /// renewal period, a connection), with room.
    fn mark_ms(&self) -> u64 {
        millis(self.lease) + 60_000
    }

    /// A call outside the caps' own (a budget, a placement) failed: a fresh connection next
    /// time, and the fleet degraded.
    pub(super) fn lost(&self, e: &anyhow::Error) {
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.degrade(&format!("{e:#}"), &[], false);
    }
}

/// Redis answered the call with an error of its own (not a lost connection, not a busy or
/// read-only moment): replaying it cannot help.
fn refused(e: &anyhow::Error) -> bool {
    e.downcast_ref::<redis::RedisError>()
        .is_some_and(|r| matches!(r.kind(), redis::ErrorKind::ResponseError))
}

fn key(tenant: &str) -> String {
    format!("tokentap:budget:{tenant}")
}

// === impl FleetBuckets for FleetLink ===

#[async_trait::async_trait]
impl FleetBuckets for FleetLink {
    fn degraded(&self) -> bool {
        FleetLink::degraded(self)
    }

    fn replicas(&self) -> u64 {
        FleetLink::replicas(self)
    }

    async fn take(&self, tenant: &str, per_minute: u64, want: u64) -> anyhow::Result<Taken> {
        self.budget_take(tenant, per_minute, want).await
    }

    fn give(self: Arc<Self>, tenant: &str, per_minute: u64, amount: i64) {
        self.budget_give(tenant, per_minute, amount);
    }
}
