//! The proxy's two paths and what they share. `front` accepts client connections and reads
//! each request head; `direct` proxies metered generation requests itself; everything else
//! goes through pingora-proxy and the `impl ProxyHttp` below. Both paths call the same
//! filters (`on_response_header`, `on_body`, `finish`), each a few lines calling routing,
//! framing, dialect and meter.
//!
//! The body filter never holds or delays a fragment, so the client sees each upstream
//! fragment the moment it arrives; it rewrites one only to take out a usage chunk the proxy
//! asked for and the client did not.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE, HOST};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::modules::http::HttpModules;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};
use pingora::ErrorSource;

use crate::dialect::{tokens_carried, Dialect, Facts, Framing};
use crate::estimate::{self, Estimate};
use crate::limit::{Limiter, Permit, Rejected};
use crate::meter::{Nanos, Outcome, Stream};
use crate::ndjson::NdjsonParser;
use crate::routing::Choice;
use crate::server::Shared;
use crate::sse::SseParser;
use crate::usage::{self, UsageStripper};

mod conn;
mod direct;
mod front;
mod h1;

pub(crate) use conn::Pool;
pub use front::{Front, FrontService};

/// The response header naming the upstream that served a request.
pub const UPSTREAM_HEADER: &str = "x-tokentap-upstream";
/// The body pingora keeps to replay upstream (its retry buffer).
const RETRY_BUFFER: usize = 64 * 1024;
/// Non-streaming bodies larger than this are forwarded but not read for `usage`.
const MAX_JSON_BODY: usize = 4 << 20;

/// The proxy.
pub struct TokenTap {
    shared: Arc<Shared>,
}

/// Per-request state.
pub struct Ctx {
    t0: Nanos,
    dialect: Option<Dialect>,
    choice: Option<Choice>,
    /// The metered request: in flight until finished (or dropped, which finishes it).
    stream: Option<Stream>,
    /// The concurrency slot, held until the request ends however it ends.
    permit: Option<Permit>,
    /// Refused a slot: answered 429 without reaching the upstream.
    rejected: bool,
    /// The request body with `stream_options.include_usage` added.
    rewritten_body: Option<Bytes>,
    /// Removes the usage-only chunk from the response (the client did not ask for it).
    strip_usage: Option<UsageStripper>,
    /// Estimate tokens with the tokenizer rather than one per event.
    tokenize: bool,
    body: Body,
    facts: Facts,
    unparsed: u64,
    status: u16,
}

impl Ctx {
    /// The body is forwarded but neither read nor rewritten.
    fn ignore_body(&mut self) {
        self.body = Body::Ignore;
        self.strip_usage = None;
    }
}

/// How the response body is read for metering.
enum Body {
    /// Not metered (not generation traffic, an error status, an encoded body…).
    Ignore,
    Sse(SseParser),
    Ndjson(NdjsonParser),
    /// A non-streaming JSON response, copied (bounded) to read its `usage` at the end.
    Json(Vec<u8>),
}

// === impl TokenTap ===

impl TokenTap {
    pub fn new(shared: Arc<Shared>) -> Self {
        TokenTap { shared }
    }

    fn now(&self) -> Nanos {
        self.shared.clock.now()
    }

    /// Feeds one response fragment to the framing and the dialect.
    fn observe(&self, ctx: &mut Ctx, now: Nanos, chunk: &[u8]) {
        let Some(dialect) = ctx.dialect else { return };
        let mut facts = Facts::default();
        let tokenize = ctx.tokenize;
        let mut on_event = |ev: crate::sse::Event<'_>| {
            let mut f = dialect.event(&ev);
            if tokenize && f.tokens > 0 {
                if let Some(n) = estimate::tokenizer_count(dialect, ev.data) {
                    f.tokens = n.max(1);
                }
            }
            facts.merge(f);
        };
        match &mut ctx.body {
            Body::Ignore => return,
            Body::Sse(parser) => parser.push(chunk, &mut on_event),
            Body::Ndjson(parser) => parser.push(chunk, &mut on_event),
            Body::Json(buf) => {
                if buf.len() + chunk.len() > MAX_JSON_BODY {
                    ctx.body = Body::Ignore;
                    ctx.unparsed += 1;
                } else {
                    buf.extend_from_slice(chunk);
                }
                return;
            }
        }
        Self::apply(ctx, now, facts);
    }

    /// The response body ended normally.
    fn body_end(&self, ctx: &mut Ctx, now: Nanos) {
        let Some(dialect) = ctx.dialect else { return };
        let mut facts = Facts::default();
        match &mut ctx.body {
            Body::Json(buf) => facts = dialect.body(buf),
            // NDJSON may end without a final newline.
            Body::Ndjson(parser) => parser.finish(|ev| facts.merge(dialect.event(&ev))),
            Body::Sse(_) | Body::Ignore => return,
        }
        Self::apply(ctx, now, facts);
    }

    /// Records what one fragment (or a whole body) said.
    fn apply(ctx: &mut Ctx, now: Nanos, facts: Facts) {
        ctx.unparsed += u64::from(facts.unparsed);
        if let Some(stream) = ctx.stream.as_mut() {
            stream.tokens(now, tokens_carried(&facts, stream.counted_tokens()));
            if let Some(total) = facts.exact_total {
                stream.exact_total(total);
            }
        }
        ctx.facts.finished |= facts.finished;
        ctx.facts.error |= facts.error;
    }

    /// Waits in the upstream's queue. While it waits, a client that goes away takes its
    /// request out of the queue at once: to notice, the (small) request body is read first
    /// into pingora's retry buffer, which pingora then sends upstream as the body.
    async fn wait_for_slot(
        &self,
        session: &mut Session,
        limiter: &Arc<Limiter>,
    ) -> Result<Result<Permit, Rejected>> {
        // A body pingora cannot replay (over 64 KiB, or chunked) waits without disconnect
        // detection, bounded by the queue timeout.
        if read_body_ahead(session).await?.is_none() {
            return Ok(limiter.acquire().await);
        }
        let downstream = session.as_mut();
        let acquire = limiter.acquire();
        tokio::pin!(acquire);
        tokio::select! {
            granted = &mut acquire => Ok(granted),
            gone = downstream.read_body_or_idle(true) => match gone {
                // The client closed: dropping `acquire` leaves the queue.
                Err(e) => Err(e.into_down()),
                // Bytes of a pipelined next request: stop watching, keep waiting.
                Ok(_) => Ok(acquire.await),
            },
        }
    }

    /// Adds `stream_options.include_usage` to a streaming OpenAI request that lacks it, so
    /// the count is exact. Reads the body ahead (up to pingora's 64 KiB retry buffer); a
    /// larger, chunked, non-JSON or non-streaming request is forwarded untouched.
    async fn inject_usage(&self, session: &mut Session, ctx: &mut Ctx) -> Result<()> {
        let Some(original) = read_body_ahead(session).await? else {
            return Ok(());
        };
        if let Some(rewritten) = usage::request_with_usage(&original) {
            ctx.rewritten_body = Some(rewritten);
            ctx.strip_usage = Some(UsageStripper::new(self.shared.config.max_event_bytes));
        }
        Ok(())
    }

    /// Answers 429 with `Retry-After` and an OpenAI-style error body.
    async fn reject(&self, session: &mut Session, choice: Choice, why: Rejected) -> Result<()> {
        let name = &self.shared.config.upstreams[choice.upstream].name;
        let limit = self.shared.limiters[choice.upstream]
            .limit()
            .map_or("-".to_owned(), |l| l.to_string());
        let message = match why {
            Rejected::QueueFull => format!("tokentap: upstream {name} is at its concurrency limit ({limit}) and its queue is full"),
            Rejected::QueueTimeout => format!("tokentap: no slot on upstream {name} (limit {limit}) within the queue timeout"),
        };
        let body = serde_json::json!({"error": {"message": message, "type": "rate_limit_exceeded", "code": format!("tokentap_{}", why.label())}})
            .to_string();
        let mut resp = ResponseHeader::build(429, Some(5))?;
        resp.insert_header(http::header::CONTENT_TYPE, "application/json")?;
        resp.insert_header(http::header::RETRY_AFTER, "1")?;
        resp.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
        resp.insert_header(UPSTREAM_HEADER, name.as_str())?;
        close_unless_body_read(session);
        session.write_response_header(Box::new(resp), false).await?;
        session
            .write_response_body(Some(Bytes::from(body)), true)
            .await?;
        Ok(())
    }

    fn outcome(ctx: &Ctx, e: Option<&pingora::Error>) -> Outcome {
        if let Some(e) = e {
            return match e.esource() {
                ErrorSource::Downstream => Outcome::Aborted,
                ErrorSource::Upstream => Outcome::UpstreamError,
                ErrorSource::Internal | ErrorSource::Unset => Outcome::ProxyError,
            };
        }
        match Outcome::from_status(ctx.status) {
            Outcome::Ok if ctx.facts.error => Outcome::StreamError,
            Outcome::Ok
                if matches!(ctx.body, Body::Sse(_) | Body::Ndjson(_)) && !ctx.facts.finished =>
            {
                Outcome::Truncated
            }
            other => other,
        }
    }
}

#[async_trait]
impl ProxyHttp for TokenTap {
    type CTX = Ctx;

    /// None: pingora's default adds a (disabled) compression module that still runs on
    /// every body fragment, and a transparent proxy never re-encodes.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    fn new_ctx(&self) -> Ctx {
        Ctx {
            t0: self.now(),
            dialect: None,
            choice: None,
            stream: None,
            permit: None,
            rejected: false,
            rewritten_body: None,
            strip_usage: None,
            tokenize: false,
            body: Body::Ignore,
            facts: Facts::default(),
            unparsed: 0,
            status: 0,
        }
    }

    /// The front door hands over a request it routed but cannot serve itself (no free slot):
    /// it keeps that choice; a client that already had its `100 Continue` does not get a
    /// second one.
    fn on_connection_reuse(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        prev: Box<dyn std::any::Any + Send + Sync>,
    ) {
        if let Ok(routed) = prev.downcast::<front::Routed>() {
            ctx.choice = routed.choice;
            if routed.continued {
                session
                    .req_header_mut()
                    .remove_header(&http::header::EXPECT);
            }
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.t0 = self.now();
        let req = session.req_header();
        if req.method == http::Method::POST {
            ctx.dialect = Dialect::from_path(req.uri.path());
        }
        let limiters = &self.shared.limiters;
        let choice = match ctx.choice {
            Some(routed) => routed,
            None => self
                .shared
                .router
                .choose(req.uri.path(), &req.headers, |u| limiters[u].has_headroom())
                .ok_or_else(|| Error::explain(HTTPStatus(404), "no route matches"))?,
        };
        ctx.choice = Some(choice);
        ctx.tokenize =
            self.shared.config.upstreams[choice.upstream].estimate == Estimate::Tokenizer;
        if ctx.dialect.is_none() {
            return Ok(false); // caps apply to generation requests only
        }
        if ctx.dialect == Some(Dialect::OpenAi)
            && self.shared.config.upstreams[choice.upstream].inject_usage
        {
            self.inject_usage(session, ctx).await?;
        }
        let limiter = &limiters[choice.upstream];
        ctx.permit = match limiter.try_acquire() {
            Some(p) => Some(p),
            None => match self.wait_for_slot(session, limiter).await? {
                Ok(p) => Some(p),
                Err(why) => {
                    ctx.rejected = true;
                    self.reject(session, choice, why).await?;
                    return Ok(true);
                }
            },
        };
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let choice = ctx
            .choice
            .ok_or_else(|| Error::explain(InternalError, "no upstream chosen"))?;
        if ctx.dialect.is_some() && ctx.stream.is_none() {
            let meter = &self.shared.meters[choice.upstream];
            ctx.stream = Some(meter.begin(ctx.t0, self.now()));
        }
        Ok(Box::new(self.shared.peers[choice.upstream].clone()))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(c) = ctx.choice {
            let host = &self.shared.config.upstreams[c.upstream].host_header;
            req.insert_header(HOST, host.as_str())?;
        }
        if let Some(body) = &ctx.rewritten_body {
            req.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // The whole original body arrives at once, from pingora's retry buffer (and again on
        // a retry): it is swapped for the rewritten one.
        if let (Some(new), Some(_)) = (&ctx.rewritten_body, body.as_ref()) {
            *body = Some(new.clone());
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.on_response_header(resp, ctx)
    }

    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<std::time::Duration>> {
        let now = self.now();
        let payload = body.as_deref().unwrap_or_default();
        if let Some(kept) = self.on_body(ctx, now, payload, end_of_stream) {
            *body = (!kept.is_empty()).then_some(kept);
        }
        Ok(None)
    }

    async fn logging(&self, _session: &mut Session, e: Option<&pingora::Error>, ctx: &mut Ctx) {
        self.finish(ctx, e);
    }
}

// === impl TokenTap: the phases both paths share ===

impl TokenTap {
    /// Reads the response header: the status, how the body is metered, the upstream's name.
    fn on_response_header(&self, resp: &mut ResponseHeader, ctx: &mut Ctx) -> Result<()> {
        ctx.status = resp.status.as_u16();
        if let Some(c) = ctx.choice {
            let name = &self.shared.config.upstreams[c.upstream].name;
            resp.insert_header(UPSTREAM_HEADER, name.as_str())?;
        }
        let encoded = resp
            .headers
            .get(CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        let framing = resp
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| Framing::from_content_type(v.as_bytes()));
        let max = self.shared.config.max_event_bytes;
        ctx.body = match framing {
            _ if ctx.dialect.is_none() || !resp.status.is_success() || encoded => Body::Ignore,
            Some(Framing::Sse) => Body::Sse(SseParser::new(max)),
            Some(Framing::Ndjson) => Body::Ndjson(NdjsonParser::new(max)),
            Some(Framing::Json) => Body::Json(Vec::new()),
            None => Body::Ignore,
        };
        if !matches!(ctx.body, Body::Sse(_)) {
            ctx.strip_usage = None; // only an SSE stream carries a usage chunk to take out
        }
        Ok(())
    }

    /// Meters one fragment of the response body (`end`: the body ended normally). With the
    /// usage chunk being taken out, returns the bytes to forward instead.
    fn on_body(&self, ctx: &mut Ctx, now: Nanos, payload: &[u8], end: bool) -> Option<Bytes> {
        if !payload.is_empty() {
            self.observe(ctx, now, payload);
        }
        // The usage chunk the proxy asked for, and the client did not, is taken out.
        let kept = ctx.strip_usage.as_mut().map(|s| s.push(payload, end));
        if end {
            self.body_end(ctx, now);
        }
        kept
    }

    /// Records how the request ended (`e`: the error that ended it).
    fn finish(&self, ctx: &mut Ctx, e: Option<&pingora::Error>) {
        let Some(choice) = ctx.choice.filter(|_| !ctx.rejected) else {
            return;
        };
        let outcome = Self::outcome(ctx, e);
        let meter = &self.shared.meters[choice.upstream];
        ctx.unparsed += match &ctx.body {
            Body::Sse(p) => p.oversized_events(),
            Body::Ndjson(p) => p.oversized_events(),
            _ => 0,
        };
        meter.count_unparsed(ctx.unparsed);
        match ctx.stream.take() {
            Some(stream) => stream.finish(self.now(), outcome),
            None => meter.count_plain(outcome),
        }
        ctx.permit = None;
    }
}

/// An unread request body makes the connection unusable for the next request.
fn close_unless_body_read(session: &mut Session) {
    if !session.as_mut().is_body_done() {
        session.set_keepalive(None);
    }
}

/// Reads the whole request body ahead into pingora's retry buffer, which pingora then sends
/// upstream as the body (through `request_body_filter`). Only a body with a
/// `Content-Length` that fits the buffer (64 KiB) is read; `None` leaves the body to be
/// streamed as usual. Reading twice is harmless: the second time returns the same bytes.
/// A client waiting for `100 Continue` gets it first (and the upstream never sees the
/// `Expect`: the body it gets is already complete).
async fn read_body_ahead(session: &mut Session) -> Result<Option<Bytes>> {
    if content_length(session).is_none_or(|l| l == 0 || l > RETRY_BUFFER) {
        return Ok(None);
    }
    let expects_continue = session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        session.as_mut().write_continue_response().await?;
        session
            .req_header_mut()
            .remove_header(&http::header::EXPECT);
    }
    let downstream = session.as_mut();
    downstream.enable_retry_buffering();
    while downstream.read_request_body().await?.is_some() {}
    Ok(downstream.get_retry_buffer())
}

fn content_length(session: &Session) -> Option<usize> {
    h1::content_length(&session.req_header().headers).and_then(|l| usize::try_from(l).ok())
}
