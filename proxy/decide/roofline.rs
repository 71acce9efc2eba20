//! The decode roofline: decoding reads every weight once per step, so one stream cannot
//! decode faster than the GPUs' memory bandwidth divided by the weights' bytes (each of
//! `tensor_parallel` GPUs reads its share at once). Model bandwidth utilisation (MBU) is how
//! close a backend runs to it: single-stream T/s ÷ that ceiling, whatever the batch (a step
//! reads the weights once for every stream in it; KV-cache reads are left out, so MBU is a
//! slight understatement at long contexts). An MBU over 100% cannot be: the size or the
//! bandwidth configured is wrong, and it is reported as that, never as a figure.

use serde::Serialize;

/// Published peak HBM bandwidth per GPU, TB/s (docs/decisions.md gives each source).
pub const GPUS: &[(&str, f64)] = &[
    ("h100-sxm", 3.35),
    ("h200", 4.8),
    ("b200", 8.0),
    ("a100-80gb", 2.039),
    ("l40s", 0.864),
    ("mi300x", 5.3),
];

/// The bandwidth of a GPU named in `GPUS`.
pub fn gpu_bandwidth(name: &str) -> Option<f64> {
    GPUS.iter().find(|(n, _)| *n == name).map(|&(_, bw)| bw)
}

/// A model on its GPUs (`upstream[].model`, `gpu` or `hbm_tb_per_s`, `tensor_parallel`).
#[derive(Debug, Clone, PartialEq)]
pub struct Roofline {
    /// The weights' size, GB (10⁹ bytes).
    pub weight_gb: f64,
    /// One GPU's HBM bandwidth, TB/s (10¹² bytes per second).
    pub hbm_tb_per_s: f64,
    /// GPUs one replica's weights are split over.
    pub tensor_parallel: u32,
    /// The GPU named, when it was named.
    pub gpu: Option<String>,
}

/// The roofline's part of `/stats`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RooflineStats {
    pub weight_gb: f64,
    pub hbm_tb_per_s: f64,
    pub tensor_parallel: u32,
    pub gpu: Option<String>,
    /// The fastest one stream can decode: bandwidth × tensor_parallel ÷ weight bytes.
    pub single_stream_ceiling_tps: f64,
    /// MBU at the lowest supported curve point (its concurrency in `mbu_at_concurrency`),
    /// percent; `null` without one, or when it would exceed 100 (see `problem`).
    pub mbu_pct: Option<f64>,
    pub mbu_at_concurrency: Option<u64>,
    /// MBU of the live window's single-stream T/s, percent.
    pub mbu_pct_now: Option<f64>,
    /// Set when a measured rate beats the ceiling: the model size or bandwidth is wrong.
    pub problem: Option<String>,
}

/// `x` to three significant digits, however small or large: 40.0, 0.0706, 7.06e-8, 1.42e10.
pub fn significant(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let magnitude = x.abs().log10().floor() as i32;
    if (-3..6).contains(&magnitude) {
        let decimals = usize::try_from(2 - magnitude).unwrap_or(0);
        format!("{x:.decimals$}")
    } else {
        format!("{x:.2e}")
    }
}

// === impl Roofline ===

impl Roofline {
    pub fn single_stream_ceiling_tps(&self) -> f64 {
        self.hbm_tb_per_s * 1e3 * f64::from(self.tensor_parallel) / self.weight_gb
    }

    /// The roofline against the single-stream T/s of the lowest supported curve point
    /// (`lowest`: its concurrency and rate) and of the live window (`now`).
    pub fn stats(&self, lowest: Option<(u64, f64)>, now: Option<f64>) -> RooflineStats {
        let ceiling = self.single_stream_ceiling_tps();
        let mbu = |tps: f64| 100.0 * tps / ceiling;
        // Read at the lowest supported point (over its support), else, before there is
        // one, at the live window's rate.
        let seen = match lowest {
            Some((c, tps)) => Some((format!("at concurrency {c}"), tps)),
            None => now.map(|tps| ("over the live window".to_owned(), tps)),
        };
        let problem = seen.filter(|(_, tps)| mbu(*tps) > 100.0).map(|(at, tps)| {
            format!(
                "single-stream {} T/s {at} is {}× the roofline's {} T/s: model.weight_gb ({}) \
                 or the bandwidth ({} TB/s × {}) is wrong",
                significant(tps),
                significant(tps / ceiling),
                significant(ceiling),
                self.weight_gb,
                self.hbm_tb_per_s,
                self.tensor_parallel
            )
        });
        let within = |tps: f64| (mbu(tps) <= 100.0).then(|| mbu(tps));
        RooflineStats {
            weight_gb: self.weight_gb,
            hbm_tb_per_s: self.hbm_tb_per_s,
            tensor_parallel: self.tensor_parallel,
            gpu: self.gpu.clone(),
            single_stream_ceiling_tps: ceiling,
            mbu_pct: lowest.and_then(|(_, tps)| within(tps)),
            mbu_at_concurrency: lowest.map(|(c, _)| c),
            mbu_pct_now: if problem.is_some() {
                None
            } else {
                now.and_then(within)
            },
            problem,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama70b_fp8() -> Roofline {
        Roofline {
            weight_gb: 70.6,
            hbm_tb_per_s: gpu_bandwidth("h100-sxm").unwrap_or_default(),
            tensor_parallel: 1,
            gpu: Some("h100-sxm".into()),
        }
    }

    #[test]
    fn seventy_gb_on_an_h100_decodes_at_most_47_5_tps() {
        let r = llama70b_fp8();
        assert!((r.single_stream_ceiling_tps() - 47.45).abs() < 0.01);
        // 25 ms a token alone: 40 T/s, 84% of the ceiling.
        let s = r.stats(Some((1, 40.0)), Some(38.0));
        assert!((s.mbu_pct.unwrap_or_default() - 84.3).abs() < 0.1, "{s:?}");
        assert!(s.problem.is_none());
        // 10 ms a token alone cannot be: reported as a misconfiguration, with no MBU.
        let s = r.stats(Some((1, 100.0)), Some(100.0));
        assert_eq!((s.mbu_pct, s.mbu_pct_now), (None, None));
        assert!(
            s.problem.as_deref().is_some_and(|p| p.contains("2.11×")),
            "{s:?}"
        );
        // A weight absurdly large: every figure in the text keeps its significant digits.
        let huge = Roofline {
            weight_gb: 1e12,
            ..llama70b_fp8()
        };
        let s = huge.stats(Some((1, 40.0)), None);
        let text = s.problem.unwrap_or_default();
        assert!(text.contains("roofline's 3.35e-9 T/s"), "{text}");
        assert!(text.contains("1.19e10×"), "{text}");
        assert_eq!(
            [1e-9, 0.0706, 0.5, 40.04, 123_456.0, 1.42e10, 0.0].map(significant),
            ["1.00e-9", "0.0706", "0.500", "40.0", "123456", "1.42e10", "0"]
        );
        // No supported point yet: the live window's rate says it just the same.
        let s = r.stats(None, Some(100.0));
        assert!(s
            .problem
            .as_deref()
            .is_some_and(|p| p.contains("over the live window")));
        assert_eq!(s.mbu_pct_now, None);
        // Split over two GPUs, each reads half.
        let tp2 = Roofline {
            tensor_parallel: 2,
            ..llama70b_fp8()
        };
        assert!((tp2.single_stream_ceiling_tps() - 94.9).abs() < 0.1);
    }
}
