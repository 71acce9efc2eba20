//! The proxy, in layers: the listener ([`front`]) accepts client connections and reads each
//! request head; the request's flow ([`exchange`]) routes, admits, sends and relays it, one
//! path for every request, metered or not, queued or not; the wire ([`http1`]) is all it
//! reads and writes with, and the tap ([`tap`]) all it meters with. Only upgrades
//! (WebSocket and the like) go through pingora-proxy ([`upgrade`]).
//!
//! A streamed fragment, from the socket to the meter: `exchange::relay` reads it into the
//! thread's scratch buffer (`http1::io`), frames it (`http1::body`), writes it to the client,
//! and hands its payload runs to `tap`, which parses them (`sse`, `dialect`) into the
//! request's `meter::Stream`.

use std::sync::Arc;

use crate::config::Config;
use crate::meter::Nanos;
use crate::state::Live;

mod ctx;
mod exchange;
mod failure;
mod front;
#[cfg(feature = "fuzzing")]
pub(crate) mod fuzzing;
mod http1;
mod pair;
mod record;
mod tap;
mod upgrade;

pub use ctx::Ctx;
pub use front::{Connections, Front, FrontService};
pub(crate) use http1::conn::Pool;
pub use http1::request::ClientError;
pub use record::REQUEST_ID_HEADER;

/// The response header naming the upstream that served a request.
pub const UPSTREAM_HEADER: &str = "x-tokentap-upstream";

/// The proxy.
pub struct TokenTap {
    live: Arc<Live>,
    transport: Arc<Transport>,
}

/// The proxy's connections: client connections counted against `server.max_connections`,
/// upstream connections pooled.
pub struct Transport {
    /// TLS upstream connections, pooled (pingora's connector).
    connector: pingora::connectors::TransportConnector,
    /// Idle plain-TCP upstream connections.
    pool: Pool,
    pub connections: Connections,
    /// Turns true when the proxy drains (SIGTERM): no new connections, idle ones closed.
    drain: tokio::sync::watch::Sender<bool>,
}

// === impl Transport ===

impl Transport {
    /// For `config`; without a `server.max_connections`, raises the open-file limit and
    /// derives it from that.
    pub fn new(config: &Config) -> Arc<Transport> {
        let max_connections = config
            .limits
            .max_connections
            .unwrap_or_else(|| connections_for(raise_fd_limit()));
        Arc::new(Transport {
            connector: pingora::connectors::TransportConnector::new(Some(
                pingora::connectors::ConnectorOptions::new(config.keepalive_pool),
            )),
            pool: Pool::new(config.keepalive_pool),
            connections: Connections::new(max_connections),
            drain: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Stops taking connections: the listener stops accepting, idle client connections
    /// close, and each request in flight closes its connection when it ends.
    pub fn drain(&self) {
        self.drain.send_replace(true);
    }

    /// True once [`Transport::drain`] was called.
    fn draining(&self) -> tokio::sync::watch::Receiver<bool> {
        self.drain.subscribe()
    }

    /// Drops idle upstream connections that expired or were closed.
    pub fn sweep(&self) {
        self.pool.sweep(std::time::Instant::now());
    }
}

/// Raises the soft limit on open files to the hard limit (1,024 by default on many hosts,
/// far below what thousands of streams need); returns the limit in force.
fn raise_fd_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!("cannot raise the open-file limit: {e}");
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

// === impl TokenTap ===

impl TokenTap {
    pub fn new(live: Arc<Live>, transport: Arc<Transport>) -> Self {
        TokenTap { live, transport }
    }

    fn now(&self) -> Nanos {
        self.live.clock().now()
    }
}
