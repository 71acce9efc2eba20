//! The request's flow: the one path every request takes (but upgrades), on tokio's sockets
//! and pingora's runtime. A metered generation request, queued or not, with a
//! `Content-Length` or a chunked body, from an HTTP/1.0 or 1.1 client, goes through the
//! same code as a model list or a health check; only metering and the concurrency cap
//! depend on what the request is.
//!
//! [`Front`](super::front::Front) hands over a request whose head passed the checks and
//! whose body was read ahead (up to 64 KiB). Here it is routed and admitted
//! ([`admission`]: a free slot, else the FIFO queue, watching for the client to leave, else
//! 429), and sent ([`upstream`]: the client's head minus its hop-by-hop fields, with the
//! upstream's `Host` and the body's framing tokentap chose, so framing cannot be smuggled).
//! The response head is read and written for the client (its hop-by-hop fields removed,
//! `Date` and `Connection` set), and the body relayed ([`relay`]): each fragment written
//! from the worker thread's scratch buffer and then handed to the tap. An open stream holds
//! no buffer of its own except bytes a slow client has not taken yet.
//!
//! A request goes through [`TokenTap::exchange`] in phases, each holding only what it needs
//! while it waits: `prepare` (routing, admission, tokentap's own answers, the upstream
//! request's bytes; boxed, freed before anything is awaited from the upstream), `deliver`
//! (connecting and sending; boxed, freed once sent), `receive` (the response head, read in
//! the scratch buffer) and `relay`. What a phase holds through a wait that thousands of
//! streams share when they open at once is left behind as holes in the allocator once it
//! is freed, so those phases are kept small (docs/performance-history.md).
//!
//! This layer reads and writes only through [`http1`](super::http1), and meters only
//! through the [`tap`](super::tap).

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use pingora::prelude::*;
use pingora::ErrorSource;

use super::ctx::Ctx;
use super::failure::{self, Failure};
use super::http1::answer::{self, error_body, json_response};
use super::http1::conn::Io;
use super::http1::io::watching;
use super::http1::request::{self, Ahead, Checked, ClientError, Rest};
use super::record::{self, model_of, RequestId, Seen, REQUEST_ID_HEADER};
use super::{TokenTap, UPSTREAM_HEADER};
use crate::dialect::Dialect;
use crate::estimate::Estimate;
use crate::limit::Rejected;
use crate::meter::Nanos;
use crate::pool::{Keyed, Unplaced};
use crate::routing::Choice;
use admission::{over_budget, reject, route};
use relay::{health_after_body, Relay};
use upstream::{needs_whole, send_rest, Outgoing, WHOLE_BODY_BYTES};

mod admission;
mod mirror;
mod relay;
mod upstream;

/// A request [`Front`](super::front::Front) read and checked, its body read ahead. Passed
/// boxed: an async fn keeps room for its arguments for its whole life, and the request
/// header is done with once it is sent.
pub(super) struct Incoming {
    pub(super) checked: Checked,
    pub(super) ahead: Ahead,
    /// When its head had arrived.
    pub(super) t0: Nanos,
    /// The client's address.
    pub(super) peer: Option<std::net::SocketAddr>,
}

/// What the connection can do after a direct request.
pub(super) enum After {
    /// Serve the next request on it.
    KeepAlive,
    Close,
    /// Close after a lingering read: the client sent bytes past its request.
    Linger,
}

/// A request routed and admitted, its bytes for the upstream made: to connect and send.
struct Ready {
    /// The request head with the body read so far, as the upstream gets them.
    wire: upstream::Wire,
    /// The rest of the body, still to read from the client.
    rest: Rest,
    sent_so_far: u64,
    watch: bool,
    leftover: BytesMut,
    client_side: ClientSide,
}

/// A request sent upstream, whose response header is awaited.
struct Sent {
    up: Io,
    /// The client is watched for going away (until it sends a pipelined request).
    watch: bool,
    /// Bytes the client sent past its request.
    leftover: BytesMut,
    client_side: ClientSide,
}

/// What shapes the client's head besides the response's: the request's side.
#[derive(Clone, Copy)]
struct ClientSide {
    keep_alive: bool,
    http10: bool,
    head_request: bool,
}

impl ClientSide {
    /// A mirror's copy: no client, nothing kept.
    const NONE: ClientSide = ClientSide {
        keep_alive: false,
        http10: false,
        head_request: false,
    };
}

/// A request whose response header is on its way to the client and whose body is next.
struct Open {
    up: Io,
    relay: Relay,
    /// Bytes for the client not written yet (the response header first).
    out: BytesMut,
    /// The client is watched for going away (until it sends a pipelined request).
    watch: bool,
    /// Bytes the client sent past its request.
    leftover: BytesMut,
    keep_alive: bool,
}

/// A request ready to send, with its upstream and whether its body was read whole; or
/// answered already, with the connection's fate and the failure if one.
enum Prepared {
    Ready(Ready, Choice, bool),
    Done(After, Option<Box<Failure>>),
}

/// How an exchange ended: done, with the connection's fate and the failure if one; or
/// failed before any byte reached the client (its upstream, the error, whether its body
/// was read whole), for the caller to answer.
/// (The failure boxed: it is rare, and what `serve` awaits keeps room for its answer.)
enum Exchanged {
    Done(After, Option<Box<Failure>>),
    Unanswered(Choice, Box<Error>, bool),
}

/// What becomes of the client connection after a request that ended with `result`.
fn ended(result: Result<After>, read_whole: bool) -> After {
    match result {
        Ok(after) => after,
        // A refused body (malformed, too large, too slow) may have more bytes coming.
        Err(e) if e.esource() == &ErrorSource::Downstream && !read_whole => After::Linger,
        Err(_) => After::Close,
    }
}

// === impl TokenTap ===

impl TokenTap {
    /// Routes, admits and proxies a request; its outcome is recorded however it ends, and
    /// logged (a failure line, the access log).
    pub(super) async fn serve(
        &self,
        client: &mut Io,
        incoming: Box<Incoming>,
        shutdown: bool,
    ) -> After {
        // Its time is the head's arrival, read once when the head was (not read again).
        let mut ctx = Ctx::new(self.live.load(), incoming.t0);
        let req = &incoming.checked.req;
        ctx.request_id = RequestId::of(&req.fields);
        if self.live.access.on() {
            ctx.seen = Some(Box::new(Seen {
                method: req.method.clone(),
                path: req.uri.path().to_owned(),
                client: incoming.peer,
                model: model_of(&incoming.ahead.bytes),
                ..Seen::default()
            }));
        }
        // Boxed in a statement of its own, as each boxed future here: one built in the
        // statement that awaits it keeps its room in this future's own state (rustc keeps
        // a statement's temporaries to its end), copied in and out for nothing: `serve`
        // was 14,488 bytes so.
        let exchange = Box::pin(self.exchange(client, &mut ctx, incoming, shutdown));
        let (after, failure) = match exchange.await {
            Exchanged::Done(after, failure) => (after, failure),
            Exchanged::Unanswered(choice, e, read_whole) => {
                let fail = Box::pin(self.fail_unanswered(client, &mut ctx, choice, e, read_whole));
                fail.await
            }
        };
        let upstream = ctx
            .choice
            .map(|c| ctx.shared.upstreams[c.upstream].config.name.as_str());
        if let (Some(f), Some(upstream)) = (&failure, upstream) {
            let endpoint = ctx.endpoint_url();
            record::log_failure(&self.live.throttle, &ctx.request_id, upstream, endpoint, f);
        }
        if ctx.seen.is_some() {
            self.log_access(&ctx, failure.as_deref());
        }
        after
    }

    /// [`TokenTap::serve`] but for the logging and a failure before any byte reached the
    /// client: the connection's fate, and why the request failed if it did.
    async fn exchange(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        incoming: Box<Incoming>,
        shutdown: bool,
    ) -> Exchanged {
        // Boxed, and gone before anything is awaited from the upstream: routing, admission
        // and making the upstream request hold the request head and answers tokentap may
        // make itself (~1.5 KiB), which a request waiting for its connection or response
        // does not need. Freed at once, that room is taken again by the next request's;
        // held through the wait (a connect retried after a full accept queue, the time to
        // first token: a second when thousands of streams open at once), it would be left
        // behind as holes among the open streams' memory.
        //
        // What each step hands the next lives in a block of its own, and a failure is
        // answered by the caller: a local live across more than one await keeps its room
        // in this future while the body streams, moved out or not (the exchange was 1,168
        // bytes an open stream, the prepared request and the opened response kept beside
        // the relay; 696 so).
        let prepare = Box::pin(self.prepare(client, ctx, incoming, shutdown));
        let (choice, read_whole, deliver) = {
            let (ready, choice, read_whole) = match prepare.await {
                Prepared::Ready(ready, choice, read_whole) => (ready, choice, read_whole),
                Prepared::Done(after, failure) => return Exchanged::Done(after, failure),
            };
            // Boxed too (connecting is a large future, needed only until it is sent).
            let deliver = Box::pin(self.deliver(client, ctx, choice, ready));
            (choice, read_whole, deliver)
        };
        let mut open = {
            let opened = match deliver.await {
                Ok(sent) => self.receive(ctx, Some(client), choice, sent).await,
                Err(e) => Err(e),
            };
            match opened {
                Ok(open) => open,
                Err(e) => return Exchanged::Unanswered(choice, e, read_whole),
            }
        };
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let read_timeout = Some(upstream.config.read_timeout);
        let relayed = self.relay(Some(client), ctx, &mut open, read_timeout).await;
        let failure = relayed
            .as_ref()
            .err()
            .map(|e| Box::new(failure::of(e, &upstream.config.name)));
        let linger = !open.watch || !open.leftover.is_empty();
        let keep_alive = open.keep_alive;
        let body = relayed.as_ref().map(|_| ()).map_err(|e| &**e);
        // One clock read for the request's end: its pool connection, meter and slot.
        let end = self.now();
        self.body_ended(ctx, choice, open, body, end);
        let result = relayed.map(|()| {
            if linger {
                After::Linger
            } else if keep_alive {
                After::KeepAlive
            } else {
                After::Close
            }
        });
        self.finish_at(ctx, result.as_ref().err().map(|e| &**e), end);
        Exchanged::Done(ended(result, read_whole), failure)
    }

    /// A response's body ended, as `body` says (the primary's or a copy's): its endpoint's
    /// passive health, and a clean connection back to its pool.
    fn body_ended(
        &self,
        ctx: &Ctx,
        choice: Choice,
        open: Open,
        body: Result<(), &Error>,
        now: Nanos,
    ) {
        let Some(held) = &ctx.endpoint else { return };
        let upstream = &ctx.shared.upstreams[choice.upstream];
        let read_timeout = upstream.config.read_timeout;
        let ok = body.is_ok();
        health_after_body(
            &upstream.pool,
            &held.endpoint,
            ctx.status,
            body,
            read_timeout,
        );
        if ok && open.relay.reusable {
            let now = self.live.clock().instant(now);
            self.release(open.up, &held.endpoint, upstream.config.idle_timeout, now);
        }
    }

    /// Routes and admits the request and sends it upstream; or answers it (no route,
    /// rejected, failed before any byte reached the client) and says what becomes of the
    /// connection.
    async fn prepare(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        incoming: Box<Incoming>,
        shutdown: bool,
    ) -> Prepared {
        let Incoming {
            checked,
            mut ahead,
            t0,
            ..
        } = *incoming;
        let Checked {
            req, body: kind, ..
        } = checked;
        let shared = Arc::clone(&ctx.shared);
        let limits = shared.config.limits;
        // Routed and told generation from the path as the backend will read it (decoded,
        // `//` and dot segments resolved), not as sent: else a tenant past its budget could
        // send `/v1/chat/%63ompletions` unmetered and uncapped.
        let path = crate::routing::path::canonical(req.uri.path());
        if req.method == http::Method::POST {
            ctx.dialect = Dialect::from_path(&path);
        }
        let routed = route(&shared, &req, &path);
        drop(path);
        // Which mirrors copy it, drawn once (generation requests only).
        let metered = routed.filter(|_| ctx.dialect.is_some());
        let plan = metered.map_or(0, |c| mirror::plan(&shared, c, &req));
        // Usage asked for and a mirror's copy need the body whole: a long prompt's rest is
        // read before it is sent (the upstream would read it all before its first token).
        if routed.is_some_and(|c| needs_whole(&shared, c, ctx.dialect, plan)) {
            let read = request::read_whole(client, &mut ahead, WHOLE_BODY_BYTES, &limits);
            match read.await {
                Ok(true) => {}
                Ok(false) => return Prepared::Done(After::Close, None),
                Err(mistake) => {
                    ctx.status = mistake.status();
                    let cwt = limits.client_write_timeout;
                    ctx.bytes_out += answer::refuse(client, mistake, cwt).await;
                    return Prepared::Done(After::Linger, None);
                }
            }
        }
        let Ahead {
            bytes,
            rest,
            mut leftover,
            room,
        } = ahead;
        let read_whole = matches!(rest, Rest::Done);
        // Shared, not copied, with a mirror's copies.
        let bytes = Ahead::into_bytes(bytes, room);
        let keep_alive = !shutdown && req.http11 && !req.fields.has_token("connection", "close");
        // An answer tokentap makes itself keeps the connection only when the request was
        // read whole and nothing came after it; the answer's `Connection`, and what follows.
        let answered = |leftover: &BytesMut, watch: bool| {
            let keep = keep_alive && read_whole && leftover.is_empty() && watch;
            let after = if keep {
                After::KeepAlive
            } else if !read_whole || !leftover.is_empty() {
                After::Linger // unread body bytes, or a pipelined request
            } else {
                After::Close
            };
            (keep, after)
        };
        ctx.t0 = t0;
        let Some(choice) = routed else {
            let body = error_body(
                "tokentap: no route matches this request",
                "invalid_request_error",
                "no_route",
            );
            let (keep, after) = answered(&leftover, true);
            let id = [(REQUEST_ID_HEADER, ctx.request_id.as_str())];
            let out = json_response(404, &body, &id, keep);
            ctx.status = 404;
            ctx.bytes_out += answer::answer(client, &out, limits.client_write_timeout).await;
            return Prepared::Done(after, None);
        };
        ctx.choice = Some(choice);
        let upstream = &shared.upstreams[choice.upstream];
        ctx.tokenize = upstream.config.estimate == Estimate::Tokenizer;
        let pool = &upstream.pool;
        let no_endpoint = |leftover: &BytesMut, watch: bool| {
            pool.log_none(self.now());
            answered(leftover, watch)
        };
        if !pool.serving() {
            let (keep, after) = no_endpoint(&leftover, true);
            ctx.status = 503;
            ctx.bytes_out += unavailable(client, ctx, choice, keep).await;
            return Prepared::Done(after, None);
        }

        // Caps apply to generation requests only. A queued client whose body was read whole
        // is watched, and leaves the queue the moment it goes away; one still sending waits
        // unwatched (its body bytes are not read here), bounded by the queue timeout.
        let mut watch = true;
        if ctx.dialect.is_some() {
            // With `[tenants]`: who it is, and what it may spend of its tenant's budget.
            match admission::tenancy(&shared, &req, &bytes).await {
                Ok(tenancy) => ctx.who = tenancy,
                Err(refusal) => {
                    upstream.limiter.reject(Rejected::OutputTokenBudget);
                    let (keep, after) = answered(&leftover, true);
                    ctx.status = 429;
                    ctx.bytes_out += over_budget(client, ctx, choice, refusal, keep).await;
                    return Prepared::Done(after, None);
                }
            }
            let tenancy = ctx.who.take();
            let who = tenancy.as_ref().map(|t| &t.who);
            let (granted, queued) = admission::slot(
                upstream,
                ctx.t0,
                who,
                client,
                &mut watch,
                &mut leftover,
                read_whole,
            )
            .await;
            ctx.who = tenancy;
            let queue_ms = queued.as_secs_f64() * 1e3;
            if let Some(seen) = ctx.seen.as_mut() {
                seen.queue_ms = queue_ms;
            }
            if let Some(t) = ctx.who.as_mut() {
                t.queue_ms = queue_ms;
            }
            match granted {
                Ok(Ok(permit)) => ctx.permit = Some(permit),
                Ok(Err(_)) if !pool.serving() => {
                    // It waited for endpoints that all went away.
                    admission::refused(ctx, None);
                    let (keep, after) = no_endpoint(&leftover, watch);
                    ctx.status = 503;
                    ctx.bytes_out += unavailable(client, ctx, choice, keep).await;
                    return Prepared::Done(after, None);
                }
                Ok(Err(why)) => {
                    admission::refused(ctx, Some(why));
                    let (keep, after) = answered(&leftover, watch);
                    ctx.status = 429;
                    ctx.bytes_out += reject(client, ctx, choice, why, keep).await;
                    return Prepared::Done(after, None);
                }
                Err(gone) => {
                    self.finish(ctx, Some(&gone));
                    let failure = failure::of(&gone, &upstream.config.name);
                    return Prepared::Done(After::Close, Some(Box::new(failure)));
                }
            }
        }

        let keyed = pool.keyed_by();
        let key = match &keyed {
            Keyed::Header(h) => req.fields.get(h.as_str()),
            Keyed::Prompt if ctx.dialect.is_some() => crate::prefix::prompt_start(&bytes),
            Keyed::Prompt | Keyed::Nothing => None,
        };
        if let (Keyed::Prompt, Some(prompt)) = (keyed, key) {
            pool.place(self.now(), prompt).await;
        }
        let wait = upstream.config.queue_timeout;
        match pool
            .pick_within(ctx.dialect.is_some(), key, &[], wait)
            .await
        {
            Ok(held) => ctx.endpoint = Some(pool.lease(held, key).await),
            Err(Unplaced::NoEndpoint) => {
                let (keep, after) = no_endpoint(&leftover, watch);
                ctx.status = 503;
                ctx.bytes_out += unavailable(client, ctx, choice, keep).await;
                ctx.permit = None;
                return Prepared::Done(after, None);
            }
            Err(Unplaced::Full) => {
                // Admitted by the pool, yet every endpoint stayed at its cap (a cap lowered
                // a moment ago) for the queue's timeout.
                let (keep, after) = answered(&leftover, watch);
                ctx.status = 429;
                ctx.permit = None;
                ctx.bytes_out += reject(client, ctx, choice, Rejected::QueueTimeout, keep).await;
                return Prepared::Done(after, None);
            }
        }
        // Admitted and placed: on a rollout's route, the share it actually serves counts it.
        if let Some(rollout) = shared.rollouts.of(choice.route) {
            rollout.sent(choice.upstream);
        }
        self.mirror(ctx, choice, &req, read_whole.then_some(&bytes), plan);
        let outgoing = Outgoing {
            req,
            kind,
            body: bytes,
            rest,
        };
        match self.ready(ctx, choice, outgoing, leftover, watch, shutdown) {
            Ok(ready) => Prepared::Ready(ready, choice, read_whole),
            Err(e) => {
                let (after, failure) = self
                    .fail_unanswered(client, ctx, choice, e, read_whole)
                    .await;
                Prepared::Done(after, failure)
            }
        }
    }

    /// Answers a request that failed before any byte reached the client, and records it.
    async fn fail_unanswered(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        choice: Choice,
        e: Box<Error>,
        read_whole: bool,
    ) -> (After, Option<Box<Failure>>) {
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let limits = shared.config.limits;
        let mut failure = None;
        let cwt = limits.client_write_timeout;
        if let Some(mistake) = e.root_cause().downcast_ref::<ClientError>() {
            // A client's mistake is answered as such; it is not a failure.
            ctx.status = mistake.status();
            ctx.bytes_out += answer::refuse(client, *mistake, cwt).await;
        } else {
            let f = failure::of(&e, &upstream.config.name);
            if !f.client {
                ctx.status = f.status;
                ctx.bytes_out += answer_failure(client, ctx, choice, &f, cwt).await;
            } // else gone: nobody to answer
            failure = Some(Box::new(f));
        }
        self.finish(ctx, Some(&e));
        (ended(Err(e), read_whole), failure)
    }

    /// The connection, the request written, the rest of its body streamed. Nothing reaches
    /// the client here (an error is answered); after the response header, an error cuts the
    /// connection, as pingora-proxy does.
    async fn deliver(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        choice: Choice,
        ready: Ready,
    ) -> Result<Sent> {
        let Ready {
            wire,
            rest,
            sent_so_far,
            mut watch,
            mut leftover,
            client_side,
        } = ready;
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let read_whole = matches!(rest, Rest::Done);
        let write_timeout = Some(upstream.config.write_timeout);
        // Boxed, in a statement of its own: named and awaited inline, it took its room
        // twice in this future's state (3,760 bytes each).
        let mut send = Box::pin(self.connect_and_write(upstream, ctx, wire));
        let up = if read_whole {
            watching(client, &mut watch, &mut leftover, send.as_mut()).await?
        } else {
            let mut up = send.await?;
            let limits = shared.config.limits;
            let streamed = Box::pin(send_rest(
                client,
                &mut up,
                rest,
                &mut leftover,
                write_timeout,
                sent_so_far,
                limits,
            ));
            streamed.await?;
            up
        };
        Ok(Sent {
            up,
            watch,
            leftover,
            client_side,
        })
    }
}

/// Answers a request the upstream failed before its response began: the status and an
/// OpenAI-style body naming the cause, with the upstream's name; closes. The bytes written.
async fn answer_failure(
    client: &mut Io,
    ctx: &Ctx,
    choice: Choice,
    f: &Failure,
    limit: Duration,
) -> u64 {
    let kind = if f.status == 500 {
        "server_error"
    } else {
        "upstream_error"
    };
    let body = error_body(&format!("tokentap: {}", f.message), kind, f.code);
    let name = &ctx.shared.upstreams[choice.upstream].config.name;
    let extra = [
        (UPSTREAM_HEADER, name.as_str()),
        (REQUEST_ID_HEADER, ctx.request_id.as_str()),
    ];
    let out = json_response(f.status, &body, &extra, false);
    answer::answer(client, &out, limit).await
}

/// Answers 503 `no_healthy_endpoint`: no endpoint of the upstream's pool takes requests.
/// The bytes written.
async fn unavailable(client: &mut Io, ctx: &Ctx, choice: Choice, keep_alive: bool) -> u64 {
    let shared = &ctx.shared;
    let name = &shared.upstreams[choice.upstream].config.name;
    let message = format!("tokentap: upstream {name} has no healthy endpoint");
    let body = error_body(&message, "upstream_error", "no_healthy_endpoint");
    let pool = &shared.upstreams[choice.upstream].pool;
    let retry = pool.retry_after(shared.clock.now()).as_secs().to_string();
    let extra = [
        ("Retry-After", retry.as_str()),
        (UPSTREAM_HEADER, name.as_str()),
        (REQUEST_ID_HEADER, ctx.request_id.as_str()),
    ];
    let out = json_response(503, &body, &extra, keep_alive);
    answer::answer(client, &out, shared.config.limits.client_write_timeout).await
}

/// A client's mistake found mid-request, as the error that ends it.
fn client_error(e: ClientError) -> Box<Error> {
    Error::because(HTTPStatus(e.status()), "request body", e).into_down()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What becomes of the client connection after each kind of end.
    #[test]
    fn the_connection_after_each_kind_of_end() {
        let down = || Error::explain(ConnectionClosed, "client").into_down();
        let up = || Error::explain(ReadError, "upstream").into_up();
        let is = |a: After, b: After| std::mem::discriminant(&a) == std::mem::discriminant(&b);
        for (result, read_whole, want) in [
            (Ok(After::KeepAlive), true, After::KeepAlive),
            (Ok(After::Close), true, After::Close),
            (Ok(After::Linger), true, After::Linger),
            // A refused body may have more bytes coming: read them away before closing.
            (Err(down()), false, After::Linger),
            (Err(down()), true, After::Close),
            (Err(up()), false, After::Close),
            (Err(up()), true, After::Close),
        ] {
            let what = format!(
                "{:?}",
                result.as_ref().map(|_| ()).map_err(|e| e.esource().clone())
            );
            assert!(
                is(ended(result, read_whole), want),
                "{what} read_whole={read_whole}"
            );
        }
    }
}
