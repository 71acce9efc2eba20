//! Where the fleet has placed a prompt prefix (`balance = "prefix"` with `[cluster]`): the
//! first tokentap to send a prefix that no endpoint holds writes its placement to
//! `tokentap:prefix:UPSTREAM:BLOCK`, and every other tokentap reads it on its own first
//! sight of that prefix, so that the fleet's tokentaps place it on one replica. One round
//! trip per prefix a tokentap has not seen (none per request: after it, the tokentap's own
//! index holds the prefix where it sent it).
//!
//! A new prefix goes to the one of its two rendezvous choices that the fleet has placed
//! fewer prefixes on (`tokentap:prefix:UPSTREAM:on:URL`, the live placements by their
//! expiry), weighed in the script, so that placements made at once by several tokentaps
//! spread as one tokentap's made one after another would (each weighing the two by its
//! own index, two tokentaps starting together each count only their own placements).

use std::sync::LazyLock;

use super::{timed, FleetLink};

/// `KEYS[1]` the prefix's placement, `KEYS[2]` and `KEYS[3]` the live placements on its two
/// rendezvous choices (a sorted set of blocks by expiry); `ARGV[1]` how long a placement
/// is kept (ms), `ARGV[2]` the block, `ARGV[3]` and `ARGV[4]` the two choices' URLs,
/// `ARGV[5..]` the endpoints taking requests now. The placement kept if it names one of
/// them (its time renewed), else the choice with fewer live placements (the first on a
/// tie): the placement.
const PLACE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = now + tonumber(ARGV[1])
local function keep(c)
  redis.call('ZADD', KEYS[1 + c], expiry, ARGV[2])
  redis.call('PEXPIRE', KEYS[1 + c], ARGV[1])
end
local v = redis.call('GET', KEYS[1])
if v then
  for i = 5, #ARGV do
    if ARGV[i] == v then
      redis.call('PEXPIRE', KEYS[1], ARGV[1])
      for c = 1, 2 do
        if ARGV[2 + c] == v then
          keep(c)
        end
      end
      return v
    end
  end
end
local live = {}
for c = 1, 2 do
  redis.call('ZREMRANGEBYSCORE', KEYS[1 + c], '-inf', now)
  live[c] = redis.call('ZCARD', KEYS[1 + c])
end
local c = 1
if live[2] < live[1] then
  c = 2
end
redis.call('SET', KEYS[1], ARGV[2 + c], 'PX', ARGV[1])
keep(c)
return ARGV[2 + c]
";

static PLACE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PLACE));

/// How long the fleet remembers where it placed a prefix that no tokentap sends again: an
/// hour (a replica's cache forgets sooner; a placement outliving it costs nothing, as the
/// prefix must go somewhere).
const KEPT_MS: u64 = 3_600_000;

impl FleetLink {
    /// The endpoint (its URL) where the fleet places `upstream`'s prefix whose first block
    /// hashes to `block`: where a tokentap placed it before, if that is one of `open`, else
    /// the one of `choices` (its two rendezvous choices) the fleet has placed fewer live
    /// prefixes on. `Err`: Redis is away (degraded, as the caps; the caller places it
    /// alone).
    pub async fn place_prefix(
        &self,
        upstream: &str,
        block: u64,
        choices: [&str; 2],
        open: &[&str],
    ) -> anyhow::Result<String> {
        if self.degraded() {
            anyhow::bail!("Redis unreachable");
        }
        let placed = async {
            let mut conn = self.connect().await?;
            let mut call = PLACE_SCRIPT.key(format!("tokentap:prefix:{upstream}:{block:016x}"));
            for url in choices {
                call.key(format!("tokentap:prefix:{upstream}:on:{url}"));
            }
            call.arg(KEPT_MS)
                .arg(format!("{block:016x}"))
                .arg(&choices[..]);
            for url in open {
                call.arg(*url);
            }
            anyhow::Ok(timed(call.invoke_async::<String>(&mut conn)).await?)
        }
        .await;
        if let Err(e) = &placed {
            self.lost(e);
        }
        placed
    }
}
