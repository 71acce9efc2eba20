//! The tap: every place the request's flow meets the meter. A generation request's demand
//! is counted as it asks for a slot ([`TokenTap::arrived`]); its record begins when it is
//! sent ([`TokenTap::begin_record`]); the response head says how the body is read (its
//! status, content type and codings: [`TokenTap::on_response`]); each upstream fragment is
//! handed over once ([`TokenTap::fragment`]), its payload runs going through the framing
//! (SSE, NDJSON, a whole JSON body) and the dialect into facts recorded on the request's
//! meter stream, and with usage injected the usage chunk the client did not ask for taken
//! out; when the request ends its outcome is recorded ([`TokenTap::finish`]), and with the
//! access log on its line written ([`TokenTap::log_access`]). Both paths
//! (the direct one, a mirror's copy with it, and pingora-proxy's for upgrades) call these;
//! none of it touches a socket, and nothing else in `service/` touches the meter.
//!
//! The tap never holds or delays a fragment, so the client sees each upstream fragment the
//! moment it arrives; it rewrites one only to take out a usage chunk the proxy asked for
//! and the client did not.

use pingora::ErrorSource;

use super::ctx::{Body, Ctx};
use super::failure::Failure;
use super::record::{self, model_of};
use super::TokenTap;
use crate::dialect::{tokens_carried, Dialect, Facts, Framing};
use crate::estimate;
use crate::meter::{Nanos, Outcome, Summary};
use crate::ndjson::NdjsonParser;
use crate::pool::Endpoint;
use crate::routing::Choice;
use crate::sse::SseParser;
use crate::state::Upstream;

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
                    if let Some(stream) = ctx.stream.as_mut() {
                        stream.unreadable();
                    }
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
            if let Some(n) = facts.cached_input_tokens {
                stream.cached_input_tokens(n);
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
        content_encoding: Option<&[u8]>,
        transfer_coded: bool,
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

    /// A generation request asks `upstream` for a slot: its demand, whether it gets one
    /// now, later or never.
    pub(super) fn arrived(upstream: &Upstream, at: Nanos) {
        upstream.meter.arrived(at);
    }

    /// The request's record begun on `endpoint`, the request sent now; with `body`, its
    /// model (when models are counted), and its GenAI operation (with `metrics.semconv`).
    pub(super) fn begin_record(
        &self,
        ctx: &mut Ctx,
        upstream: &Upstream,
        endpoint: &Endpoint,
        body: Option<&[u8]>,
        operation: Option<&'static str>,
    ) {
        let config = &ctx.shared.config;
        let counted = config.model_label || config.semconv;
        let model = body
            .filter(|_| counted)
            .map(|b| model_of(b).unwrap_or_else(|| "unknown".into()));
        let on = std::sync::Arc::clone(&endpoint.meter);
        let mut stream = upstream.meter.begin_on(ctx.t0, self.now(), on);
        stream.set_model(model);
        if let (true, Some(dialect), Some(operation)) = (config.semconv, ctx.dialect, operation) {
            stream.set_gen_ai(operation, dialect.provider());
        }
        ctx.stream = Some(stream);
    }

    /// The request moved to `to` before it was sent (its connect failed): its record
    /// follows it.
    pub(super) fn moved(stream: &mut Option<crate::meter::Stream>, to: &Endpoint) {
        if let Some(s) = stream.as_mut() {
            s.move_to(std::sync::Arc::clone(&to.meter));
        }
    }

    /// [`TokenTap::fragment`] of a fragment whose body bytes are one run. A non-streamed
    /// reply that came whole in it (the usual short one) is read where it is rather than
    /// copied into the body's buffer first (an allocation, a copy and a free a request).
    pub(super) fn fragment_one(
        &self,
        ctx: &mut Ctx,
        now: Nanos,
        payload: &[u8],
        end: bool,
        emit: impl FnMut(&[u8]),
    ) {
        if let (true, Body::Json(buf), Some(dialect)) = (end, &ctx.body, ctx.dialect) {
            if buf.is_empty() && !payload.is_empty() && payload.len() <= MAX_JSON_BODY {
                let facts = dialect.body(payload);
                // Read: the fragment's metering below passes over it.
                ctx.body = Body::Ignore;
                Self::apply(ctx, now, facts);
            }
        }
        self.fragment(ctx, now, [payload], end, emit);
    }

    /// Meters one upstream fragment, handed over once: each of its payload runs
    /// (`payloads`: a chunked body's, or the body bytes it carried) through the framing and
    /// the dialect, the events it carried recorded at once (see
    /// [`crate::meter::Stream::tokens`]); `end`: the body ended with it. `emit` gets what
    /// the client is to get of each run when tokentap frames the body itself: the run, or,
    /// with the usage chunk being taken out, what the stripper lets through (and at the
    /// end what it held back).
    #[inline]
    pub(super) fn fragment<'a>(
        &self,
        ctx: &mut Ctx,
        now: Nanos,
        payloads: impl IntoIterator<Item = &'a [u8]>,
        end: bool,
        mut emit: impl FnMut(&[u8]),
    ) {
        for payload in payloads {
            if payload.is_empty() {
                continue;
            }
            self.observe(ctx, now, payload);
            match ctx.strip_usage.as_mut() {
                // The usage chunk the proxy asked for, and the client did not, taken out.
                Some(s) => emit(&s.push(payload, false)),
                None => emit(payload),
            }
        }
        if end {
            if let Some(s) = ctx.strip_usage.as_mut() {
                emit(&s.push(&[], true));
            }
            self.body_end(ctx, now);
        }
        if let Some(stream) = ctx.stream.as_mut() {
            stream.flush();
        }
    }

    /// Records how the request ended (`e`: the error that ended it).
    pub(super) fn finish(&self, ctx: &mut Ctx, e: Option<&pingora::Error>) {
        self.finish_at(ctx, e, self.now());
    }

    /// [`TokenTap::finish`] at `now`, the clock read by the caller for the request's end.
    pub(super) fn finish_at(&self, ctx: &mut Ctx, e: Option<&pingora::Error>, now: Nanos) {
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
        // Its endpoint's slot is given back before the meter counts it ended, and its cap's
        // slot after: `/stats` reads them in the reverse order (see `admin::report`).
        if let Some(held) = ctx.endpoint.as_mut() {
            held.end(matches!(
                outcome,
                Outcome::ServerError | Outcome::UpstreamError | Outcome::Truncated
            ));
        }
        let mirrored = ctx.mirror.take();
        match ctx.stream.take() {
            Some(stream) => {
                if let Some(seen) = ctx.seen.as_mut() {
                    seen.metered = Some(stream.summary().into());
                }
                if ctx.who.is_some() {
                    self.settle(ctx, choice, outcome, stream.summary());
                }
                let summary = mirrored.as_ref().map(|_| stream.summary());
                stream.finish(now, outcome);
                if let Some(link) = mirrored {
                    link.primary_done(now, outcome, summary);
                }
            }
            None => {
                meter.count_plain(outcome);
                if let Some(link) = mirrored {
                    link.primary_done(now, outcome, None);
                }
            }
        }
        if let Some(slot) = ctx.permit.take() {
            slot.release_at(self.live.clock().instant(now));
        }
    }

    /// A metered request ended: its tenant's fair-queue charge and budget reservation made
    /// exact, and its figures booked to its tenant (with `[tenants]`).
    /// A body that could not be read keeps its reservation and its fair charge as made up
    /// front: a count of nothing would refund a generation it never saw.
    fn settle(&self, ctx: &mut Ctx, choice: Choice, outcome: Outcome, s: Summary) {
        if let Some(slot) = ctx.permit.as_mut().filter(|_| !s.unread) {
            slot.settle(s.output_tokens);
        }
        let Some(mut t) = ctx.who.take() else {
            return;
        };
        match t.reservation.take() {
            Some(r) if s.unread => r.keep(s.output_tokens),
            Some(r) => r.settle(s.output_tokens),
            None => {}
        }
        let shared = &ctx.shared;
        let targets = &shared.upstreams[choice.upstream].config.targets;
        let judged = targets.any().then(|| {
            targets.judge(&crate::meter::Judged {
                outcome,
                ttft_ms: s.ttft_ms,
                tpot_ms: s.tpot_ms,
                e2e_ms: self.now().saturating_sub(ctx.t0) as f64 / 1e6,
            })
        });
        let served = crate::tenant::book::Served {
            input_tokens: ctx.facts.input_tokens.unwrap_or(0),
            output_tokens: s.output_tokens,
            ttft_ms: s.ttft_ms,
            tpot_ms: s.tpot_ms,
            queue_ms: t.queue_ms,
            good: judged.flatten().map(|v| v == crate::meter::Verdict::Good),
        };
        let now = std::time::Instant::now();
        (shared.book).served(&t.who.tenant, now, shared.config.window, served);
    }

    /// Writes the access-log line of a request that ended.
    pub(super) fn log_access(&self, ctx: &Ctx, failure: Option<&Failure>) {
        let Some(seen) = ctx.seen.as_deref() else {
            return;
        };
        let metered = seen.metered;
        let outcome = ctx
            .outcome
            .unwrap_or_else(|| Outcome::from_status(ctx.status));
        let line = record::Line {
            ts: record::Timestamp::now(),
            request_id: ctx.request_id.as_str(),
            method: seen.method.as_str(),
            path: &seen.path,
            upstream: ctx
                .choice
                .map(|c| ctx.shared.upstreams[c.upstream].config.name.as_str()),
            endpoint: ctx.endpoint_url(),
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
            ttft_ms: metered.and_then(|m| m.ttft_ms),
            tpot_ms: metered.and_then(|m| m.tpot_ms),
            e2e_ms: self.now().saturating_sub(ctx.t0) as f64 / 1e6,
            input_tokens: ctx.facts.input_tokens,
            output_tokens: metered.map(|m| m.output_tokens),
            counts: metered.map(|m| if m.exact { "exact" } else { "estimated" }),
            bytes_out: ctx.bytes_out,
            client: seen.client,
        };
        self.live.access.write(|out| line.write(out));
    }
}
