//! Goodput: each finished generation request judged against its upstream's latency SLOs
//! ([`Targets`], `[upstream.slo]`): good, or the first SLO it broke. Throughput that breaks
//! the SLO is not capacity, so the judgements are counted three ways: over the live window
//! (good requests and their output tokens per second, and the share of requests that were
//! good: [`Ring`]), by curve bucket over the curve's window (up to which concurrency the
//! upstream keeps its attainment target: `curve::Verdicts`), and since start
//! (`tokentap_slo_requests_total`).
//!
//! A request is judged as `vllm bench serve --goodput` judges it: every SLO set must hold,
//! a figure equal to its SLO holds, TPOT is the request's own (`(t_last − t_first) /
//! (N − 1)`, none under two tokens, which holds). A response that was not streamed has its
//! first token when it ends. A request that failed (an error, an upstream that cut it) is
//! not good.
//!
//! A request its client abandoned (a chat UI's stop button, a client that stopped) is
//! judged only by what it had already broken when the client left: a TTFT past the SLO
//! (its first token late, or none yet after the SLO's time), gaps past the TPOT SLO so
//! far, an e2e past its SLO. Otherwise it is not judged (counted as cancelled): it says
//! nothing of whether its backend would have met the SLO.

use super::Outcome;

/// The latency SLOs a request is judged against; each is optional.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Targets {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

/// How a finished request stood against the SLOs: good, or the first one it broke (in
/// the order TTFT, TPOT, e2e), or an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Good,
    Ttft,
    Tpot,
    E2e,
    Error,
}

/// What a finished request is judged by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Judged {
    pub outcome: Outcome,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
}

// === impl Targets ===

impl Targets {
    /// Whether any SLO is set.
    pub fn any(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some() || self.e2e_ms.is_some()
    }

    /// How `r` stood against the SLOs; `None`: not judged (its client left before it broke
    /// any).
    pub fn judge(&self, r: &Judged) -> Option<Verdict> {
        let breaks = |slo: Option<f64>, figure: Option<f64>| {
            slo.zip(figure).is_some_and(|(slo, figure)| figure > slo)
        };
        // For an abandoned request, each figure is what it was when the client left.
        let broken = if breaks(self.ttft_ms, Some(r.ttft_ms.unwrap_or(r.e2e_ms))) {
            Some(Verdict::Ttft)
        } else if breaks(self.tpot_ms, r.tpot_ms) {
            Some(Verdict::Tpot)
        } else if breaks(self.e2e_ms, Some(r.e2e_ms)) {
            Some(Verdict::E2e)
        } else {
            None
        };
        match r.outcome {
            Outcome::Ok => Some(broken.unwrap_or(Verdict::Good)),
            Outcome::Aborted => broken,
            _ => Some(Verdict::Error),
        }
    }
}

// === impl Verdict ===

impl Verdict {
    pub const ALL: [Verdict; 5] = [
        Verdict::Good,
        Verdict::Ttft,
        Verdict::Tpot,
        Verdict::E2e,
        Verdict::Error,
    ];

    /// The `result` label of `tokentap_slo_requests_total`.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Good => "good",
            Verdict::Ttft => "ttft",
            Verdict::Tpot => "tpot",
            Verdict::E2e => "e2e",
            Verdict::Error => "error",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// One slot of the live window's judgements.
#[derive(Debug, Clone, Copy)]
struct Slot {
    epoch: u64,
    judged: u64,
    good: u64,
    good_tokens: u64,
    /// Abandoned by their clients before breaking any SLO: not judged.
    cancelled: u64,
    /// The judged that were not good, by verdict (TTFT, TPOT, e2e, error).
    broken: [u64; 4],
}

impl Slot {
    const EMPTY: Slot = Slot {
        epoch: u64::MAX,
        judged: 0,
        good: 0,
        good_tokens: 0,
        cancelled: 0,
        broken: [0; 4],
    };
}

/// The live window's judgements, by slot (the window's own `N` slots), and the totals since
/// start.
pub(super) struct Ring<const N: usize> {
    slots: [Slot; N],
    pub(super) totals: [u64; Verdict::ALL.len()],
    pub(super) cancelled_total: u64,
}

/// The live window's judgements, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Window {
    pub(super) judged: u64,
    pub(super) good: u64,
    pub(super) good_tokens: u64,
    pub(super) cancelled: u64,
    /// The judged that were not good, by verdict ([`Verdict::ALL`] without `Good`).
    pub(super) broken: [u64; 4],
}

impl<const N: usize> Ring<N> {
    pub(super) fn new() -> Ring<N> {
        Ring {
            slots: [Slot::EMPTY; N],
            totals: [0; Verdict::ALL.len()],
            cancelled_total: 0,
        }
    }

    fn slot(&mut self, epoch: u64) -> &mut Slot {
        let slot = &mut self.slots[(epoch % self.slots.len() as u64) as usize];
        if slot.epoch != epoch {
            *slot = Slot {
                epoch,
                ..Slot::EMPTY
            };
        }
        slot
    }

    /// A request its client abandoned before it broke any SLO ended in slot `epoch`.
    pub(super) fn cancelled(&mut self, epoch: u64) {
        self.cancelled_total += 1;
        self.slot(epoch).cancelled += 1;
    }

    /// A request judged `verdict` finished in slot `epoch` with `tokens` output tokens.
    pub(super) fn add(&mut self, epoch: u64, verdict: Verdict, tokens: u64) {
        self.totals[verdict.index()] += 1;
        let slot = self.slot(epoch);
        slot.judged += 1;
        if verdict == Verdict::Good {
            slot.good += 1;
            slot.good_tokens = slot.good_tokens.saturating_add(tokens);
        } else {
            slot.broken[verdict.index() - 1] += 1;
        }
    }

    /// Forgets the window's judgements (the totals since start stay).
    pub(super) fn clear(&mut self) {
        for s in &mut self.slots {
            s.epoch = u64::MAX;
        }
    }

    /// The judgements of the slots `inside` keeps.
    pub(super) fn window(&self, inside: impl Fn(u64) -> bool) -> Window {
        self.slots
            .iter()
            .filter(|s| inside(s.epoch))
            .fold(Window::default(), |w, s| Window {
                judged: w.judged + s.judged,
                good: w.good + s.good,
                good_tokens: w.good_tokens.saturating_add(s.good_tokens),
                cancelled: w.cancelled + s.cancelled,
                broken: std::array::from_fn(|i| w.broken[i] + s.broken[i]),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ttft_ms: Option<f64>, tpot_ms: Option<f64>, e2e_ms: f64) -> Judged {
        Judged {
            outcome: Outcome::Ok,
            ttft_ms,
            tpot_ms,
            e2e_ms,
        }
    }

    #[test]
    fn every_slo_set_must_hold_and_the_first_broken_is_named() {
        let t = Targets {
            ttft_ms: Some(200.0),
            tpot_ms: Some(30.0),
            e2e_ms: Some(5000.0),
        };
        let good = Some(Verdict::Good);
        assert_eq!(t.judge(&ok(Some(200.0), Some(30.0), 5000.0)), good);
        assert_eq!(
            t.judge(&ok(Some(201.0), Some(31.0), 9e3)),
            Some(Verdict::Ttft)
        );
        assert_eq!(
            t.judge(&ok(Some(100.0), Some(31.0), 9e3)),
            Some(Verdict::Tpot)
        );
        assert_eq!(
            t.judge(&ok(Some(100.0), Some(20.0), 9e3)),
            Some(Verdict::E2e)
        );
        // One token: no TPOT, which holds (vLLM counts it 0).
        assert_eq!(t.judge(&ok(Some(100.0), None, 100.0)), good);
        // Not streamed: its first token came with the end.
        assert_eq!(t.judge(&ok(None, None, 300.0)), Some(Verdict::Ttft));
        for outcome in Outcome::ALL
            .into_iter()
            .filter(|o| !matches!(o, Outcome::Ok | Outcome::Aborted))
        {
            let r = Judged {
                outcome,
                ..ok(Some(1.0), Some(1.0), 1.0)
            };
            assert_eq!(t.judge(&r), Some(Verdict::Error), "{outcome:?}");
        }
        let only_tpot = Targets {
            tpot_ms: Some(30.0),
            ..Targets::default()
        };
        assert_eq!(only_tpot.judge(&ok(None, Some(29.0), 1e9)), good);
        assert!(!Targets::default().any());
    }

    /// A request its client abandoned is judged by what it had broken when the client
    /// left, and otherwise not at all.
    #[test]
    fn an_abandoned_request_is_judged_by_what_it_had_broken() {
        let t = Targets {
            ttft_ms: Some(500.0),
            tpot_ms: Some(30.0),
            e2e_ms: Some(5000.0),
        };
        let left = |ttft_ms, tpot_ms, e2e_ms| Judged {
            outcome: Outcome::Aborted,
            ..ok(ttft_ms, tpot_ms, e2e_ms)
        };
        // Within every SLO so far: not judged.
        assert_eq!(t.judge(&left(Some(40.0), Some(26.0), 900.0)), None);
        assert_eq!(t.judge(&left(None, None, 300.0)), None);
        assert_eq!(t.judge(&left(Some(40.0), None, 41.0)), None);
        // Its first token late, or none yet past the TTFT SLO.
        assert_eq!(
            t.judge(&left(Some(600.0), Some(26.0), 900.0)),
            Some(Verdict::Ttft)
        );
        assert_eq!(t.judge(&left(None, None, 501.0)), Some(Verdict::Ttft));
        // Its gaps so far past the TPOT SLO; its time past the e2e SLO.
        assert_eq!(
            t.judge(&left(Some(40.0), Some(31.0), 900.0)),
            Some(Verdict::Tpot)
        );
        assert_eq!(
            t.judge(&left(Some(40.0), Some(26.0), 5001.0)),
            Some(Verdict::E2e)
        );
    }

    #[test]
    fn the_ring_forgets_old_slots() {
        const SLOTS: u64 = 20;
        let mut r = Ring::<{ SLOTS as usize }>::new();
        r.add(3, Verdict::Good, 10);
        r.add(3, Verdict::Tpot, 10);
        r.add(4, Verdict::Good, 7);
        let w = r.window(|e| e >= 4 && e != u64::MAX);
        assert_eq!((w.judged, w.good, w.good_tokens), (1, 1, 7));
        // Slot 3 + SLOTS reuses slot 3's place.
        r.add(3 + SLOTS, Verdict::Error, 0);
        let w = r.window(|e| e != u64::MAX);
        assert_eq!((w.judged, w.good), (2, 1));
        assert_eq!(r.totals, [2, 0, 1, 0, 1]);
    }
}
