//! Where the fleet has placed a prompt prefix (`balance = "prefix"` with `[cluster]`): the
//! first tokentap to send a prefix that no endpoint holds writes its choice to
//! `tokentap:prefix:UPSTREAM:BLOCK`, and every other tokentap reads it on its own first
//! sight of that prefix, so that the fleet's tokentaps place it on one replica. One round
//! trip per prefix a tokentap has not seen (none per request: after it, the tokentap's own
//! index holds the prefix where it sent it).

use std::sync::LazyLock;

use super::{timed, FleetLink};

/// `KEYS[1]` the prefix's placement; `ARGV[1]` the caller's choice, `ARGV[2]` how long a
/// placement is kept (ms), `ARGV[3..]` the endpoints taking requests now. The placement
/// kept if it names one of them (its time renewed), else the caller's choice: the
/// placement.
const PLACE: &str = r"
local v = redis.call('GET', KEYS[1])
if v then
  for i = 3, #ARGV do
    if ARGV[i] == v then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      return v
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
";

static PLACE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PLACE));

/// How long the fleet remembers where it placed a prefix that no tokentap sends again: an
/// hour (a replica's cache forgets sooner; a placement outliving it costs nothing, as the
/// prefix must go somewhere).
const KEPT_MS: u64 = 3_600_000;

impl FleetLink {
    /// The endpoint (its URL) where the fleet places `upstream`'s prefix whose first block
    /// hashes to `block`: where a tokentap placed it before, if that is one of `open`, else
    /// `choice`. `Err`: Redis is away (degraded, as the caps; the caller places it alone).
    pub async fn place_prefix(
        &self,
        upstream: &str,
        block: u64,
        choice: &str,
        open: &[&str],
    ) -> anyhow::Result<String> {
        if self.degraded() {
            anyhow::bail!("Redis unreachable");
        }
        let placed = async {
            let mut conn = self.connect().await?;
            let mut call = PLACE_SCRIPT.key(format!("tokentap:prefix:{upstream}:{block:016x}"));
            call.arg(choice).arg(KEPT_MS);
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
