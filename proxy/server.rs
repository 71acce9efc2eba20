//! Assembles the pingora server from a [`Config`]: the proxy service, the admin service and
//! the upkeep task (telemetry, idle upstream connections), all sharing one [`Shared`].

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;
use tokio::sync::Notify;

use crate::admin::telemetry::Telemetry;
use crate::admin::Admin;
use crate::config::{Config, Upstream};
use crate::limit::controller::{Controller, Slo, Tick};
use crate::limit::{LimitConfig, Limiter};
use crate::meter::{Clock, UpstreamMeter};
use crate::routing::Router;
use crate::service::{Connections, Front, FrontService, Pool, TokenTap};

/// What the proxy, the admin API and the background tasks share.
pub struct Shared {
    pub config: Config,
    pub clock: Clock,
    /// One per upstream, in config order.
    pub meters: Vec<Arc<UpstreamMeter>>,
    /// Prebuilt peers, one per upstream, cloned per request.
    pub peers: Vec<HttpPeer>,
    /// The direct path's (`service/direct.rs`) TLS upstream connections, pooled.
    pub connector: pingora::connectors::TransportConnector,
    /// The direct path's idle plain-TCP upstream connections.
    pub(crate) pool: Pool,
    pub router: Router,
    pub telemetry: Telemetry,
    /// One per upstream: its concurrency limit (unlimited without a cap or an SLO).
    pub limiters: Vec<Arc<Limiter>>,
    /// One per upstream with an SLO.
    pub slo: Vec<Option<SloState>>,
    /// Open client connections, against `server.max_connections`.
    pub connections: Connections,
}

/// An upstream's adaptive cap.
pub struct SloState {
    pub slo: Slo,
    pub controller: Mutex<Controller>,
    /// The SLO percentile of per-token gaps over the last tick, ms.
    pub current_tpot_ms: Mutex<Option<f64>>,
}

// === impl Shared ===

impl Shared {
    pub fn new(config: Config) -> Arc<Shared> {
        let clock = Clock::new();
        let telemetry = Telemetry::new();
        let meters = config
            .upstreams
            .iter()
            .map(|u| {
                let m = UpstreamMeter::new(
                    &u.name,
                    config.window,
                    clock,
                    telemetry.histograms(&u.name),
                );
                m.set_sample_window(config.compare_window);
                m
            })
            .collect();
        let slo: Vec<Option<SloState>> = config
            .upstreams
            .iter()
            .map(|u| {
                u.slo.map(|slo| SloState {
                    slo,
                    controller: Mutex::new(Controller::new(slo)),
                    current_tpot_ms: Mutex::new(None),
                })
            })
            .collect();
        let limiters = config
            .upstreams
            .iter()
            .zip(&slo)
            .map(|(u, s)| {
                let initial = match s {
                    Some(s) => Some(lock(&s.controller).limit()),
                    None => u.max_concurrency,
                };
                let config = LimitConfig {
                    initial,
                    max_queue: u.max_queue,
                    queue_timeout: u.queue_timeout,
                };
                Limiter::new(config, telemetry.queue_wait(&u.name))
            })
            .collect();
        let max_connections = config
            .limits
            .max_connections
            .unwrap_or_else(|| connections_for(raise_fd_limit()));
        Arc::new(Shared {
            connections: Connections::new(max_connections),
            limiters,
            slo,
            peers: config.upstreams.iter().map(peer).collect(),
            connector: pingora::connectors::TransportConnector::new(Some(
                pingora::connectors::ConnectorOptions::new(config.keepalive_pool),
            )),
            pool: Pool::new(config.upstreams.len(), config.keepalive_pool),
            router: Router::new(&config.routes),
            clock,
            meters,
            telemetry,
            config,
        })
    }
}

/// Raises the soft limit on open files to the hard limit (1,024 by default on many hosts,
/// far below what thousands of streams need); returns the limit in force.
fn raise_fd_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            eprintln!("tokentap: cannot raise the open-file limit: {e}");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    }
}

/// The default `server.max_connections` under a file limit: each client connection may
/// hold an upstream connection too, and 64 descriptors stay for listeners, the admin API
/// and the rest.
fn connections_for(fd_limit: u64) -> usize {
    usize::try_from(fd_limit.saturating_sub(64) / 2)
        .unwrap_or(usize::MAX)
        .max(1)
}

fn peer(u: &Upstream) -> HttpPeer {
    let mut p = HttpPeer::new(u.addr, u.tls, u.sni.clone());
    p.options.connection_timeout = Some(u.connect_timeout);
    p.options.total_connection_timeout = Some(u.connect_timeout * 2);
    p.options.read_timeout = Some(u.read_timeout);
    p.options.write_timeout = Some(u.write_timeout);
    p.options.idle_timeout = Some(u.idle_timeout);
    p
}

/// The pingora server for `config`, not yet running.
pub fn build(config: Config) -> (Server, Arc<Shared>) {
    let conf = ServerConf {
        threads: config.threads,
        grace_period_seconds: Some(config.grace_period.as_secs()),
        graceful_shutdown_timeout_seconds: Some(5),
        // One attempt: pingora-proxy never replays a request (the direct path retries only a
        // connect that failed, when nothing was sent).
        max_retries: 1,
        upstream_keepalive_pool_size: config.keepalive_pool,
        work_stealing: config.work_stealing,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    let shared = Shared::new(config);

    let proxy =
        pingora::proxy::http_proxy(&server.configuration, TokenTap::new(Arc::clone(&shared)));
    let proxy = FrontService::new(Front::new(TokenTap::new(Arc::clone(&shared)), proxy));
    let mut admin = Service::new("tokentap admin".to_owned(), Admin::new(Arc::clone(&shared)));
    admin.threads = Some(1);
    admin.add_tcp(&shared.config.listen.admin.to_string());
    let upkeep = background_service("upkeep", Upkeep(Arc::clone(&shared)));
    let control = background_service("slo control", SloControl(Arc::clone(&shared)));

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(upkeep);
    server.add_service(control);
    (server, shared)
}

/// Drains histogram samples every few seconds, and drops idle upstream connections that
/// expired or were closed.
struct Upkeep(Arc<Shared>);

#[async_trait]
impl BackgroundService for Upkeep {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    self.0.telemetry.upkeep();
                    self.0.pool.sweep(std::time::Instant::now());
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Ticks every upstream's SLO controller once a second.
struct SloControl(Arc<Shared>);

impl SloControl {
    fn tick(&self) {
        let shared = &self.0;
        let now = shared.clock.now();
        for (i, state) in shared.slo.iter().enumerate() {
            let Some(state) = state else { continue };
            let sample = shared.meters[i].control_sample(now, state.slo.percentile);
            let limiter = &shared.limiters[i];
            let tick = Tick {
                tpot_ms: sample.tpot_ms,
                concurrency: sample.concurrency,
                in_flight: limiter.stats().in_flight,
                queued: limiter.take_binding(),
            };
            let limit = lock(&state.controller).update(tick);
            limiter.set_limit(limit);
            if sample.tpot_ms.is_some() {
                *lock(&state.current_tpot_ms) = sample.tpot_ms;
            }
        }
    }
}

#[async_trait]
impl BackgroundService for SloControl {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if self.0.slo.iter().all(Option::is_none) {
            return;
        }
        let mut tick = tokio::time::interval(CONTROL_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.tick(),
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// How often the SLO controllers look at the evidence.
pub const CONTROL_TICK: Duration = Duration::from_secs(1);

/// A poisoned lock is used as is: the controller's state stays meaningful.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A server running on its own thread, stopped by [`Running::stop`]: for the demo and tests.
pub struct Running {
    pub shared: Arc<Shared>,
    stop: Arc<Notify>,
    thread: Option<JoinHandle<()>>,
}

struct NotifyShutdown(Arc<Notify>);

#[async_trait]
impl ShutdownSignalWatch for NotifyShutdown {
    async fn recv(&self) -> ShutdownSignal {
        self.0.notified().await;
        ShutdownSignal::FastShutdown
    }
}

// === impl Running ===

impl Running {
    /// Starts `config` in this process. Returns once the server thread is started; the
    /// listeners accept shortly after (see [`Running::wait_ready`]).
    pub fn start(config: Config) -> Running {
        let (server, shared) = build(config);
        let stop = Arc::new(Notify::new());
        let signal = NotifyShutdown(Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("tokentap-server".into())
            .spawn(move || {
                server.run(RunArgs {
                    shutdown_signal: Box::new(signal),
                })
            })
            .ok();
        Running {
            shared,
            stop,
            thread,
        }
    }

    /// Waits until both listeners accept connections (pingora binds them asynchronously).
    pub async fn wait_ready(&self, timeout: Duration) -> std::io::Result<()> {
        let listen = self.shared.config.listen;
        let deadline = tokio::time::Instant::now() + timeout;
        for addr in [listen.proxy, listen.admin] {
            loop {
                match tokio::net::TcpStream::connect(addr).await {
                    Ok(_) => break,
                    Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        }
        Ok(())
    }

    /// Shuts the server down and waits for its thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shutdown();
    }
}
