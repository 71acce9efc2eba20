//! The config file as written, one file a section (vector's `config/`): each section's
//! structs reject unknown keys and document their defaults, and each sits beside the small
//! checks that make it the runtime's. [`FileConfig::validate`] composes them and reports
//! every problem at once, with its dotted path.

mod cluster;
mod metrics;
mod rollout;
mod route;
mod server;
mod tenants;
mod upstream;

use std::time::Duration;

use serde::Deserialize;

pub use cluster::ClusterFile;
pub use metrics::{CompareFile, MetricsFile};
pub use rollout::{RolloutFile, RolloutsFile};
pub use route::RouteFile;
pub use server::{AdminFile, ListenFile, LogFile, ServerFile};
pub use tenants::TenantsFile;
pub use upstream::UpstreamFile;

use super::{Config, Listen, Problem, Problems, Route, UpstreamConfig};
use route::route;
use upstream::upstream;

/// The default of `server.grace_period_secs`: how long running streams may finish after SIGTERM.
pub(crate) const GRACE_PERIOD_SECS: u64 = 30;

/// The default of `server.upstream_keepalive_pool_size`: idle upstream connections kept.
pub(crate) const KEEPALIVE_POOL: usize = 1024;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub listen: ListenFile,
    #[serde(default)]
    pub metrics: MetricsFile,
    #[serde(default)]
    pub server: ServerFile,
    #[serde(default)]
    pub compare: CompareFile,
    #[serde(default)]
    pub admin: AdminFile,
    #[serde(default)]
    pub log: LogFile,
    #[serde(default)]
    pub cluster: ClusterFile,
    #[serde(default)]
    pub tenants: TenantsFile,
    #[serde(default)]
    pub rollouts: RolloutsFile,
    #[serde(default)]
    pub upstream: Vec<UpstreamFile>,
    #[serde(default)]
    pub route: Vec<RouteFile>,
}

// === impl FileConfig ===

impl FileConfig {
    /// Checks everything and builds the runtime config, or returns every problem found:
    /// small checks of one section each, composed; those that read files (certificates,
    /// the admin token, the access log, a CA bundle) or resolve names (upstream URLs) last.
    pub fn validate(self) -> Result<Config, Vec<Problem>> {
        let mut p = Problems::default();
        // The pure checks, each of its own section: …
        let (proxy, admin) = self.listen.addrs(&mut p);
        self.check_ranges(&mut p);
        let cluster = self.cluster.cluster(&mut p);
        let tenants = self.tenants.tenants(&mut p);
        if self.upstream.is_empty() {
            p.add("upstream", "at least one [[upstream]] is required");
        }

        let routes = self.routes(&mut p);
        let limits = self.server.limits(&mut p);
        // … then those that read files or resolve names.
        let addrs = (&proxy, &admin);
        let upstreams: Vec<UpstreamConfig> = (self.upstream.iter().enumerate())
            .filter_map(|(i, u)| upstream(i, u, &self.upstream[..i], addrs, &mut p))
            .collect();
        let admin_auth = self.admin.auth(&mut p);
        let log = self.log.log(&mut p);
        let listen_tls = self.listen.tls(&mut p);
        let threads = self
            .server
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
        let grace = self.server.grace_period_secs.unwrap_or(GRACE_PERIOD_SECS);
        let keepalive_pool = self
            .server
            .upstream_keepalive_pool_size
            .unwrap_or(KEEPALIVE_POOL);
        let window = Duration::from_secs(self.metrics.window_secs);
        let max_event_bytes = self.metrics.max_event_bytes;
        let compare_window = Duration::from_secs(self.compare.window_secs);
        let model_label = self.metrics.model_label;
        let curve_window = Duration::from_secs(self.metrics.curve_window_secs);
        let endpoint_labels = self.metrics.endpoint_labels;
        let tenant_labels = self.metrics.tenant_labels;
        let semconv = self.metrics.semconv;
        let rollout_state_file = self.rollouts.state_file.clone();
        p.into_result(move || Config {
            listen: Listen {
                // Both are Ok here: an Err added a problem.
                proxy: proxy.unwrap_or_else(|_| unreachable!()),
                admin: admin.unwrap_or_else(|_| unreachable!()),
                tls: listen_tls,
            },
            window,
            compare_window,
            max_event_bytes,
            model_label,
            curve_window,
            endpoint_labels,
            tenant_labels,
            semconv,
            tenants,
            rollout_state_file,
            cluster,
            threads,
            grace_period: Duration::from_secs(grace),
            keepalive_pool,
            work_stealing: self.server.work_stealing.unwrap_or(true),
            request_id_upstream: self.server.request_id_upstream.unwrap_or(true),
            watch_config: self.server.watch_config.unwrap_or(true),
            limits,
            admin: admin_auth,
            log,
            upstreams,
            routes,
        })
    }
}

impl FileConfig {
    /// The bounds of the global numbers (`metrics`, `compare`, `cluster.lease_secs`,
    /// `server.threads`).
    fn check_ranges(&self, p: &mut Problems) {
        if !(1..=3600).contains(&self.metrics.window_secs) {
            p.add("metrics.window_secs", "must be between 1 and 3600");
        }
        if !(10..=86_400).contains(&self.compare.window_secs) {
            p.add("compare.window_secs", "must be between 10 and 86400");
        }
        if !(3..=300).contains(&self.cluster.lease_secs) {
            p.add("cluster.lease_secs", "must be between 3 and 300");
        }
        if !(60..=86_400).contains(&self.metrics.curve_window_secs) {
            p.add("metrics.curve_window_secs", "must be between 60 and 86400");
        }
        if self.metrics.max_event_bytes < 1024 {
            p.add("metrics.max_event_bytes", "must be at least 1024");
        }
        if self.server.threads == Some(0) {
            p.add("server.threads", "must be at least 1");
        }
    }

    /// Every route checked against the upstreams' names; with none, one for `/` to the
    /// only upstream.
    fn routes(&self, p: &mut Problems) -> Vec<Route> {
        let index = |name: &str| self.upstream.iter().position(|u| u.name == name);
        let mut routes = Vec::new();
        for (i, r) in self.route.iter().enumerate() {
            let checked = route(i, r, &routes, index, p);
            routes.push(checked);
        }
        // A mirror takes copies only: its requests run outside any cap, so it must not
        // serve real clients on another route.
        for (i, r) in routes.iter().enumerate() {
            for (j, m) in r.mirrors.iter().enumerate() {
                // A rollout's `to` takes copies on its own route only (its shadow).
                let shadow = r.rollout.as_ref().is_some_and(|ro| ro.to == m.upstream);
                let primary = |(k, o): &(usize, &Route)| {
                    o.split.iter().any(|&(u, _)| u == m.upstream) && !(shadow && *k == i)
                };
                if let Some((k, _)) = routes.iter().enumerate().find(primary) {
                    p.add(
                        format!("route[{i}].mirror[{j}].upstream"),
                        format!(
                            "`{}` is in route[{k}]'s split: a mirror serves copies only",
                            self.upstream[m.upstream].name
                        ),
                    );
                }
            }
        }
        if routes.is_empty() && self.upstream.len() > 1 {
            p.add(
                "route",
                "with more than one upstream, a [[route]] must say which gets what",
            );
        }
        if routes.is_empty() {
            routes.push(Route {
                name: "/".into(),
                path_prefix: "/".into(),
                headers: Vec::new(),
                split: vec![(0, 1)],
                sticky: None,
                spill: false,
                mirrors: Vec::new(),
                rollout: None,
            });
        }
        routes
    }
}
