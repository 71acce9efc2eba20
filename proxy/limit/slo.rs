//! The adaptive cap of one upstream, and the loop that ticks every such cap once a second:
//! the controller ([`super::controller`]) reads the meter's evidence and the limiter's
//! state, and moves the limiter's limit.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::controller::{Controller, Slo, Tick};
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
}

impl Adaptive {
    pub fn new(slo: Slo) -> Self {
        Adaptive {
            slo: Mutex::new(slo),
            controller: Mutex::new(Controller::new(slo)),
            current_tpot_ms: Mutex::new(None),
        }
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
    /// new limit.
    pub fn tick(&self, meter: &UpstreamMeter, limiter: &Limiter, now: crate::meter::Nanos) {
        let sample = meter.control_sample(now, self.slo().percentile);
        let tick = Tick {
            tpot_ms: sample.tpot_ms,
            concurrency: sample.concurrency,
            in_flight: limiter.stats().in_flight,
            queued: limiter.take_binding(),
        };
        let limit = lock(&self.controller).update(tick);
        limiter.set_limit(limit);
        if sample.tpot_ms.is_some() {
            *lock(&self.current_tpot_ms) = sample.tpot_ms;
        }
    }
}

/// An upstream under an adaptive cap: its meter, its limiter, its cap.
pub type Target = (Arc<UpstreamMeter>, Arc<Limiter>, Arc<Adaptive>);

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
                for (meter, limiter, adaptive) in &targets() {
                    adaptive.tick(meter, limiter, now);
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}

/// A poisoned lock is used as is: the controller's state stays meaningful.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
