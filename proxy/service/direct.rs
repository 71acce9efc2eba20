//! The direct streaming path: a metered generation request proxied by tokentap's own
//! HTTP/1.1 loop on tokio's sockets (`conn`), on pingora's runtime.
//!
//! pingora-proxy runs every request as an upstream half and a downstream half that hand
//! each body fragment over a channel, through its cache, module and range machinery, in
//! request futures of ~20 KiB with a 64 KiB upstream body buffer per stream (57–61 KiB per
//! stream in all: README, "What changed"). Here one small future reads each upstream fragment into the worker
//! thread's scratch buffer, writes it to the client straight from there and then meters
//! it: an open stream holds no buffer of its own except bytes a slow client has not taken
//! yet, and a chunked body is forwarded as it came, its framing decoded in place.
//!
//! [`Front`](super::front::Front) sends a request here only when tokentap can do exactly
//! what pingora-proxy would: an HTTP/1.1 `POST` to a metered path, origin-form, without
//! `Upgrade` or an `Expect` other than `100-continue`, with one `Content-Length` of at
//! most 64 KiB and no `Transfer-Encoding`, its body read whole, on an upstream with a free
//! concurrency slot. The upstream request
//! is the client's minus its hop-by-hop fields, with the upstream's `Host` and the length
//! of the body actually sent, so framing cannot be smuggled; the response is forwarded
//! through the same filters, with `Date` and `Connection` set as pingora's server session
//! sets them.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderName};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::protocols::http::v1::client::http_req_header_to_wire;
use pingora::upstreams::peer::{HttpPeer, Peer};
use pingora::ErrorSource;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{timeout, Instant};

use super::conn::Io;
use super::h1::{self, Chunked, Framing, Head};
use super::{Ctx, TokenTap, HOST};
use crate::dialect::Dialect;
use crate::limit::Permit;
use crate::meter::Nanos;
use crate::routing::Choice;
use crate::usage::{self, UsageStripper};

/// Hop-by-hop fields (RFC 9110 §7.6.1, and the obsolete ones proxies still meet), never
/// forwarded; the fields the client's `Connection` names are removed too.
const HOP_BY_HOP: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
    "expect",
];

/// Attempts at connecting: a connect that failed in a way pingora marks retryable is tried
/// once more. A request that was sent is never sent again (a generation would run twice),
/// as on pingora-proxy's path and nginx's default for POST.
const ATTEMPTS: usize = 2;

/// The worker thread's read buffer: every read lands here and is forwarded from here, so an
/// open stream waiting for its next token holds no read buffer of its own.
const SCRATCH: usize = 32 * 1024;

thread_local! {
    static SCRATCH_BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH].into_boxed_slice());
}

/// Reads what `io` has into the thread's scratch buffer and hands it to `f` (an empty slice
/// at end of stream). `f` must not read from a connection itself.
fn poll_read_with<R>(
    io: &mut Io,
    cx: &mut Context<'_>,
    f: impl FnOnce(&[u8], &mut Context<'_>) -> R,
) -> Poll<io::Result<R>> {
    SCRATCH_BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        let mut read = ReadBuf::new(&mut buf[..]);
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

/// A request [`Front`](super::front::Front) parsed, read whole and found fit for the direct
/// path, with its concurrency slot. Passed boxed: an async fn keeps room for its arguments
/// for its whole life, and the request header is done with once it is sent.
pub(super) struct Admitted {
    pub(super) req: RequestHeader,
    pub(super) body_len: usize,
    pub(super) choice: Choice,
    pub(super) permit: Permit,
    /// When its head had arrived.
    pub(super) t0: Nanos,
}

impl Admitted {
    /// Moved out of its box, which is freed now rather than when the request ends.
    fn unboxed(self: Box<Self>) -> Self {
        *self
    }
}

/// What the connection can do after a direct request.
pub(super) enum After {
    /// Serve the next request on it.
    KeepAlive,
    Close,
    /// Close after a lingering read: the client sent bytes past its request.
    Linger,
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

/// A response body being relayed.
struct Relay {
    framing: Framing,
    chunked: Chunked,
    /// The client gets a body tokentap frames as chunks (usage stripped, or an upstream body
    /// ended by close); otherwise it gets the upstream's bytes as they are.
    reframe: bool,
    /// The upstream body ended.
    done: bool,
    /// The upstream connection can go back to the pool at the end.
    reusable: bool,
}

// === impl TokenTap ===

impl TokenTap {
    /// Proxies an admitted request whose head is parsed and whose first body bytes are
    /// `body`; its outcome is recorded however it ends.
    pub(super) async fn serve_direct(
        &self,
        client: &mut Io,
        admitted: Box<Admitted>,
        body: BytesMut,
        shutdown: bool,
    ) -> After {
        let Admitted {
            req,
            body_len,
            choice,
            permit,
            t0,
        } = admitted.unboxed();
        let mut ctx = self.new_ctx();
        ctx.t0 = t0;
        ctx.dialect = Dialect::from_path(req.uri.path());
        ctx.choice = Some(choice);
        ctx.tokenize = self.shared.config.upstreams[choice.upstream].estimate
            == crate::estimate::Estimate::Tokenizer;
        ctx.permit = Some(permit);
        // Boxed: setting up is a large future needed only until the response header; kept
        // inline, every open stream would hold its space.
        let opened = Box::pin(self.open(client, &mut ctx, (req, body_len, choice), body, shutdown));
        let opened = opened.await;
        if let Err(e) = &opened {
            // Nothing reached the client yet: answer as pingora-proxy would.
            let status = match e.esource() {
                ErrorSource::Upstream => Some(502),
                ErrorSource::Downstream => None,
                ErrorSource::Internal | ErrorSource::Unset => Some(500),
            };
            if let Some(status) = status {
                let _ = write_error(client, status).await;
            }
        }
        let result = match opened {
            Ok(mut open) => {
                let peer = &self.shared.peers[choice.upstream];
                let relayed = self
                    .relay(client, &mut ctx, &mut open, peer.options.read_timeout)
                    .await;
                relayed.map(|()| {
                    if open.relay.reusable {
                        let idle = self.shared.config.upstreams[choice.upstream].idle_timeout;
                        match open.up {
                            Io::Tcp(tcp) => {
                                let now = std::time::Instant::now();
                                self.shared.pool.release(choice.upstream, tcp, now, idle);
                            }
                            Io::Pingora(tls) => {
                                let hash = peer.reuse_hash();
                                self.shared.connector.release_stream(tls, hash, Some(idle));
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
                })
            }
            Err(e) => Err(e),
        };
        self.finish(&mut ctx, result.as_ref().err().map(|e| &**e));
        result.unwrap_or(After::Close)
    }

    /// Everything up to the response body: the upstream request (usage injected), the
    /// connection, the response header. Nothing reaches the client here (`serve_direct`
    /// answers an error); after, an error cuts the connection, as pingora-proxy does.
    async fn open(
        &self,
        client: &mut Io,
        ctx: &mut Ctx,
        (req, body_len, choice): (RequestHeader, usize, Choice),
        mut body: BytesMut,
        shutdown: bool,
    ) -> Result<Open> {
        // Bytes past the body are a pipelined next request, which (as on pingora's default)
        // closes the connection after this response.
        let mut leftover = body.split_off(body_len);
        let mut body = body.freeze();
        let upstream = &self.shared.config.upstreams[choice.upstream];
        if ctx.dialect == Some(Dialect::OpenAi) && upstream.inject_usage {
            if let Some(rewritten) = usage::request_with_usage(&body) {
                body = rewritten;
                ctx.strip_usage = Some(UsageStripper::new(self.shared.config.max_event_bytes));
            }
        }
        let mut keep_alive = !shutdown && !h1::has_token(&req.headers, header::CONNECTION, "close");
        let up_req = self.upstream_request(&req, choice, body.len())?;
        drop(req);
        let Some(mut wire) = http_req_header_to_wire(&up_req) else {
            return Error::e_explain(InvalidHTTPHeader, "request target");
        };
        drop(up_req);
        wire.extend_from_slice(&body);
        drop(body);

        let meter = &self.shared.meters[choice.upstream];
        ctx.stream = Some(meter.begin(ctx.t0, self.now()));
        let peer = &self.shared.peers[choice.upstream];
        let mut watch = true;
        // Boxed: connecting (TCP, TLS, the pool) is a large future, needed only until the
        // response header; kept inline, every open stream would hold its space.
        let send = Box::pin(self.send(choice.upstream, peer, wire));
        let sent = watching(client, &mut watch, &mut leftover, send).await;
        let (up, mut resp, first) = sent?;
        let Some(framing) = Framing::of(&resp) else {
            return Err(up_err(InvalidHTTPHeader, "upstream response framing"));
        };
        let reusable = resp.version == http::Version::HTTP_11
            && framing != Framing::UntilClose
            && !h1::has_token(&resp.headers, header::CONNECTION, "close");
        self.on_response_header(&mut resp, ctx)?;
        if framing == Framing::Chunked {
            // RFC 9112 §6.3: `Transfer-Encoding` overrides a `Content-Length`, which a proxy
            // removes (as pingora does); and chunked is HTTP/1.1.
            resp.remove_header(&header::CONTENT_LENGTH);
            resp.set_version(http::Version::HTTP_11);
            if !h1::only_chunked(&resp.headers) {
                // A compressed transfer coding: neither read nor rewritten.
                ctx.ignore_body();
            }
        }
        let reframe = framing == Framing::UntilClose
            || (ctx.strip_usage.is_some() && framing != Framing::Empty);
        if reframe {
            // As pingora-proxy: a body without a length goes on chunked, so the client
            // connection survives it; so does a body whose length stripping changes.
            resp.set_version(http::Version::HTTP_11);
            resp.remove_header(&header::CONTENT_LENGTH);
            resp.insert_header(header::TRANSFER_ENCODING, "chunked")?;
        }
        resp.insert_header(
            header::DATE,
            pingora::protocols::http::date::get_cached_date(),
        )?;
        keep_alive &= leftover.is_empty() && watch;
        let connection = if keep_alive { "keep-alive" } else { "close" };
        resp.insert_header(header::CONNECTION, connection)?;
        let mut out = BytesMut::with_capacity(512 + first.len());
        h1::write_response(&resp, &mut out);
        drop(resp);

        let mut relay = Relay {
            framing,
            chunked: Chunked::default(),
            reframe,
            done: false,
            reusable,
        };
        // The body bytes that came with the header (an empty read is the end of stream).
        if !first.is_empty() || matches!(framing, Framing::Empty | Framing::Length(0)) {
            relay
                .fragment(self, ctx, self.now(), &first, &mut out, None)
                .map_err(|e| e.into_up())?;
        }
        drop(first);
        Ok(Open {
            up,
            relay,
            out,
            watch,
            leftover,
            keep_alive,
        })
    }

    /// Forwards the response body until it ends: each upstream fragment is written to the
    /// client from the thread's scratch buffer and metered; only what the client has not
    /// taken yet is copied, into `out`, and the upstream is not read again until it has.
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
        // The read timeout, kept lazily: one timer per timeout period, which when it fires
        // checks the time of the last fragment written.
        let mut last = Instant::now();
        let timer = tokio::time::sleep(read_timeout.unwrap_or(Duration::MAX / 4));
        tokio::pin!(timer);
        let mut flushing = false;
        poll_fn(|cx| loop {
            while !out.is_empty() {
                match Pin::new(&mut *client).poll_write(cx, out) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(down(WriteError, "client took 0 bytes")))
                    }
                    Poll::Ready(Ok(n)) if n == out.len() => *out = BytesMut::new(), // its memory too
                    Poll::Ready(Ok(n)) => out.advance(n),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(down_io(WriteError, e))),
                    Poll::Pending => return Poll::Pending,
                }
                flushing = true;
            }
            if flushing {
                match Pin::new(&mut *client).poll_flush(cx) {
                    Poll::Ready(Ok(())) => flushing = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(down_io(WriteError, e))),
                    Poll::Pending => return Poll::Pending,
                }
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

    /// The request as the upstream gets it.
    fn upstream_request(
        &self,
        client: &RequestHeader,
        choice: Choice,
        body_len: usize,
    ) -> Result<RequestHeader> {
        let mut req = client.clone();
        let named: Vec<HeaderName> = req
            .headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::try_from(t.trim()).ok())
            .collect();
        for name in named.iter().chain(&HOP_BY_HOP.map(HeaderName::from_static)) {
            req.remove_header(name);
        }
        let host = &self.shared.config.upstreams[choice.upstream].host_header;
        req.insert_header(HOST, host.as_str())?;
        req.insert_header(header::CONTENT_LENGTH, body_len.to_string())?;
        Ok(req)
    }

    /// A pooled connection to `upstream`, else a new one. Plain TCP is tokio's own, pooled
    /// in [`Pool`](super::Pool); TLS is pingora's connector and pool. (pingora's connect
    /// future, with TLS, proxies and socket options tokentap does not set, is 8.5 KiB: a
    /// burst of thousands of new streams would leave that much per stream behind in the
    /// allocator.)
    async fn connect(&self, upstream: usize, peer: &HttpPeer) -> Result<Io> {
        let plain = match peer._address {
            pingora::protocols::l4::socket::SocketAddr::Inet(addr) if !peer.is_tls() => Some(addr),
            _ => None,
        };
        let Some(addr) = plain else {
            let connector = &self.shared.connector;
            if let Some(pooled) = connector.reused_stream(peer).await {
                return Ok(Io::Pingora(pooled));
            }
            return Box::pin(connector.new_stream(peer)).await.map(Io::Pingora);
        };
        if let Some(pooled) = self.shared.pool.take(upstream, std::time::Instant::now()) {
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

    /// Sends the request (head and body in one write) and reads the response header, past
    /// any 1xx; returns the connection, the header and the body bytes read with it.
    async fn send(
        &self,
        upstream: usize,
        peer: &HttpPeer,
        wire: BytesMut,
    ) -> Result<(Io, ResponseHeader, BytesMut)> {
        let mut attempt = 0;
        let mut up = loop {
            attempt += 1;
            match self.connect(upstream, peer).await {
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
        let write = async {
            up.write_all(&wire).await?;
            up.flush().await
        };
        match peer.options.write_timeout {
            Some(t) => match timeout(t, write).await {
                Ok(r) => r.map_err(|e| up_io(WriteError, e))?,
                Err(_) => return Err(up_err(WriteTimedout, "writing the request")),
            },
            None => write.await.map_err(|e| up_io(WriteError, e))?,
        }
        drop(wire);
        let mut buf = BytesMut::new();
        loop {
            let read = read_more(&mut up, &mut buf);
            let n = match peer.options.read_timeout {
                Some(t) => match timeout(t, read).await {
                    Ok(r) => r.map_err(|e| up_io(ReadError, e))?,
                    Err(_) => return Err(up_err(ReadTimedout, "reading the response header")),
                },
                None => read.await.map_err(|e| up_io(ReadError, e))?,
            };
            if n == 0 {
                return Err(up_err(
                    ConnectionClosed,
                    "upstream closed before its header",
                ));
            }
            // Informational responses are skipped (the client gets the final one).
            loop {
                match h1::response(&buf) {
                    Head::Complete(resp, _)
                        if resp.status == http::StatusCode::SWITCHING_PROTOCOLS =>
                    {
                        return Err(up_err(
                            InvalidHTTPHeader,
                            "101 to a request without Upgrade",
                        ));
                    }
                    Head::Complete(resp, len) => {
                        buf.advance(len);
                        if !resp.status.is_informational() {
                            return Ok((up, resp, buf));
                        }
                    }
                    Head::Invalid => {
                        return Err(up_err(InvalidHTTPHeader, "upstream response header"))
                    }
                    Head::Partial if buf.len() > h1::MAX_RESPONSE_HEAD => {
                        return Err(up_err(
                            InvalidHTTPHeader,
                            "upstream response header too large",
                        ))
                    }
                    Head::Partial => break, // read more
                }
            }
        }
    }
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
        // Where the body is in `data`.
        let chunked_before = self.chunked.clone();
        let n = match self.framing {
            Framing::Empty => 0,
            Framing::Length(left) => {
                let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                self.framing = Framing::Length(left - n as u64);
                n
            }
            Framing::Chunked => self
                .chunked
                .feed(data, |_| {})
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
        // Forwarded as it came before it is metered: the client does not wait on the meter.
        if !self.reframe {
            forward(body, out, client);
        }
        // Metered; with the usage chunk being taken out, `kept` is what the client gets.
        let mut kept = BytesMut::new();
        let mut keep = |kept_now: Option<Bytes>| {
            if let Some(k) = kept_now {
                h1::put_chunk(&mut kept, &k);
            }
        };
        if self.framing == Framing::Chunked {
            // The same bytes again from the same state: the payload, which cannot fail now.
            let mut decoder = chunked_before;
            let _ = decoder.feed(body, |payload| keep(tap.on_body(ctx, now, payload, false)));
        } else if !body.is_empty() {
            keep(tap.on_body(ctx, now, body, false));
        }
        if self.done {
            // What a stripper held back, and the end of a JSON or NDJSON body.
            keep(tap.on_body(ctx, now, &[], true));
        }
        if !self.reframe {
            return Ok(());
        }
        if self.framing == Framing::UntilClose && ctx.strip_usage.is_none() {
            h1::put_chunk(&mut kept, body);
        }
        if self.done {
            kept.extend_from_slice(h1::LAST_CHUNK);
        }
        out.extend_from_slice(&kept);
        Ok(())
    }
}

/// Writes `bytes` to the client now when nothing is queued before them, queueing what it
/// does not take.
fn forward(bytes: &[u8], out: &mut BytesMut, client: Option<(&mut Io, &mut Context<'_>)>) {
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

/// Answers `code` as pingora does when proxying fails, and closes.
pub(super) async fn write_error(client: &mut Io, code: u16) -> io::Result<()> {
    let mut resp = pingora::protocols::http::error_resp::gen_error_response(code);
    let _ = resp.insert_header(
        header::DATE,
        pingora::protocols::http::date::get_cached_date(),
    );
    let _ = resp.insert_header(header::CONNECTION, "close");
    let mut out = BytesMut::with_capacity(256);
    h1::write_response(&resp, &mut out);
    client.write_all(&out).await?;
    client.flush().await
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
