//! Output-token budgets across the fleet (`[tenants] output_tokens_per_minute` with
//! `[cluster]`): each tenant's token bucket is one hash in Redis
//! (`tokentap:budget:TENANT`), taken from and given back to by Lua scripts on Redis's own
//! clock, so every tokentap of the fleet spends one budget. A call that fails marks the
//! fleet degraded (one log line, as the caps do): each replica then spends its share of the
//! budget locally until the keeper hears Redis again.

use std::sync::LazyLock;

use super::{timed, FleetLink};

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
/// tokens left}`.
const TAKE: &str = concat!(
    bucket_head!(),
    r"
tokens = math.min(cap, tokens + refill)
local ok = 0
if tokens >= tonumber(ARGV[2]) then
  tokens = tokens - tonumber(ARGV[2])
  ok = 1
end
",
    bucket_tail!(),
    "return {ok, tostring(tokens)}\n"
);

/// Refills the bucket to now, then adds `ARGV[2]` (negative: a request that ran past its
/// reservation), at most full.
const GIVE: &str = concat!(
    bucket_head!(),
    "tokens = math.min(cap, tokens + refill + tonumber(ARGV[2]))\n",
    bucket_tail!(),
    "return 1\n"
);

static TAKE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(TAKE));
static GIVE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(GIVE));

/// What the fleet's bucket said to a reservation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Taken {
    pub granted: bool,
    /// Tokens left in the bucket after it.
    pub left: f64,
}

impl FleetLink {
    /// Takes `want` of `tenant`'s bucket of `per_minute` tokens a minute; `Err`: Redis is
    /// away (the fleet is marked degraded).
    pub async fn budget_take(
        &self,
        tenant: &str,
        per_minute: u64,
        want: u64,
    ) -> anyhow::Result<Taken> {
        let took = async {
            let mut conn = self.connect().await?;
            let mut call = TAKE_SCRIPT.key(key(tenant));
            call.arg(per_minute).arg(want);
            let (ok, left): (u64, String) = timed(call.invoke_async(&mut conn)).await?;
            anyhow::Ok(Taken {
                granted: ok == 1,
                left: left.parse().unwrap_or(0.0),
            })
        }
        .await;
        if let Err(e) = &took {
            self.lost(e);
        }
        took
    }

    /// Gives `amount` back to `tenant`'s bucket (negative: takes it).
    pub async fn budget_give(&self, tenant: &str, per_minute: u64, amount: i64) {
        let given = async {
            let mut conn = self.connect().await?;
            let mut call = GIVE_SCRIPT.key(key(tenant));
            call.arg(per_minute).arg(amount);
            let _: u64 = timed(call.invoke_async(&mut conn)).await?;
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = &given {
            self.lost(e);
        }
    }

    /// A call outside the caps' own (a budget, a placement) failed: a fresh connection next
    /// time, and the fleet degraded.
    pub(super) fn lost(&self, e: &anyhow::Error) {
        *self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        self.degrade(&format!("{e:#}"), &[], false);
    }
}

fn key(tenant: &str) -> String {
    format!("tokentap:budget:{tenant}")
}
