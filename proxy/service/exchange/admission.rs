//! Routing and admission: the upstream a request goes to, and for a generation request its
//! tenant's budget (with `[tenants]`) and a concurrency slot — a free one, else a place in
//! the upstream's queue (the client watched, and gone the moment it leaves), then with
//! `[cluster]` the fleet's lease — or a 429 that says when to try again.

use std::pin::pin;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use pingora::prelude::*;

use super::Ctx;
use crate::limit::fleet::Slot;
use crate::limit::{Permit, Rejected};
use crate::meter::Nanos;
use crate::routing::Choice;
use crate::service::ctx::Tenancy;
use crate::service::http1::answer::{self, error_body, json_response};
use crate::service::http1::conn::Io;
use crate::service::http1::head::RequestHead;
use crate::service::http1::io::watching;
use crate::service::record::REQUEST_ID_HEADER;
use crate::service::TokenTap;
use crate::service::UPSTREAM_HEADER;
use crate::state::{Shared, Upstream};
use crate::tenant::book::Cause;
use crate::tenant::budget::Refusal;
use crate::tenant::Who;

/// The upstream of a request to `path` (as the backend reads it), if a route matches.
pub(super) fn route(shared: &Shared, req: &RequestHead, path: &str) -> Option<Choice> {
    let upstreams = &shared.upstreams;
    shared
        .router
        .choose(path, &req.fields, |u| upstreams[u].has_headroom())
}

/// Answers 429 with `Retry-After` and an OpenAI-style error body; the bytes written.
pub(super) async fn reject(
    client: &mut Io,
    ctx: &Ctx,
    choice: Choice,
    why: Rejected,
    keep_alive: bool,
) -> u64 {
    let shared = &ctx.shared;
    let upstream = &shared.upstreams[choice.upstream];
    let name = &upstream.config.name;
    let limit = upstream
        .limiter
        .limit()
        .map_or("-".to_owned(), |l| l.to_string());
    let message = match why {
        Rejected::QueueFull => format!(
            "tokentap: upstream {name} is at its concurrency limit ({limit}) and its queue is full"
        ),
        Rejected::QueueTimeout => {
            format!("tokentap: no slot on upstream {name} (limit {limit}) within the queue timeout")
        }
        Rejected::PredictedWait => format!(
            "tokentap: no slot on upstream {name} (limit {limit}) is expected within the queue timeout"
        ),
        Rejected::OutputTokenBudget => {
            "tokentap: this tenant's output-token budget is spent".to_owned()
        }
    };
    let body = error_body(&message, "rate_limit_exceeded", why.label());
    // The predicted wait for a slot now, at least a second.
    let who = ctx.who.as_ref().map(|t| &t.who);
    let retry = (upstream.limiter)
        .retry_after(who.unwrap_or(&Who::default()))
        .as_secs_f64()
        .ceil()
        .to_string();
    let extra = [
        ("Retry-After", retry.as_str()),
        (UPSTREAM_HEADER, name.as_str()),
        (REQUEST_ID_HEADER, ctx.request_id.as_str()),
    ];
    let out = json_response(429, &body, &extra, keep_alive);
    let cwt = shared.config.limits.client_write_timeout;
    answer::answer(client, &out, cwt).await
}

/// With `[tenants]`: who a generation request is, and its reservation of its tenant's
/// budget; `Err`: over the budget (the refusal booked to the tenant).
pub(super) async fn tenancy(
    shared: &Shared,
    req: &RequestHead,
    body: &[u8],
) -> Result<Option<Box<Tenancy>>, Refusal> {
    if !shared.tenants.config().any() {
        return Ok(None);
    }
    let who = shared.tenants.who(|h| req.fields.get(h));
    // The body is scanned for its `max_tokens` only when a budget is to be reserved.
    let asked = who.budget.and_then(|_| crate::tenant::max_tokens(body));
    // Boxed: with `[cluster]` it is a Redis call, which would make every request's state
    // larger inline. Without a budget, or without the fleet, it is answered at once.
    let answer = match shared.budgets.reserve_now(&who, asked) {
        Some(answer) => answer,
        None => {
            let reserve = Box::pin(shared.budgets.reserve(&who, asked));
            reserve.await
        }
    };
    let reservation = match answer {
        Ok(reservation) => reservation,
        Err(refusal) => {
            shared
                .book
                .refused(&who.tenant, Instant::now(), Cause::Budget);
            return Err(refusal);
        }
    };
    Ok(Some(Box::new(Tenancy {
        who,
        reservation,
        queue_ms: 0.0,
    })))
}

/// Books a refusal (`why`; `None`: no endpoint) to the request's tenant, with `[tenants]`.
pub(super) fn refused(ctx: &Ctx, why: Option<Rejected>) {
    let Some(t) = ctx.who.as_ref() else { return };
    let cause = why.map_or(Cause::NoEndpoint, Cause::from);
    ctx.shared
        .book
        .refused(&t.who.tenant, Instant::now(), cause);
}

/// Answers 429 for a request over its tenant's output-token budget, with `Retry-After` and
/// OpenAI's `x-ratelimit-*-tokens` headers; the bytes written.
pub(super) async fn over_budget(
    client: &mut Io,
    ctx: &Ctx,
    choice: Choice,
    refusal: Refusal,
    keep_alive: bool,
) -> u64 {
    let shared = &ctx.shared;
    let name = &shared.upstreams[choice.upstream].config.name;
    let message = format!(
        "tokentap: this tenant's output-token budget ({} a minute) is spent; {} tokens left",
        refusal.limit, refusal.remaining
    );
    let body = error_body(&message, "rate_limit_exceeded", "output_token_budget");
    let (limit, remaining) = (refusal.limit.to_string(), refusal.remaining.to_string());
    let (reset, retry) = (refusal.reset_text(), refusal.retry_after_secs().to_string());
    let extra = [
        ("Retry-After", retry.as_str()),
        ("x-ratelimit-limit-tokens", limit.as_str()),
        ("x-ratelimit-remaining-tokens", remaining.as_str()),
        ("x-ratelimit-reset-tokens", reset.as_str()),
        (UPSTREAM_HEADER, name.as_str()),
        (REQUEST_ID_HEADER, ctx.request_id.as_str()),
    ];
    let out = json_response(429, &body, &extra, keep_alive);
    answer::answer(client, &out, shared.config.limits.client_write_timeout).await
}

/// A concurrency slot on `upstream` for a generation request of `who` (with `[tenants]`):
/// the local slot, then (with `[cluster]`) the fleet's, both within the queue's timeout;
/// `Ok(Err(why))` when refused.
/// A queued client whose body was read whole is watched (`watch`: whether it still is;
/// `leftover`: the bytes it sent past its request), and leaves the queue the moment it goes away
/// (`Err`); one still sending waits unwatched (its body bytes are not read here), bounded
/// by the queue timeout. `arrived_at`: when the request arrived, on the meter's clock.
/// With it, the time it waited in the queue (none when a slot was free at once).
pub(super) async fn slot(
    upstream: &Upstream,
    arrived_at: Nanos,
    who: Option<&Who>,
    client: &mut Io,
    watch: &mut bool,
    leftover: &mut BytesMut,
    read_whole: bool,
) -> (Result<Result<Slot, Rejected>>, Duration) {
    let limiter = &upstream.limiter;
    // Demand, whether it gets a slot now, later or never.
    TokenTap::arrived(upstream, arrived_at);
    let permit = match (
        limiter.try_acquire(who.unwrap_or(&Who::default())),
        &upstream.fleet,
    ) {
        // The common case: a slot at once, no queue, no clock read.
        (Some(permit), None) => return (Ok(Ok(Slot::local(permit))), Duration::ZERO),
        (permit, _) => permit,
    };
    let arrived = Instant::now();
    let slot = slot_after(
        upstream, who, permit, arrived, client, watch, leftover, read_whole,
    );
    (slot.await, arrived.elapsed())
}

/// [`slot`] past its common case: a fleet's slot, or a wait in the queue.
#[allow(clippy::too_many_arguments)]
async fn slot_after(
    upstream: &Upstream,
    who: Option<&Who>,
    permit: Option<Permit>,
    arrived: Instant,
    client: &mut Io,
    watch: &mut bool,
    leftover: &mut BytesMut,
    read_whole: bool,
) -> Result<Result<Slot, Rejected>> {
    let limiter = &upstream.limiter;
    let deadline = arrived + upstream.config.queue_timeout;
    // With tenants, the fleet's slots go fairly between them too.
    let fair = who.is_some().then_some(arrived);
    let anyone = Who::default();
    let who = who.unwrap_or(&anyone);
    // Boxed: taking a fleet slot (Redis calls) is a large future, and inline it would make
    // every request's state, streaming or not, ~5 KiB larger.
    let slot = |permit: Permit| async move {
        match &upstream.fleet {
            Some(fleet) => {
                let slot = Box::pin(fleet.slot(limiter, permit, deadline, fair));
                slot.await
            }
            None => Ok(Slot::local(permit)),
        }
    };
    match permit {
        Some(permit) if read_whole => {
            let acquire = pin!(async { Ok(slot(permit).await) });
            watching(client, watch, leftover, acquire).await
        }
        Some(permit) => Ok(slot(permit).await),
        None if read_whole => {
            let acquire = pin!(async {
                Ok(match limiter.acquire(who).await {
                    Ok(permit) => slot(permit).await,
                    Err(why) => Err(why),
                })
            });
            watching(client, watch, leftover, acquire).await
        }
        None => Ok(match limiter.acquire(who).await {
            Ok(permit) => slot(permit).await,
            Err(why) => Err(why),
        }),
    }
}

/// Routing reads the request's fields through [`crate::routing::Fields`].
impl crate::routing::Fields for crate::service::http1::head::Fields {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.get(name)
    }
}
