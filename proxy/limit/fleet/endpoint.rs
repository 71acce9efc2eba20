//! An endpoint's lease in a pool (`[cluster]` with a capped pool): asked once, not queued;
//! the pool's own slot, taken first, is what queues.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, PoisonError};

use super::{timed, Fleet, Lease, Leased, Pending};

impl Fleet {
    /// A lease under `limit`, asked once, not queued (an endpoint of a pool: the pool's own
    /// slot, taken first, is what queues). Redis away, or slow: [`Leased::Away`].
    pub async fn try_lease(self: &Arc<Self>, limit: u64) -> Leased {
        let c = &self.cluster;
        if c.degraded() {
            return Leased::Away;
        }
        let Ok(mut conn) = c.connect().await else {
            return Leased::Away;
        };
        let id = c.next_lease.fetch_add(1, Relaxed);
        self.limit.store(limit, Relaxed);
        let mut pending = Pending {
            fleet: self,
            id,
            armed: true,
        };
        let mut call = c.acquire.key(&self.key);
        call.key(&self.limit_key);
        (call.arg(limit).arg(c.lease_ms()).arg(c.member(id)))
            .arg(1)
            .arg(0);
        let got: anyhow::Result<u64> = timed(call.invoke_async(&mut conn)).await;
        self.set_full(matches!(got, Ok(0)));
        match got {
            Ok(1) => {
                pending.armed = false;
                self.held
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(id);
                Leased::Held(Lease {
                    fleet: Arc::clone(self),
                    id,
                })
            }
            Ok(_) => {
                pending.armed = false;
                Leased::Full
            }
            // Timed out, the script may still have run: `pending` frees it.
            Err(_) => Leased::Away,
        }
    }
}
