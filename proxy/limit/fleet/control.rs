//! The fleet's one adaptive limit (`[cluster]`, an upstream with an SLO): every second each
//! replica reports its control tick into Redis, and the replica that holds the upstream's
//! leader key runs the one controller on every replica's reports merged.
//!
//! A report is the replica's per-token gaps over the tick (a histogram at the meter's
//! resolution, so merged gaps give the percentile one histogram of them all would), its
//! in-flight count, its mean concurrency and whether it queued. One script stores it, takes
//! or renews the 3 s leader key, and hands the leader every report younger than that; the
//! leader sums the counts, merges the gaps (each report once, by its sequence number), runs
//! the controller and writes `tokentap:UPSTREAM:limit`, which the lease script reads itself.
//! A leader that dies is replaced within 3 s, from the limit in Redis.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::Duration;

use super::wire::Report;
use super::{millis, timed, Fleet};
use crate::limit::controller::Tick;
use crate::meter::{ControlSample, Gaps};

/// How long the leader of an upstream's controller leads without reporting, and how old
/// a replica's evidence may be and still count (three control ticks).
const CONTROL_LEASE: Duration = Duration::from_secs(3);
/// How long the fleet's adaptive limit outlives the last leader (a fleet restarted within
/// it starts from there).
const LIMIT_TTL: Duration = Duration::from_secs(600);

/// One replica's control tick (`[cluster]`, an adaptive cap): its evidence goes into the
/// hash `tokentap:UPSTREAM:evidence`; the replica holding `tokentap:UPSTREAM:leader` (taken
/// when free, for ARGV[3] ms) gets every fresh record back, the others the fleet's limit.
pub(super) const REPORT: &str = r"
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local leader = redis.call('GET', KEYS[2])
if not leader then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
  leader = ARGV[1]
elseif leader == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
local limit = redis.call('GET', KEYS[3]) or ''
if leader ~= ARGV[1] then
  return {'follow', limit}
end
local out = {'lead', limit}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local at = tonumber(string.match(all[i + 1], '^%d+'))
  if now - at > tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
";

/// The leader sets the fleet's limit (only while it leads).
pub(super) const SET_LIMIT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
";

/// This replica's side of the fleet's controller.
#[derive(Default)]
pub(super) struct Control {
    /// Its reports so far.
    seq: u64,
    /// The last report taken from each replica: one report counts once.
    seen: HashMap<String, u64>,
    /// Whether it led at the last tick.
    leading: bool,
}

/// What a control tick does, from [`Fleet::steer`].
#[derive(Debug, Clone, PartialEq)]
pub enum Steer {
    /// This replica leads the controller: the fleet's tick, from every replica's evidence;
    /// the fleet's limit when this replica has just taken the lead.
    Lead {
        tick: Tick,
        take_over: Option<u64>,
        replicas: usize,
    },
    /// Another replica leads: the fleet's limit (none before it set one).
    Follow(Option<u64>),
    /// Redis is away: this replica steers alone.
    Alone,
}

// === impl Fleet ===

impl Fleet {
    /// One control tick of an adaptive cap: reports this replica's evidence (`sample`, and
    /// `local`, the tick it makes alone) and learns whether it leads the fleet's controller.
    /// The leader merges every replica's fresh evidence into one tick: their gaps together
    /// (the SLO `percentile` of them), their concurrencies and in-flight counts summed.
    pub async fn steer(&self, sample: &ControlSample, local: Tick, percentile: f64) -> Steer {
        let c = &self.cluster;
        if c.degraded() {
            self.lock_control().leading = false;
            return Steer::Alone;
        }
        let seq = {
            let mut ctl = self.lock_control();
            ctl.seq += 1;
            ctl.seq
        };
        let record = Report {
            seq,
            // The leases it holds: its local permits also count requests still waiting
            // for a fleet slot, which would make the fleet look over its limit for ever
            // (and a cut wait for a drain that cannot come).
            in_flight: self.held_count(),
            concurrency: local.concurrency,
            queued: local.queued,
            gaps: sample.gaps.clone(),
        };
        let reply: anyhow::Result<Vec<String>> = async {
            let mut conn = c.connect().await?;
            timed(
                c.report
                    .key(&self.evidence_key)
                    .key(&self.leader_key)
                    .key(&self.limit_key)
                    .arg(&c.replica)
                    .arg(record.encode())
                    .arg(millis(CONTROL_LEASE))
                    .invoke_async(&mut conn),
            )
            .await
        }
        .await;
        let Ok(reply) = reply else {
            // The keeper finds Redis away and says so; this tick is this replica's own. A
            // leader keeps its place (and its controller's state) should Redis answer again
            // before its key expires.
            return Steer::Alone;
        };
        let limit = reply.get(1).and_then(|l| l.parse().ok());
        let mut ctl = self.lock_control();
        if reply.first().map(String::as_str) != Some("lead") {
            ctl.leading = false;
            return Steer::Follow(limit);
        }
        let take_over = if ctl.leading { None } else { limit };
        ctl.leading = true;
        let mut records = Vec::new();
        for pair in reply[2..].chunks_exact(2) {
            let Some(r) = Report::decode(&pair[1]) else {
                continue;
            };
            let new = ctl.seen.insert(pair[0].clone(), r.seq) != Some(r.seq);
            records.push((r, new));
        }
        ctl.seen
            .retain(|replica, _| reply[2..].iter().step_by(2).any(|r| r == replica));
        // Every replica's state (its latest report) counts; gaps and queueing only once.
        let gaps = Gaps::merged(records.iter().filter(|(_, new)| *new).map(|(r, _)| &r.gaps));
        Steer::Lead {
            tick: Tick {
                tpot_ms: gaps.percentile_ms(percentile),
                concurrency: records.iter().map(|(r, _)| r.concurrency).sum(),
                in_flight: records.iter().map(|(r, _)| r.in_flight).sum(),
                queued: records.iter().any(|(r, new)| *new && r.queued),
            },
            take_over,
            replicas: records.len(),
        }
    }

    /// The leader's new limit for the fleet (ignored should it have lost the lead).
    pub async fn publish_limit(&self, limit: u64) {
        let c = &self.cluster;
        let Ok(mut conn) = c.connect().await else {
            return;
        };
        let _: anyhow::Result<u64> = timed(
            c.set_limit
                .key(&self.leader_key)
                .key(&self.limit_key)
                .arg(&c.replica)
                .arg(limit)
                .arg(millis(LIMIT_TTL))
                .invoke_async(&mut conn),
        )
        .await;
    }

    /// The replicas this fleet part's cluster has seen in the last minute.
    pub fn replicas(&self) -> u64 {
        self.cluster.replicas()
    }

    fn lock_control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
