//! Assembles the pingora server from a [`Config`]: the proxy service, the admin service and
//! the upkeep task (telemetry, idle upstream connections), all sharing one [`Shared`].

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

use crate::admin::Admin;
use crate::config::Config;
use crate::limit::slo;
use crate::service::{Front, FrontService, TokenTap, Transport};
use crate::state::Shared;

/// The pingora server for `config`, not yet running.
pub fn build(config: Config) -> (Server, Arc<Shared>, Arc<Transport>) {
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
    let transport = Transport::new(&config);
    let shared = Shared::new(config);

    let tap = || TokenTap::new(Arc::clone(&shared), Arc::clone(&transport));
    let proxy = pingora::proxy::http_proxy(&server.configuration, tap());
    let proxy = FrontService::new(Front::new(tap(), proxy));
    let admin_app = Admin::new(Arc::clone(&shared), Arc::clone(&transport));
    let mut admin = Service::new("tokentap admin".to_owned(), admin_app);
    admin.threads = Some(1);
    admin.add_tcp(&shared.config.listen.admin.to_string());
    let upkeep = Upkeep(Arc::clone(&shared), Arc::clone(&transport));
    let upkeep = background_service("upkeep", upkeep);
    let control = background_service("slo control", SloControl(Arc::clone(&shared)));

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(upkeep);
    server.add_service(control);
    (server, shared, transport)
}

/// Drains histogram samples every few seconds, and drops idle upstream connections that
/// expired or were closed.
struct Upkeep(Arc<Shared>, Arc<Transport>);

#[async_trait]
impl BackgroundService for Upkeep {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    self.0.telemetry.upkeep();
                    self.1.sweep();
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Runs the adaptive caps' control loop (`limit::slo`).
struct SloControl(Arc<Shared>);

#[async_trait]
impl BackgroundService for SloControl {
    async fn start(&self, shutdown: ShutdownWatch) {
        let targets = self
            .0
            .upstreams
            .iter()
            .filter_map(|u| {
                let adaptive = u.slo.clone()?;
                Some((Arc::clone(&u.meter), Arc::clone(&u.limiter), adaptive))
            })
            .collect();
        slo::control(targets, self.0.clock, shutdown).await;
    }
}

/// A server running on its own thread, stopped by [`Running::stop`]: for the demo and tests.
pub struct Running {
    pub shared: Arc<Shared>,
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
        let (server, shared, transport) = build(config);
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
            transport,
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
