//! The running state the proxy, the admin API and the background tasks share: the config,
//! the clock, one [`Upstream`] per configured upstream (its config, peer, meter, limiter and
//! adaptive cap together, found by name), the router and the telemetry.
//!
//! [`Live`] holds the state in force. A reload builds the next [`Shared`] aside from a
//! validated config ([`Shared::successor`]) and swaps it in with one store; a request holds
//! the state it started with until it ends, so a removed upstream drains on it. Upstreams
//! kept by name keep their meter (windows, curve, A/B samples) and limiter (in-flight
//! count, queue), reconfigured in place.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::access::Access;
use crate::backend::Backend;
use crate::config::{self, Config, ConfigError};
use crate::limit::fleet::{Fleet, FleetLink};
use crate::limit::slo::Adaptive;
use crate::limit::{LimitConfig, Limiter};
use crate::logs::Throttle;
use crate::meter::{Clock, UpstreamMeter};
use crate::pool::Pool;
use crate::routing::Router;
use crate::telemetry::Telemetry;
use crate::tenant::book::Book;
use crate::tenant::budget::Budgets;
use crate::tenant::Tenants;

/// What the proxy, the admin API and the background tasks share: one generation of the
/// running state.
pub struct Shared {
    pub config: Config,
    pub clock: Clock,
    /// In config order: routes name upstreams by their place here.
    pub upstreams: Vec<Upstream>,
    pub router: Router,
    pub telemetry: Arc<Telemetry>,
    /// The fleet's Redis, with `[cluster]`.
    pub cluster: Option<Arc<FleetLink>>,
    /// Who a request belongs to (`[tenants]`), and per tenant its budget's bucket and its
    /// figures (both kept across reloads).
    pub tenants: Tenants,
    pub budgets: Arc<Budgets>,
    pub book: Arc<Book>,
    /// Each route's rollout (kept across reloads while unchanged).
    pub rollouts: crate::rollout::Rollouts,
}

/// Everything tokentap keeps for one upstream.
pub struct Upstream {
    pub config: config::UpstreamConfig,
    /// Its endpoints, their health and how requests are spread over them.
    pub pool: Arc<Pool>,
    pub meter: Arc<UpstreamMeter>,
    /// Its concurrency limit (unlimited without a cap or an SLO).
    pub limiter: Arc<Limiter>,
    /// The adaptive cap, with an SLO.
    pub slo: Option<Arc<Adaptive>>,
    /// The backend's own load, with `backend_metrics`.
    pub backend: Option<Arc<Backend>>,
    /// Its slots as fleet leases, with `[cluster]` and a cap.
    pub fleet: Option<Arc<Fleet>>,
    /// As a mirror: its copies in flight, those skipped, and the pairs they made.
    pub shadow: Arc<Shadow>,
    /// Its capacity's endpoints needed, held steady (kept across reloads).
    pub steady: Arc<crate::decide::capacity::Steady>,
}

/// What an upstream that routes mirror to keeps of its shadow traffic, across reloads.
#[derive(Debug, Default)]
pub struct Shadow {
    /// Copies in flight now (every route's mirror to it counts here).
    pub in_flight: AtomicU64,
    /// Copies not sent because `max_in_flight` were running.
    pub skipped_max_in_flight: AtomicU64,
    /// Sampled requests whose body was not read whole (over the 64 KiB read-ahead).
    pub skipped_body_unread: AtomicU64,
    /// Copies with no endpoint to go to.
    pub skipped_no_endpoint: AtomicU64,
    /// Copies not sent because the upstream's own cap (`max_concurrency`, an SLO's) had no
    /// slot free at once: a copy never waits for one.
    pub skipped_cap: AtomicU64,
    /// Each copy against its primary, when both finished.
    pub pairs: crate::compare::paired::Pairs,
}

// === impl Shared ===

impl Shared {
    pub fn new(config: Config) -> Arc<Shared> {
        let cluster = config.cluster.as_ref().and_then(|c| {
            FleetLink::new(&c.redis_url, c.lease)
                .map_err(|e| tracing::error!(cause = %e, "cluster: cannot use [cluster] redis_url; caps are per replica"))
                .ok()
        });
        Shared::build(
            config,
            Clock::new(),
            Arc::new(Telemetry::new()),
            cluster.clone(),
            (
                Arc::new(Budgets::new(cluster.map(|c| c as _))),
                Arc::default(),
            ),
            None,
            |_| None,
        )
    }

    fn build<'a>(
        config: Config,
        clock: Clock,
        telemetry: Arc<Telemetry>,
        cluster: Option<Arc<FleetLink>>,
        (budgets, book): (Arc<Budgets>, Arc<Book>),
        rollouts: Option<&crate::rollout::Rollouts>,
        kept: impl Fn(&str) -> Option<&'a Upstream>,
    ) -> Arc<Shared> {
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| match kept(&u.name) {
                Some(old) => old.successor(u, &config, &telemetry, cluster.as_ref()),
                None => Upstream::new(u, &config, clock, &telemetry, cluster.as_ref()),
            })
            .collect();
        let names: Vec<String> = config.upstreams.iter().map(|u| u.name.clone()).collect();
        let rollouts = crate::rollout::Rollouts::new(
            &config.routes,
            &names,
            config.rollout_state_file.as_deref(),
            rollouts,
            clock.now(),
        );
        Arc::new(Shared {
            router: Router::new(&config.routes, &rollouts),
            rollouts,
            upstreams,
            clock,
            telemetry,
            cluster,
            tenants: Tenants::new(config.tenants.clone(), Arc::clone(&book)),
            budgets,
            book,
            config,
        })
    }

    /// The state `config` describes, following this one: upstreams of the same name keep
    /// their meter, limiter and adaptive cap. What cannot change while running (listen
    /// addresses, threads, the connection limit and pool size, work stealing, the live
    /// window's length) keeps its running value; each such change is returned as a note.
    pub fn successor(&self, mut config: Config) -> (Arc<Shared>, Vec<String>) {
        let old = &self.config;
        let mut notes = Vec::new();
        let n = &mut notes;
        let c = &mut config;
        keep(n, "listen.proxy", &mut c.listen.proxy, old.listen.proxy);
        keep(n, "listen.admin", &mut c.listen.admin, old.listen.admin);
        keep(n, "server.threads", &mut c.threads, old.threads);
        keep(
            n,
            "server.work_stealing",
            &mut c.work_stealing,
            old.work_stealing,
        );
        keep(
            n,
            "server.upstream_keepalive_pool_size",
            &mut c.keepalive_pool,
            old.keepalive_pool,
        );
        keep(
            n,
            "server.max_connections",
            &mut c.limits.max_connections,
            old.limits.max_connections,
        );
        keep(n, "metrics.window_secs", &mut c.window, old.window);
        keep(n, "log.format", &mut c.log.format, old.log.format);
        if c.cluster != old.cluster {
            n.push("cluster: changes only on restart; the running [cluster] stays".to_owned());
            c.cluster.clone_from(&old.cluster);
        }
        let cluster = self.cluster.clone();
        let next = Shared::build(
            config,
            self.clock,
            Arc::clone(&self.telemetry),
            cluster,
            (Arc::clone(&self.budgets), Arc::clone(&self.book)),
            Some(&self.rollouts),
            |name| self.upstream(name).map(|(_, u)| u),
        );
        (next, notes)
    }

    /// Evaluates each rollout that is due, on its upstreams' counters and the comparison of
    /// the samples of its step.
    pub fn tick_rollouts(&self) {
        if self.rollouts.is_empty() {
            return;
        }
        let now = self.clock.now();
        let counts = |u: usize| {
            let s = self.upstreams[u].meter.stats(now);
            let slo = &s.slo_requests_total;
            crate::rollout::judge::Counts {
                requests: s.requests_total,
                errors: s.errors_total,
                judged: slo.iter().map(|(_, n)| n).sum(),
                good: (slo.iter())
                    .find(|(v, _)| *v == "good")
                    .map_or(0, |(_, n)| *n),
            }
        };
        let compare = |r: &crate::rollout::Rollout, since: crate::meter::Nanos| {
            let step = |u: usize| -> Vec<crate::meter::RequestSample> {
                let all = self.upstreams[u].meter.samples(now);
                all.into_iter().filter(|s| s.at >= since).collect()
            };
            let secs = now.saturating_sub(since) / 1_000_000_000;
            let (from, to) = (step(r.config.from), step(r.config.to));
            crate::compare::compare(&r.from, &from, &r.to, &to, secs)
        };
        self.rollouts.tick(now, counts, compare);
    }

    /// The upstream called `name`, and its place.
    pub fn upstream(&self, name: &str) -> Option<(usize, &Upstream)> {
        self.upstreams
            .iter()
            .enumerate()
            .find(|(_, u)| u.config.name == name)
    }
}

/// A setting that changes only on restart: `field` (the file's value) is set back to
/// `running`, with a note when they differ.
fn keep<T: PartialEq + Copy + std::fmt::Debug>(
    notes: &mut Vec<String>,
    key: &str,
    field: &mut T,
    running: T,
) {
    if *field != running {
        notes.push(format!(
            "{key}: changes only on restart; still {running:?} (the file says {:?})",
            *field
        ));
        *field = running;
    }
}

// === impl Upstream ===

impl Upstream {
    fn new(
        u: &config::UpstreamConfig,
        config: &Config,
        clock: Clock,
        telemetry: &Arc<Telemetry>,
        cluster: Option<&Arc<FleetLink>>,
    ) -> Self {
        let meter =
            UpstreamMeter::new(&u.name, config.window, clock, telemetry.histograms(&u.name));
        meter.set_sample_window(config.compare_window);
        meter.set_curve_window(config.curve_window);
        meter.set_semconv(config.semconv.then(|| Arc::clone(telemetry)));
        meter.set_slo_targets(u.targets);
        let slo = u.slo.map(|slo| Arc::new(Adaptive::new(slo)));
        let limiter = Limiter::new(
            limit_config(u, config, slo.as_deref()),
            telemetry.queue_wait(&u.name),
        );
        Upstream {
            config: u.clone(),
            pool: Pool::new(u, clock, Arc::clone(&limiter), cluster.cloned()),
            meter,
            limiter,
            slo,
            backend: backend(u),
            fleet: fleet(u, cluster),
            shadow: Arc::default(),
            steady: Arc::default(),
        }
    }

    /// Whether a request arriving now would get a slot without waiting: locally, and (with
    /// `[cluster]`) in the fleet as this replica last heard. `spill` asks it.
    pub fn has_headroom(&self) -> bool {
        self.limiter.has_headroom() && self.fleet.as_ref().is_none_or(|f| f.has_room())
    }

    /// This upstream as `u` configures it now: the same meter and limiter (its in-flight
    /// requests and queue carry over; a lower cap admits nothing new until in-flight is
    /// under it), and the same adaptive cap when it keeps an SLO, retuned.
    fn successor(
        &self,
        u: &config::UpstreamConfig,
        config: &Config,
        telemetry: &Arc<Telemetry>,
        cluster: Option<&Arc<FleetLink>>,
    ) -> Upstream {
        self.meter.set_sample_window(config.compare_window);
        self.meter
            .set_semconv(config.semconv.then(|| Arc::clone(telemetry)));
        // A new length starts the curve's window afresh; the same keeps it.
        self.meter.set_curve_window(config.curve_window);
        self.meter.set_slo_targets(u.targets);
        let slo = match (u.slo, &self.slo) {
            (Some(slo), Some(adaptive)) => {
                adaptive.retune(slo);
                Some(Arc::clone(adaptive))
            }
            (Some(slo), None) => Some(Arc::new(Adaptive::new(slo))),
            (None, _) => None,
        };
        // An adaptive cap kept goes on from the limit it is at.
        self.limiter
            .reconfigure(limit_config(u, config, slo.as_deref()));
        // The same endpoint keeps its readings; a new one starts afresh, and none puts the
        // curve back on tokentap's own count.
        let backend = match (&u.backend_metrics, &self.backend) {
            (Some(url), Some(b)) if b.same_as(url, u.backend_scrape) => Some(Arc::clone(b)),
            _ => backend(u),
        };
        if backend.is_none() {
            self.meter.set_backend_running(None);
        }
        self.pool.reconfigure(u);
        Upstream {
            config: u.clone(),
            pool: Arc::clone(&self.pool),
            meter: Arc::clone(&self.meter),
            limiter: Arc::clone(&self.limiter),
            slo,
            backend,
            shadow: Arc::clone(&self.shadow),
            steady: Arc::clone(&self.steady),
            // Held leases stay with the fleet part that took them.
            fleet: match (&self.fleet, fleet(u, cluster)) {
                (Some(kept), Some(_)) => {
                    kept.set_adaptive(u.slo.is_some());
                    Some(Arc::clone(kept))
                }
                (_, next) => {
                    if next.is_none() {
                        // Uncapped (or out of the cluster): no share holds it back.
                        self.limiter.set_share(None);
                    }
                    next
                }
            },
        }
    }
}

/// The fleet part of an upstream with a cap, when there is a cluster.
fn fleet(u: &config::UpstreamConfig, cluster: Option<&Arc<FleetLink>>) -> Option<Arc<Fleet>> {
    let capped = u.max_concurrency.is_some() || u.slo.is_some();
    let fleet = cluster.filter(|_| capped).map(|c| Fleet::new(c, &u.name))?;
    fleet.set_adaptive(u.slo.is_some());
    Some(fleet)
}

fn backend(u: &config::UpstreamConfig) -> Option<Arc<Backend>> {
    u.backend_metrics
        .clone()
        .map(|url| Backend::new(url, u.backend_scrape))
}

fn limit_config(
    u: &config::UpstreamConfig,
    config: &Config,
    slo: Option<&Adaptive>,
) -> LimitConfig {
    LimitConfig {
        initial: slo.map_or(u.max_concurrency, |s| Some(s.limit())),
        total: u.max_concurrency_total,
        max_queue: u.max_queue,
        queue_timeout: u.queue_timeout,
        ageing: config.tenants.ageing,
    }
}

/// The state in force, swapped whole by a reload, and the reloads' record.
pub struct Live {
    current: ArcSwap<Shared>,
    clock: Clock,
    /// The access log (`[log] access`).
    pub access: Access,
    /// Failure lines, at most one a second per upstream and cause.
    pub throttle: Throttle,
    /// The file a reload reads; `None`: the config was given in memory (tests, the demo).
    source: Option<PathBuf>,
    /// One reload at a time (SIGHUP and `POST /reload` may race).
    reloading: Mutex<()>,
    reloads_ok: AtomicU64,
    reloads_failed: AtomicU64,
    /// Unix time of the last successful reload (of the start until one), seconds.
    last_success: AtomicU64,
    /// A drain (SIGTERM) has begun: `/readyz` answers 503.
    draining: std::sync::atomic::AtomicBool,
}

/// What `/metrics` shows of the process itself: its reloads and its access log.
pub struct Process {
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// Unix time of the last successful reload (of the start until one), seconds.
    pub last_reload_success: u64,
    /// Access-log lines dropped because the writer could not keep up.
    pub access_dropped: u64,
    /// With `[cluster]`: the fleet as this replica sees it.
    pub cluster: Option<ClusterFigures>,
}

/// What `/metrics` shows of the fleet, with `[cluster]`.
#[derive(Debug, Clone, Copy)]
pub struct ClusterFigures {
    /// Redis is away: each replica on its share.
    pub degraded: bool,
    /// Replicas seen in the last minute.
    pub replicas: u64,
    /// Budget calls kept until Redis confirms them.
    pub unsettled: u64,
}

/// What a reload did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Reloaded {
    pub ok: bool,
    /// Why the file was refused, each with its dotted path; the running config stays.
    pub problems: Vec<String>,
    /// Settings that changed in the file but only take effect on restart.
    pub notes: Vec<String>,
}

// === impl Live ===

impl Live {
    pub fn new(config: Config, source: Option<PathBuf>) -> Arc<Live> {
        let access = Access::new(&config.log.access);
        let shared = Shared::new(config);
        Arc::new(Live {
            access,
            throttle: Throttle::default(),
            clock: shared.clock,
            current: ArcSwap::new(shared),
            source,
            reloading: Mutex::new(()),
            reloads_ok: AtomicU64::new(0),
            reloads_failed: AtomicU64::new(0),
            last_success: AtomicU64::new(unix_now()),
            draining: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The file the config came from (`None`: given in memory).
    pub fn source(&self) -> Option<&std::path::Path> {
        self.source.as_deref()
    }

    /// A drain has begun: not ready for new traffic.
    pub fn start_draining(&self) {
        self.draining.store(true, Relaxed);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Relaxed)
    }

    /// The clock every generation of the state shares.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// The state in force now; a request keeps the one it started with.
    pub fn load(&self) -> Arc<Shared> {
        self.current.load_full()
    }

    /// Reads the config file again and swaps the state it describes in; a file with
    /// problems changes nothing. Logged (each problem and note on a line), as asked by
    /// `trigger` (SIGHUP, POST /reload).
    pub fn reload(&self, trigger: &str) -> Reloaded {
        let reloaded = self.reload_file();
        let (ok, failed) = (
            self.reloads_ok.load(Relaxed),
            self.reloads_failed.load(Relaxed),
        );
        if reloaded.ok {
            tracing::info!(trigger, reloads_ok = ok, "config reloaded");
        } else {
            tracing::error!(
                trigger,
                reloads_failed = failed,
                "config reload refused; the running config stays"
            );
        }
        for problem in &reloaded.problems {
            tracing::error!(trigger, "config problem: {problem}");
        }
        for note in &reloaded.notes {
            tracing::warn!(trigger, "config: {note}");
        }
        reloaded
    }

    fn reload_file(&self) -> Reloaded {
        let Some(path) = &self.source else {
            return self.refused(vec![
                "this tokentap was started without a config file: nothing to reload".into(),
            ]);
        };
        match Config::load(path) {
            Ok(config) => self.apply(config),
            Err(ConfigError { problems, .. }) => {
                self.refused(problems.iter().map(ToString::to_string).collect())
            }
        }
    }

    /// Swaps in the state `config` describes (validated already), with its log settings.
    pub fn apply(&self, config: Config) -> Reloaded {
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        let (next, mut notes) = self.load().successor(config);
        notes.extend(crate::logs::apply(&next.config.log));
        self.access.set(&next.config.log.access);
        self.current.store(next);
        self.reloads_ok.fetch_add(1, Relaxed);
        self.last_success.store(unix_now(), Relaxed);
        Reloaded {
            ok: true,
            problems: Vec::new(),
            notes,
        }
    }

    /// `POST /rollout/ROUTE`: the steer applied to the rollout live when it is applied,
    /// and the rollout as it is then. Its lookup, the steer and the state file's write
    /// happen one reload at a time with them: a reload builds its successor from the
    /// rollout either before the steer or after it, never around it, so the answer,
    /// `GET /rollout` and the state file agree.
    pub fn steer(
        &self,
        route: &str,
        action: crate::rollout::Action,
    ) -> Result<crate::rollout::RolloutStats, crate::rollout::ActError> {
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        self.load().rollouts.act(route, action, self.clock.now())
    }

    fn refused(&self, problems: Vec<String>) -> Reloaded {
        self.reloads_failed.fetch_add(1, Relaxed);
        Reloaded {
            ok: false,
            problems,
            notes: Vec::new(),
        }
    }

    /// What `/metrics` shows of the process: its reloads and access log.
    pub fn process(&self) -> Process {
        Process {
            reloads_ok: self.reloads_ok.load(Relaxed),
            reloads_failed: self.reloads_failed.load(Relaxed),
            last_reload_success: self.last_success.load(Relaxed),
            access_dropped: self.access.dropped(),
            cluster: self.load().cluster.as_ref().map(|c| ClusterFigures {
                degraded: c.degraded(),
                replicas: c.replicas(),
                unsettled: c.unsettled(),
            }),
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
