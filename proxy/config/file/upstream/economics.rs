//! An upstream's price, model and GPUs (`cost_per_hour`, `model`, `gpu`…) and its
//! capacity's headroom: what the decisions are computed from.

use serde::Deserialize;

use super::UpstreamFile;
use crate::config::Problems;
use crate::decide::Economics;
use crate::decide::Price;
use crate::decide::Roofline;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// The weights' size in GB (10⁹ bytes). Default: none.
    #[serde(default)]
    pub weight_gb: Option<f64>,
    /// Or the parameters, billions… Default: none.
    #[serde(default)]
    pub params_b: Option<f64>,
    /// …and the bytes each takes (2 for BF16, 1 for FP8, 0.5 for 4-bit). Default: none.
    #[serde(default)]
    pub bytes_per_param: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityFile {
    /// Demand is met with this much to spare, percent. Default 20.
    #[serde(default)]
    pub headroom_pct: Option<f64>,
}

/// The highest `cost_per_hour` taken: a billion an hour, in any currency.
const MAX_COST_PER_HOUR: f64 = 1e9;

/// `upstream[i]`'s price, model and GPUs, and its capacity's headroom, checked.
pub(super) fn economics(i: usize, u: &UpstreamFile, p: &mut Problems) -> Economics {
    let at = |f: &str| format!("upstream[{i}].{f}");
    let positive = |p: &mut Problems, key: &str, v: Option<f64>, what: &str| {
        v.filter(|v| {
            let ok = *v > 0.0 && v.is_finite();
            if !ok {
                p.add(at(key), format!("must be a positive {what}, not {v}"));
            }
            ok
        })
    };
    // A price past this is a slip of the keyboard, and its figures would overflow to
    // nothing (1e308 per hour has no per-token cost an f64 can hold): refused.
    let per_hour = positive(p, "cost_per_hour", u.cost_per_hour, "price per hour").filter(|v| {
        let ok = *v <= MAX_COST_PER_HOUR;
        if !ok {
            p.add(
                at("cost_per_hour"),
                format!("{v:e} is not a price per hour (at most {MAX_COST_PER_HOUR:e})"),
            );
        }
        ok
    });
    if u.cost_per_hour.is_none() {
        for (key, given) in [
            ("cost_currency", u.cost_currency.is_some()),
            ("gpus", u.gpus.is_some()),
        ] {
            if given {
                p.add(at(key), "applies with cost_per_hour only");
            }
        }
    }
    if u.gpus == Some(0) {
        p.add(at("gpus"), "must be at least 1");
    }
    let price = per_hour.map(|per_hour| Price {
        per_hour,
        currency: u.cost_currency.clone(),
        gpus: u.gpus.map(|g| u32::try_from(g).unwrap_or(u32::MAX)),
    });
    let weight_gb = u.model.as_ref().and_then(|m| {
        let model = |f: &str| format!("upstream[{i}].model.{f}");
        match (m.weight_gb, m.params_b, m.bytes_per_param) {
            (Some(w), None, None) => positive(p, "model.weight_gb", Some(w), "size in GB"),
            (None, Some(params), Some(bytes)) => {
                let params = positive(p, "model.params_b", Some(params), "number of billions");
                let bytes = positive(p, "model.bytes_per_param", Some(bytes), "number of bytes");
                params.zip(bytes).map(|(n, b)| n * b)
            }
            (None, Some(_), None) => {
                p.add(
                    model("bytes_per_param"),
                    "is required with params_b: 2 for BF16, 1 for FP8, 0.5 for 4-bit",
                );
                None
            }
            (None, None, Some(_)) => {
                p.add(model("params_b"), "is required with bytes_per_param");
                None
            }
            (None, None, None) => {
                p.add(
                    at("model"),
                    "give weight_gb, or params_b and bytes_per_param",
                );
                None
            }
            (Some(_), ..) => {
                p.add(
                    model("weight_gb"),
                    "give weight_gb, or params_b and bytes_per_param, not both",
                );
                None
            }
        }
    });
    let bandwidth = match (&u.gpu, u.hbm_tb_per_s) {
        (Some(_), Some(_)) => {
            p.add(
                at("hbm_tb_per_s"),
                "give gpu (a known GPU) or hbm_tb_per_s, not both",
            );
            None
        }
        (Some(gpu), None) => crate::decide::gpu_bandwidth(gpu).or_else(|| {
            let known: Vec<&str> = crate::decide::GPUS.iter().map(|(n, _)| *n).collect();
            p.add(
                at("gpu"),
                format!(
                    "`{gpu}` is not one of {}; give hbm_tb_per_s for another GPU",
                    known.join(", ")
                ),
            );
            None
        }),
        (None, bw) => positive(p, "hbm_tb_per_s", bw, "bandwidth in TB/s"),
    };
    if u.tensor_parallel == Some(0) {
        p.add(at("tensor_parallel"), "must be at least 1");
    }
    let roofline_keys = [
        ("gpu", u.gpu.is_some()),
        ("hbm_tb_per_s", u.hbm_tb_per_s.is_some()),
        ("tensor_parallel", u.tensor_parallel.is_some()),
    ];
    if u.model.is_none() {
        for (key, _) in roofline_keys.iter().filter(|(_, given)| *given) {
            p.add(at(key), "applies with model (the decode roofline) only");
        }
    } else if u.gpu.is_none() && u.hbm_tb_per_s.is_none() {
        p.add(
            at("model"),
            "the roofline needs the GPU: gpu = \"h100-sxm\" (or another known one) or hbm_tb_per_s",
        );
    }
    let roofline = weight_gb
        .zip(bandwidth)
        .map(|(weight_gb, hbm_tb_per_s)| Roofline {
            weight_gb,
            hbm_tb_per_s,
            tensor_parallel: u
                .tensor_parallel
                .map_or(1, |t| u32::try_from(t.max(1)).unwrap_or(u32::MAX)),
            gpu: u.gpu.clone(),
        });
    let headroom_pct = match u.capacity.as_ref().and_then(|c| c.headroom_pct) {
        Some(h) if (0.0..=1000.0).contains(&h) => h,
        Some(h) => {
            p.add(
                at("capacity.headroom_pct"),
                format!("must be between 0 and 1000, not {h}"),
            );
            crate::decide::DEFAULT_HEADROOM_PCT
        }
        None => crate::decide::DEFAULT_HEADROOM_PCT,
    };
    Economics {
        price,
        roofline,
        headroom_pct,
    }
}
