//! The proxy. `front` accepts client connections and reads each request head, `request`
//! checks it and reads its body ahead, and `direct` proxies it: one path for every request,
//! metered or not, queued or not. Only upgrades (WebSocket and the like) go through
//! pingora-proxy and the thin `impl ProxyHttp` below. The filters (`on_response_header`,
//! `on_body`, `finish`) are a few lines each calling routing, framing, dialect and meter.
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

use crate::config::Config;
use crate::dialect::{tokens_carried, Dialect, Facts, Framing};
use crate::estimate;
use crate::limit::fleet::Slot;
use crate::meter::{Nanos, Outcome, Stream};
use crate::ndjson::NdjsonParser;
use crate::routing::Choice;
use crate::sse::SseParser;
use crate::state::{Live, Shared};
use crate::usage::UsageStripper;
use record::{RequestId, Seen};

mod conn;
mod direct;
mod failure;
mod front;
#[cfg(feature = "fuzzing")]
pub(crate) mod fuzzing;
mod h1;
mod head;
mod record;
mod request;

pub(crate) use conn::Pool;
pub use front::{Connections, Front, FrontService};
pub use record::REQUEST_ID_HEADER;
pub use request::ClientError;

/// The response header naming the upstream that served a request.
pub const UPSTREAM_HEADER: &str = "x-tokentap-upstream";
/// Non-streaming bodies larger than this are forwarded but not read for `usage`.
const MAX_JSON_BODY: usize = 4 << 20;

/// The proxy.
pub struct TokenTap {
    live: Arc<Live>,
    transport: Arc<Transport>,
}

/// The proxy's connections: client connections counted against `server.max_connections`,
/// upstream connections pooled.
pub struct Transport {
    /// TLS upstream connections, pooled (pingora's connector).
    connector: pingora::connectors::TransportConnector,
    /// Idle plain-TCP upstream connections.
    pool: Pool,
    pub connections: Connections,
    /// Turns true when the proxy drains (SIGTERM): no new connections, idle ones closed.
    drain: tokio::sync::watch::Sender<bool>,
}

// === impl Transport ===

impl Transport {
    /// For `config`; without a `server.max_connections`, raises the open-file limit and
    /// derives it from that.
    pub fn new(config: &Config) -> Arc<Transport> {
        let max_connections = config
            .limits
            .max_connections
            .unwrap_or_else(|| connections_for(raise_fd_limit()));
        Arc::new(Transport {
            connector: pingora::connectors::TransportConnector::new(Some(
                pingora::connectors::ConnectorOptions::new(config.keepalive_pool),
            )),
            pool: Pool::new(config.keepalive_pool),
            connections: Connections::new(max_connections),
            drain: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Stops taking connections: the listener stops accepting, idle client connections
    /// close, and each request in flight closes its connection when it ends.
    pub fn drain(&self) {
        self.drain.send_replace(true);
    }

    /// True once [`Transport::drain`] was called.
    fn draining(&self) -> tokio::sync::watch::Receiver<bool> {
        self.drain.subscribe()
    }

    /// Drops idle upstream connections that expired or were closed.
    pub fn sweep(&self) {
        self.pool.sweep(std::time::Instant::now());
    }
}

/// Raises the soft limit on open files to the hard limit (1,024 by default on many hosts,
/// far below what thousands of streams need); returns the limit in force.
fn raise_fd_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!("cannot raise the open-file limit: {e}");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    }
}

/// The default `server.max_connections` under a file limit: each client connection may
/// hold an upstream connection too, and 64 descriptors stay for listeners, the admin API
/// and the rest.
fn connections_for(fd_limit: u64) -> usize {
    usize::try_from(fd_limit.saturating_sub(64) / 2)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// Per-request state.
pub struct Ctx {
    /// The state the request started on, kept until it ends (a reload swaps in another).
    shared: Arc<Shared>,
    t0: Nanos,
    dialect: Option<Dialect>,
    choice: Option<Choice>,
    /// The metered request: in flight until finished (or dropped, which finishes it).
    stream: Option<Stream>,
    /// The concurrency slot, held until the request ends however it ends.
    permit: Option<Slot>,
    /// Removes the usage-only chunk from the response (the client did not ask for it).
    strip_usage: Option<UsageStripper>,
    /// Estimate tokens with the tokenizer rather than one per event.
    tokenize: bool,
    body: Body,
    facts: Facts,
    unparsed: u64,
    status: u16,
    request_id: RequestId,
    /// Bytes written to the client.
    bytes_out: u64,
    /// How the request ended, once it has.
    outcome: Option<Outcome>,
    /// What the access log needs besides, when it is on.
    seen: Option<Box<Seen>>,
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
    pub fn new(live: Arc<Live>, transport: Arc<Transport>) -> Self {
        TokenTap { live, transport }
    }

    fn now(&self) -> Nanos {
        self.live.clock().now()
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
            if let Some(n) = facts.input_tokens {
                stream.input_tokens(n);
            }
        }
        ctx.facts.finished |= facts.finished;
        ctx.facts.error |= facts.error;
        if facts.input_tokens.is_some() {
            ctx.facts.input_tokens = facts.input_tokens;
        }
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
            shared: self.live.load(),
            t0: self.now(),
            dialect: None,
            choice: None,
            stream: None,
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
        }
    }

    /// An upgrade request (the only kind pingora-proxy carries): routed, never capped.
    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.t0 = self.now();
        let req = session.req_header();
        ctx.request_id = RequestId::of(&req.headers);
        let upstreams = &ctx.shared.upstreams;
        let choice = ctx
            .shared
            .router
            .choose(req.uri.path(), &req.headers, |u| {
                upstreams[u].has_headroom()
            })
            .ok_or_else(|| Error::explain(HTTPStatus(404), "no route matches"))?;
        ctx.choice = Some(choice);
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let choice = ctx
            .choice
            .ok_or_else(|| Error::explain(InternalError, "no upstream chosen"))?;
        if ctx.dialect.is_some() && ctx.stream.is_none() {
            let meter = &ctx.shared.upstreams[choice.upstream].meter;
            ctx.stream = Some(meter.begin(ctx.t0, self.now()));
        }
        Ok(Box::new(ctx.shared.upstreams[choice.upstream].peer.clone()))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(c) = ctx.choice {
            let host = &ctx.shared.upstreams[c.upstream].config.host_header;
            req.insert_header(HOST, host.as_str())?;
        }
        // An absolute-form target goes on in origin-form, as on the direct path: the
        // authority the client chose never reaches the upstream.
        if req.uri.authority().is_some() {
            let path = req.uri.path_and_query().map_or("/", |p| p.as_str());
            let origin = http::Uri::try_from(path).map_err(|e| {
                Error::because(InvalidHTTPHeader, "absolute-form request target", e)
            })?;
            req.set_uri(origin);
        }
        if ctx.request_id.is_ours() && ctx.shared.config.request_id_upstream {
            req.insert_header(REQUEST_ID_HEADER, ctx.request_id.as_str())?;
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
        Self::fragment_read(ctx);
        Ok(None)
    }

    async fn logging(&self, _session: &mut Session, e: Option<&pingora::Error>, ctx: &mut Ctx) {
        self.finish(ctx, e);
    }
}

// === impl TokenTap: the phases both paths share ===

impl TokenTap {
    /// Reads the response header on pingora's path: [`TokenTap::on_response`] with the
    /// fields tokentap adds.
    fn on_response_header(&self, resp: &mut ResponseHeader, ctx: &mut Ctx) -> Result<()> {
        let has_id = resp.headers.contains_key(REQUEST_ID_HEADER);
        for (name, value) in Self::added_fields(ctx, has_id).into_iter().flatten() {
            resp.insert_header(name, value)?;
        }
        let first = |name| resp.headers.get(name).map(http::HeaderValue::as_bytes);
        self.on_response(
            ctx,
            resp.status,
            first(CONTENT_TYPE),
            (first(CONTENT_ENCODING), false),
        );
        Ok(())
    }

    /// The fields tokentap adds to a response: the upstream's name, and the request id
    /// unless the upstream sent its own (`has_id`), which is its to keep.
    fn added_fields(ctx: &Ctx, has_id: bool) -> [Option<(&'static str, &str)>; 2] {
        let upstream = ctx.choice.map(|c| {
            (
                UPSTREAM_HEADER,
                ctx.shared.upstreams[c.upstream].config.name.as_str(),
            )
        });
        let id = ctx.request_id.as_str();
        let id = (!id.is_empty() && !has_id).then_some((REQUEST_ID_HEADER, id));
        [upstream, id]
    }

    /// Reads the response header: the status, and how the body is metered from its
    /// `Content-Type` and `Content-Encoding` (their first values). A generation's body
    /// under a coding tokentap does not undo (`Content-Encoding`, or a transfer coding
    /// under the chunks: `transfer_coded`) is forwarded unread and counted as one
    /// unparsed event, its request as one not counted exactly.
    fn on_response(
        &self,
        ctx: &mut Ctx,
        status: http::StatusCode,
        content_type: Option<&[u8]>,
        (content_encoding, transfer_coded): (Option<&[u8]>, bool),
    ) {
        ctx.status = status.as_u16();
        let encoded = transfer_coded
            || content_encoding.is_some_and(|v| !v.eq_ignore_ascii_case(b"identity"));
        let framing = content_type.and_then(Framing::from_content_type);
        let max = ctx.shared.config.max_event_bytes;
        ctx.body = match framing {
            _ if ctx.dialect.is_none() || !status.is_success() => Body::Ignore,
            Some(_) if encoded => {
                ctx.unparsed += 1;
                if let Some(stream) = ctx.stream.as_mut() {
                    stream.unreadable();
                }
                Body::Ignore
            }
            Some(Framing::Sse) => Body::Sse(SseParser::new(max)),
            Some(Framing::Ndjson) => Body::Ndjson(NdjsonParser::new(max)),
            Some(Framing::Json) => Body::Json(Vec::new()),
            None => Body::Ignore,
        };
        if !matches!(ctx.body, Body::Sse(_)) {
            ctx.strip_usage = None; // only an SSE stream carries a usage chunk to take out
        }
        if let Some(seen) = ctx.seen.as_mut() {
            seen.stream = matches!(framing, Some(Framing::Sse | Framing::Ndjson));
        }
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

    /// An upstream fragment has been metered: the events it carried at once are recorded
    /// (see [`crate::meter::Stream::tokens`]).
    fn fragment_read(ctx: &mut Ctx) {
        if let Some(stream) = ctx.stream.as_mut() {
            stream.flush();
        }
    }

    /// Records how the request ended (`e`: the error that ended it).
    fn finish(&self, ctx: &mut Ctx, e: Option<&pingora::Error>) {
        let Some(choice) = ctx.choice else {
            return;
        };
        let outcome = Self::outcome(ctx, e);
        ctx.outcome = Some(outcome);
        let meter = &ctx.shared.upstreams[choice.upstream].meter;
        ctx.unparsed += match &ctx.body {
            Body::Sse(p) => p.oversized_events(),
            Body::Ndjson(p) => p.oversized_events(),
            _ => 0,
        };
        meter.count_unparsed(ctx.unparsed);
        match ctx.stream.take() {
            Some(stream) => {
                if let Some(seen) = ctx.seen.as_mut() {
                    seen.summary = Some(stream.summary());
                }
                stream.finish(self.now(), outcome)
            }
            None => meter.count_plain(outcome),
        }
        ctx.permit = None;
    }
}
