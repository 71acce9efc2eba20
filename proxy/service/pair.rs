//! A primary request's link to its mirrors' copies, kept in its context until it ends:
//! where each copy and the primary make their pair for `/compare`, and the signal that cuts
//! the copies that go with their client. The copies themselves are sent by the exchange
//! (`exchange::mirror`); the context holds only this link, so it points one way.

use std::sync::Arc;

use tokio::sync::watch;

use crate::compare::paired::{Meeting, Side};
use crate::meter::{Outcome, Summary};
use crate::state::Shadow;

/// What a primary request keeps of its copies: where each pair is made, and the signal
/// that cuts the copies that go with their client.
pub(in crate::service) struct Link {
    pub(in crate::service) meetings: Vec<(Arc<Meeting>, Arc<Shadow>)>,
    pub(in crate::service) cancel: Option<watch::Sender<bool>>,
}

// === impl Link ===

impl Link {
    /// The primary ended with `outcome`, its record saying `summary`: a client that left
    /// cuts the copies that go with it, and each copy that has finished makes its pair.
    pub(in crate::service) fn primary_done(
        self,
        now: crate::meter::Nanos,
        outcome: Outcome,
        summary: Option<Summary>,
    ) {
        if outcome == Outcome::Aborted {
            if let Some(cancel) = &self.cancel {
                let _ = cancel.send(true);
            }
        }
        let Some(summary) = summary else { return };
        let side = side_of(&summary, outcome == Outcome::Ok);
        for (meeting, shadow) in self.meetings {
            if let Some(pair) = meeting.arrive(now, false, side) {
                shadow.pairs.push(pair);
            }
        }
    }
}

/// One side of a pair, as the request's record `s` says it ended (`ok`: it finished well).
pub(in crate::service) fn side_of(s: &Summary, ok: bool) -> Side {
    Side {
        ttft_ms: s.sent_ttft_ms,
        tpot_ms: s.tpot_ms,
        e2e_ms: s.sent_to_last_ms,
        output_tokens: s.output_tokens,
        concurrency: s.concurrency,
        ok,
    }
}
