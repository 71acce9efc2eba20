//! Assembles the pingora server from the [`Live`] state: the proxy service, the admin
//! service and the upkeep task (telemetry, idle upstream connections); and the signals of
//! `tokentap run`: SIGHUP reloads, SIGUSR1 reopens the access log, SIGTERM drains (no new
//! connections; exit once nothing is in flight, or when the grace period ends), SIGINT
//! exits at once.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;
use tokio::sync::Notify;

use crate::admin::history::History;
use crate::admin::Admin;
use crate::config::Config;
use crate::limit::slo;
use crate::service::{Front, FrontService, TokenTap, Transport};
use crate::state::{Live, Shared};

/// The pingora server for the state in `live`, not yet running.
pub fn build(live: &Arc<Live>) -> (Server, Arc<Transport>) {
    let config = &live.load().config;
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
    let transport = Transport::new(config);

    let tap = || TokenTap::new(Arc::clone(live), Arc::clone(&transport));
    let proxy = pingora::proxy::http_proxy(&server.configuration, tap());
    let proxy = FrontService::new(Front::new(tap(), proxy));
    let history = Arc::new(History::new());
    let admin_app = Admin::new(
        Arc::clone(live),
        Arc::clone(&transport),
        Arc::clone(&history),
    );
    let mut admin = Service::new("tokentap admin".to_owned(), admin_app);
    admin.threads = Some(1);
    admin.add_tcp(&config.listen.admin.to_string());
    let upkeep = Upkeep(Arc::clone(live), Arc::clone(&transport));
    let upkeep = background_service("upkeep", upkeep);
    let control = background_service("slo control", SloControl(Arc::clone(live)));
    let sampler = Sampler(history, Arc::clone(live), Arc::clone(&transport));
    let sampler = background_service("history", sampler);
    let scraper = background_service("upstream upkeep", UpstreamUpkeep(Arc::clone(live)));
    let fleet = background_service("cluster", FleetKeeper(Arc::clone(live)));
    let watch = background_service("config watch", ConfigWatch(Arc::clone(live)));
    let rollouts = background_service("rollouts", RolloutKeeper(Arc::clone(live)));

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(upkeep);
    server.add_service(control);
    server.add_service(sampler);
    server.add_service(scraper);
    server.add_service(fleet);
    server.add_service(watch);
    server.add_service(rollouts);
    (server, transport)
}

/// Whether `addr` can be listened on now (as the listeners bind it, with `SO_REUSEADDR`, so
/// connections of a previous run in TIME_WAIT do not count).
pub fn can_listen(addr: std::net::SocketAddr) -> std::io::Result<()> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1)
}

/// Drains histogram samples every few seconds, and drops idle upstream connections that
/// expired or were closed.
struct Upkeep(Arc<Live>, Arc<Transport>);

#[async_trait]
impl BackgroundService for Upkeep {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    self.0.load().telemetry.upkeep();
                    self.1.sweep();
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Evaluates each route's rollout when it is due (`rollout`), looked at every second.
struct RolloutKeeper(Arc<Live>);

#[async_trait]
impl BackgroundService for RolloutKeeper {
    async fn start(&self, shutdown: ShutdownWatch) {
        every(Duration::from_secs(1), shutdown, || {
            self.0.load().tick_rollouts();
        })
        .await;
    }
}

/// Runs `f` every `period` (a tick missed is skipped, not made up) until shutdown.
async fn every(period: Duration, mut shutdown: ShutdownWatch, mut f: impl FnMut()) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => f(),
            _ = shutdown.changed() => return,
        }
    }
}

/// Takes the dashboard's snapshot every second (`admin::history`).
struct Sampler(Arc<History>, Arc<Live>, Arc<Transport>);

#[async_trait]
impl BackgroundService for Sampler {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.0.run(&self.1, &self.2, shutdown).await;
    }
}

/// Each upstream's upkeep, looked at every 100 ms: its `backend_metrics` scraped when due
/// (`backend`); its pool's ejections that ended, discovery, health checks and endpoints'
/// scrapes (`pool`).
struct UpstreamUpkeep(Arc<Live>);

#[async_trait]
impl BackgroundService for UpstreamUpkeep {
    async fn start(&self, shutdown: ShutdownWatch) {
        every(Duration::from_millis(100), shutdown, || {
            let shared = self.0.load();
            for u in &shared.upstreams {
                if let Some(b) = &u.backend {
                    b.tick(&u.config.name, Arc::clone(&u.meter) as _);
                }
                u.pool.tick(
                    shared.config.window,
                    shared.config.endpoint_labels,
                    &u.meter,
                );
            }
        })
        .await;
    }
}

/// How often the config file is read for a change, and how long a change must stay the same
/// before it is loaded (an editor's or a ConfigMap's several writes are one change).
const WATCH_EVERY: Duration = Duration::from_millis(500);
const WATCH_SETTLE: Duration = Duration::from_millis(300);

/// Reloads when the config file's content changes (`server.watch_config`). The file is read
/// through its symlinks, so a Kubernetes ConfigMap update (a new directory, the `..data`
/// symlink swapped to it) is a change like an edit in place. Content, not timestamps: a
/// `touch` reloads nothing. A file that cannot be read for a moment (mid-swap) is looked at
/// again next time.
struct ConfigWatch(Arc<Live>);

#[async_trait]
impl BackgroundService for ConfigWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(path) = self.0.source().map(std::path::Path::to_path_buf) else {
            return;
        };
        let read = |path: std::path::PathBuf| async move {
            tokio::task::spawn_blocking(move || std::fs::read(path))
                .await
                .ok()
                .and_then(Result::ok)
        };
        let mut seen = read(path.clone()).await;
        let mut tick = tokio::time::interval(WATCH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            if !self.0.load().config.watch_config {
                seen = None; // looked at afresh when switched on again
                continue;
            }
            let Some(now) = read(path.clone()).await else {
                continue;
            };
            if seen.is_none() {
                seen = Some(now);
                continue;
            }
            if seen.as_deref() == Some(&now[..]) {
                continue;
            }
            tokio::time::sleep(WATCH_SETTLE).await;
            let Some(settled) = read(path.clone()).await else {
                continue;
            };
            if settled != now {
                continue; // still being written: next time
            }
            seen = Some(settled);
            let live = Arc::clone(&self.0);
            let _ = tokio::task::spawn_blocking(move || live.reload("config file changed")).await;
        }
    }
}

/// Keeps this replica's place in the fleet (`limit::fleet`): alive, its leases renewed.
struct FleetKeeper(Arc<Live>);

#[async_trait]
impl BackgroundService for FleetKeeper {
    async fn start(&self, shutdown: ShutdownWatch) {
        let Some(cluster) = self.0.load().cluster.clone() else {
            return;
        };
        let fleets = || {
            self.0
                .load()
                .upstreams
                .iter()
                .filter_map(|u| Some((Arc::clone(u.fleet.as_ref()?), Arc::clone(&u.limiter))))
                .collect()
        };
        cluster.keep(fleets, shutdown).await;
    }
}

/// Runs the adaptive caps' control loop (`limit::slo`) over the upstreams in force.
struct SloControl(Arc<Live>);

#[async_trait]
impl BackgroundService for SloControl {
    async fn start(&self, shutdown: ShutdownWatch) {
        let targets = || {
            let shared: Arc<Shared> = self.0.load();
            shared
                .upstreams
                .iter()
                .filter_map(|u| {
                    // Under `slo_headroom` each endpoint's cap is its own (`pool::headroom`).
                    let adaptive = u.slo.clone().filter(|_| !u.pool.caps_each_endpoint())?;
                    Some((
                        Arc::clone(&u.meter),
                        Arc::clone(&u.limiter),
                        adaptive,
                        u.fleet.clone(),
                    ))
                })
                .collect()
        };
        slo::control(targets, self.0.clock(), shutdown).await;
    }
}

/// A server running on its own thread, stopped by [`Running::stop`]: for the demo and tests.
pub struct Running {
    pub live: Arc<Live>,
    pub transport: Arc<Transport>,
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
        let live = Live::new(config, None);
        let (server, transport) = build(&live);
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
            live,
            transport,
            stop,
            thread,
        }
    }

    /// The running state and its reloads.
    pub fn live(&self) -> &Arc<Live> {
        &self.live
    }

    /// The state in force.
    pub fn shared(&self) -> Arc<Shared> {
        self.live.load()
    }

    /// Waits until both listeners accept connections (pingora binds them asynchronously).
    pub async fn wait_ready(&self, timeout: Duration) -> std::io::Result<()> {
        let listen = self.shared().config.listen.clone();
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

/// The signals of `tokentap run`: SIGHUP reloads the config file, SIGUSR1 reopens the access
/// log, SIGTERM (and SIGQUIT) drain, SIGINT (or a second SIGTERM while draining) exits at
/// once.
pub struct Signals {
    pub live: Arc<Live>,
    pub transport: Arc<Transport>,
}

/// How often a drain looks at what is still in flight.
const DRAIN_POLL: Duration = Duration::from_millis(20);

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{signal, SignalKind};
        let kinds = [
            SignalKind::interrupt(),
            SignalKind::terminate(),
            SignalKind::quit(),
            SignalKind::hangup(),
            SignalKind::user_defined1(),
        ];
        let mut streams = Vec::new();
        for kind in kinds {
            match signal(kind) {
                Ok(s) => streams.push(s),
                Err(e) => {
                    tracing::error!("cannot watch signal {}: {e}", kind.as_raw_value());
                    return ShutdownSignal::FastShutdown;
                }
            }
        }
        let [int, term, quit, hup, usr1] = &mut streams[..] else {
            return ShutdownSignal::FastShutdown;
        };
        loop {
            tokio::select! {
                _ = int.recv() => {
                    tracing::info!("SIGINT: exiting now");
                    return ShutdownSignal::FastShutdown;
                }
                _ = term.recv() => return self.drain("SIGTERM", int, term).await,
                _ = quit.recv() => return self.drain("SIGQUIT", int, term).await,
                _ = hup.recv() => {
                    let live = Arc::clone(&self.live);
                    // Off the runtime: a reload reads files and resolves names.
                    let _ = tokio::task::spawn_blocking(move || live.reload("SIGHUP")).await;
                }
                _ = usr1.recv() => self.live.access.reopen(),
            }
        }
    }
}

impl Signals {
    /// Stops accepting, then waits until no client connection is open, or the grace period
    /// ends, or SIGINT or another SIGTERM comes; what is still open then is cut.
    async fn drain(
        &self,
        why: &str,
        int: &mut tokio::signal::unix::Signal,
        term: &mut tokio::signal::unix::Signal,
    ) -> ShutdownSignal {
        let grace = self.live.load().config.grace_period;
        let connections = &self.transport.connections;
        // Not ready from now on (`/readyz` 503), before the listener stops accepting.
        self.live.start_draining();
        self.transport.drain();
        tracing::info!(
            open_connections = connections.open(),
            grace_period_secs = grace.as_secs(),
            "{why}: draining: no new connections; running requests may finish"
        );
        let deadline = tokio::time::Instant::now() + grace;
        let mut poll = tokio::time::interval(DRAIN_POLL);
        loop {
            tokio::select! {
                _ = poll.tick() => {}
                _ = int.recv() => break,
                _ = term.recv() => break,
                _ = tokio::time::sleep_until(deadline) => break,
            }
            if connections.open() == 0 {
                tracing::info!("drained: exiting");
                return ShutdownSignal::FastShutdown;
            }
        }
        tracing::warn!(
            cut_connections = connections.open(),
            "drain ended before every connection closed: cutting the rest"
        );
        ShutdownSignal::FastShutdown
    }
}
