//! Cost per token: a pool's price per hour over the tokens it delivers in an hour. $ per
//! million output tokens = price/hour ÷ (system T/s × 3600) × 10⁶, at the load running now
//! and at the SLO-bounded load (the most the pool delivers while it holds its SLO): the
//! figure to set beside a hosted API's price.

use serde::Serialize;

/// `upstream[].cost_per_hour`, `cost_currency`, `gpus`.
#[derive(Debug, Clone, PartialEq)]
pub struct Price {
    /// The pool's price per hour, in `currency`.
    pub per_hour: f64,
    pub currency: Option<String>,
    /// GPUs the price pays for.
    pub gpus: Option<u32>,
}

/// The cost's part of `/stats`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CostStats {
    pub per_hour: f64,
    pub currency: Option<String>,
    pub gpus: Option<u32>,
    /// At the live window's system T/s.
    pub per_million_output_tokens: Option<f64>,
    /// At the SLO-bounded system T/s of the pool (`slo_bounded_system_tps`).
    pub per_million_at_slo_bounded: Option<f64>,
    /// The pool's SLO-bounded system T/s: one endpoint's (`slo.slo_bounded_system_tps`) ×
    /// the endpoints taking requests.
    pub pool_slo_bounded_system_tps: Option<f64>,
    pub system_tps_per_gpu: Option<f64>,
}

/// What `per_hour` buys per million tokens at `tps` tokens a second (`None` at no rate).
pub fn per_million(per_hour: f64, tps: f64) -> Option<f64> {
    (tps > 0.0 && tps.is_finite()).then(|| per_hour / (tps * 3600.0) * 1e6)
}

// === impl Price ===

impl Price {
    /// The cost at the window's `system_tps` and the pool's `slo_bounded` system T/s.
    pub fn stats(&self, system_tps: Option<f64>, slo_bounded: Option<f64>) -> CostStats {
        CostStats {
            per_hour: self.per_hour,
            currency: self.currency.clone(),
            gpus: self.gpus,
            per_million_output_tokens: system_tps.and_then(|t| per_million(self.per_hour, t)),
            per_million_at_slo_bounded: slo_bounded.and_then(|t| per_million(self.per_hour, t)),
            pool_slo_bounded_system_tps: slo_bounded,
            system_tps_per_gpu: system_tps
                .zip(self.gpus)
                .map(|(t, g)| t / f64::from(g.max(1))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_price_over_the_tokens_of_an_hour() {
        // An H100 at $2.50/h delivering 3,600 T/s: 12.96 M tokens an hour, $0.193 per M.
        let p = Price {
            per_hour: 2.5,
            currency: Some("USD".into()),
            gpus: Some(1),
        };
        let s = p.stats(Some(3600.0), Some(2432.0));
        let m = s.per_million_output_tokens.unwrap_or_default();
        assert!((m - 2.5 / 12.96).abs() < 1e-9, "{s:?}");
        let b = s.per_million_at_slo_bounded.unwrap_or_default();
        assert!((b - 2.5 / (2432.0 * 3600.0) * 1e6).abs() < 1e-9);
        assert_eq!(s.system_tps_per_gpu, Some(3600.0));
        let idle = p.stats(Some(0.0), None);
        assert_eq!(
            (
                idle.per_million_output_tokens,
                idle.per_million_at_slo_bounded
            ),
            (None, None)
        );
    }
}
