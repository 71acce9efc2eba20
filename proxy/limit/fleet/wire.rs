//! The fleet's wire format in Redis: the Lua scripts that take, renew and count leases
//! atomically on Redis's own clock, a replica's control tick as one line of text
//! ([`Report`]), its per-token gaps as `µs:count` pairs. A record that does not read
//! (another version's) is left out, never misread.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::PoisonError;

use redis::aio::ConnectionManager;

use super::{FleetLink, CALL_TIMEOUT};
use crate::meter::Gaps;

/// The head of a lease script: Redis's clock in `now`, the expired leases dropped, the
/// limit in force in `limit` (`ARGV[1]`, and the fleet's published limit in `KEYS[2]`,
/// times the endpoints `ARGV[4]`, when `ARGV[5]` is 1).
macro_rules! lease_head {
    () => {
        r"
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit = tonumber(ARGV[1])
if ARGV[5] == '1' then
  local fleet = tonumber(redis.call('GET', KEYS[2]) or '')
  if fleet then
    -- The fleet's limit is each endpoint's: the pool's is that times its endpoints.
    fleet = fleet * tonumber(ARGV[4])
  end
  if fleet and fleet < limit then
    limit = fleet
  end
end
"
    };
}
pub(super) use lease_head;

/// Takes a lease under the limit: 1, or 0 when the fleet holds it.
pub(super) const ACQUIRE: &str = concat!(
    lease_head!(),
    r"
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  return 1
end
return 0
"
);

/// Renews this replica's leases; the count after.
pub(super) const RENEW: &str = r"
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
end
return redis.call('ZCARD', KEYS[1])
";

/// Marks this replica alive; the replicas seen in the last minute.
pub(super) const ALIVE: &str = r"
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
return redis.call('ZCARD', KEYS[1])
";

/// One replica's control tick, as it travels: `seq in_flight concurrency queued gaps`
/// (Redis puts its clock's time in front).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Report {
    pub(super) seq: u64,
    pub(super) in_flight: u64,
    pub(super) concurrency: f64,
    pub(super) queued: bool,
    pub(super) gaps: Gaps,
}

impl Report {
    pub(super) fn encode(&self) -> String {
        format!(
            "{} {} {:.3} {} {}",
            self.seq,
            self.in_flight,
            self.concurrency,
            u8::from(self.queued),
            encode_gaps(&self.gaps)
        )
    }

    /// A stored record (`at seq in_flight concurrency queued gaps`); `None` if malformed
    /// (a replica of another version: left out).
    pub(super) fn decode(s: &str) -> Option<Report> {
        let mut f = s.split(' ');
        let _at: u64 = f.next()?.parse().ok()?;
        let r = Report {
            seq: f.next()?.parse().ok()?,
            in_flight: f.next()?.parse().ok()?,
            concurrency: f.next()?.parse().ok().filter(|c: &f64| c.is_finite())?,
            queued: f.next()? == "1",
            gaps: decode_gaps(f.next().unwrap_or(""))?,
        };
        f.next().is_none().then_some(r)
    }
}

/// Gaps as `µs:count` pairs, comma-separated.
pub(super) fn encode_gaps(gaps: &Gaps) -> String {
    let pairs = gaps.pairs();
    let mut s = String::with_capacity(pairs.len() * 10);
    for (i, (v, n)) in pairs.iter().enumerate() {
        let _ = write!(s, "{}{v}:{n}", if i > 0 { "," } else { "" });
    }
    s
}

/// What [`encode_gaps`] wrote; `None` for anything else.
pub(super) fn decode_gaps(s: &str) -> Option<Gaps> {
    if s.is_empty() {
        return Some(Gaps::default());
    }
    s.split(',')
        .map(|pair| {
            let (v, n) = pair.split_once(':')?;
            Some((v.parse().ok()?, n.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()
        .map(Gaps::from_pairs)
}

// === impl FleetLink: the connection ===

impl FleetLink {
    pub(super) fn conn(&self) -> Option<ConnectionManager> {
        self.conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The connection, made now if there is none (one attempt at a time). A caller that
    /// waited while another's attempt failed fails with it, at once: requests that arrive
    /// together while Redis accepts but never answers each wait for one attempt at most
    /// ([`CALL_TIMEOUT`]), not for one attempt each in turn.
    pub(super) async fn connect(&self) -> anyhow::Result<ConnectionManager> {
        if let Some(c) = self.conn() {
            return Ok(c);
        }
        let failures = self.connect_failures.load(Relaxed);
        let _one = self.connecting.lock().await;
        if let Some(c) = self.conn() {
            return Ok(c);
        }
        if self.connect_failures.load(Relaxed) != failures {
            anyhow::bail!("Redis unreachable: the connection attempt in progress failed");
        }
        // One try, bounded as one call is: the keeper tries again every period, and a
        // request waiting on a Redis that is away should find out at once.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(CALL_TIMEOUT)
            .set_response_timeout(CALL_TIMEOUT);
        let made = tokio::time::timeout(
            CALL_TIMEOUT,
            ConnectionManager::new_with_config(self.client.clone(), config),
        )
        .await;
        let c = match made {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                self.connect_failures.fetch_add(1, Relaxed);
                return Err(e.into());
            }
            Err(_) => {
                self.connect_failures.fetch_add(1, Relaxed);
                anyhow::bail!("connecting: no answer in {CALL_TIMEOUT:?}");
            }
        };
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(c.clone());
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_travels_and_a_stranger_s_is_left_out() {
        let r = Report {
            seq: 7,
            in_flight: 12,
            concurrency: 11.5,
            queued: true,
            gaps: decode_gaps("20000:3,21000:1").unwrap(),
        };
        assert_eq!(
            Report::decode(&format!("1700000000000 {}", r.encode())),
            Some(r)
        );
        let idle = Report {
            gaps: Gaps::default(),
            queued: false,
            ..Report::decode("1 7 12 11.5 1 20000:3").unwrap()
        };
        assert_eq!(Report::decode(&format!("1 {}", idle.encode())), Some(idle));
        for bad in [
            "",
            "1 2 3",
            "1 2 3 NaN 0 ",
            "1 2 3 4.0 0 1:2 extra",
            "a 2 3 4 0 ",
        ] {
            assert_eq!(Report::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn gaps_travel_as_text_and_refuse_garbage() {
        let g = decode_gaps("20000:2,31000:1,2000000:1").unwrap();
        assert_eq!(g.pairs(), [(20_000, 2), (31_000, 1), (2_000_000, 1)]);
        assert_eq!(decode_gaps(&encode_gaps(&g)), Some(g));
        assert_eq!(decode_gaps(""), Some(Gaps::default()));
        for bad in ["1:2,", "x:1", "1:-1", "1", "1:2:3"] {
            assert_eq!(decode_gaps(bad), None, "{bad}");
        }
    }
}
