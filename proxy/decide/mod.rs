//! Decisions users take from the figures: what a pool costs per token, how close it runs
//! to the decode roofline, and how many endpoints its demand needs at its SLO. Goodput,
//! the judgement of each request against the SLO, is the meter's (`meter::goodput`); what
//! follows from it is here. Pure arithmetic on figures the meter and the limiter report:
//! no I/O, no state, no clock.

pub mod capacity;
pub mod cost;
pub mod roofline;

pub use capacity::{capacity, CapacityStats, Demand};
pub use cost::{per_million, CostStats, Price};
pub use roofline::{gpu_bandwidth, Roofline, RooflineStats, GPUS};

/// An upstream's price, model and GPUs, and the headroom its capacity keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Economics {
    pub price: Option<Price>,
    pub roofline: Option<Roofline>,
    /// `capacity.headroom_pct`.
    pub headroom_pct: f64,
}

/// `capacity.headroom_pct`'s default.
pub const DEFAULT_HEADROOM_PCT: f64 = 20.0;

/// `slo.attainment_pct`'s default.
pub const DEFAULT_ATTAINMENT_PCT: f64 = 90.0;

impl Default for Economics {
    fn default() -> Self {
        Economics {
            price: None,
            roofline: None,
            headroom_pct: DEFAULT_HEADROOM_PCT,
        }
    }
}
