//! One endpoint of a pool: where it is, its health (active checks, passive ejection), its
//! load (slots held, the backend's own count), its counters, and its meter.

use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst,
};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use pingora::upstreams::peer::HttpPeer;

use crate::backend::{Backend, BackendStats};
use crate::config::EndpointAddr;
use crate::limit::fleet::{Fleet, FleetLink, Lease};
use crate::meter::{EndpointMeter, Nanos};
use crate::prefix::BlockLru;

/// The backend's load is not known.
pub(super) const UNKNOWN: u64 = u64::MAX;

/// One replica of a pool.
pub struct Endpoint {
    pub at: EndpointAddr,
    /// Its connection settings (the upstream's timeouts and TLS), rebuilt on reload.
    peer: ArcSwap<HttpPeer>,
    pub meter: Arc<EndpointMeter>,
    /// Generation requests on it, each holding a slot of the pool's limiter.
    pub(super) slots: AtomicU64,
    /// Active checks say it serves (true while there are none).
    pub(super) healthy: AtomicBool,
    /// Passively ejected until then ([`Nanos`]; 0: not ejected).
    pub(super) ejected_until: AtomicU64,
    /// Consecutive 5xx answers.
    pub(super) fails: AtomicU32,
    /// Consecutive ejections (each doubles the next), reset by a good answer.
    pub(super) ejections: AtomicU32,
    pub(super) ejections_total: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) errors: AtomicU64,
    /// The backend's running + waiting, from its own metrics ([`UNKNOWN`] without).
    pub(super) backend_load: AtomicU64,
    pub(super) backend: Mutex<Option<Arc<Backend>>>,
    /// Consecutive good and failed active checks, and whether one is running.
    pub(super) checks: Mutex<Checks>,
    pub(super) last_error: Mutex<Option<Box<str>>>,
    /// Its slots as leases in the fleet's Redis (`[cluster]`), made when first needed.
    fleet: std::sync::OnceLock<Arc<Fleet>>,
    /// Its pool's requests waiting for a slot on some endpoint, woken when one frees.
    freed: Arc<Freed>,
    /// With `balance = "prefix"`: the prompt blocks it was sent lately, as its prefix
    /// cache would hold them (bounded, the oldest out first).
    pub(super) prefixes: Mutex<BlockLru>,
    /// Its own cap under `slo_headroom` with a TPOT SLO ([`POOLED`]: the pool's cap for
    /// each endpoint), and its curve and controller there.
    pub(super) cap: AtomicU64,
    pub(super) steering: Mutex<super::curve::Steering>,
}

/// An endpoint's `cap` when it is the pool's per-endpoint one.
pub(super) const POOLED: u64 = u64::MAX;

/// Prompt blocks remembered per endpoint: 8,192 of 256 bytes, about half a million tokens
/// of prompt (more than one replica's KV cache holds), some 600 KiB.
const PREFIX_INDEX_BLOCKS: usize = 8192;

#[derive(Debug, Default)]
pub(super) struct Checks {
    pub(super) ok: u32,
    pub(super) failed: u32,
    /// A check failed during the ejection running now: the checks saw it down too, so a
    /// check that passes again may end the ejection (a replica restarted). An ejection the
    /// checks never saw (its health path fine, its generations failing) runs its length.
    pub(super) down_while_ejected: bool,
}

/// Requests of one pool that wait for a slot (every endpoint at its cap: a connect retried
/// after its endpoint failed, a cap lowered a moment ago), woken when a slot frees.
#[derive(Debug, Default)]
pub(super) struct Freed {
    pub(super) waiting: AtomicUsize,
    pub(super) notify: tokio::sync::Notify,
}

impl Freed {
    /// Wakes the waiting requests, if any (one load when none waits).
    pub(super) fn wake(&self) {
        if self.waiting.load(SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }
}

/// What `/stats` shows of an endpoint.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct EndpointStats {
    pub address: String,
    /// Takes requests now: its active checks pass (or there are none) and it is not
    /// ejected.
    pub healthy: bool,
    /// Its active checks pass (or there are none).
    pub health_checks_pass: bool,
    /// Unix time (seconds) its ejection ends; `null` when not ejected.
    pub ejected_until: Option<f64>,
    pub last_error: Option<String>,
    pub in_flight: u64,
    /// Its concurrency cap (`null`: none).
    pub limit: Option<u64>,
    pub requests_total: u64,
    pub errors_total: u64,
    pub ejections_total: u64,
    /// Prompt blocks (256 bytes) tokentap believes it holds in its prefix cache
    /// (`balance = "prefix"`; 0 otherwise).
    pub prefix_index_blocks: usize,
    /// Its own curve's predictions (`balance = "slo_headroom"`; `null` otherwise).
    pub slo_headroom: Option<super::curve::HeadroomStats>,
    pub output_tokens_total: u64,
    /// Prompt tokens of its requests that reported them, and of those the ones its
    /// backend read from its prefix cache.
    pub input_tokens_total: u64,
    pub cached_input_tokens_total: u64,
    pub system_tps: Option<f64>,
    pub single_stream_tps: Option<f64>,
    pub tpot_ms: crate::meter::Percentiles,
    pub ttft_ms: crate::meter::Percentiles,
    /// Its backend's own load, with `backend_metrics_path`.
    pub backend: Option<BackendStats>,
}

// === impl Endpoint ===

impl Endpoint {
    pub(super) fn new(at: EndpointAddr, peer: HttpPeer, freed: &Arc<Freed>) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            at,
            peer: ArcSwap::from_pointee(peer),
            meter: Arc::default(),
            slots: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            ejected_until: AtomicU64::new(0),
            fails: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejections_total: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            backend_load: AtomicU64::new(UNKNOWN),
            backend: Mutex::new(None),
            checks: Mutex::default(),
            last_error: Mutex::new(None),
            fleet: std::sync::OnceLock::new(),
            freed: Arc::clone(freed),
            prefixes: Mutex::new(BlockLru::new(PREFIX_INDEX_BLOCKS)),
            cap: AtomicU64::new(POOLED),
            steering: Mutex::default(),
        })
    }

    /// Its part of the fleet: leases under `tokentap:UPSTREAM@URL:leases`.
    pub(super) fn fleet(&self, cluster: &Arc<FleetLink>, upstream: &str) -> Arc<Fleet> {
        let name = || format!("{upstream}@{}", self.at.url);
        Arc::clone(self.fleet.get_or_init(|| Fleet::new(cluster, &name())))
    }

    /// Its connection settings now.
    pub fn peer(&self) -> Arc<HttpPeer> {
        self.peer.load_full()
    }

    pub(super) fn set_peer(&self, peer: HttpPeer) {
        self.peer.store(Arc::new(peer));
    }

    /// Ejected at `now`.
    pub fn ejected(&self, now: Nanos) -> bool {
        self.ejected_until.load(Relaxed) > now
    }

    /// Takes requests at `now`: healthy and not ejected.
    pub fn eligible(&self, now: Nanos) -> bool {
        self.healthy.load(Relaxed) && !self.ejected(now)
    }

    /// Generation requests on it now.
    pub fn in_flight(&self) -> u64 {
        self.slots.load(Relaxed)
    }

    /// Its cap: its own (`slo_headroom`), else the pool's for each endpoint, `each`.
    pub(super) fn cap(&self, each: Option<u64>) -> Option<u64> {
        match self.cap.load(Relaxed) {
            POOLED => each,
            own => Some(own),
        }
    }

    /// Its load for `least_loaded`: the backend's running + waiting while known, else its
    /// requests here over its cap (or their number, uncapped).
    pub(super) fn load(&self, each: Option<u64>) -> f64 {
        let each = self.cap(each);
        match self.backend_load.load(Relaxed) {
            UNKNOWN => {
                let n = self.slots.load(Relaxed) as f64;
                each.map_or(n, |cap| n / cap as f64)
            }
            backend => each.map_or(backend as f64, |cap| backend as f64 / cap as f64),
        }
    }

    /// Takes a slot if it has room under its cap (`each`, the pool's, unless it has its
    /// own; none: always).
    pub(super) fn take_slot(&self, each: Option<u64>) -> bool {
        match self.cap(each) {
            None => {
                self.slots.fetch_add(1, Relaxed);
                true
            }
            // SeqCst with the release's: a request that found no room, and waits for one,
            // is woken by the slot freed after it looked (see [`Freed`]).
            Some(cap) => self
                .slots
                .fetch_update(SeqCst, SeqCst, |n| (n < cap).then_some(n + 1))
                .is_ok(),
        }
    }

    pub(super) fn set_error(&self, cause: &str) {
        *self
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(cause.into());
    }

    /// What `/stats` shows of it, its window figures over the `window` before `now`
    /// (`steering`: under `slo_headroom`).
    pub(super) fn stats(
        &self,
        now: Nanos,
        window: Nanos,
        (each, steering): (Option<u64>, bool),
        clock_unix: f64,
    ) -> EndpointStats {
        let f = self.meter.figures(now, window);
        let until = self.ejected_until.load(Relaxed);
        EndpointStats {
            address: self.at.url.clone(),
            healthy: self.eligible(now),
            health_checks_pass: self.healthy.load(Relaxed),
            ejected_until: (until > now)
                .then(|| clock_unix + (until - now) as f64 / 1e9)
                .map(|t| (t * 1e3).round() / 1e3),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_deref()
                .map(str::to_owned),
            in_flight: self.in_flight(),
            limit: self.cap(each),
            requests_total: self.requests.load(Relaxed),
            errors_total: self.errors.load(Relaxed),
            ejections_total: self.ejections_total.load(Relaxed),
            prefix_index_blocks: self
                .prefixes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len(),
            slo_headroom: self.headroom(steering),
            output_tokens_total: f.output_tokens_total,
            input_tokens_total: f.input_tokens_total,
            cached_input_tokens_total: f.cached_input_tokens_total,
            system_tps: f.system_tps,
            single_stream_tps: f.single_stream_tps,
            tpot_ms: f.tpot_ms,
            ttft_ms: f.ttft_ms,
            backend: self
                .backend
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .map(|b| b.stats()),
        }
    }
}

impl crate::backend::Sink for Endpoint {
    fn reading(&self, backend: &Backend) {
        self.meter.set_backend_running(backend.running());
        let load = backend.load().unwrap_or(UNKNOWN);
        self.backend_load.store(load, Relaxed);
    }
}

/// An endpoint chosen for a request: the slot it holds there (a generation request's),
/// freed when dropped.
pub struct Held {
    pub endpoint: Arc<Endpoint>,
    slot: bool,
    /// The request ended: its slot and lease are given back (the endpoint is kept, to be
    /// named in the request's log lines).
    ended: bool,
    /// The slot's lease in the fleet's Redis, with `[cluster]`.
    pub(super) lease: Option<Lease>,
}

impl Held {
    pub(super) fn new(endpoint: Arc<Endpoint>, slot: bool) -> Held {
        endpoint.requests.fetch_add(1, Relaxed);
        Held {
            endpoint,
            slot,
            ended: false,
            lease: None,
        }
    }

    /// Whether it holds a slot there (a generation request's).
    pub fn holds_slot(&self) -> bool {
        self.slot
    }

    /// The request on it ended (`failed`: as an error: 5xx, a failed connection, an
    /// upstream that broke off): counted, its slot and lease given back. Once.
    pub fn end(&mut self, failed: bool) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if failed {
            self.endpoint.errors.fetch_add(1, Relaxed);
        }
        self.release();
    }

    /// Gives the slot and its lease back (once).
    fn release(&mut self) {
        if std::mem::take(&mut self.slot) {
            self.endpoint.slots.fetch_sub(1, SeqCst);
            self.endpoint.freed.wake();
        }
        self.lease = None;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("at", &self.at.url)
            .finish_non_exhaustive()
    }
}
