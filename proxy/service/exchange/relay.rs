//! The response: its head read and written for the client (`receive`, `opened`: the
//! hop-by-hop fields removed, the client's framing chosen, `Date`, `Connection` and
//! tokentap's fields set), then its body relayed: each upstream fragment read into the
//! thread's scratch buffer, written to the client from there, then handed to the tap
//! ([`Relay::fragment`]); the upstream's silence and the client's stall timed by one lazy
//! timer. A mirror's copy takes the same path with no client: its bytes go nowhere, its
//! metering and its endpoint's health are the primary's.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use pingora::prelude::*;
use pingora::ErrorSource;
use tokio::io::AsyncWrite;
use tokio::time::Instant;

use std::sync::Arc;

use pingora::protocols::http::date::get_cached_date;

use super::{ClientSide, Open, Sent};
use crate::meter::Nanos;
use crate::pool::{Endpoint, Pool};
use crate::routing::Choice;
use crate::service::http1::body::{self, BodyFraming, Chunked};
use crate::service::http1::conn::Io;
use crate::service::http1::head::ResponseHead;
use crate::service::http1::io::{
    down, down_io, forward, poll_client_gone, poll_read_with, up_err, up_io,
};
use crate::service::http1::response::{read_response_head, to_client, ToClient};
use crate::service::record::REQUEST_ID_HEADER;
use crate::service::{Ctx, TokenTap};

thread_local! {
    /// Where a chunked fragment's payload runs are, found while framing it and metered
    /// after it was forwarded (the thread's, so that no request allocates for it).
    static PAYLOAD_RUNS: RefCell<Vec<Range<usize>>> = const { RefCell::new(Vec::new()) };
}

/// A response body being relayed.
pub(super) struct Relay {
    pub(super) framing: BodyFraming,
    pub(super) chunked: Chunked,
    pub(super) to_client: ToClient,
    /// The upstream body ended.
    pub(super) done: bool,
    /// The upstream connection can go back to the pool at the end.
    pub(super) reusable: bool,
}

// === impl TokenTap ===

impl TokenTap {
    /// The response header, read and written for the client with the body bytes that came
    /// with it: the request opened for its body. Nothing reaches the client here either.
    pub(super) async fn receive(
        &self,
        ctx: &mut Ctx,
        client: Option<&mut Io>,
        choice: Choice,
        sent: Sent,
    ) -> Result<Open> {
        let Sent {
            mut up,
            mut watch,
            mut leftover,
            client_side,
        } = sent;
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let endpoint = ctx.endpoint.as_ref().map(|h| Arc::clone(&h.endpoint));
        // Boxed: the wait for the first byte needs it, an open stream does not.
        let head = Box::pin(read_response_head(
            &mut up,
            client.map(|c| (c, &mut watch, &mut leftover)),
            Some(upstream.config.read_timeout),
            |resp, first, bare_lf, watched| {
                self.respond_head(ctx, resp, first, bare_lf, client_side, watched)
            },
        ));
        let opened = head.await;
        if let Some(endpoint) = &endpoint {
            let read_timeout = upstream.config.read_timeout;
            health_after_head(&upstream.pool, endpoint, &opened, ctx.status, read_timeout);
        }
        let (relay, out, keep_alive) = opened?;
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
    fn respond_head(
        &self,
        ctx: &mut Ctx,
        mut resp: ResponseHead,
        first: &[u8],
        bare_lf: bool,
        client_side: ClientSide,
        watched: bool,
    ) -> Result<(Relay, BytesMut, bool)> {
        let ClientSide {
            mut keep_alive,
            http10,
            head_request,
        } = client_side;
        let framing = match resp.framing() {
            _ if head_request => BodyFraming::Empty,
            Some(framing) => framing,
            None => return Err(up_err(InvalidHTTPHeader, "upstream response framing")),
        };
        let reusable = resp.http11
            && framing != BodyFraming::UntilClose
            && !resp.fields.has_token("connection", "close");
        resp.fields.remove_hop_by_hop("transfer-encoding");
        // A transfer coding under the chunks (`gzip, chunked`): neither read nor rewritten
        // (the tap leaves a coded body unread), and forwarded as it came (re-framing it
        // would lose the coding).
        let coded = framing == BodyFraming::Chunked && !resp.only_chunked();
        let content_type = resp.fields.get("content-type");
        let content_encoding = resp.fields.get("content-encoding");
        self.on_response(ctx, resp.status, content_type, content_encoding, coded);
        if framing == BodyFraming::Chunked {
            // RFC 9112 §6.3: `Transfer-Encoding` overrides a `Content-Length`, which a proxy
            // removes (as pingora does).
            resp.fields.remove("content-length");
        }
        if coded && http10 {
            // No transfer coding can reach an HTTP/1.0 client.
            return Err(up_err(
                InvalidHTTPHeader,
                "a transfer coding an HTTP/1.0 client cannot take",
            ));
        }
        let rewritten = ctx.strip_usage.is_some() && framing != BodyFraming::Empty;
        let to_client = to_client(framing, http10, rewritten, bare_lf && !coded);
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
        let [upstream, id] = ctx.added_fields(resp.fields.contains(REQUEST_ID_HEADER));
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
        if !first.is_empty() || matches!(framing, BodyFraming::Empty | BodyFraming::Length(0)) {
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
    pub(super) async fn relay(
        &self,
        mut client: Option<&mut Io>,
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
        let period = read_timeout.unwrap_or(Duration::MAX / 4);
        // (Pinned where it is made: made, then pinned, it was kept twice in every open
        // stream's state.)
        let mut timer = std::pin::pin!(tokio::time::sleep(period));
        // The timer's start, without a clock read of its own.
        let mut last = timer
            .deadline()
            .checked_sub(period)
            .unwrap_or_else(Instant::now);
        let mut stalled: Option<Instant> = None;
        let mut flushing = false;
        // When the fragment being written was read, while its write has not waited: its
        // write ended then too, as far as the upstream's silence is counted, and the clock
        // is not read again for it.
        let mut read_at: Option<Nanos> = None;
        poll_fn(|cx| loop {
            match client.as_deref_mut() {
                // No client (a mirror's copy): what it would get goes nowhere.
                None => {
                    out.clear();
                    if std::mem::take(&mut flushing) {
                        last = Instant::now();
                    }
                }
                Some(client) => {
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
                                read_at = None;
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
                                read_at = None;
                                return stall(cx, timer.as_mut(), &mut stalled, stall_limit);
                            }
                        }
                        stalled = None;
                        // After the write: time spent on a slow client is not upstream
                        // silence.
                        last = match read_at.take() {
                            Some(at) => Instant::from_std(self.live.clock().instant(at)),
                            None => Instant::now(),
                        };
                    }
                }
            }
            if relay.done {
                return Poll::Ready(Ok(()));
            }
            let read = poll_read_with(up, cx, |data, cx| {
                let now = self.now();
                read_at = Some(now);
                let to = client.as_deref_mut().map(|c| (c, cx));
                relay.fragment(self, ctx, now, data, out, to)
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
            if let Some(client) = client.as_deref_mut() {
                if let Some(gone) = poll_client_gone(client, cx, watch, leftover) {
                    return Poll::Ready(Err(gone));
                }
            }
            return silence(cx, timer.as_mut(), last, read_timeout);
        })
        .await
    }
}

/// The upstream has sent nothing for now: pending, or an error once it has been silent
/// for `read_timeout` since `last`.
fn silence<T>(
    cx: &mut Context<'_>,
    mut timer: Pin<&mut tokio::time::Sleep>,
    last: Instant,
    read_timeout: Option<Duration>,
) -> Poll<Result<T>> {
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
    Poll::Pending
}

/// Passive health from a response head read (or not) from `endpoint`, the primary's or a
/// copy's: a reset or close before it ejects at once; a 5xx, or no head within
/// `read_timeout_secs` (a replica that accepts and never answers), is a failure of the
/// `eject_after` in a row that eject. A head under 500 is judged when its body ends
/// ([`health_after_body`]).
pub(super) fn health_after_head<T>(
    pool: &Pool,
    endpoint: &Endpoint,
    head: &Result<T>,
    status: u16,
    read_timeout: Duration,
) {
    match head {
        Ok(_) => pool.answered(endpoint, status),
        Err(e) if e.esource() != &ErrorSource::Upstream => {}
        Err(e) => match e.etype() {
            ConnectionClosed | ReadError => {
                let cause = e.etype().as_str();
                pool.unreachable(endpoint, &format!("before its response head: {cause}"));
            }
            ReadTimedout => pool.failed(
                endpoint,
                &format!(
                    "no response head within read_timeout_secs ({} s)",
                    read_timeout.as_secs()
                ),
            ),
            _ => {}
        },
    }
}

/// Passive health from how the body of a response under 500 from `endpoint` ended: to its
/// end, the endpoint served it (its run of failures ends); gone silent past
/// `read_timeout_secs` or cut by the upstream, a failure. A client that left says nothing
/// of the endpoint.
pub(super) fn health_after_body(
    pool: &Pool,
    endpoint: &Endpoint,
    status: u16,
    body: Result<(), &Error>,
    read_timeout: Duration,
) {
    if status >= 500 {
        return; // counted at its head
    }
    match body {
        Ok(()) => pool.served(endpoint),
        Err(e) if e.esource() != &ErrorSource::Upstream => {}
        Err(e) => match e.etype() {
            ReadTimedout => pool.failed(
                endpoint,
                &format!(
                    "its response body silent for read_timeout_secs ({} s)",
                    read_timeout.as_secs()
                ),
            ),
            ConnectionClosed | ReadError => {
                let cause = e.etype().as_str();
                pool.failed(endpoint, &format!("its response body cut: {cause}"));
            }
            _ => {}
        },
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

// === impl Relay ===

impl Relay {
    /// Meters one upstream fragment (empty at end of stream) and forwards it: appended to
    /// `out`, or, when `out` is empty and `client` is given, written to the client at once.
    pub(super) fn fragment(
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
        let nothing_left = matches!(self.framing, BodyFraming::Empty | BodyFraming::Length(0));
        if data.is_empty() && !nothing_left && self.framing != BodyFraming::UntilClose {
            return Error::e_explain(ConnectionClosed, "upstream closed mid-body");
        }
        // Where the body is in `data`, and in a chunked body where its payload is.
        let n = match self.framing {
            BodyFraming::Empty => 0,
            BodyFraming::Length(left) => {
                let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                self.framing = BodyFraming::Length(left - n as u64);
                n
            }
            BodyFraming::Chunked => PAYLOAD_RUNS
                .with_borrow_mut(|runs| {
                    runs.clear();
                    self.chunked.feed_ranges(data, |run| runs.push(run))
                })
                .or_else(|_| Error::e_explain(InvalidHTTPHeader, "malformed chunked body"))?,
            BodyFraming::UntilClose => data.len(),
        };
        self.done = match self.framing {
            BodyFraming::Empty => true,
            BodyFraming::Length(left) => left == 0,
            BodyFraming::Chunked => self.chunked.done(),
            BodyFraming::UntilClose => data.is_empty(),
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
        // Handed to the tap, once; otherwise framed by tokentap: `kept` is what the client
        // gets (with the usage chunk being taken out, what the tap lets through).
        let mut kept = BytesMut::new();
        let emit = |bytes: &[u8]| match mode {
            ToClient::AsIs => {}
            ToClient::Chunked => body::put_chunk(&mut kept, bytes),
            ToClient::Close => kept.extend_from_slice(bytes),
        };
        let done = self.done;
        if self.framing == BodyFraming::Chunked {
            PAYLOAD_RUNS.with_borrow(|runs| {
                let payloads = runs.iter().map(|run| &body[run.clone()]);
                tap.fragment(ctx, now, payloads, done, emit);
            });
        } else {
            tap.fragment_one(ctx, now, body, done, emit);
        }
        if done && mode == ToClient::Chunked {
            kept.extend_from_slice(body::LAST_CHUNK);
        }
        if mode != ToClient::AsIs {
            ctx.bytes_out += forward(&kept, out, client);
        }
        Ok(())
    }
}
