//! Upstream choice: the first matching route, then its split — smooth weighted round-robin
//! (no A,A,A,B bursts), or a sticky key hashed into [0, 1) when the route names one and the
//! request carries it. The sticky choice is a pure function of (key, weights). A route
//! with a rollout takes its two arms' weights from the rollout's share as it goes, and
//! while the rollout holds a share its `spill` moves no request into or out of those two
//! arms: an overflow of `from` that spilled to `to` would serve `to` far past its step.

use std::sync::{Arc, Mutex, PoisonError};

use http::HeaderMap;

use crate::config::Route;
use crate::rollout::{Rollout, Rollouts};

pub mod path;

/// A request's header fields as routing reads them: the first value of a field, by a
/// lowercase name (pingora's header map, or tokentap's own head).
pub trait Fields {
    fn first(&self, name: &str) -> Option<&[u8]>;
}

impl Fields for HeaderMap {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.get(name).map(http::HeaderValue::as_bytes)
    }
}

/// The routes of one config, with their round-robin state.
pub struct Router {
    routes: Vec<(Route, Mutex<SmoothWrr>)>,
    /// Each route's rollout, if it has one, and the share its split was weighed at, and
    /// that split (made again only when the share moves: no allocation a request).
    rollouts: Vec<Option<(Arc<Rollout>, Mutex<RolloutSplit>)>>,
}

/// A rollout route's split at a share.
type RolloutSplit = (f64, Vec<(usize, u32)>);

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub route: usize,
    pub upstream: usize,
}

// === impl Router ===

impl Router {
    pub fn new(routes: &[Route], rollouts: &Rollouts) -> Self {
        Router {
            routes: routes
                .iter()
                .map(|r| {
                    let weights = r.split.iter().map(|&(_, w)| w).collect();
                    (r.clone(), Mutex::new(SmoothWrr::new(weights)))
                })
                .collect(),
            rollouts: (0..routes.len())
                .map(|i| {
                    let made = (f64::NAN, Vec::new());
                    rollouts.of(i).map(|r| (Arc::clone(r), Mutex::new(made)))
                })
                .collect(),
        }
    }

    /// Route `route`'s split as its rollout weighs it now: `to` its share of the two arms'
    /// weight, `from` the rest, in ten-thousandths (other arms' weights scaled alike), so a
    /// share of 0.5% is not rounded away.
    pub fn rollout_split(&self, route: usize) -> Option<(f64, Vec<(usize, u32)>)> {
        let (rollout, _) = self.rollouts.get(route)?.as_ref()?;
        let (r, c) = (&self.routes[route].0, &rollout.config);
        let p = rollout.percent();
        let pair: u32 = (r.split.iter())
            .filter(|&&(u, _)| u == c.from || u == c.to)
            .map(|&(_, w)| w)
            .sum::<u32>()
            .max(1);
        let split = (r.split.iter())
            .map(|&(u, w)| {
                let share = if u == c.to {
                    p
                } else if u == c.from {
                    100.0 - p
                } else {
                    return (u, w.saturating_mul(10_000));
                };
                (
                    u,
                    (f64::from(pair) * share * 100.0)
                        .round()
                        .min(f64::from(u32::MAX)) as u32,
                )
            })
            .collect();
        Some((p, split))
    }

    /// The upstream for a request, or `None` when no route matches. On a route with
    /// `spill`, a choice without `headroom` moves to the heaviest other arm that has some.
    pub fn choose(
        &self,
        path: &str,
        headers: &(impl Fields + ?Sized),
        headroom: impl Fn(usize) -> bool,
    ) -> Option<Choice> {
        let (route, (r, wrr)) = self
            .routes
            .iter()
            .enumerate()
            .find(|(_, (r, _))| matches(r, path, headers))?;
        let key = r.sticky.as_ref().and_then(|h| headers.first(h.as_str()));
        // A rollout's split, weighed again (and the round-robin started again) only when
        // its share moved; held for the rest of the choice.
        let mut made;
        let rollout = self.rollouts.get(route).and_then(Option::as_ref);
        let split = match rollout {
            Some((rollout, cell)) => {
                made = cell.lock().unwrap_or_else(PoisonError::into_inner);
                if made.0 != rollout.percent() {
                    if let Some((at, split)) = self.rollout_split(route) {
                        let weights = split.iter().map(|&(_, w)| w).collect();
                        *wrr.lock().unwrap_or_else(PoisonError::into_inner) =
                            SmoothWrr::new(weights);
                        *made = (at, split);
                    }
                }
                if made.1.is_empty() {
                    &r.split[..]
                } else {
                    &made.1[..]
                }
            }
            None => &r.split[..],
        };
        let arm = match key {
            Some(key) => sticky_arm(key, split),
            None => wrr.lock().unwrap_or_else(PoisonError::into_inner).pick(),
        };
        let mut upstream = split[arm].0;
        if r.spill {
            // The rollout's two arms, while it holds a share: nothing spills into or out of
            // them (the step's share is of what they serve).
            let pair = (rollout.map(|(ro, _)| ro))
                .filter(|ro| ro.holds_share())
                .map(|ro| (ro.config.from, ro.config.to));
            let held = |u: usize| pair.is_some_and(|(from, to)| u == from || u == to);
            if !held(upstream) && !headroom(upstream) {
                let spill = split
                    .iter()
                    .filter(|&&(u, w)| u != upstream && w > 0 && !held(u) && headroom(u))
                    .max_by_key(|&&(_, w)| w);
                if let Some(&(u, _)) = spill {
                    upstream = u;
                }
            }
        }
        Some(Choice { route, upstream })
    }
}

fn matches(route: &Route, path: &str, headers: &(impl Fields + ?Sized)) -> bool {
    path.starts_with(&route.path_prefix)
        && route.headers.iter().all(|(name, want)| {
            headers
                .first(name.as_str())
                .is_some_and(|v| v == want.as_bytes())
        })
}

/// A key's hash as a point in [0, 1): the same key, the same point.
pub fn unit_hash(key: &[u8]) -> f64 {
    // Divide by 2^64, not u64::MAX, so the point is strictly below 1.
    hash(key) as f64 / 18_446_744_073_709_551_616.0
}

/// The arm a sticky key lands on: its hash in [0, 1) against the cumulative weights.
pub fn sticky_arm(key: &[u8], split: &[(usize, u32)]) -> usize {
    let total: u64 = split.iter().map(|&(_, w)| u64::from(w)).sum();
    // Divide by 2^64, not u64::MAX, so the point is strictly below 1.
    let point = (hash(key) as f64 / 18_446_744_073_709_551_616.0) * total as f64;
    let mut acc = 0u64;
    for (i, &(_, w)) in split.iter().enumerate() {
        acc += u64::from(w);
        if point < acc as f64 {
            return i;
        }
    }
    split.len() - 1
}

/// FNV-1a, finished with the splitmix64 mixer so short keys spread over the high bits too.
/// Stable across builds and restarts, unlike std's `DefaultHasher`.
fn hash(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// nginx's smooth weighted round-robin: every pick adds each weight to its arm's credit,
/// takes the arm with the most credit and charges it the total.
pub struct SmoothWrr {
    weights: Vec<i64>,
    credit: Vec<i64>,
    total: i64,
}

// === impl SmoothWrr ===

impl SmoothWrr {
    pub fn new(weights: Vec<u32>) -> Self {
        let weights: Vec<i64> = weights.into_iter().map(i64::from).collect();
        SmoothWrr {
            total: weights.iter().sum(),
            credit: vec![0; weights.len()],
            weights,
        }
    }

    /// The next arm.
    pub fn pick(&mut self) -> usize {
        let mut best = 0;
        for i in 0..self.weights.len() {
            self.credit[i] += self.weights[i];
            if self.credit[i] > self.credit[best] {
                best = i;
            }
        }
        self.credit[best] -= self.total;
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smooth_wrr_spreads_picks() {
        let mut w = SmoothWrr::new(vec![5, 1, 1]);
        let picks: Vec<usize> = (0..7).map(|_| w.pick()).collect();
        assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
        let mut w = SmoothWrr::new(vec![1, 1]);
        let picks: Vec<usize> = (0..4).map(|_| w.pick()).collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
        let mut w = SmoothWrr::new(vec![0, 3]);
        assert!(
            (0..5).all(|_| w.pick() == 1),
            "a zero weight is never picked"
        );
    }

    #[test]
    fn split_shares_match_weights() {
        let mut w = SmoothWrr::new(vec![90, 10]);
        let mut n = [0u32; 2];
        for _ in 0..10_000 {
            n[w.pick()] += 1;
        }
        assert_eq!(n, [9_000, 1_000]);
    }

    #[test]
    fn a_full_arm_spills_to_the_heaviest_arm_with_headroom() {
        let route = |spill| Route {
            name: "/".into(),
            path_prefix: "/".into(),
            headers: vec![],
            split: vec![(0, 50), (1, 10), (2, 40)],
            sticky: None,
            spill,
            mirrors: vec![],
            rollout: None,
        };
        let headers = HeaderMap::new();
        let r = Router::new(&[route(true)], &Rollouts::default());
        // Arm 0 is full: its picks go to arm 2 (weight 40), never to the lighter arm 1.
        let picks: Vec<usize> = (0..10)
            .map(|_| {
                r.choose("/v1", &headers, |u| u != 0)
                    .map(|c| c.upstream)
                    .unwrap_or(9)
            })
            .collect();
        assert!(!picks.contains(&0), "{picks:?}");
        assert_eq!(
            picks.iter().filter(|&&u| u == 1).count(),
            1,
            "arm 1 keeps its own share: {picks:?}"
        );
        let r = Router::new(&[route(false)], &Rollouts::default());
        let picks: Vec<usize> = (0..10)
            .map(|_| {
                r.choose("/v1", &headers, |u| u != 0)
                    .map(|c| c.upstream)
                    .unwrap_or(9)
            })
            .collect();
        assert_eq!(
            picks.iter().filter(|&&u| u == 0).count(),
            5,
            "without spill the full arm still gets its share (and queues)"
        );
        assert_eq!(
            r.choose("/elsewhere", &headers, |_| true).map(|c| c.route),
            Some(0)
        );
        let none = Router::new(
            &[Route {
                name: "/".into(),
                path_prefix: "/v1/".into(),
                ..route(false)
            }],
            &Rollouts::default(),
        );
        assert_eq!(none.choose("/health", &headers, |_| true), None);
    }

    /// While a rollout holds a share, `spill` moves nothing into or out of its two arms: a
    /// full `from` keeps its picks (they queue) rather than handing them to `to`, and a
    /// full third arm does not spill into the pair. Once the rollout has ended, spill is as
    /// on any route.
    #[test]
    fn spill_keeps_a_rollouts_share() {
        use crate::config::RolloutConfig;
        use crate::rollout::Action;
        let rollout = RolloutConfig {
            from: 0,
            to: 1,
            steps: vec![10.0, 50.0, 100.0],
            every: std::time::Duration::from_secs(3600),
            max_tpot_ratio: 1.05,
            max_ttft_ratio: None,
            max_error_pct: 1.0,
            min_requests: 50,
        };
        let route = |split: Vec<(usize, u32)>| Route {
            name: "chat".into(),
            path_prefix: "/".into(),
            headers: vec![],
            split,
            sticky: None,
            spill: true,
            mirrors: vec![],
            rollout: Some(rollout.clone()),
        };
        let names: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let headers = HeaderMap::new();
        let picks = |r: &Router, full: usize| {
            let mut n = [0u32; 3];
            for _ in 0..1_000 {
                let c = r.choose("/v1", &headers, |u| u != full).unwrap();
                n[c.upstream] += 1;
            }
            n
        };
        // `from` (a) full: `to` (b) still gets its 10%, not a's overflow.
        let routes = [route(vec![(0, 1), (1, 1)])];
        let rollouts = Rollouts::new(&routes, &names, None, None, 0);
        let r = Router::new(&routes, &rollouts);
        assert_eq!(picks(&r, 0), [900, 100, 0]);
        // A third arm (c) full: its picks stay with it, not spilled into the pair; and a full
        // `from` does not spill out to c either.
        let routes = [route(vec![(0, 1), (1, 1), (2, 1)])];
        let rollouts = Rollouts::new(&routes, &names, None, None, 0);
        let r = Router::new(&routes, &rollouts);
        // (Weights 9 : 1 : 5 in a 15-pick cycle: a thousand picks give c 333 or 334.)
        let n = picks(&r, 2);
        assert!((333..=334).contains(&n[2]), "{n:?}");
        let n = picks(&r, 0);
        assert!(n[0] == 600 && (66..=67).contains(&n[1]), "{n:?}");
        // Ended (rolled back: b at 0): a full `from` spills to c again.
        rollouts.act("chat", Action::Abort, 1).unwrap();
        let n = picks(&r, 0);
        assert_eq!((n[0], n[1]), (0, 0), "{n:?}");
    }

    #[test]
    fn sticky_keys_are_stable_and_follow_weights() {
        let split = [(0, 70), (1, 30)];
        let mut n = [0u32; 2];
        for k in 0..1_000 {
            let key = format!("user-{k}");
            let arm = sticky_arm(key.as_bytes(), &split);
            assert_eq!(arm, sticky_arm(key.as_bytes(), &split));
            n[arm] += 1;
        }
        assert!((650..=750).contains(&n[0]), "{n:?}");
    }
}
