//! `[cluster]`: the fleet's Redis, where caps and fair shares hold across replicas.

use std::time::Duration;

use serde::Deserialize;

use crate::config::{Cluster, Problems};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterFile {
    /// `redis://host:port[/db]`: the caps (`max_concurrency`, the adaptive SLO cap) hold
    /// across every tokentap sharing it, as leases in Redis. Default: none (each replica
    /// caps alone).
    pub redis_url: Option<String>,
    /// How long a slot's lease lives unless renewed: a replica that dies frees its slots
    /// within this. Default 10.
    pub lease_secs: u64,
}

impl Default for ClusterFile {
    fn default() -> Self {
        ClusterFile {
            redis_url: None,
            lease_secs: 10,
        }
    }
}

impl ClusterFile {
    /// `[cluster]`, when it names a Redis.
    pub(super) fn cluster(&self, p: &mut Problems) -> Option<Cluster> {
        let url = self.redis_url.as_deref()?;
        match redis::Client::open(url) {
            Ok(_) if url.starts_with("redis://") => Some(Cluster {
                redis_url: url.to_owned(),
                lease: Duration::from_secs(self.lease_secs.clamp(3, 300)),
            }),
            _ => {
                p.add(
                    "cluster.redis_url",
                    format!("must be a URL like redis://127.0.0.1:6379, not `{url}`"),
                );
                None
            }
        }
    }
}
