//! The running state the proxy, the admin API and the background tasks share: the config,
//! the clock, one [`Upstream`] per configured upstream (its config, peer, meter, limiter and
//! adaptive cap together, found by name), the router and the telemetry. Built whole by
//! [`Shared::new`]; a reload will build a new one aside and swap it in.

use std::sync::Arc;

use pingora::upstreams::peer::HttpPeer;

use crate::config::{self, Config};
use crate::limit::slo::Adaptive;
use crate::limit::{LimitConfig, Limiter};
use crate::meter::{Clock, UpstreamMeter};
use crate::routing::Router;
use crate::telemetry::Telemetry;

/// What the proxy, the admin API and the background tasks share.
pub struct Shared {
    pub config: Config,
    pub clock: Clock,
    /// In config order: routes name upstreams by their place here.
    pub upstreams: Vec<Upstream>,
    pub router: Router,
    pub telemetry: Telemetry,
}

/// Everything tokentap keeps for one upstream.
pub struct Upstream {
    pub config: config::Upstream,
    /// Prebuilt, cloned per request on pingora-proxy's path.
    pub peer: HttpPeer,
    pub meter: Arc<UpstreamMeter>,
    /// Its concurrency limit (unlimited without a cap or an SLO).
    pub limiter: Arc<Limiter>,
    /// The adaptive cap, with an SLO.
    pub slo: Option<Arc<Adaptive>>,
}

// === impl Shared ===

impl Shared {
    pub fn new(config: Config) -> Arc<Shared> {
        let clock = Clock::new();
        let telemetry = Telemetry::new();
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| Upstream::new(u, &config, clock, &telemetry))
            .collect();
        Arc::new(Shared {
            router: Router::new(&config.routes),
            upstreams,
            clock,
            telemetry,
            config,
        })
    }

    /// The upstream called `name`, and its place.
    pub fn upstream(&self, name: &str) -> Option<(usize, &Upstream)> {
        self.upstreams
            .iter()
            .enumerate()
            .find(|(_, u)| u.config.name == name)
    }
}

// === impl Upstream ===

impl Upstream {
    fn new(u: &config::Upstream, config: &Config, clock: Clock, telemetry: &Telemetry) -> Self {
        let meter =
            UpstreamMeter::new(&u.name, config.window, clock, telemetry.histograms(&u.name));
        meter.set_sample_window(config.compare_window);
        let slo = u.slo.map(|slo| Arc::new(Adaptive::new(slo)));
        let limit = LimitConfig {
            initial: slo.as_ref().map_or(u.max_concurrency, |s| Some(s.limit())),
            max_queue: u.max_queue,
            queue_timeout: u.queue_timeout,
        };
        Upstream {
            config: u.clone(),
            peer: peer(u),
            meter,
            limiter: Limiter::new(limit, telemetry.queue_wait(&u.name)),
            slo,
        }
    }
}

fn peer(u: &config::Upstream) -> HttpPeer {
    let mut p = HttpPeer::new(u.addr, u.tls, u.sni.clone());
    p.options.connection_timeout = Some(u.connect_timeout);
    p.options.total_connection_timeout = Some(u.connect_timeout * 2);
    p.options.read_timeout = Some(u.read_timeout);
    p.options.write_timeout = Some(u.write_timeout);
    p.options.idle_timeout = Some(u.idle_timeout);
    p
}
