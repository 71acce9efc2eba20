//! What the A/B verdict says of cost: each arm's price per hour over its system T/s at
//! matched concurrency, per million output tokens, and the cheaper arm only when the cost
//! ratio's CI says so.

use serde::Serialize;

use super::Comparison;

/// The arms' cost per million output tokens at matched concurrency: each one's price per
/// hour over its system T/s there (one endpoint's × its endpoints taking requests).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CostComparison {
    pub currency: Option<String>,
    pub a_per_million: f64,
    pub b_per_million: f64,
    /// The arm that costs less per token; `null` when the 95% CI of the cost ratio
    /// (the price ratio over the system T/s ratio's CI) covers no difference.
    pub cheaper: Option<String>,
    /// How much less, percent of the dearer arm's (point estimates).
    pub cheaper_by_pct: f64,
    /// b's cost per token over a's, 95% CI.
    pub b_over_a_ci95: Option<[f64; 2]>,
}

/// An arm's price: per hour, its currency, and its endpoints taking requests.
#[derive(Debug, Clone, PartialEq)]
pub struct ArmPrice {
    pub per_hour: f64,
    pub currency: Option<String>,
    pub endpoints: u64,
}

// === impl Comparison ===

impl Comparison {
    /// Adds each arm's cost per million tokens at matched concurrency to the comparison
    /// and its verdict, when both arms have a price in one currency and the comparison
    /// has each arm's system T/s there.
    pub fn priced(mut self, a: Option<&ArmPrice>, b: Option<&ArmPrice>) -> Comparison {
        let (Some(a), Some(b)) = (a, b) else {
            return self;
        };
        if a.currency != b.currency || self.reason.is_some() {
            return self;
        }
        let rate = |tps: Option<f64>, p: &ArmPrice| {
            tps.map(|t| t * p.endpoints.max(1) as f64)
                .and_then(|t| crate::decide::per_million(p.per_hour, t))
        };
        let tps = &self.metrics.system_tps;
        let (Some(a_cost), Some(b_cost)) = (rate(tps.a, a), rate(tps.b, b)) else {
            return self;
        };
        let (cheaper, low, high) = if a_cost <= b_cost {
            (&self.a, a_cost, b_cost)
        } else {
            (&self.b, b_cost, a_cost)
        };
        let by = 100.0 * (high - low) / high;
        // b's cost over a's = (b's price / a's) ÷ (b's T/s / a's): its CI from the T/s
        // difference's. A difference the CI covers names no cheaper arm.
        let prices =
            (b.per_hour * a.endpoints.max(1) as f64) / (a.per_hour * b.endpoints.max(1) as f64);
        let ci = tps.ci95_pct.map(|[lo, hi]| {
            let ratio = |pct: f64| prices / (1.0 + pct / 100.0).max(f64::MIN_POSITIVE);
            [ratio(hi), ratio(lo)]
        });
        let cheaper = match ci {
            Some([lo, _]) if lo > 1.0 => Some(self.a.clone()),
            Some([_, hi]) if hi < 1.0 => Some(self.b.clone()),
            Some(_) => None,
            None => Some(cheaper.clone()),
        };
        let unit = a
            .currency
            .as_deref()
            .map_or(String::new(), |c| format!(" {c}"));
        let said = match &cheaper {
            Some(arm) => format!("{arm} is {by:.1}% cheaper per token"),
            None => "no significant difference per token".to_owned(),
        };
        self.verdict.push_str(&format!(
            "; cost per million output tokens at matched concurrency: {} {a_cost:.3}{unit}, {} {b_cost:.3}{unit}: {said}",
            self.a, self.b
        ));
        self.cost = Some(CostComparison {
            currency: a.currency.clone(),
            a_per_million: a_cost,
            b_per_million: b_cost,
            cheaper,
            cheaper_by_pct: by,
            b_over_a_ci95: ci,
        });
        self
    }
}
