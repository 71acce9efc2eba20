//! A TPOT curve: decode step time (ms) by batch size, piecewise-linear between points and
//! flat beyond the ends.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    /// (batch size, step ms), sorted by batch size, at least one point.
    points: Vec<(f64, f64)>,
}

impl Curve {
    /// The reference shape: Llama 3.1 70B FP8 on an H100.
    pub fn reference() -> Curve {
        Curve {
            points: vec![(1.0, 20.0), (16.0, 22.0), (64.0, 26.0), (128.0, 36.0)],
        }
    }

    /// The curve with every step time multiplied by `factor`.
    pub fn scaled(&self, factor: f64) -> Curve {
        Curve {
            points: self
                .points
                .iter()
                .map(|&(b, ms)| (b, ms * factor))
                .collect(),
        }
    }

    /// Step time, ms, at batch size `b`.
    pub fn tpot_ms(&self, b: f64) -> f64 {
        let p = &self.points;
        if b <= p[0].0 {
            return p[0].1;
        }
        for w in p.windows(2) {
            let ((b0, t0), (b1, t1)) = (w[0], w[1]);
            if b <= b1 {
                return t0 + (t1 - t0) * (b - b0) / (b1 - b0);
            }
        }
        p[p.len() - 1].1
    }
}

impl FromStr for Curve {
    type Err = String;

    fn from_str(s: &str) -> Result<Curve, String> {
        let mut points = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (b, ms) = part
                .split_once(':')
                .ok_or_else(|| format!("`{part}` is not BATCH:MS"))?;
            let b: f64 = b
                .trim()
                .parse()
                .map_err(|_| format!("`{b}` is not a batch size"))?;
            let ms: f64 = ms
                .trim()
                .parse()
                .map_err(|_| format!("`{ms}` is not a time in ms"))?;
            if !(b >= 1.0 && ms > 0.0 && ms.is_finite()) {
                return Err(format!("`{part}`: batch must be ≥ 1 and time > 0"));
            }
            if points.last().is_some_and(|&(pb, _)| b <= pb) {
                return Err(format!("`{part}`: batch sizes must increase"));
            }
            points.push((b, ms));
        }
        if points.is_empty() {
            return Err("a curve needs at least one BATCH:MS point".into());
        }
        Ok(Curve { points })
    }
}

impl fmt::Display for Curve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .points
            .iter()
            .map(|(b, ms)| format!("{b}:{ms}"))
            .collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_and_clamps() {
        let c: Curve = "1:20,16:22,64:26,128:36".parse().expect("valid");
        assert_eq!(c, Curve::reference());
        assert_eq!(c.tpot_ms(1.0), 20.0);
        assert_eq!(c.tpot_ms(16.0), 22.0);
        assert_eq!(c.tpot_ms(40.0), 24.0);
        assert_eq!(c.tpot_ms(96.0), 31.0);
        assert_eq!(c.tpot_ms(500.0), 36.0);
        assert_eq!(c.to_string().parse::<Curve>(), Ok(c));
        assert!("16:22,1:20".parse::<Curve>().is_err());
        assert!("x".parse::<Curve>().is_err());
    }
}
