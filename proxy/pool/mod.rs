//! An upstream is a pool of endpoints (replicas of one model) that come and go: given in
//! the file (`url`, `endpoints`) or found while running (`discover`: DNS records, a file).
//!
//! - **Choice** ([`Pool::pick`]): among the endpoints that take requests (healthy, not
//!   ejected), by `balance`: the less loaded of two picked at random, round robin, or the
//!   highest rendezvous hash of a header's value (bounded by load). A generation request
//!   holds a slot of the endpoint it goes to; each endpoint's cap is the limiter's
//!   per-endpoint limit, and the limiter's pool limit (that cap times the endpoints that
//!   take requests) guarantees one has room for every request it admits.
//! - **Caps**: a generation request takes a slot under its endpoint's cap or none; with
//!   every endpoint full (a connect retried after its endpoint failed, a cap lowered a
//!   moment ago) it waits for one to free ([`Pool::pick_within`]), never over a cap.
//! - **Passive health**: a failed connect or a reset before any response byte eject an
//!   endpoint at once; `eject_after` failures in a row (5xx, no response head within
//!   `read_timeout_secs`, a body gone silent or cut by the upstream) eject it; a response
//!   under 500 that completes ends the run. An ejection lasts `eject_secs`, doubled while
//!   the endpoint keeps failing (at most five minutes). The last endpoint taking requests is
//!   never ejected on passive evidence alone; if they all are, requests go to all that pass
//!   their checks (panic mode).
//! - **Active health** (`health`, [`health`]): a GET of its path every `every_secs`. A
//!   passing check never ends an ejection on its own: evidence from real traffic outweighs
//!   a probe ("/health is fine, the model is broken"), unless a check failed during the
//!   ejection too (the probes saw it down; passing again, it was restarted).
//! - **Discovery** ([`discover`]): the set follows the records or the file; an endpoint
//!   keeps its state by address; one that leaves drains (its requests finish on it).
//!
//! The pool and its endpoints are kept across reloads by the upstream's name.

mod choice;
mod curve;
mod discover;
mod eject;
mod endpoint;
mod headroom;
mod health;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use pingora::upstreams::peer::HttpPeer;

use crate::backend::Backend;
use crate::config::{Balance, Discover, EndpointAddr, HealthCheck, UpstreamConfig};
use crate::limit::fleet::FleetLink;
use crate::limit::Limiter;
use crate::meter::{Clock, Nanos};

pub use curve::HeadroomStats;
pub use endpoint::{Endpoint, EndpointStats, Held};

use endpoint::Freed;

/// An upstream's endpoints and how requests are spread over them.
pub struct Pool {
    name: Arc<str>,
    clock: Clock,
    /// The fleet's Redis, with `[cluster]`: each endpoint's cap as leases there.
    cluster: Option<Arc<FleetLink>>,
    limiter: Arc<Limiter>,
    members: ArcSwap<Vec<Arc<Endpoint>>>,
    settings: ArcSwap<Settings>,
    next: AtomicUsize,
    /// One change of the endpoint set at a time (discovery, a reload).
    changing: Mutex<()>,
    discovery: Mutex<Due>,
    checks: Mutex<Due>,
    /// The endpoints the limiter counted last, and the last second a "no healthy
    /// endpoint" line was logged.
    counted: AtomicU64,
    quiet_until: AtomicU64,
    sampled: AtomicU64,
    /// Past `metrics.endpoint_labels` (logged when it becomes so).
    unlabelled: AtomicBool,
    /// Requests waiting for a slot on an endpoint, woken when one frees.
    freed: Arc<Freed>,
}

/// What the pool takes from its upstream's config.
struct Settings {
    balance: Balance,
    /// What `slo_headroom` routes on (`None` under another balance).
    headroom: Option<curve::Headroom>,
    eject_after: u32,
    eject: Duration,
    health: Option<HealthCheck>,
    discover: Option<Discover>,
    backend_path: Option<String>,
    backend_scrape: Duration,
    peer: PeerOptions,
}

/// The connection settings every endpoint's peer gets.
#[derive(Clone)]
struct PeerOptions {
    connect: Duration,
    read: Duration,
    write: Duration,
    idle: Duration,
    verify: bool,
    trust: Option<crate::config::Trust>,
}

/// When a background job is due next, and whether one runs.
#[derive(Default)]
struct Due {
    next: Option<Instant>,
    running: bool,
    /// What the last run found wrong, logged once until it works again.
    failing: bool,
}

/// What of a request picks its endpoint ([`Pool::keyed_by`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keyed {
    Header(http::HeaderName),
    /// The prompt: the request body from where the prompt starts.
    Prompt,
    Nothing,
}

/// Why a request has no endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unplaced {
    /// None takes requests (unhealthy, or none at all).
    NoEndpoint,
    /// Every endpoint that takes requests is at its cap.
    Full,
}

/// How the endpoints of a pool stand, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    pub endpoints: u64,
    /// Taking requests.
    pub healthy: u64,
    pub ejected: u64,
    /// Failing their active checks.
    pub unhealthy: u64,
}

// === impl Pool ===

impl Pool {
    pub fn new(
        u: &UpstreamConfig,
        clock: Clock,
        limiter: Arc<Limiter>,
        cluster: Option<Arc<FleetLink>>,
    ) -> Arc<Pool> {
        let settings = Settings::of(u);
        let freed = Arc::new(Freed::default());
        let members = u
            .endpoints
            .iter()
            .map(|at| Endpoint::new(at.clone(), settings.peer.peer(at), &freed))
            .collect();
        let pool = Arc::new(Pool {
            name: u.name.as_str().into(),
            clock,
            cluster,
            limiter,
            members: ArcSwap::from_pointee(members),
            settings: ArcSwap::from_pointee(settings),
            next: AtomicUsize::new(0),
            changing: Mutex::new(()),
            discovery: Mutex::default(),
            checks: Mutex::default(),
            counted: AtomicU64::new(u64::MAX),
            quiet_until: AtomicU64::new(0),
            sampled: AtomicU64::new(0),
            unlabelled: AtomicBool::new(false),
            freed,
        });
        pool.refresh(clock.now());
        pool
    }

    /// Takes `u` on (a reload): its balance, health, ejection and connection settings, and
    /// the endpoints the file gives, each kept by address (a new one starts afresh; one
    /// no longer listed drains). With `discover` changed, the next discovery runs at once.
    pub fn reconfigure(&self, u: &UpstreamConfig) {
        let settings = Settings::of(u);
        let rediscover = settings.discover != self.settings.load().discover;
        let no_checks = settings.health.is_none();
        self.settings.store(Arc::new(settings));
        if u.discover.is_none() {
            self.replace(u.endpoints.clone());
        } else if rediscover {
            lock(&self.discovery).next = None;
        }
        let settings = self.settings.load();
        for e in self.members.load().iter() {
            e.set_peer(settings.peer.peer(&e.at));
            if no_checks {
                e.healthy.store(true, Relaxed);
            }
        }
        *lock(&self.checks) = Due::default();
        self.refresh(self.clock.now());
    }

    /// The endpoints now.
    pub fn members(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.members.load_full()
    }

    /// Whether any endpoint can take a request now (else: 503 `no_healthy_endpoint`).
    pub fn serving(&self) -> bool {
        // Ejected or not: panic mode sends requests to any endpoint passing its checks.
        self.members.load().iter().any(|e| e.healthy.load(Relaxed))
    }

    /// Counts the endpoints that take requests for the limiter (all that pass their checks
    /// when none does: panic mode), and logs ejections that ended.
    fn refresh(&self, now: Nanos) {
        let members = self.members.load();
        let eligible = members.iter().filter(|e| e.eligible(now)).count() as u64;
        let n = if eligible > 0 {
            eligible
        } else {
            members.iter().filter(|e| e.healthy.load(Relaxed)).count() as u64
        };
        for e in members.iter() {
            let until = e.ejected_until.load(Relaxed);
            if until != 0
                && until <= now
                && e.ejected_until
                    .compare_exchange(until, 0, Relaxed, Relaxed)
                    .is_ok()
            {
                tracing::info!(
                    upstream = %self.name,
                    endpoint = %e.at.url,
                    "endpoint's ejection ended: it takes requests again"
                );
            }
        }
        if self.counted.swap(n, Relaxed) != n {
            self.limiter.set_members(n);
        }
    }

    /// One line a second at most: no endpoint takes requests.
    pub fn log_none(&self, now: Nanos) {
        let second = now / 1_000_000_000;
        if self.quiet_until.swap(second + 1, Relaxed) <= second {
            let members = self.members.load();
            tracing::error!(
                upstream = %self.name,
                endpoints = members.len(),
                "no healthy endpoint: requests get 503 no_healthy_endpoint"
            );
        }
    }

    /// How its endpoints stand now.
    pub fn counts(&self, now: Nanos) -> PoolCounts {
        let members = self.members.load();
        let mut c = PoolCounts {
            endpoints: members.len() as u64,
            ..PoolCounts::default()
        };
        for e in members.iter() {
            if !e.healthy.load(Relaxed) {
                c.unhealthy += 1;
            } else if e.ejected(now) {
                c.ejected += 1;
            } else {
                c.healthy += 1;
            }
        }
        c
    }

    /// Each endpoint's part of `/stats`, its figures over `window`.
    pub fn stats(&self, now: Nanos, window: Duration) -> Vec<EndpointStats> {
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let each = self.limiter.each();
        let steering = self.settings.load().headroom.is_some();
        let window = window.as_nanos() as u64;
        (self.members.load().iter())
            .map(|e| e.stats(now, window, (each, steering), unix))
            .collect()
    }

    // --- the endpoint set ---

    /// Makes `found` the endpoint set: those already there (by address) kept, the others
    /// new; the ones gone drain. Logged when it changes.
    fn replace(&self, found: Vec<EndpointAddr>) {
        let _one = lock(&self.changing);
        let old = self.members.load_full();
        let settings = self.settings.load();
        let next: Vec<Arc<Endpoint>> = found
            .into_iter()
            .map(|at| match old.iter().find(|e| e.at == at) {
                Some(kept) => Arc::clone(kept),
                None => Endpoint::new(at.clone(), settings.peer.peer(&at), &self.freed),
            })
            .collect();
        let added: Vec<&str> = (next.iter())
            .filter(|e| !old.iter().any(|o| Arc::ptr_eq(o, e)))
            .map(|e| e.at.url.as_str())
            .collect();
        let removed: Vec<&str> = (old.iter())
            .filter(|o| !next.iter().any(|e| Arc::ptr_eq(o, e)))
            .map(|e| e.at.url.as_str())
            .collect();
        if !added.is_empty() || !removed.is_empty() {
            tracing::info!(
                upstream = %self.name,
                added = %added.join(" "),
                removed = %removed.join(" "),
                endpoints = next.len(),
                "endpoints changed"
            );
        }
        self.members.store(Arc::new(next));
        drop(_one);
        self.refresh(self.clock.now());
    }

    /// The pool's background work, called every 100 ms: ejections that ended, the endpoints'
    /// rate samples (each second), discovery, active checks and backend scrapes when due.
    pub fn tick(
        self: &Arc<Self>,
        window: Duration,
        endpoint_labels: usize,
        meter: &crate::meter::UpstreamMeter,
    ) {
        let now = self.clock.now();
        self.refresh(now);
        // Requests waiting for a slot look again: an ejection may have ended, a cap risen.
        self.freed.wake();
        let unlabelled = self.members.load().len() > endpoint_labels;
        if self.unlabelled.swap(unlabelled, Relaxed) != unlabelled && unlabelled {
            tracing::warn!(
                upstream = %self.name,
                endpoints = self.members.load().len(),
                endpoint_labels,
                "more endpoints than metrics.endpoint_labels: /metrics has this pool's series only"
            );
        }
        let second = now / 1_000_000_000;
        if self.sampled.swap(second, Relaxed) != second {
            let w = window.as_nanos() as u64;
            for e in self.members.load().iter() {
                e.meter.sample(now, w);
            }
            self.steer(now);
        }
        let settings = self.settings.load_full();
        if let Some(d) = &settings.discover {
            if due(&self.discovery, discover::every(d)) {
                let (pool, d) = (Arc::clone(self), d.clone());
                tokio::spawn(async move { pool.discover(d).await });
            }
        }
        if let Some(h) = &settings.health {
            if due(&self.checks, h.every) {
                let (pool, h) = (Arc::clone(self), h.clone());
                tokio::spawn(async move { pool.check(h).await });
            }
        }
        if let Some(path) = &settings.backend_path {
            for e in self.members.load().iter() {
                let backend = {
                    let mut b = lock(&e.backend);
                    let every = settings.backend_scrape;
                    // Made when first needed, and again when a reload changes its path or pace.
                    if !b.as_ref().is_some_and(|b| b.scrapes(path, every)) {
                        let url = format!("http://{}{path}", e.at.addr);
                        *b = url.parse().ok().map(|u| Backend::new(u, every));
                    }
                    b.clone()
                };
                if let Some(b) = backend {
                    b.tick(&self.name, Arc::clone(e) as _);
                }
                // The curve takes the reading with its time booked up to now.
                meter.set_endpoint_backend(&e.meter, e.meter.backend_reported());
            }
        }
    }

    /// Finds the endpoints again and makes them the set; a failure keeps the set as it is
    /// (logged once until discovery works again).
    async fn discover(self: Arc<Self>, d: Discover) {
        let found = discover::find(&d).await;
        let mut due = lock(&self.discovery);
        due.running = false;
        match found {
            Ok(found) => {
                if due.failing {
                    tracing::info!(upstream = %self.name, "endpoint discovery works again");
                }
                due.failing = false;
                drop(due);
                self.replace(found);
            }
            Err(e) => {
                if !due.failing {
                    tracing::warn!(
                        upstream = %self.name,
                        cause = %e,
                        "endpoint discovery failed; the endpoints found before stay"
                    );
                }
                due.failing = true;
            }
        }
    }

    /// Checks every endpoint at once and takes what each answered on.
    async fn check(self: Arc<Self>, h: HealthCheck) {
        let members = self.members.load_full();
        let mut checks = tokio::task::JoinSet::new();
        for e in members.iter() {
            let (e, h) = (Arc::clone(e), h.clone());
            checks.spawn(async move {
                let result = health::probe(&e.at, &h).await;
                (e, result)
            });
        }
        while let Some(done) = checks.join_next().await {
            if let Ok((e, result)) = done {
                self.checked(&e, &h, result);
            }
        }
        lock(&self.checks).running = false;
        self.refresh(self.clock.now());
    }
}

/// Marks the job running when it is due (and due again `every` later).
fn due(job: &Mutex<Due>, every: Duration) -> bool {
    let mut d = lock(job);
    let now = Instant::now();
    if d.running || d.next.is_some_and(|next| now < next) {
        return false;
    }
    d.running = true;
    d.next = Some(now + every);
    true
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// === impl Settings ===

impl Settings {
    fn of(u: &UpstreamConfig) -> Settings {
        Settings {
            balance: u.balance.clone(),
            headroom: (u.balance == Balance::SloHeadroom).then_some(curve::Headroom {
                tpot_ms: u.targets.tpot_ms,
                ttft_ms: u.targets.ttft_ms,
                cap: u.slo,
            }),
            eject_after: u.eject_after,
            eject: u.eject,
            health: u.health.clone(),
            discover: u.discover.clone(),
            backend_path: u.backend_metrics_path.clone(),
            backend_scrape: u.backend_scrape,
            peer: PeerOptions {
                connect: u.connect_timeout,
                read: u.read_timeout,
                write: u.write_timeout,
                idle: u.idle_timeout,
                verify: u.tls_verify,
                trust: u.trust.clone(),
            },
        }
    }
}

impl PeerOptions {
    fn peer(&self, at: &EndpointAddr) -> HttpPeer {
        let mut p = HttpPeer::new(at.addr, at.tls, at.sni.clone());
        p.options.connection_timeout = Some(self.connect);
        p.options.total_connection_timeout = Some(self.connect * 2);
        p.options.read_timeout = Some(self.read);
        p.options.write_timeout = Some(self.write);
        p.options.idle_timeout = Some(self.idle);
        p.options.verify_cert = self.verify;
        p.options.verify_hostname = self.verify;
        p.options.ca = self.trust.clone();
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::limit::LimitConfig;

    fn pool(extra: &str, n: usize) -> (Arc<Pool>, Arc<Limiter>) {
        let list: Vec<String> = (0..n)
            .map(|i| format!("\"http://127.0.0.{}:9\"", i + 1))
            .collect();
        let text = format!(
            "[[upstream]]\nname = \"p\"\nendpoints = [{}]\n{extra}",
            list.join(", ")
        );
        let c = Config::parse(&text, "t").unwrap_or_else(|e| panic!("{e}"));
        let u = &c.upstreams[0];
        let limiter = Limiter::new(
            LimitConfig {
                initial: u.max_concurrency,
                total: u.max_concurrency_total,
                max_queue: 10,
                queue_timeout: Duration::from_secs(1),
                ageing: Duration::from_secs(5),
            },
            metrics::Histogram::noop(),
        );
        (
            Pool::new(u, Clock::new(), Arc::clone(&limiter), None),
            limiter,
        )
    }

    fn at(p: &Pool, i: usize) -> Arc<Endpoint> {
        Arc::clone(&p.members()[i])
    }

    /// Ejections double while an endpoint keeps failing, end with a good answer's run, and
    /// never take the last endpoint out; the limiter counts those taking requests.
    #[test]
    fn ejection_doubles_and_spares_the_last_endpoint() {
        let (p, limiter) = pool("max_concurrency = 4\neject_secs = 2\n", 2);
        assert_eq!(limiter.limit(), Some(8));
        let (a, b) = (at(&p, 0), at(&p, 1));
        let now = p.clock.now();
        p.unreachable(&a, "connect: refused");
        let first = a.ejected_until.load(Relaxed) - now;
        assert!((2_000_000_000..2_500_000_000).contains(&first), "{first}");
        assert_eq!(limiter.limit(), Some(4));
        // b is the last one taking requests: failing, it stays.
        p.unreachable(&b, "connect: refused");
        assert!(b.eligible(p.clock.now()));
        // Every request goes to b now.
        for _ in 0..4 {
            let h = p.pick(p.clock.now(), true, None, &[]).unwrap();
            assert!(Arc::ptr_eq(&h.endpoint, &b));
        }
        // a's ejection ends; failing again, it is out for twice as long.
        a.ejected_until.store(1, Relaxed);
        p.refresh(p.clock.now());
        assert_eq!(limiter.limit(), Some(8));
        let now = p.clock.now();
        p.unreachable(&a, "connect: refused");
        let second = a.ejected_until.load(Relaxed) - now;
        assert!((4_000_000_000..4_500_000_000).contains(&second), "{second}");
        // 5xx: eject_after (3) in a row eject; a good answer ends the run.
        let (p, _) = pool("", 3);
        let c = at(&p, 2);
        p.answered(&c, 503);
        p.answered(&c, 502);
        p.answered(&c, 200); // judged when its body ends:
        p.served(&c);
        p.answered(&c, 500);
        p.answered(&c, 500);
        assert!(c.eligible(p.clock.now()));
        p.answered(&c, 500);
        assert!(!c.eligible(p.clock.now()));
        assert_eq!(c.ejections_total.load(Relaxed), 1);
    }

    /// With every endpoint out on passive evidence, requests go to all that pass their
    /// checks (panic mode); with none passing its checks, there is no endpoint.
    #[test]
    fn panic_mode_and_no_endpoint() {
        let (p, _) = pool("", 2);
        let (a, b) = (at(&p, 0), at(&p, 1));
        let far = p.clock.now() + 60_000_000_000;
        a.ejected_until.store(far, Relaxed);
        b.ejected_until.store(far, Relaxed);
        assert!(p.serving());
        assert!(p.pick(p.clock.now(), true, None, &[]).is_ok());
        a.healthy.store(false, Relaxed);
        b.healthy.store(false, Relaxed);
        assert!(!p.serving());
        assert_eq!(
            p.pick(p.clock.now(), true, None, &[]).err(),
            Some(Unplaced::NoEndpoint)
        );
    }

    /// `slo_headroom`'s order: an endpoint without a curve is tried once, alone and idle,
    /// while another meets the SLO; then those that meet it, the most room first, until
    /// their caps; then those without a curve; the one that misses the SLO even alone last.
    #[test]
    fn slo_headroom_explores_then_fills_by_room_and_spares_the_one_over_the_slo() {
        let (p, _) = pool(
            "max_concurrency = 3\nbalance = \"slo_headroom\"\n[upstream.slo]\ntpot_ms = 30\n",
            4,
        );
        at(&p, 0).set_curve(Some((20.0, 1.0)));
        at(&p, 1).set_curve(None);
        at(&p, 2).set_curve(Some((40.0, 1.0)));
        at(&p, 3).set_curve(Some((10.0, 1.0)));
        let now = p.clock.now();
        let mut held = Vec::new();
        let mut order = Vec::new();
        while let Ok(h) = p.pick(now, true, None, &[]) {
            order.push(
                p.members()
                    .iter()
                    .position(|e| Arc::ptr_eq(e, &h.endpoint))
                    .unwrap(),
            );
            held.push(h);
        }
        // 3 has the most room (10 + 1·batch: 13 ms at its cap, against 0's 21 ms idle)
        // while 0 and 3 both meet the SLO; 1 is explored first, then waits its turn after
        // them.
        assert_eq!(order, [1, 3, 3, 3, 0, 0, 0, 1, 1, 2, 2, 2]);
        // No second exploration within a second, nor while one is in flight.
        held.clear();
        let h = p.pick(now, true, None, &[]).unwrap();
        assert!(Arc::ptr_eq(&h.endpoint, &at(&p, 3)));
    }

    /// Caps: a generation request takes a slot under its endpoint's cap; others go without.
    #[test]
    fn slots_hold_the_cap_of_each_endpoint() {
        let (p, _) = pool("max_concurrency = 2\nbalance = \"round_robin\"\n", 3);
        let held: Vec<Held> = (0..6)
            .map(|_| p.pick(p.clock.now(), true, None, &[]).unwrap())
            .collect();
        for e in p.members().iter() {
            assert_eq!(e.in_flight(), 2);
        }
        let plain = p.pick(p.clock.now(), false, None, &[]).unwrap();
        assert!(!plain.holds_slot());
        drop(held);
        for e in p.members().iter() {
            assert_eq!(e.in_flight(), 0);
        }
    }

    /// Full means full: with every endpoint at its cap a generation request gets no slot
    /// (it was given one over the cap), waits for one, and has it the moment one frees; a
    /// wait that no slot ends is refused at its end.
    #[tokio::test]
    async fn a_full_pool_waits_for_a_slot_and_never_passes_a_cap() {
        let (p, _) = pool("max_concurrency = 1\n", 2);
        let a = p.pick(p.clock.now(), true, None, &[]).unwrap();
        let b = p.pick(p.clock.now(), true, None, &[]).unwrap();
        assert_eq!(
            p.pick(p.clock.now(), true, None, &[]).err(),
            Some(Unplaced::Full)
        );
        // A failover avoids where it failed, and the only other one is full.
        let avoid = [Arc::clone(&a.endpoint)];
        let waited = p.pick_within(true, None, &avoid, Duration::from_millis(30));
        assert_eq!(waited.await.err(), Some(Unplaced::Full));
        // Waiting, it takes b's slot when b's request ends; a's freeing does not help it.
        let b_at = Arc::clone(&b.endpoint);
        let (p2, avoid2) = (Arc::clone(&p), avoid.clone());
        let waiter = tokio::spawn(async move {
            p2.pick_within(true, None, &avoid2, Duration::from_secs(30))
                .await
                .map(|h| h.endpoint.at.url.clone())
        });
        while p.freed.waiting.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        drop(b);
        assert_eq!(waiter.await.unwrap(), Ok(b_at.at.url.clone()));
        for e in p.members().iter() {
            assert!(e.in_flight() <= 1, "{}: {}", e.at.url, e.in_flight());
        }
        drop(a);
        assert_eq!(p.freed.waiting.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    /// Evidence from real traffic outweighs a probe: a passing check leaves a passive
    /// ejection running, unless a check failed during it (the probes saw it down: passing
    /// again, it was restarted).
    #[test]
    fn a_passing_check_ends_only_an_ejection_the_checks_saw() {
        let (p, _) = pool("eject_after = 1\n", 2);
        let a = at(&p, 0);
        let h = HealthCheck {
            path: "/health".into(),
            every: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            unhealthy_after: 2,
            healthy_after: 1,
        };
        p.answered(&a, 500);
        assert!(a.ejected(p.clock.now()));
        for _ in 0..3 {
            p.checked(&a, &h, Ok(()));
            assert!(
                a.ejected(p.clock.now()),
                "a good /health ended the ejection"
            );
        }
        // Down to its checks as well, then up: restarted.
        p.checked(&a, &h, Err("connect: refused".into()));
        assert!(a.ejected(p.clock.now()));
        p.checked(&a, &h, Ok(()));
        assert!(a.eligible(p.clock.now()));
        // Failing again, its next ejection is twice as long: no good answer came between.
        let now = p.clock.now();
        p.answered(&a, 500);
        let second = a.ejected_until.load(Relaxed) - now;
        assert!(
            (20_000_000_000..21_000_000_000).contains(&second),
            "{second}"
        );
        // A failure's cause is named: a head that never came counts as a failure too.
        let b = at(&p, 1);
        a.ejected_until.store(0, Relaxed);
        p.failed(&b, "no response head within read_timeout_secs (1 s)");
        assert!(!b.eligible(p.clock.now()));
        let s = p.stats(p.clock.now(), Duration::from_secs(10));
        assert_eq!(
            s[1].last_error.as_deref(),
            Some("no response head within read_timeout_secs (1 s)")
        );
        assert_eq!(s[1].ejections_total, 1);
    }

    /// Prefix affinity: a prompt keeps to the endpoint it was placed on, the prompts spread
    /// evenly, and an endpoint that leaves moves only its own prompts (read from which
    /// endpoint's index holds each).
    #[test]
    fn a_leaving_endpoint_moves_only_its_prefixes() {
        let (p, _) = pool("balance = \"prefix\"\n", 4);
        let prompt = |k: usize| {
            format!(
                r#""messages":[{{"role":"system","content":"{}"}}]"#,
                format!("p{k} ").repeat(300)
            )
        };
        let place = |p: &Pool| -> Vec<String> {
            (0..64)
                .map(|k| {
                    let h = p
                        .pick(p.clock.now(), true, Some(prompt(k).as_bytes()), &[])
                        .unwrap();
                    h.endpoint.at.url.clone()
                })
                .collect()
        };
        let before = place(&p);
        assert_eq!(before, place(&p), "each prompt keeps its endpoint");
        let mut per: std::collections::HashMap<&str, usize> = Default::default();
        for u in &before {
            *per.entry(u.as_str()).or_default() += 1;
        }
        let (lo, hi) = (per.values().min().copied(), per.values().max().copied());
        assert!(
            per.len() == 4 && lo >= Some(12) && hi <= Some(20),
            "spread {per:?}"
        );
        let gone = at(&p, 1).at.url.clone();
        at(&p, 1).healthy.store(false, Relaxed);
        let after = place(&p);
        for (b, a) in before.iter().zip(&after) {
            if *b == gone {
                assert_ne!(*a, gone);
            } else {
                assert_eq!(a, b, "a prompt that was not on the one that left moved");
            }
        }
    }

    /// Consistent hashing: a key keeps its endpoint; an endpoint that leaves moves its own
    /// keys only.
    #[test]
    fn a_leaving_endpoint_moves_only_its_keys() {
        let (p, _) = pool("balance = \"consistent_hash:header:x-s\"\n", 4);
        let place = |p: &Pool| -> Vec<String> {
            (0..200)
                .map(|k| {
                    let key = format!("session-{k}");
                    let h = p
                        .pick(p.clock.now(), true, Some(key.as_bytes()), &[])
                        .unwrap();
                    h.endpoint.at.url.clone()
                })
                .collect()
        };
        let before = place(&p);
        assert_eq!(before, place(&p));
        let gone = at(&p, 2).at.url.clone();
        let moved_share = before.iter().filter(|u| **u == gone).count();
        assert!((25..=75).contains(&moved_share), "{moved_share}");
        at(&p, 2).healthy.store(false, Relaxed);
        let after = place(&p);
        for (b, a) in before.iter().zip(&after) {
            if *b == gone {
                assert_ne!(*a, gone);
            } else {
                assert_eq!(a, b);
            }
        }
    }
}
