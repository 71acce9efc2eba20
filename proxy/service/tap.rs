//! The tap: what the request's flow hands over of a response, turned into the meter's
//! record. The response head says how the body is read (its status, content type and
//! codings); each payload run goes through the framing (SSE, NDJSON, a whole JSON body) and
//! the dialect into facts, recorded on the request's meter stream; with usage injected, the
//! usage chunk the client did not ask for is taken out. When the request ends, its outcome
//! is recorded. Both paths (the direct one and pingora-proxy's for upgrades) call these;
//! none of it touches a socket.
//!
//! The tap never holds or delays a fragment, so the client sees each upstream fragment the
//! moment it arrives; it rewrites one only to take out a usage chunk the proxy asked for
//! and the client did not.

use bytes::Bytes;
use pingora::ErrorSource;

use super::ctx::{Body, Ctx};
use super::TokenTap;
use crate::dialect::{tokens_carried, Facts, Framing};
use crate::estimate;
use crate::meter::{Nanos, Outcome};
use crate::ndjson::NdjsonParser;
use crate::sse::SseParser;

/// Non-streaming bodies larger than this are forwarded but not read for `usage`.
const MAX_JSON_BODY: usize = 4 << 20;

// === impl TokenTap ===

impl TokenTap {
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
    // Inlined into each caller as when they shared the service's module: a call per
    // payload run on the hot path (callgrind, short scenario: +300 instructions a request
    // out of line).
    #[inline]
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

    /// Reads the response header: the status, and how the body is metered from its
    /// `Content-Type` and `Content-Encoding` (their first values). A generation's body
    /// under a coding tokentap does not undo (`Content-Encoding`, or a transfer coding
    /// under the chunks: `transfer_coded`) is forwarded unread and counted as one
    /// unparsed event, its request as one not counted exactly.
    pub(super) fn on_response(
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
    #[inline]
    pub(super) fn on_body(
        &self,
        ctx: &mut Ctx,
        now: Nanos,
        payload: &[u8],
        end: bool,
    ) -> Option<Bytes> {
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
    #[inline]
    pub(super) fn fragment_read(ctx: &mut Ctx) {
        if let Some(stream) = ctx.stream.as_mut() {
            stream.flush();
        }
    }

    /// Records how the request ended (`e`: the error that ended it).
    pub(super) fn finish(&self, ctx: &mut Ctx, e: Option<&pingora::Error>) {
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
        let mirrored = ctx.mirror.take();
        match ctx.stream.take() {
            Some(stream) => {
                if let Some(seen) = ctx.seen.as_mut() {
                    seen.summary = Some(stream.summary());
                }
                let summary = mirrored.as_ref().map(|_| stream.summary());
                stream.finish(self.now(), outcome);
                if let Some(link) = mirrored {
                    link.primary_done(self.now(), outcome, summary);
                }
            }
            None => {
                meter.count_plain(outcome);
                if let Some(link) = mirrored {
                    link.primary_done(self.now(), outcome, None);
                }
            }
        }
        if let Some(held) = ctx.endpoint.as_mut() {
            held.end(matches!(
                outcome,
                Outcome::ServerError | Outcome::UpstreamError | Outcome::Truncated
            ));
        }
        ctx.permit = None;
    }
}
