//! A phase's client-side figures, and how they print.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Quantiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub mean: Option<f64>,
}

impl Quantiles {
    pub fn of(mut v: Vec<f64>) -> Quantiles {
        if v.is_empty() {
            return Quantiles::default();
        }
        v.sort_unstable_by(f64::total_cmp);
        let q = |p: f64| {
            let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
            Some(v[rank.clamp(1, v.len()) - 1])
        };
        Quantiles {
            p50: q(50.0),
            p90: q(90.0),
            p99: q(99.0),
            mean: Some(v.iter().sum::<f64>() / v.len() as f64),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseReport {
    /// Closed-loop concurrency, or `null` for an open-loop phase.
    pub concurrency: Option<usize>,
    /// Open-loop arrival rate, requests/s.
    pub rate: Option<f64>,
    pub duration_secs: f64,
    /// Requests that finished inside the measured window.
    pub requests: u64,
    pub errors: BTreeMap<String, u64>,
    pub ttft_ms: Quantiles,
    pub tpot_ms: Quantiles,
    pub itl_ms: Quantiles,
    /// 1000 / mean TPOT.
    pub single_stream_tps: Option<f64>,
    /// Tokens that arrived inside the measured window, per second.
    pub system_tps: Option<f64>,
    pub output_tokens: u64,
    /// With `--slo`: the requests that met it.
    pub goodput: Option<LoadGoodput>,
}

/// Latency SLOs to judge requests by (`--slo ttft:MS,tpot:MS,e2e:MS,attainment:PCT`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// The share of requests that must be good for a phase to be within the SLO.
    pub attainment_pct: f64,
}

impl std::str::FromStr for Slo {
    type Err = String;

    fn from_str(text: &str) -> Result<Slo, String> {
        let mut slo = Slo {
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: None,
            attainment_pct: 90.0,
        };
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once(':')
                .ok_or_else(|| format!("`{part}` is not KEY:VALUE (ttft:500)"))?;
            let v: f64 = value
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| *v > 0.0 && v.is_finite())
                .ok_or_else(|| format!("`{part}`: the value must be a positive number"))?;
            match key.trim() {
                "ttft" => slo.ttft_ms = Some(v),
                "tpot" => slo.tpot_ms = Some(v),
                "e2e" | "e2el" => slo.e2e_ms = Some(v),
                "attainment" if v <= 100.0 => slo.attainment_pct = v,
                "attainment" => return Err("attainment is a percentage, at most 100".into()),
                other => {
                    return Err(format!(
                        "`{other}`: the SLOs are ttft, tpot, e2e (ms) and attainment (%)"
                    ))
                }
            }
        }
        if slo.ttft_ms.is_none() && slo.tpot_ms.is_none() && slo.e2e_ms.is_none() {
            return Err("give at least one of ttft:MS, tpot:MS, e2e:MS".into());
        }
        Ok(slo)
    }
}

impl Slo {
    /// Whether a request with these figures is good, as vLLM's `--goodput` judges it: every
    /// SLO set holds (a figure equal to its SLO holds); no TPOT (one token) holds.
    pub fn good(&self, ttft_ms: f64, tpot_ms: Option<f64>, e2e_ms: f64) -> bool {
        let holds = |slo: Option<f64>, v: Option<f64>| slo.zip(v).is_none_or(|(s, v)| v <= s);
        holds(self.ttft_ms, Some(ttft_ms))
            && holds(self.tpot_ms, tpot_ms)
            && holds(self.e2e_ms, Some(e2e_ms))
    }
}

/// A phase's goodput, from the client's side.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct LoadGoodput {
    /// Requests that ended inside the measured window and met every SLO.
    pub good: u64,
    /// Requests judged: those that ended inside the window, errors included.
    pub judged: u64,
    pub requests_per_sec: f64,
    pub output_tokens_per_sec: f64,
    pub attainment_pct: Option<f64>,
}

/// One request that ended inside a measured window (`--records`).
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct RequestRecord {
    /// The phase: `c=16` or `rate=4/s`.
    pub phase: String,
    /// When it was sent, ms after the phase began (`null` for a failure before it was).
    pub start_ms: Option<f64>,
    /// `null` for a complete response, else the kind of failure.
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    /// vLLM's: (t_last − t_first) / (N − 1); `null` under two tokens.
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub output_tokens: u64,
    /// With `--slo`: whether it met every SLO.
    pub good: Option<bool>,
    /// It was sent in the window and ended after it (`--drain`): in no phase figure.
    pub after_window: bool,
}

fn f(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

impl PhaseReport {
    pub fn label(&self) -> String {
        match (self.concurrency, self.rate) {
            (Some(c), _) => format!("c={c}"),
            (_, Some(r)) => format!("rate={r}/s"),
            _ => "-".into(),
        }
    }

    pub fn one_line(&self) -> String {
        let goodput = self.goodput.map_or_else(String::new, |g| {
            format!(
                ", goodput {:.2} req/s ({}% good)",
                g.requests_per_sec,
                f(g.attainment_pct)
            )
        });
        format!(
            "{}: {} requests, TTFT p50 {} ms, TPOT p50 {} ms, single-stream {} T/s, system {} T/s, errors {}{goodput}",
            self.label(),
            self.requests,
            f(self.ttft_ms.p50),
            f(self.tpot_ms.p50),
            f(self.single_stream_tps),
            f(self.system_tps),
            self.errors.values().sum::<u64>()
        )
    }

    /// Whether the phase kept `slo`: at least its attainment of requests good.
    pub fn within(&self, slo: &Slo) -> bool {
        self.goodput
            .and_then(|g| g.attainment_pct)
            .is_some_and(|a| a >= slo.attainment_pct)
    }
}

/// The SLO-bounded phase: the highest system T/s among phases within `slo`.
pub fn slo_bounded<'a>(reports: &'a [PhaseReport], slo: &Slo) -> Option<&'a PhaseReport> {
    reports
        .iter()
        .filter(|r| r.within(slo))
        .filter(|r| r.system_tps.is_some())
        .max_by(|a, b| {
            a.system_tps
                .unwrap_or(0.0)
                .total_cmp(&b.system_tps.unwrap_or(0.0))
        })
}

/// The end-of-run table.
pub fn table(reports: &[PhaseReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>10} {:>7} {:>6} | {:>21} | {:>21} | {:>13} | {:>9} {:>9}",
        "load",
        "reqs",
        "errors",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90/mean ms",
        "ITL p50/p99",
        "1-str T/s",
        "sys T/s"
    );
    for r in reports {
        let errors = r.errors.values().sum::<u64>();
        let _ = writeln!(
            out,
            "{:>10} {:>7} {:>6} | {:>21} | {:>21} | {:>13} | {:>9} {:>9}",
            r.label(),
            r.requests,
            errors,
            format!(
                "{}/{}/{}",
                f(r.ttft_ms.p50),
                f(r.ttft_ms.p90),
                f(r.ttft_ms.p99)
            ),
            format!(
                "{}/{}/{}",
                f(r.tpot_ms.p50),
                f(r.tpot_ms.p90),
                f(r.tpot_ms.mean)
            ),
            format!("{}/{}", f(r.itl_ms.p50), f(r.itl_ms.p99)),
            f(r.single_stream_tps),
            f(r.system_tps)
        );
    }
    for r in reports.iter().filter(|r| !r.errors.is_empty()) {
        let kinds: Vec<String> = r.errors.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = writeln!(out, "errors at {}: {}", r.label(), kinds.join(", "));
    }
    for r in reports {
        if let Some(g) = r.goodput {
            let _ = writeln!(
                out,
                "goodput at {}: {:.2} req/s, {:.1} T/s of good requests, {} of {} good ({}%)",
                r.label(),
                g.requests_per_sec,
                g.output_tokens_per_sec,
                g.good,
                g.judged,
                f(g.attainment_pct)
            );
        }
    }
    out
}
