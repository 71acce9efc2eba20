//! Shadow traffic (`route[].mirror`): a sampled share of a route's generation requests is
//! sent to another upstream as well, with the same method, path, headers (`set_headers`
//! replaced) and body, metered there like any request (its own TTFT, TPOT, curve, exact
//! counts), and its answer read and discarded. The client never sees a byte, header or
//! error of it, and the primary never waits on it: a copy runs in a task of its own, on
//! slots of its own (`max_in_flight`, over it skipped and counted), never in a queue, and
//! goes on after its primary's client leaves unless `cancel_with_client`. When both have
//! finished, the copy and its primary make a pair for `/compare`'s paired verdict.
//!
//! Only a request whose body was read whole (the 64 KiB read-ahead) is copied; a longer one
//! is counted as skipped.

use std::future::poll_fn;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::prelude::*;
use tokio::sync::watch;

use super::relay::{health_after_body, health_after_head, Relay};
use super::upstream::{upstream_request, UpBody};
use crate::compare::paired::{Meeting, Side};
use crate::config::Mirror;
use crate::dialect::Dialect;
use crate::estimate::Estimate;
use crate::meter::{Outcome, Summary};
use crate::routing::Choice;
use crate::service::ctx::Ctx;
use crate::service::failure;
use crate::service::http1::body::{BodyFraming, Chunked};
use crate::service::http1::conn::Io;
use crate::service::http1::head::{RequestHead, ResponseHead};
use crate::service::http1::io::{poll_read_with, up_err, up_io};
use crate::service::http1::response::{read_response_head, ToClient};
use crate::service::record::{self, RequestId};
use crate::service::TokenTap;
use crate::state::{Shadow, Shared};
use crate::usage;

/// What a primary request keeps of its copies: where each pair is made, and the signal
/// that cuts the copies that go with their client.
pub(in crate::service) struct Link {
    meetings: Vec<(Arc<Meeting>, Arc<Shadow>)>,
    cancel: Option<watch::Sender<bool>>,
}

/// A copy's slot on its mirror upstream, freed however the copy ends.
struct InFlight(Arc<Shadow>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

/// One copy to send.
struct Job {
    shared: Arc<Shared>,
    /// The route and the mirror upstream; the mirror's settings are the route's
    /// `mirrors[mirror]` in `shared`.
    choice: Choice,
    mirror: usize,
    head: RequestHead,
    body: Bytes,
    request_id: RequestId,
    dialect: Dialect,
    meeting: Arc<Meeting>,
    cancel: Option<watch::Receiver<bool>>,
    slot: InFlight,
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

fn side_of(s: &Summary, ok: bool) -> Side {
    Side {
        ttft_ms: s.sent_ttft_ms,
        tpot_ms: s.tpot_ms,
        e2e_ms: s.sent_to_last_ms,
        output_tokens: s.output_tokens,
        concurrency: s.concurrency,
        ok,
    }
}

/// Whether `m` samples the request: its share of them, drawn at random or, with `sticky`,
/// from the key's hash (the same key always the same way).
fn sampled(m: &Mirror, req: &RequestHead) -> bool {
    if m.percent >= 100.0 {
        return true;
    }
    let point = match m.sticky.as_ref().and_then(|h| req.fields.get(h.as_str())) {
        // Salted with the mirror's upstream: a route sticky on the same header must not
        // send every mirrored key to one of its arms.
        Some(key) => {
            let mut salted = Vec::with_capacity(key.len() + 16);
            salted.extend_from_slice(&m.upstream.to_le_bytes());
            salted.extend_from_slice(key);
            crate::routing::unit_hash(&salted)
        }
        None => rand::random::<f64>(),
    };
    point * 100.0 < m.percent
}

// === impl TokenTap ===

impl TokenTap {
    /// Sends a copy of a generation request to each of its route's mirrors that samples
    /// it; what the request keeps of them goes in its context. `read_whole`: its body is
    /// all in `body` (else the copies are skipped and counted).
    pub(super) fn mirror(
        &self,
        ctx: &mut Ctx,
        choice: Choice,
        (req, body, read_whole): (&RequestHead, &[u8], bool),
    ) {
        let shared = Arc::clone(&ctx.shared);
        let Some(dialect) = ctx.dialect else { return };
        let route = &shared.config.routes[choice.route];
        let primary = &shared.upstreams[choice.upstream].config.name;
        let mut link = Link {
            meetings: Vec::new(),
            cancel: None,
        };
        let mut body_bytes: Option<Bytes> = None;
        for (j, m) in route.mirrors.iter().enumerate() {
            if !sampled(m, req) {
                continue;
            }
            let shadow = &shared.upstreams[m.upstream].shadow;
            if !read_whole {
                shadow.skipped_body_unread.fetch_add(1, Relaxed);
                continue;
            }
            if shadow.in_flight.fetch_add(1, Relaxed) >= m.max_in_flight {
                shadow.in_flight.fetch_sub(1, Relaxed);
                shadow.skipped_max_in_flight.fetch_add(1, Relaxed);
                continue;
            }
            let slot = InFlight(Arc::clone(shadow));
            let meeting = Arc::new(Meeting::new(primary));
            let cancel = m.cancel_with_client.then(|| {
                link.cancel
                    .get_or_insert_with(|| watch::channel(false).0)
                    .subscribe()
            });
            let job = Job {
                shared: Arc::clone(&shared),
                choice: Choice {
                    route: choice.route,
                    upstream: m.upstream,
                },
                mirror: j,
                head: req.clone(),
                body: body_bytes
                    .get_or_insert_with(|| Bytes::copy_from_slice(body))
                    .clone(),
                request_id: ctx.request_id.clone(),
                dialect,
                meeting: Arc::clone(&meeting),
                cancel,
                slot,
            };
            let tap = TokenTap {
                live: Arc::clone(&self.live),
                transport: Arc::clone(&self.transport),
            };
            tokio::spawn(async move { tap.copy(job).await });
            link.meetings.push((meeting, Arc::clone(shadow)));
        }
        if !link.meetings.is_empty() {
            ctx.mirror = Some(Box::new(link));
        }
    }

    /// Sends one copy, meters its answer and discards it; makes its pair.
    async fn copy(self, job: Job) {
        let Job {
            shared,
            choice,
            mirror,
            mut head,
            body,
            request_id,
            dialect,
            meeting,
            cancel,
            slot,
        } = job;
        let upstream = &shared.upstreams[choice.upstream];
        let name = upstream.config.name.clone();
        let mut ctx = Ctx::new(Arc::clone(&shared), self.now());
        ctx.dialect = Some(dialect);
        ctx.choice = Some(choice);
        ctx.request_id = request_id;
        ctx.tokenize = upstream.config.estimate == Estimate::Tokenizer;
        let held = match upstream.pool.pick(self.now(), false, None, &[]) {
            Ok(held) => held,
            Err(_) => {
                slot.0.skipped_no_endpoint.fetch_add(1, Relaxed);
                return;
            }
        };
        let endpoint = Arc::clone(&held.endpoint);
        ctx.endpoint = Some(held);
        // Counted exactly where the mirror upstream asks for usage (its chunk is read here
        // and discarded with the rest).
        let ask = dialect == Dialect::OpenAi && upstream.config.inject_usage;
        let body = match ask.then(|| usage::request_with_usage(&body)).flatten() {
            Some(asked) => asked,
            None => body,
        };
        let ours = ctx.request_id.is_ours() && shared.config.request_id_upstream;
        let mut wire = BytesMut::with_capacity(512 + body.len());
        // `set_headers`: out of the copied head, and written with tokentap's own.
        let sets = &shared.config.routes[choice.route].mirrors[mirror].set_headers;
        for (name, _) in sets {
            head.fields.remove(name.as_str());
        }
        let extra: Vec<(&str, &[u8])> = sets
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        upstream_request(
            head,
            &endpoint.at.host_header,
            ours.then(|| ctx.request_id.as_str()),
            UpBody::Length(body.len() as u64),
            &extra,
            &mut wire,
        );
        wire.extend_from_slice(&body);
        drop(body);
        let on = Arc::clone(&endpoint.meter);
        ctx.stream = Some(upstream.meter.begin_on(ctx.t0, self.now(), on));

        let exchange = self.copy_exchange(&mut ctx, choice, wire);
        let result = match cancel {
            Some(mut cut) => {
                let cut = async move {
                    // A primary that ended without its client leaving drops the sender:
                    // then the copy runs on.
                    while cut.changed().await.is_ok() {
                        if *cut.borrow() {
                            return;
                        }
                    }
                    std::future::pending::<()>().await;
                };
                tokio::select! {
                    r = exchange => r,
                    () = cut => Err(Error::explain(ConnectionClosed, "its primary's client left")
                        .into_down()),
                }
            }
            None => exchange.await,
        };
        let summary = ctx.stream.as_ref().map(|s| s.summary());
        if let Err(e) = &result {
            let f = failure::of(e, &name);
            record::log_failure(
                &self.live.throttle,
                &ctx.request_id,
                &name,
                ctx.endpoint_url(),
                &f,
            );
        }
        self.finish(&mut ctx, result.as_ref().err().map(|e| &**e));
        let ok = ctx.outcome == Some(Outcome::Ok);
        if let Some(s) = summary {
            if let Some(pair) = meeting.arrive(self.now(), true, side_of(&s, ok)) {
                slot.0.pairs.push(pair);
            }
        }
        drop(slot);
    }

    /// Connects, sends `wire`, reads the answer and discards it, metered.
    async fn copy_exchange(&self, ctx: &mut Ctx, choice: Choice, wire: BytesMut) -> Result<()> {
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let pool = &upstream.pool;
        let mut up = self
            .connect_and_write(
                (pool, upstream.config.queue_timeout),
                (&mut ctx.endpoint, &mut ctx.stream),
                wire,
            )
            .await?;
        let read_timeout = upstream.config.read_timeout;
        let head = read_response_head(&mut up, None, Some(read_timeout), |resp, first, _, _| {
            self.copy_head(ctx, resp, first)
        })
        .await;
        let endpoint = ctx.endpoint.as_ref().map(|h| Arc::clone(&h.endpoint));
        if let Some(endpoint) = &endpoint {
            health_after_head(pool, endpoint, &head, ctx.status, read_timeout);
        }
        let mut relay = head?;
        let body = self.copy_body(ctx, &mut up, &mut relay, read_timeout).await;
        if let Some(endpoint) = &endpoint {
            let ended = body.as_ref().map_err(|e| &**e).copied();
            health_after_body(pool, endpoint, ctx.status, ended, read_timeout);
        }
        body?;
        // A clean connection goes back to the pool, as a primary's does.
        if let (true, Some(held)) = (relay.reusable, ctx.endpoint.as_ref()) {
            self.release(up, &held.endpoint, upstream.config.idle_timeout);
        }
        Ok(())
    }

    /// Reads the copy's body to its end, metered and discarded.
    async fn copy_body(
        &self,
        ctx: &mut Ctx,
        up: &mut Io,
        relay: &mut Relay,
        read_timeout: Duration,
    ) -> Result<()> {
        let mut out = BytesMut::new();
        while !relay.done {
            let read = poll_fn(|cx| {
                poll_read_with(&mut *up, cx, |data, _| {
                    let now = self.now();
                    let r = relay.fragment(self, ctx, now, data, &mut out, None);
                    out.clear(); // discarded: nothing of it goes anywhere
                    r
                })
            });
            match tokio::time::timeout(read_timeout, read).await {
                Err(_) => return Err(up_err(ReadTimedout, "reading the mirror's response body")),
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => return Err(e.into_up()),
                Ok(Err(e)) => return Err(up_io(ReadError, e)),
            }
        }
        Ok(())
    }

    /// The copy's response head: metered as a primary's is, its body to be read and
    /// discarded (the bytes that came with the head first).
    fn copy_head(&self, ctx: &mut Ctx, resp: ResponseHead, first: &[u8]) -> Result<Relay> {
        let Some(framing) = resp.framing() else {
            return Err(up_err(InvalidHTTPHeader, "upstream response framing"));
        };
        let coded = framing == BodyFraming::Chunked && !resp.only_chunked();
        let content_type = resp.fields.get("content-type");
        let content_encoding = resp.fields.get("content-encoding");
        self.on_response(ctx, resp.status, content_type, (content_encoding, coded));
        let reusable = resp.http11
            && framing != BodyFraming::UntilClose
            && !resp.fields.has_token("connection", "close");
        let mut relay = Relay {
            framing,
            chunked: Chunked::default(),
            to_client: ToClient::AsIs,
            done: false,
            reusable,
        };
        if !first.is_empty() || matches!(framing, BodyFraming::Empty | BodyFraming::Length(0)) {
            let mut out = BytesMut::new();
            relay
                .fragment(self, ctx, self.now(), first, &mut out, None)
                .map_err(|e| e.into_up())?;
        }
        Ok(relay)
    }
}
