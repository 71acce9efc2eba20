//! The one path every request takes (but upgrades): tokentap's own HTTP/1.1 loop on
//! tokio's sockets (`conn`), on pingora's runtime. A metered generation request, queued or
//! not, with a `Content-Length` or a chunked body, from an HTTP/1.0 or 1.1 client, goes
//! through the same code as a model list or a health check; only metering and the
//! concurrency cap depend on what the request is.
//!
//! pingora-proxy runs every request as an upstream half and a downstream half that hand
//! each body fragment over a channel, through its cache, module and range machinery, in
//! request futures of ~20 KiB with a 64 KiB upstream body buffer per stream. Here one small
//! future reads each upstream fragment into the worker thread's scratch buffer, writes it to
//! the client straight from there and then meters it: an open stream holds no buffer of its
//! own except bytes a slow client has not taken yet (one read's worth: the upstream is not
//! read again until the client has taken them), and a chunked body is forwarded as it
//! came, its framing decoded in place.
//!
//! [`Front`](super::front::Front) hands over a request whose head passed
//! [`check`](super::request::check) and whose body was read ahead (up to 64 KiB). Here it
//! is routed, admitted (a free slot, else the FIFO queue, watching for the client to leave,
//! else 429), and sent: the client's head minus its hop-by-hop fields, with the upstream's
//! `Host` and the body's framing tokentap chose (the exact length of a body read whole;
//! the rest of a longer one streamed after it, re-chunked when it came chunked), so framing
//! cannot be smuggled. The response goes through the same filters, its hop-by-hop fields
//! removed, with `Date` and `Connection` set as pingora's server session sets them; an
//! HTTP/1.0 client gets a body ended by close instead of chunks. A client that takes no
//! bytes for `client_write_timeout` is cut.
//!
//! A request goes through [`TokenTap::exchange`] in phases, each holding only what it needs
//! while it waits: `prepare` (routing, admission, tokentap's own answers, the upstream
//! request's bytes; boxed, freed before anything is awaited from the upstream), `deliver`
//! (connecting and sending; boxed, freed once sent), `receive` (the response head, read in
//! the scratch buffer) and `relay`. What a phase holds through a wait that thousands of
//! streams share when they open at once is left behind as holes among the open streams'
//! memory once it is freed, so those phases are kept small.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::io::{self, Write as _};
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use pingora::prelude::*;
use pingora::protocols::http::date::get_cached_date;
use pingora::upstreams::peer::{HttpPeer, Peer};
use pingora::ErrorSource;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{timeout, Instant};

use super::conn::Io;
use super::failure::{self, Failure};
use super::h1::{self, Chunked, Framing, Head};
use super::head::{RequestHead, ResponseHead};
use super::record::{self, model_of, RequestId, Seen, REQUEST_ID_HEADER};
use super::request::{
    self, error_body, json_response, Ahead, BodyKind, Checked, ClientError, Rest,
};
use super::{Ctx, TokenTap, UPSTREAM_HEADER};
use crate::config::Limits;
use crate::dialect::Dialect;
use crate::estimate::Estimate;
use crate::limit::fleet::Slot;
use crate::limit::{Permit, Rejected};
use crate::meter::{Nanos, Outcome};
use crate::routing::Choice;
use crate::state::Shared;
use crate::usage::{self, UsageStripper};

/// Attempts at connecting: a connect that failed in a way pingora marks retryable is tried
/// once more. A request that was sent is never sent again (a generation would run twice),
/// as on pingora-proxy's path and nginx's default for POST.
const ATTEMPTS: usize = 2;

/// The worker thread's read buffer: every read lands here and is forwarded from here, so an
/// open stream waiting for its next token holds no read buffer of its own.
const SCRATCH: usize = 32 * 1024;

thread_local! {
    static SCRATCH_BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH].into_boxed_slice());
    /// Where a chunked fragment's payload runs are, found while framing it and metered
    /// after it was forwarded (the thread's, so that no request allocates for it).
    static PAYLOAD_RUNS: RefCell<Vec<Range<usize>>> = const { RefCell::new(Vec::new()) };
}

/// Reads what `io` has into the thread's scratch buffer and hands it to `f` (an empty slice
/// at end of stream). `f` must not read from a connection itself.
fn poll_read_with<R>(
    io: &mut Io,
    cx: &mut Context<'_>,
    f: impl FnOnce(&[u8], &mut Context<'_>) -> R,
) -> Poll<io::Result<R>> {
    poll_read_capped(io, cx, SCRATCH, f)
}

/// As [`poll_read_with`], reading at most `cap` bytes (at least one).
fn poll_read_capped<R>(
    io: &mut Io,
    cx: &mut Context<'_>,
    cap: usize,
    f: impl FnOnce(&[u8], &mut Context<'_>) -> R,
) -> Poll<io::Result<R>> {
    SCRATCH_BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        let cap = cap.clamp(1, buf.len());
        let mut read = ReadBuf::new(&mut buf[..cap]);
        ready!(Pin::new(io).poll_read(cx, &mut read))?;
        Poll::Ready(Ok(f(read.filled(), cx)))
    })
}

/// Reads what `io` has next onto `buf`; 0 at end of stream.
pub(super) async fn read_more(io: &mut Io, buf: &mut BytesMut) -> io::Result<usize> {
    poll_fn(|cx| {
        poll_read_with(io, cx, |data, _| {
            buf.extend_from_slice(data);
            data.len()
        })
    })
    .await
}

/// Reads what `io` has next onto `buf`, but no more than brings it one byte past `limit`
/// (enough to tell it overflowed; the rest stays unread); 0 at end of stream.
pub(super) async fn read_more_upto(
    io: &mut Io,
    buf: &mut BytesMut,
    limit: usize,
) -> io::Result<usize> {
    let room = limit.saturating_add(1).saturating_sub(buf.len());
    poll_fn(|cx| {
        poll_read_capped(io, cx, room, |data, _| {
            buf.extend_from_slice(data);
            data.len()
        })
    })
    .await
}

/// Reads and drops what `io` has next, with no buffer of its own; 0 at end of stream.
pub(super) async fn discard(io: &mut Io) -> io::Result<usize> {
    poll_fn(|cx| poll_read_with(io, cx, |data, _| data.len())).await
}

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

/// What goes upstream: the client's head and body as read so far.
struct Outgoing {
    req: RequestHead,
    kind: BodyKind,
    body: BytesMut,
    rest: Rest,
}

/// How the upstream request's body is framed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum UpBody {
    None,
    Length(u64),
    Chunked,
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
    wire: BytesMut,
    /// The rest of the body, still to read from the client.
    rest: Rest,
    sent_so_far: u64,
    watch: bool,
    leftover: BytesMut,
    opening: Opening,
}

/// A request sent upstream, whose response header is awaited.
struct Sent {
    up: Io,
    /// The client is watched for going away (until it sends a pipelined request).
    watch: bool,
    /// Bytes the client sent past its request.
    leftover: BytesMut,
    opening: Opening,
}

/// What shapes the client's head besides the response's: the request's side.
#[derive(Clone, Copy)]
struct Opening {
    keep_alive: bool,
    http10: bool,
    head_request: bool,
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
    Done(After, Option<Failure>),
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

/// How the client gets the response body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ToClient {
    /// The upstream's bytes as they came.
    AsIs,
    /// Chunks tokentap frames (usage stripped, or an upstream body ended by close).
    Chunked,
    /// The payload alone, ended by closing the connection (an HTTP/1.0 client).
    Close,
}

/// A response body being relayed.
struct Relay {
    framing: Framing,
    chunked: Chunked,
    to_client: ToClient,
    /// The upstream body ended.
    done: bool,
    /// The upstream connection can go back to the pool at the end.
    reusable: bool,
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
        let mut ctx = self.new_ctx();
        let req = &incoming.checked.req;
        ctx.request_id = RequestId::of(&req.fields);
        if self.live.access.on() {
            ctx.seen = Some(Box::new(Seen {
                method: req.method.as_str().to_owned(),
                path: req.uri.path().to_owned(),
                client: incoming.peer,
                model: model_of(&incoming.ahead.bytes),
                ..Seen::default()
            }));
        }
        let (after, failure) = Box::pin(self.exchange(client, &mut ctx, incoming, shutdown)).await;
        let upstream = ctx
            .choice
            .map(|c| ctx.shared.upstreams[c.upstream].config.name.as_str());
        if let (Some(f), Some(upstream)) = (&failure, upstream) {
            record::log_failure(&self.live.throttle, &ctx.request_id, upstream, f);
        }
        if ctx.seen.is_some() {
            self.log_access(&ctx, failure.as_ref());
        }
        after
    }

    /// Writes the access-log line of a request that ended.
    fn log_access(&self, ctx: &Ctx, failure: Option<&Failure>) {
        let Some(seen) = ctx.seen.as_deref() else {
            return;
        };
        let summary = seen.summary;
        let outcome = ctx
            .outcome
            .unwrap_or_else(|| Outcome::from_status(ctx.status));
        let line = record::Line {
            ts: record::timestamp(),
            request_id: ctx.request_id.as_str(),
            method: &seen.method,
            path: &seen.path,
            upstream: ctx
                .choice
                .map(|c| ctx.shared.upstreams[c.upstream].config.name.as_str()),
            route: ctx
                .choice
                .map(|c| ctx.shared.config.routes[c.route].name.as_str()),
            status: (ctx.status > 0).then_some(ctx.status),
            outcome: outcome.label(),
            cause: failure.map(|f| f.cause),
            dialect: ctx.dialect.map(Dialect::label),
            model: seen.model.as_deref(),
            stream: seen.stream,
            queue_ms: seen.queue_ms,
            ttft_ms: summary.and_then(|s| s.ttft_ms),
            tpot_ms: summary.and_then(|s| s.tpot_ms),
            e2e_ms: self.now().saturating_sub(ctx.t0) as f64 / 1e6,
            input_tokens: ctx.facts.input_tokens,
            output_tokens: summary.map(|s| s.output_tokens),
            counts: summary.map(|s| if s.exact { "exact" } else { "estimated" }),
            bytes_out: ctx.bytes_out,
            client: seen.client.map(|a| a.to_string()),
        };
        if let Ok(text) = serde_json::to_string(&line) {
            self.live.access.write(text);
        }
    }

    /// [`TokenTap::serve`] but for the logging: the connection's fate, and why the request
    /// failed if it did.
    async fn exchange(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        incoming: Box<Incoming>,
        shutdown: bool,
    ) -> (After, Option<Failure>) {
        // Boxed, and gone before anything is awaited from the upstream: routing, admission
        // and making the upstream request hold the request head and answers tokentap may
        // make itself (~1.5 KiB), which a request waiting for its connection or response
        // does not need. Freed at once, that room is taken again by the next request's;
        // held through the wait (a connect retried after a full accept queue, the time to
        // first token: a second when thousands of streams open at once), it would be left
        // behind as holes among the open streams' memory.
        let prepared = Box::pin(self.prepare(client, ctx, incoming, shutdown)).await;
        let (ready, choice, read_whole) = match prepared {
            Prepared::Ready(ready, choice, read_whole) => (ready, choice, read_whole),
            Prepared::Done(after, failure) => return (after, failure),
        };
        // Boxed too (connecting is a large future, needed only until the request is sent).
        let opened = match Box::pin(self.deliver(client, ctx, choice, ready)).await {
            Ok(sent) => self.receive(ctx, client, choice, sent).await,
            Err(e) => Err(e),
        };
        let mut open = match opened {
            Ok(open) => open,
            Err(e) => return Box::pin(self.unopened(client, ctx, choice, e, read_whole)).await,
        };
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let peer = &upstream.peer;
        let relayed = self
            .relay(client, ctx, &mut open, peer.options.read_timeout)
            .await;
        let failure = relayed
            .as_ref()
            .err()
            .map(|e| failure::of(e, &upstream.config.name));
        let result = relayed.map(|()| {
            if open.relay.reusable {
                let idle = upstream.config.idle_timeout;
                match open.up {
                    Io::Tcp(tcp) => {
                        let now = std::time::Instant::now();
                        let addr = upstream.config.addr;
                        self.transport.pool.release(addr, tcp, now, idle);
                    }
                    Io::Pingora(tls) => {
                        let hash = peer.reuse_hash();
                        self.transport
                            .connector
                            .release_stream(tls, hash, Some(idle));
                    }
                }
            }
            if !open.watch || !open.leftover.is_empty() {
                After::Linger
            } else if open.keep_alive {
                After::KeepAlive
            } else {
                After::Close
            }
        });
        self.finish(ctx, result.as_ref().err().map(|e| &**e));
        (ended(result, read_whole), failure)
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
            checked, ahead, t0, ..
        } = *incoming;
        let Checked {
            req, body: kind, ..
        } = checked;
        let Ahead {
            bytes,
            rest,
            mut leftover,
        } = ahead;
        let shared = Arc::clone(&ctx.shared);
        let limits = shared.config.limits;
        let read_whole = matches!(rest, Rest::Done);
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
        if req.method == http::Method::POST {
            ctx.dialect = Dialect::from_path(req.uri.path());
        }
        let Some(choice) = route(&shared, &req) else {
            let body = error_body(
                "tokentap: no route matches this request",
                "invalid_request_error",
                "no_route",
            );
            let (keep, after) = answered(&leftover, true);
            let id = [(REQUEST_ID_HEADER, ctx.request_id.as_str())];
            let out = json_response(404, &body, &id, keep);
            ctx.status = 404;
            ctx.bytes_out += request::answer(client, &out, limits.client_write_timeout).await;
            return Prepared::Done(after, None);
        };
        ctx.choice = Some(choice);
        let upstream = &shared.upstreams[choice.upstream];
        ctx.tokenize = upstream.config.estimate == Estimate::Tokenizer;

        // Caps apply to generation requests only. A queued client whose body was read whole
        // is watched, and leaves the queue the moment it goes away; one still sending waits
        // unwatched (its body bytes are not read here), bounded by the queue timeout.
        let mut watch = true;
        if ctx.dialect.is_some() {
            let queued = std::time::Instant::now();
            let limiter = &upstream.limiter;
            // The local slot, then (with [cluster]) the fleet's: both within the queue's
            // timeout.
            let deadline = queued + upstream.config.queue_timeout;
            // Boxed: taking a fleet slot (Redis calls) is a large future, and inline it would
            // make every request's state, streaming or not, ~5 KiB larger.
            let slot = |permit: Permit| async move {
                match &upstream.fleet {
                    Some(fleet) => Box::pin(fleet.slot(limiter, permit, deadline)).await,
                    None => Ok(Slot::local(permit)),
                }
            };
            let granted = match (limiter.try_acquire(), &upstream.fleet) {
                (Some(permit), None) => Ok(Ok(Slot::local(permit))),
                (Some(permit), Some(_)) if read_whole => {
                    let acquire = async { Ok(slot(permit).await) };
                    watching(client, &mut watch, &mut leftover, acquire).await
                }
                (Some(permit), Some(_)) => Ok(slot(permit).await),
                (None, _) if read_whole => {
                    let acquire = async {
                        Ok(match limiter.acquire().await {
                            Ok(permit) => slot(permit).await,
                            Err(why) => Err(why),
                        })
                    };
                    watching(client, &mut watch, &mut leftover, acquire).await
                }
                (None, _) => Ok(match limiter.acquire().await {
                    Ok(permit) => slot(permit).await,
                    Err(why) => Err(why),
                }),
            };
            if let Some(seen) = ctx.seen.as_mut() {
                seen.queue_ms = queued.elapsed().as_secs_f64() * 1e3;
            }
            match granted {
                Ok(Ok(permit)) => ctx.permit = Some(permit),
                Ok(Err(why)) => {
                    let (keep, after) = answered(&leftover, watch);
                    ctx.status = 429;
                    ctx.bytes_out += reject(client, ctx, choice, why, keep).await;
                    return Prepared::Done(after, None);
                }
                Err(gone) => {
                    self.finish(ctx, Some(&gone));
                    let failure = failure::of(&gone, &upstream.config.name);
                    return Prepared::Done(After::Close, Some(failure));
                }
            }
        }

        let outgoing = Outgoing {
            req,
            kind,
            body: bytes,
            rest,
        };
        match self.outgoing(ctx, choice, outgoing, leftover, watch, shutdown) {
            Ok(ready) => Prepared::Ready(ready, choice, read_whole),
            Err(e) => {
                let (after, failure) = self.unopened(client, ctx, choice, e, read_whole).await;
                Prepared::Done(after, failure)
            }
        }
    }

    /// Answers a request that failed before any byte reached the client, and records it.
    async fn unopened(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        choice: Choice,
        e: Box<Error>,
        read_whole: bool,
    ) -> (After, Option<Failure>) {
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let limits = shared.config.limits;
        let mut failure = None;
        let cwt = limits.client_write_timeout;
        if let Some(mistake) = e.root_cause().downcast_ref::<ClientError>() {
            // A client's mistake is answered as such; it is not a failure.
            ctx.status = mistake.status();
            ctx.bytes_out += request::refuse(client, *mistake, cwt).await;
        } else {
            let f = failure::of(&e, &upstream.config.name);
            if !f.client {
                ctx.status = f.status;
                ctx.bytes_out += answer_failure(client, ctx, choice, &f, cwt).await;
            } // else gone: nobody to answer
            failure = Some(f);
        }
        self.finish(ctx, Some(&e));
        (ended(Err(e), read_whole), failure)
    }

    /// The upstream request's bytes (usage injected), and the request's record begun.
    fn outgoing(
        &self,
        ctx: &mut Ctx,
        choice: Choice,
        outgoing: Outgoing,
        leftover: BytesMut,
        watch: bool,
        shutdown: bool,
    ) -> Result<Ready> {
        let Outgoing {
            req,
            kind,
            body,
            rest,
        } = outgoing;
        let http10 = !req.http11;
        let head_request = req.method == http::Method::HEAD;
        let keep_alive = !shutdown && !http10 && !req.fields.has_token("connection", "close");
        let mut body = body.freeze();
        let read_whole = matches!(rest, Rest::Done);
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        if read_whole && ctx.dialect == Some(Dialect::OpenAi) && upstream.config.inject_usage {
            if let Some(rewritten) = usage::request_with_usage(&body) {
                body = rewritten;
                ctx.strip_usage = Some(UsageStripper::new(shared.config.max_event_bytes));
            }
        }
        let expects_body = matches!(
            req.method,
            http::Method::POST | http::Method::PUT | http::Method::PATCH
        );
        let up_body = match (kind, &rest) {
            // RFC 9110 §8.6: a method that has a body gets a length, 0 for none (some servers
            // answer 411 without one).
            (BodyKind::None, _) if expects_body => UpBody::Length(0),
            (BodyKind::None, _) => UpBody::None,
            (_, Rest::Done) => UpBody::Length(body.len() as u64),
            (BodyKind::Length(n), _) => UpBody::Length(n),
            (BodyKind::Chunked, _) => UpBody::Chunked,
        };
        // The client's own id goes as it came; tokentap's only when asked to.
        let ours = ctx.request_id.is_ours() && shared.config.request_id_upstream;
        let id = ours.then(|| ctx.request_id.as_str());
        let mut wire = BytesMut::with_capacity(512 + body.len());
        upstream_request(req, &upstream.config.host_header, id, up_body, &mut wire);
        if up_body == UpBody::Chunked {
            h1::put_chunk(&mut wire, &body);
        } else {
            wire.extend_from_slice(&body);
        }
        let sent_so_far = body.len() as u64;
        let model = (shared.config.model_label && ctx.dialect.is_some())
            .then(|| model_of(&body).unwrap_or_else(|| "unknown".into()));
        drop(body);

        if ctx.dialect.is_some() {
            let mut stream = upstream.meter.begin(ctx.t0, self.now());
            stream.set_model(model);
            ctx.stream = Some(stream);
        }
        Ok(Ready {
            wire,
            rest,
            sent_so_far,
            watch,
            leftover,
            opening: Opening {
                keep_alive,
                http10,
                head_request,
            },
        })
    }

    /// The connection, the request written, the rest of its body streamed. Nothing reaches
    /// the client here (an error is answered); after the response header, an error cuts the
    /// connection, as pingora-proxy does.
    async fn deliver(
        &self,
        client: &mut Io,
        ctx: &Ctx,
        choice: Choice,
        ready: Ready,
    ) -> Result<Sent> {
        let Ready {
            wire,
            rest,
            sent_so_far,
            mut watch,
            mut leftover,
            opening,
        } = ready;
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let read_whole = matches!(rest, Rest::Done);
        let peer = &upstream.peer;
        let send = self.connect_and_write(upstream.config.addr, peer, wire);
        let up = if read_whole {
            watching(client, &mut watch, &mut leftover, send).await?
        } else {
            let up = send.await?;
            let mut up = up;
            let limits = shared.config.limits;
            let streamed = Box::pin(send_rest(
                client,
                &mut up,
                rest,
                &mut leftover,
                peer.options.write_timeout,
                (sent_so_far, limits),
            ));
            streamed.await?;
            up
        };
        Ok(Sent {
            up,
            watch,
            leftover,
            opening,
        })
    }

    /// The response header, read and written for the client with the body bytes that came
    /// with it: the request opened for its body. Nothing reaches the client here either.
    async fn receive(
        &self,
        ctx: &mut Ctx,
        client: &mut Io,
        choice: Choice,
        sent: Sent,
    ) -> Result<Open> {
        let Sent {
            mut up,
            mut watch,
            mut leftover,
            opening,
        } = sent;
        let shared = Arc::clone(&ctx.shared);
        let peer = &shared.upstreams[choice.upstream].peer;
        // Boxed: the wait for the first byte needs it, an open stream does not.
        let head = Box::pin(read_response_head(
            &mut up,
            (client, &mut watch, &mut leftover),
            peer.options.read_timeout,
            |resp, first, bare_lf, watched| {
                self.opened(ctx, resp, first, bare_lf, opening, watched)
            },
        ));
        let (relay, out, keep_alive) = head.await?;
        Ok(Open {
            up,
            relay,
            out,
            watch,
            leftover,
            keep_alive,
        })
    }

    /// The client's head for the upstream's `resp`, and the body bytes that came with it
    /// (`first`, read in the thread's scratch buffer), metered and framed after it: the
    /// relay, the bytes for the client and whether the connection is kept. `watched`: the
    /// client is still watched and sent nothing past its request.
    fn opened(
        &self,
        ctx: &mut Ctx,
        mut resp: ResponseHead,
        first: &[u8],
        bare_lf: bool,
        opening: Opening,
        watched: bool,
    ) -> Result<(Relay, BytesMut, bool)> {
        let Opening {
            mut keep_alive,
            http10,
            head_request,
        } = opening;
        let framing = match resp.framing() {
            _ if head_request => Framing::Empty,
            Some(framing) => framing,
            None => return Err(up_err(InvalidHTTPHeader, "upstream response framing")),
        };
        let reusable = resp.http11
            && framing != Framing::UntilClose
            && !resp.fields.has_token("connection", "close");
        resp.fields.remove_hop_by_hop("transfer-encoding");
        // A transfer coding under the chunks (`gzip, chunked`): neither read nor rewritten,
        // and forwarded as it came (re-framing it would lose the coding).
        let coded = framing == Framing::Chunked && !resp.only_chunked();
        let content_type = resp.fields.get("content-type");
        let content_encoding = resp.fields.get("content-encoding");
        self.on_response(ctx, resp.status, content_type, (content_encoding, coded));
        if framing == Framing::Chunked {
            // RFC 9112 §6.3: `Transfer-Encoding` overrides a `Content-Length`, which a proxy
            // removes (as pingora does).
            resp.fields.remove("content-length");
            if coded {
                ctx.ignore_body();
            }
        }
        if coded && http10 {
            // No transfer coding can reach an HTTP/1.0 client.
            return Err(up_err(
                InvalidHTTPHeader,
                "a transfer coding an HTTP/1.0 client cannot take",
            ));
        }
        let rewritten = ctx.strip_usage.is_some() && framing != Framing::Empty;
        let to_client = match framing {
            // RFC 9112 §7: an HTTP/1.0 client gets no chunks, but a body ended by close.
            Framing::Chunked | Framing::UntilClose if http10 => ToClient::Close,
            _ if rewritten && http10 => ToClient::Close,
            // As pingora-proxy: a body without a length goes on chunked, so the client
            // connection survives it; so does a body whose length stripping changes.
            Framing::UntilClose => ToClient::Chunked,
            _ if rewritten => ToClient::Chunked,
            // Chunk lines ended by a bare LF are read, and framed again for the client.
            Framing::Chunked if bare_lf && !coded => ToClient::Chunked,
            _ => ToClient::AsIs,
        };
        match to_client {
            ToClient::AsIs => {}
            ToClient::Chunked => resp.fields.remove("content-length"),
            ToClient::Close => {
                resp.fields.remove("content-length");
                resp.fields.remove("transfer-encoding");
                keep_alive = false;
            }
        }
        keep_alive &= watched;
        let connection: &[u8] = if keep_alive { b"keep-alive" } else { b"close" };
        let date = get_cached_date();
        let [upstream, id] = Self::added_fields(ctx, resp.fields.contains(REQUEST_ID_HEADER));
        let chunked = to_client == ToClient::Chunked;
        let mut out = BytesMut::with_capacity(512 + first.len());
        resp.write(
            &mut out,
            &[
                upstream.map(|(n, v)| (n, v.as_bytes())),
                id.map(|(n, v)| (n, v.as_bytes())),
                chunked.then_some(("Transfer-Encoding", b"chunked")),
                Some(("Date", date.as_bytes())),
                Some(("Connection", connection)),
            ],
        );
        drop(resp);

        let mut relay = Relay {
            framing,
            chunked: Chunked::default(),
            to_client,
            done: false,
            reusable,
        };
        // The body bytes that came with the header (an empty read is the end of stream).
        if !first.is_empty() || matches!(framing, Framing::Empty | Framing::Length(0)) {
            relay
                .fragment(self, ctx, self.now(), first, &mut out, None)
                .map_err(|e| e.into_up())?;
        }
        Ok((relay, out, keep_alive))
    }

    /// Forwards the response body until it ends: each upstream fragment is written to the
    /// client from the thread's scratch buffer and metered; only what the client has not
    /// taken yet is copied, into `out`, and the upstream is not read again until it has. A
    /// client that takes nothing for `client_write_timeout` is cut.
    async fn relay(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        open: &mut Open,
        read_timeout: Option<Duration>,
    ) -> Result<()> {
        let Open {
            up,
            relay,
            out,
            watch,
            leftover,
            ..
        } = open;
        let stall_limit = ctx.shared.config.limits.client_write_timeout;
        // The timeouts, kept lazily: one timer, which when it fires checks the time of the
        // last fragment written (the upstream's silence) or of the stall's start (the
        // client's).
        let mut last = Instant::now();
        let mut stalled: Option<Instant> = None;
        let timer = tokio::time::sleep(read_timeout.unwrap_or(Duration::MAX / 4));
        tokio::pin!(timer);
        let mut flushing = false;
        poll_fn(|cx| loop {
            while !out.is_empty() {
                match Pin::new(&mut *client).poll_write(cx, out) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(down(WriteError, "client took 0 bytes")))
                    }
                    Poll::Ready(Ok(n)) if n == out.len() => {
                        ctx.bytes_out += n as u64;
                        *out = BytesMut::new(); // its memory too
                    }
                    Poll::Ready(Ok(n)) => {
                        ctx.bytes_out += n as u64;
                        out.advance(n);
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(down_io(WriteError, e))),
                    Poll::Pending => {
                        return stall(cx, timer.as_mut(), &mut stalled, stall_limit);
                    }
                }
                stalled = None;
                flushing = true;
            }
            if flushing {
                match Pin::new(&mut *client).poll_flush(cx) {
                    Poll::Ready(Ok(())) => flushing = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(down_io(WriteError, e))),
                    Poll::Pending => {
                        return stall(cx, timer.as_mut(), &mut stalled, stall_limit);
                    }
                }
                stalled = None;
                // After the write: time spent on a slow client is not upstream silence.
                last = Instant::now();
            }
            if relay.done {
                return Poll::Ready(Ok(()));
            }
            let read = poll_read_with(up, cx, |data, cx| {
                let now = self.now();
                relay.fragment(self, ctx, now, data, out, Some((&mut *client, cx)))
            });
            match read {
                Poll::Ready(Ok(Ok(()))) => {
                    flushing = true;
                    continue;
                }
                Poll::Ready(Ok(Err(e))) => return Poll::Ready(Err(e.into_up())),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(up_io(ReadError, e))),
                Poll::Pending => {}
            }
            if let Some(gone) = poll_client_gone(client, cx, watch, leftover) {
                return Poll::Ready(Err(gone));
            }
            if let Some(period) = read_timeout {
                while timer.as_mut().poll(cx).is_ready() {
                    let deadline = last + period;
                    if Instant::now() >= deadline {
                        let e = Error::explain(ReadTimedout, "reading the upstream response body");
                        return Poll::Ready(Err(e.into_up()));
                    }
                    timer.as_mut().reset(deadline);
                }
            }
            return Poll::Pending;
        })
        .await
    }

    /// A pooled connection to `upstream`, else a new one. Plain TCP is tokio's own, pooled
    /// in [`Pool`](super::Pool); TLS is pingora's connector and pool. (pingora's connect
    /// future, with TLS, proxies and socket options tokentap does not set, is 8.5 KiB: a
    /// burst of thousands of new streams would leave that much per stream behind in the
    /// allocator.)
    async fn connect(&self, addr: std::net::SocketAddr, peer: &HttpPeer) -> Result<Io> {
        if peer.is_tls() {
            // Boxed: pingora's pool and connector are large futures, and a plain request
            // waiting for its connection would hold their room.
            return Box::pin(async {
                let connector = &self.transport.connector;
                if let Some(pooled) = connector.reused_stream(peer).await {
                    return Ok(Io::Pingora(pooled));
                }
                connector.new_stream(peer).await.map(Io::Pingora)
            })
            .await;
        }
        if let Some(pooled) = self.transport.pool.take(addr, std::time::Instant::now()) {
            return Ok(Io::Tcp(pooled));
        }
        let connect = tokio::net::TcpStream::connect(addr);
        let connected = match peer.options.connection_timeout {
            Some(t) => timeout(t, connect).await.unwrap_or_else(|_| {
                Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
            }),
            None => connect.await,
        };
        let tcp = connected.map_err(|e| {
            let kind = match e.kind() {
                io::ErrorKind::TimedOut => ConnectTimedout,
                io::ErrorKind::ConnectionRefused => ConnectRefused,
                _ => ConnectError,
            };
            let mut e = Error::because(kind, format!("connecting to {addr}"), e);
            e.set_retry(true); // nothing was sent
            e
        })?;
        let _ = tcp.set_nodelay(true);
        Ok(Io::Tcp(tcp))
    }

    /// Connects (a connect that failed is tried once more: nothing was sent) and writes the
    /// request head with the body read so far, in one write.
    async fn connect_and_write(
        &self,
        addr: std::net::SocketAddr,
        peer: &HttpPeer,
        wire: BytesMut,
    ) -> Result<Io> {
        let mut attempt = 0;
        let mut up = loop {
            attempt += 1;
            match self.connect(addr, peer).await {
                Ok(up) => break up,
                Err(mut e) => {
                    e.retry.decide_reuse(false);
                    if e.retry() && attempt < ATTEMPTS {
                        continue;
                    }
                    return Err(e.into_up());
                }
            }
        };
        write_up(&mut up, &wire, peer.options.write_timeout).await?;
        Ok(up)
    }
}

/// The upstream of a request, if a route matches.
fn route(shared: &Shared, req: &RequestHead) -> Option<Choice> {
    let upstreams = &shared.upstreams;
    shared
        .router
        .choose(req.uri.path(), &req.fields, |u| upstreams[u].has_headroom())
}

/// Answers 429 with `Retry-After` and an OpenAI-style error body; the bytes written.
async fn reject(
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
    };
    let body = error_body(&message, "rate_limit_exceeded", why.label());
    let extra = [
        ("Retry-After", "1"),
        (UPSTREAM_HEADER, name.as_str()),
        (REQUEST_ID_HEADER, ctx.request_id.as_str()),
    ];
    let out = json_response(429, &body, &extra, keep_alive);
    let cwt = shared.config.limits.client_write_timeout;
    request::answer(client, &out, cwt).await
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
    request::answer(client, &out, limit).await
}

/// Appends the request as the upstream gets it (with tokentap's request `id` when the
/// client sent none): HTTP/1.1, without hop-by-hop fields and `Expect` (the body is on its
/// way already), its `Host` the upstream's, its body framed by tokentap.
fn upstream_request(
    mut req: RequestHead,
    host: &str,
    id: Option<&str>,
    body: UpBody,
    out: &mut BytesMut,
) {
    let h = &mut req.fields;
    h.remove_hop_by_hop("");
    h.remove("expect");
    h.remove("content-length");
    let mut digits = [0u8; 20];
    let framing: Option<(&str, &[u8])> = match body {
        UpBody::None => None,
        UpBody::Length(n) => {
            let mut w = &mut digits[..];
            let _ = write!(w, "{n}"); // a u64 has at most 20 digits
            let len = 20 - w.len();
            Some(("Content-Length", &digits[..len]))
        }
        UpBody::Chunked => Some(("Transfer-Encoding", b"chunked")),
    };
    req.write(
        out,
        &[
            Some(("Host", host.as_bytes())),
            id.map(|id| (REQUEST_ID_HEADER, id.as_bytes())),
            framing,
        ],
    );
}

/// Writes to the upstream within its write timeout.
async fn write_up(up: &mut Io, bytes: &[u8], write_timeout: Option<Duration>) -> Result<()> {
    let write = async {
        up.write_all(bytes).await?;
        up.flush().await
    };
    match write_timeout {
        Some(t) => match timeout(t, write).await {
            Ok(r) => r.map_err(|e| up_io(WriteError, e)),
            Err(_) => Err(up_err(WriteTimedout, "writing the request")),
        },
        None => write.await.map_err(|e| up_io(WriteError, e)),
    }
}

/// Streams the rest of a request body the read-ahead did not hold to the upstream: a
/// length's worth as it comes, or chunks decoded strictly and framed again, so that nothing
/// past a malformed chunk is sent. Each read must come within
/// `server.request_body_timeout_secs`; bytes past the body go to `leftover`. `sent`: the
/// payload sent so far, against `server.max_request_body_bytes`.
async fn send_rest(
    client: &mut Io,
    up: &mut Io,
    rest: Rest,
    leftover: &mut BytesMut,
    write_timeout: Option<Duration>,
    (mut sent, limits): (u64, Limits),
) -> Result<()> {
    let limit = limits.max_request_body_bytes;
    let mut read = BytesMut::new();
    let next = async |client: &mut Io, read: &mut BytesMut| {
        read.clear();
        match timeout(limits.request_body_timeout, read_more(client, read)).await {
            Ok(Ok(0)) => Err(down(ConnectionClosed, "client closed mid-body")),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(down_io(ReadError, e)),
            Err(_) => Err(client_error(ClientError::BodyTimeout)),
        }
    };
    match rest {
        Rest::Done => Ok(()),
        Rest::Length(mut left) => {
            while left > 0 {
                next(client, &mut read).await?;
                let take = read.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                leftover.extend_from_slice(&read[take..]);
                write_up(up, &read[..take], write_timeout).await?;
                left -= take as u64;
            }
            Ok(())
        }
        Rest::Chunked(mut decoder) => loop {
            next(client, &mut read).await?;
            let mut out = BytesMut::with_capacity(read.len() + 16);
            let used = decoder
                .feed(&read, |payload| {
                    sent += payload.len() as u64;
                    h1::put_chunk(&mut out, payload);
                })
                .map_err(|_| client_error(ClientError::BadChunk))?;
            if sent > limit {
                return Err(client_error(ClientError::BodyTooLarge));
            }
            if decoder.done() {
                out.extend_from_slice(h1::LAST_CHUNK);
                leftover.extend_from_slice(&read[used..]);
                return write_up(up, &out, write_timeout).await;
            }
            write_up(up, &out, write_timeout).await?;
        },
    }
}

/// Reads the response header, past any 1xx, while watching the client (see [`watching`]);
/// hands it, the body bytes read with it and whether its lines ended in a bare LF (a server
/// that ends its chunk lines so too) to `then`, with whether the client is still watched
/// and sent nothing more. A head that comes in one read (the usual case) is parsed in the
/// thread's scratch buffer, and the bytes after it are given from there: only a head split
/// across reads is gathered into a buffer of its own. The first byte of a head must come
/// within `read_timeout`, and the rest of it within `read_timeout` of that byte (a 504).
async fn read_response_head<T>(
    up: &mut Io,
    (client, watch, leftover): (&mut Io, &mut bool, &mut BytesMut),
    read_timeout: Option<Duration>,
    then: impl FnOnce(ResponseHead, &[u8], bool, bool) -> Result<T>,
) -> Result<T> {
    let mut then = Some(then);
    let mut buf = BytesMut::new();
    let mut head_begun = false;
    let timer = tokio::time::sleep(read_timeout.unwrap_or(Duration::MAX / 4));
    tokio::pin!(timer);
    poll_fn(|cx| loop {
        let watched = leftover.is_empty() && *watch;
        let mut found = |bytes: &[u8], at: usize, resp, bare_lf| match then.take() {
            Some(then) => then(resp, &bytes[at..], bare_lf, watched).map(Some),
            None => Err(Error::explain(InternalError, "response header read twice")),
        };
        let read = poll_read_with(up, cx, |data, _| {
            if data.is_empty() {
                return Err(up_err(
                    ConnectionClosed,
                    "upstream closed before its header",
                ));
            }
            if buf.is_empty() {
                match find_head(data)? {
                    Found::Head(resp, at, bare_lf) => return found(data, at, resp, bare_lf),
                    Found::Partial(at) => buf.extend_from_slice(&data[at..]),
                }
            } else {
                buf.extend_from_slice(data);
                match find_head(&buf)? {
                    Found::Head(resp, at, bare_lf) => return found(&buf, at, resp, bare_lf),
                    Found::Partial(at) => buf.advance(at),
                }
            }
            Ok(None)
        });
        match read {
            Poll::Ready(Ok(Ok(Some(opened)))) => return Poll::Ready(Ok(opened)),
            Poll::Ready(Ok(Ok(None))) => {
                // Waiting for a head's first byte (a backend's prefill), each read has
                // `read_timeout`; once a head has begun, all of it must arrive within
                // `read_timeout` of its first byte, however it trickles.
                let begun = !buf.is_empty();
                if let (Some(t), false) = (read_timeout, begun && head_begun) {
                    timer.as_mut().reset(tokio::time::Instant::now() + t);
                }
                head_begun = begun;
                continue;
            }
            Poll::Ready(Ok(Err(e))) => return Poll::Ready(Err(e)),
            Poll::Ready(Err(e)) => return Poll::Ready(Err(up_io(ReadError, e))),
            Poll::Pending => {}
        }
        if let Some(gone) = poll_client_gone(client, cx, watch, leftover) {
            return Poll::Ready(Err(gone));
        }
        if read_timeout.is_some() && timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(up_err(ReadTimedout, "reading the response header")));
        }
        return Poll::Pending;
    })
    .await
}

/// What [`find_head`] found.
enum Found {
    /// The final head, the offset of the bytes after it, and whether a line of it ended in
    /// a bare LF.
    Head(ResponseHead, usize, bool),
    /// No final head yet: more is needed, from this offset on (past any whole 1xx heads).
    Partial(usize),
}

/// The final response head at the start of `bytes`, past any informational ones (the client
/// gets the final one).
fn find_head(bytes: &[u8]) -> Result<Found> {
    let mut at = 0;
    loop {
        let rest = &bytes[at..];
        match ResponseHead::parse(rest) {
            Head::Complete(resp, _) if resp.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                return Err(up_err(
                    InvalidHTTPHeader,
                    "101 to a request without Upgrade",
                ));
            }
            Head::Complete(mut resp, len) => {
                let bare_lf = memchr::memchr_iter(b'\n', &rest[..len])
                    .any(|i| i == 0 || rest[i - 1] != b'\r');
                if !resp.status.is_informational() {
                    resp.copy(rest, len);
                    return Ok(Found::Head(resp, at + len, bare_lf));
                }
                at += len;
            }
            Head::Invalid => return Err(up_err(InvalidHTTPHeader, "upstream response header")),
            Head::Partial if rest.len() > h1::MAX_RESPONSE_HEAD => {
                return Err(up_err(
                    InvalidHTTPHeader,
                    "upstream response header too large",
                ))
            }
            Head::Partial => return Ok(Found::Partial(at)),
        }
    }
}

/// The client accepts no more bytes for now: pending until it does, or an error once it
/// has taken nothing for `limit` since the stall began.
fn stall<T>(
    cx: &mut Context<'_>,
    mut timer: Pin<&mut tokio::time::Sleep>,
    stalled: &mut Option<Instant>,
    limit: Duration,
) -> Poll<Result<T>> {
    let since = *stalled.get_or_insert_with(|| {
        let now = Instant::now();
        if now + limit < timer.deadline() {
            timer.as_mut().reset(now + limit);
        }
        now
    });
    while timer.as_mut().poll(cx).is_ready() {
        let deadline = since + limit;
        if Instant::now() >= deadline {
            let e = down(
                WriteTimedout,
                "client accepted no bytes for client_write_timeout_secs",
            );
            return Poll::Ready(Err(e));
        }
        timer.as_mut().reset(deadline);
    }
    Poll::Pending
}

/// A client's mistake found mid-request, as the error that ends it.
fn client_error(e: ClientError) -> Box<Error> {
    Error::because(HTTPStatus(e.status()), "request body", e).into_down()
}

// === impl Relay ===

impl Relay {
    /// Meters one upstream fragment (empty at end of stream) and forwards it: appended to
    /// `out`, or, when `out` is empty and `client` is given, written to the client at once.
    fn fragment(
        &mut self,
        tap: &TokenTap,
        ctx: &mut Ctx,
        now: Nanos,
        data: &[u8],
        out: &mut BytesMut,
        client: Option<(&mut Io, &mut Context<'_>)>,
    ) -> Result<()> {
        if self.done {
            return Ok(());
        }
        let nothing_left = matches!(self.framing, Framing::Empty | Framing::Length(0));
        if data.is_empty() && !nothing_left && self.framing != Framing::UntilClose {
            return Error::e_explain(ConnectionClosed, "upstream closed mid-body");
        }
        // Where the body is in `data`, and in a chunked body where its payload is.
        let n = match self.framing {
            Framing::Empty => 0,
            Framing::Length(left) => {
                let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                self.framing = Framing::Length(left - n as u64);
                n
            }
            Framing::Chunked => PAYLOAD_RUNS
                .with_borrow_mut(|runs| {
                    runs.clear();
                    self.chunked.feed_ranges(data, |run| runs.push(run))
                })
                .or_else(|_| Error::e_explain(InvalidHTTPHeader, "malformed chunked body"))?,
            Framing::UntilClose => data.len(),
        };
        self.done = match self.framing {
            Framing::Empty => true,
            Framing::Length(left) => left == 0,
            Framing::Chunked => self.chunked.done(),
            Framing::UntilClose => data.is_empty(),
        };
        let body = &data[..n];
        if n < data.len() {
            self.reusable = false; // bytes past the body: the connection is not clean
        }
        let mode = self.to_client;
        // Forwarded as it came before it is metered: the client does not wait on the meter.
        let mut client = client;
        if mode == ToClient::AsIs {
            ctx.bytes_out += forward(body, out, client.take());
        }
        // Metered; otherwise framed by tokentap: `kept` is what the client gets (with the
        // usage chunk being taken out, what the stripper lets through).
        let stripping = ctx.strip_usage.is_some();
        let mut kept = BytesMut::new();
        let mut emit = |bytes: &[u8]| match mode {
            ToClient::AsIs => {}
            ToClient::Chunked => h1::put_chunk(&mut kept, bytes),
            ToClient::Close => kept.extend_from_slice(bytes),
        };
        let mut payload = |payload: &[u8]| {
            let stripped = tap.on_body(ctx, now, payload, false);
            match stripped {
                Some(k) => emit(&k),
                None if !stripping => emit(payload),
                None => {}
            }
        };
        if self.framing == Framing::Chunked {
            PAYLOAD_RUNS.with_borrow(|runs| {
                for run in runs {
                    payload(&body[run.clone()]);
                }
            });
        } else if !body.is_empty() {
            payload(body);
        }
        if self.done {
            // What a stripper held back, and the end of a JSON or NDJSON body.
            if let Some(k) = tap.on_body(ctx, now, &[], true) {
                emit(&k);
            }
            if mode == ToClient::Chunked {
                kept.extend_from_slice(h1::LAST_CHUNK);
            }
        }
        TokenTap::fragment_read(ctx);
        if mode != ToClient::AsIs {
            ctx.bytes_out += forward(&kept, out, client);
        }
        Ok(())
    }
}

/// Writes `bytes` to the client now when nothing is queued before them, queueing what it
/// does not take; the bytes written now.
fn forward(bytes: &[u8], out: &mut BytesMut, client: Option<(&mut Io, &mut Context<'_>)>) -> u64 {
    let mut written = 0;
    if let (true, Some((client, cx))) = (out.is_empty(), client) {
        while written < bytes.len() {
            match Pin::new(&mut *client).poll_write(cx, &bytes[written..]) {
                Poll::Ready(Ok(n)) if n > 0 => written += n,
                // Errors surface on the next write, from `out`.
                _ => break,
            }
        }
    }
    out.extend_from_slice(&bytes[written..]);
    written as u64
}

/// Runs `work` while watching the client: a client that goes away ends it with a downstream
/// error; bytes it sends (a pipelined next request) are kept in `leftover`, and the
/// watching stops.
async fn watching<T>(
    client: &mut Io,
    watch: &mut bool,
    leftover: &mut BytesMut,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::pin!(work);
    poll_fn(|cx| {
        if let Poll::Ready(done) = work.as_mut().poll(cx) {
            return Poll::Ready(done);
        }
        match poll_client_gone(client, cx, watch, leftover) {
            Some(gone) => Poll::Ready(Err(gone)),
            None => Poll::Pending,
        }
    })
    .await
}

/// While `watch`ing: the error to end with if the client closed or failed. Bytes it sent (a
/// pipelined next request) are kept in `leftover`, and the watching stops.
fn poll_client_gone(
    client: &mut Io,
    cx: &mut Context<'_>,
    watch: &mut bool,
    leftover: &mut BytesMut,
) -> Option<Box<Error>> {
    if !*watch {
        return None;
    }
    let seen = poll_read_with(client, cx, |data, _| {
        leftover.extend_from_slice(data);
        !data.is_empty()
    });
    match seen {
        Poll::Ready(Ok(true)) => {
            *watch = false;
            None
        }
        Poll::Ready(Ok(false)) | Poll::Ready(Err(_)) => {
            Some(down(ConnectionClosed, "client went away"))
        }
        Poll::Pending => None,
    }
}

fn down(kind: ErrorType, what: &'static str) -> Box<Error> {
    Error::explain(kind, what).into_down()
}

fn down_io(kind: ErrorType, e: io::Error) -> Box<Error> {
    Error::because(kind, "client connection", e).into_down()
}

fn up_err(kind: ErrorType, what: &'static str) -> Box<Error> {
    Error::explain(kind, what).into_up()
}

fn up_io(kind: ErrorType, e: io::Error) -> Box<Error> {
    Error::because(kind, "upstream connection", e).into_up()
}
