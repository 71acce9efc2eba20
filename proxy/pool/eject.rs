//! Passive health: what real traffic says of an endpoint. A failed connect or a reset
//! before any response byte ejects it at once; `eject_after` failures in a row (a 5xx, no
//! response head within `read_timeout_secs`, a body gone silent or cut) eject it; a
//! response under 500 served to its end ends the run. An ejection lasts `eject_secs`,
//! doubled while the endpoint keeps failing, at most [`MAX_EJECTION`]; the last endpoint
//! taking requests is never ejected.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use super::{lock, Endpoint, Pool};

/// The longest ejection.
const MAX_EJECTION: Duration = Duration::from_secs(300);

// === impl Pool ===

impl Pool {
    /// What a request refused for want of an endpoint is told to wait (`Retry-After`): until
    /// the first ejection ends, or the next active check, at least a second.
    pub fn retry_after(&self, now: crate::meter::Nanos) -> Duration {
        let members = self.members.load();
        let ejection = (members.iter())
            .map(|e| e.ejected_until.load(Relaxed))
            .filter(|&until| until > now)
            .min()
            .map(|until| Duration::from_nanos(until - now));
        let check = (self.settings.load().health.as_ref()).map(|h| h.every);
        let wait = match (ejection, check) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(Duration::ZERO),
        };
        Duration::from_secs(wait.as_secs_f64().ceil().max(1.0) as u64)
    }

    /// `e` could not be reached (a connect that failed: nothing was sent) or closed or
    /// reset the connection before any response byte: ejected at once.
    pub fn unreachable(&self, e: &Endpoint, cause: &str) {
        e.set_error(cause);
        self.eject(e, cause);
    }

    /// `e` answered with `status`: a 5xx is a failure (see [`Pool::failed`]); an answer
    /// under 500 is judged when its body ends ([`Pool::served`], or a failure).
    pub fn answered(&self, e: &Endpoint, status: u16) {
        if status >= 500 {
            self.failed(e, &format!("answered {status}"));
        }
    }

    /// `e` failed a request it was sent (`cause`: a 5xx, no response head within
    /// `read_timeout_secs`, a body gone silent or cut): `eject_after` in a row eject it.
    pub fn failed(&self, e: &Endpoint, cause: &str) {
        let fails = e.fails.fetch_add(1, Relaxed) + 1;
        e.set_error(cause);
        if fails >= self.settings.load().eject_after {
            e.fails.store(0, Relaxed);
            self.eject(e, &format!("{fails} failures in a row (the last: {cause})"));
        }
    }

    /// `e` served a response under 500 to its end: its run of failures ends, and the
    /// doubling of its ejections.
    pub fn served(&self, e: &Endpoint) {
        if e.fails.load(Relaxed) != 0 {
            e.fails.store(0, Relaxed);
        }
        if e.ejections.load(Relaxed) != 0 {
            e.ejections.store(0, Relaxed);
        }
    }

    /// Ejects `e`, unless it is the last endpoint taking requests (or already ejected).
    fn eject(&self, e: &Endpoint, cause: &str) {
        let now = self.clock.now();
        if e.ejected(now) {
            return;
        }
        let members = self.members.load();
        let others = members
            .iter()
            .filter(|m| !std::ptr::eq(&***m, e) && m.eligible(now))
            .count();
        if others == 0 {
            tracing::warn!(
                upstream = %self.name,
                endpoint = %e.at.url,
                cause,
                "endpoint failing, but it is the last one taking requests: not ejected"
            );
            return;
        }
        let k = e.ejections.fetch_add(1, Relaxed).min(16);
        let base = self.settings.load().eject;
        let length = base.saturating_mul(1 << k).min(MAX_EJECTION);
        lock(&e.checks).down_while_ejected = false;
        e.ejected_until
            .store(now + length.as_nanos() as u64, Relaxed);
        e.ejections_total.fetch_add(1, Relaxed);
        tracing::warn!(
            upstream = %self.name,
            endpoint = %e.at.url,
            cause,
            secs = length.as_secs(),
            "endpoint ejected"
        );
        self.refresh(now);
    }
}
