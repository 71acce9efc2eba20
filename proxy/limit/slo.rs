//! The adaptive cap of one upstream, and the loop that ticks every such cap once a second:
//! the controller ([`super::controller`]) reads the meter's evidence and the limiter's
//! state, and moves the limiter's limit.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::controller::{Controller, Slo, Tick};
use super::fleet::{Fleet, Steer};
use super::Limiter;
use crate::meter::{Clock, UpstreamMeter};

/// How often the SLO controllers look at the evidence.
pub const CONTROL_TICK: Duration = Duration::from_secs(1);

/// An upstream's adaptive cap.
pub struct Adaptive {
    slo: Mutex<Slo>,
    controller: Mutex<Controller>,
    /// The SLO percentile of per-token gaps over the last tick, ms.
    current_tpot_ms: Mutex<Option<f64>>,
    role: Mutex<Role>,
}

/// Who moves the limit (`/stats`' `slo.controller`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// This tokentap alone (no `[cluster]`).
    Local,
    /// This replica, for the whole fleet, from every replica's evidence.
    FleetLeader,
    /// Another replica; this one reports its evidence and takes the fleet's limit.
    FleetFollower,
    /// This replica on its own evidence, scaled by the replicas seen, while Redis is away.
    Degraded,
}

impl Role {
    pub fn label(self) -> &'static str {
        match self {
            Role::Local => "local",
            Role::FleetLeader => "fleet_leader",
            Role::FleetFollower => "fleet_follower",
            Role::Degraded => "degraded",
        }
    }
}

impl Adaptive {
    pub fn new(slo: Slo) -> Self {
        Adaptive {
            slo: Mutex::new(slo),
            controller: Mutex::new(Controller::new(slo)),
            current_tpot_ms: Mutex::new(None),
            role: Mutex::new(Role::Local),
        }
    }

    /// Who moved the limit at the last tick.
    pub fn role(&self) -> Role {
        *lock(&self.role)
    }

    /// The SLO it holds.
    pub fn slo(&self) -> Slo {
        *lock(&self.slo)
    }

    /// Holds `slo` from now on (a reload), from the limit in force.
    pub fn retune(&self, slo: Slo) {
        *lock(&self.slo) = slo;
        lock(&self.controller).retune(slo);
    }

    /// The limit the controller is at.
    pub fn limit(&self) -> u64 {
        lock(&self.controller).limit()
    }

    /// The SLO percentile of per-token gaps over the last tick that had any, ms.
    pub fn current_tpot_ms(&self) -> Option<f64> {
        *lock(&self.current_tpot_ms)
    }

    /// One controller tick: the meter's evidence since the last, the limiter's state, a
    /// new limit. With a `fleet` part, the limit is the fleet's: its leader's controller
    /// moves it from every replica's evidence, the others take it.
    pub async fn tick(
        &self,
        meter: &UpstreamMeter,
        limiter: &Limiter,
        fleet: Option<&Fleet>,
        now: crate::meter::Nanos,
    ) {
        let percentile = self.slo().percentile;
        let sample = meter.control_sample(now, percentile);
        // The limit is each endpoint's: a pool's evidence is its endpoints' mean (its
        // curve is already bucketed by the batch of the endpoint that served each token).
        let members = limiter.members().max(1);
        let local = Tick {
            tpot_ms: sample.tpot_ms,
            concurrency: sample.concurrency / members as f64,
            in_flight: limiter.stats().in_flight.div_ceil(members),
            queued: limiter.take_binding(),
        };
        let (limit, role, tpot_ms) = match fleet {
            None => (
                lock(&self.controller).update(local),
                Role::Local,
                local.tpot_ms,
            ),
            Some(fleet) => match fleet.steer(&sample, local, percentile).await {
                Steer::Lead {
                    tick, take_over, ..
                } => {
                    let limit = {
                        let mut ctl = lock(&self.controller);
                        if let Some(l) = take_over {
                            // Having steered alone (Redis away), it knows better than a
                            // limit written before: the lower of the two.
                            let own = ctl.limit();
                            let alone = self.role() == Role::Degraded;
                            ctl.follow(if alone { l.min(own) } else { l });
                        }
                        ctl.update(tick)
                    };
                    fleet.publish_limit(limit).await;
                    (limit, Role::FleetLeader, tick.tpot_ms)
                }
                Steer::Follow(limit) => {
                    let mut ctl = lock(&self.controller);
                    if let Some(l) = limit {
                        ctl.follow(l);
                    }
                    (ctl.limit(), Role::FleetFollower, local.tpot_ms)
                }
                Steer::Alone => {
                    // Each replica holds about limit / replicas: its own count, scaled,
                    // stands for the fleet's. A queue on its share is not the limit binding
                    // (the limiter does not report it): whether the limit binds is the
                    // scaled concurrency's to say.
                    let n = fleet.replicas() as f64;
                    let scaled = Tick {
                        concurrency: local.concurrency * n,
                        in_flight: (local.in_flight as f64 * n).round() as u64,
                        ..local
                    };
                    (
                        lock(&self.controller).update(scaled),
                        Role::Degraded,
                        local.tpot_ms,
                    )
                }
            },
        };
        limiter.set_limit(limit);
        *lock(&self.role) = role;
        if tpot_ms.is_some() {
            *lock(&self.current_tpot_ms) = tpot_ms;
        }
    }
}

/// An upstream under an adaptive cap: its meter, its limiter, its cap, its fleet part.
pub type Target = (
    Arc<UpstreamMeter>,
    Arc<Limiter>,
    Arc<Adaptive>,
    Option<Arc<Fleet>>,
);

/// Ticks the controller of every target `targets` gives (asked each tick: a reload may
/// change them) each [`CONTROL_TICK`] until `shutdown` turns true.
pub async fn control(
    targets: impl Fn() -> Vec<Target>,
    clock: Clock,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(CONTROL_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let now = clock.now();
                // At once: a slow Redis holds one upstream's tick, not the others'.
                let mut ticks = tokio::task::JoinSet::new();
                for (meter, limiter, adaptive, fleet) in targets() {
                    ticks.spawn(async move {
                        adaptive.tick(&meter, &limiter, fleet.as_deref(), now).await;
                    });
                }
                while ticks.join_next().await.is_some() {}
            }
            _ = shutdown.changed() => return,
        }
    }
}

/// A poisoned lock is used as is: the controller's state stays meaningful.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
