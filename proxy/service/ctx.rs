//! A request's own state (its context), from its head to its end, on either path: the
//! state it started on, its route and slot, its metering, its id and what the access log
//! needs. Grouped here so that each phase takes what it needs from one place.

use std::sync::Arc;

use crate::dialect::{Dialect, Facts};
use crate::limit::fleet::Slot;
use crate::meter::{Nanos, Outcome, Stream};
use crate::ndjson::NdjsonParser;
use crate::pool::Held;
use crate::routing::Choice;
use crate::sse::SseParser;
use crate::state::Shared;
use crate::usage::UsageStripper;

use super::record::{RequestId, Seen, REQUEST_ID_HEADER};
use super::UPSTREAM_HEADER;

/// Per-request state.
pub struct Ctx {
    /// The state the request started on, kept until it ends (a reload swaps in another).
    pub(super) shared: Arc<Shared>,
    pub(super) t0: Nanos,
    pub(super) dialect: Option<Dialect>,
    pub(super) choice: Option<Choice>,
    /// The metered request: in flight until finished (or dropped, which finishes it).
    pub(super) stream: Option<Stream>,
    /// The endpoint of the pool it went to, and its slot there; freed before `permit`
    /// (declared first: dropped first), so a slot of the pool always finds an endpoint's.
    pub(super) endpoint: Option<Held>,
    /// The concurrency slot, held until the request ends however it ends.
    pub(super) permit: Option<Slot>,
    /// Removes the usage-only chunk from the response (the client did not ask for it).
    /// Boxed, as `who`: most requests have neither, and every open stream keeps its `Ctx`.
    pub(super) strip_usage: Option<Box<UsageStripper>>,
    /// Estimate tokens with the tokenizer rather than one per event.
    pub(super) tokenize: bool,
    pub(super) body: Body,
    pub(super) facts: Facts,
    pub(super) unparsed: u64,
    pub(super) status: u16,
    pub(super) request_id: RequestId,
    /// Bytes written to the client.
    pub(super) bytes_out: u64,
    /// How the request ended, once it has.
    pub(super) outcome: Option<Outcome>,
    /// What the access log needs besides, when it is on.
    pub(super) seen: Option<Box<Seen>>,
    /// Its copies to mirrors (shadow traffic), when the route sent any.
    pub(super) mirror: Option<Box<super::pair::Link>>,
    /// Who it is, with `[tenants]`, and its reservation of its tenant's budget.
    pub(super) who: Option<Box<Tenancy>>,
}

/// A request's tenant, with `[tenants]`.
pub(super) struct Tenancy {
    pub(super) who: crate::tenant::Who,
    pub(super) reservation: Option<crate::tenant::budget::Reservation>,
    /// Its wait for a slot, ms.
    pub(super) queue_ms: f64,
}

/// How the response body is read for metering.
pub(super) enum Body {
    /// Not metered (not generation traffic, an error status, an encoded body…), or a
    /// whole non-streamed reply already read where it came (`TokenTap::fragment_one`).
    Ignore,
    Sse(SseParser),
    Ndjson(NdjsonParser),
    /// A non-streaming JSON response that came in more than one fragment, copied (bounded)
    /// to read its `usage` at the end.
    Json(Vec<u8>),
}

// === impl Ctx ===

impl Ctx {
    /// A request's context, begun at `t0` on the state in force.
    pub(super) fn new(shared: Arc<Shared>, t0: Nanos) -> Ctx {
        Ctx {
            shared,
            t0,
            dialect: None,
            choice: None,
            stream: None,
            endpoint: None,
            permit: None,
            strip_usage: None,
            tokenize: false,
            body: Body::Ignore,
            facts: Facts::default(),
            unparsed: 0,
            status: 0,
            request_id: RequestId::default(),
            bytes_out: 0,
            outcome: None,
            seen: None,
            mirror: None,
            who: None,
        }
    }

    /// The address of the endpoint it went to, if it got one.
    pub(super) fn endpoint_url(&self) -> Option<&str> {
        self.endpoint.as_ref().map(|h| h.endpoint.at.url.as_str())
    }

    /// The fields tokentap adds to a response: the upstream's name, and the request id
    /// unless the upstream sent its own (`has_id`), which is its to keep.
    pub(super) fn added_fields(&self, has_id: bool) -> [Option<(&'static str, &str)>; 2] {
        let upstream = self.choice.map(|c| {
            (
                UPSTREAM_HEADER,
                self.shared.upstreams[c.upstream].config.name.as_str(),
            )
        });
        let id = self.request_id.as_str();
        let id = (!id.is_empty() && !has_id).then_some((REQUEST_ID_HEADER, id));
        [upstream, id]
    }
}
