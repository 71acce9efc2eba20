//! The request sent upstream: its bytes made (`outgoing`: usage asked for, the record
//! begun), the connection (pooled plain TCP, or pingora's TLS
//! connector), a connect that failed tried once more, the head written for the upstream
//! with the body read ahead, and the rest of the body streamed.

use std::io::{self, IoSlice, Write as _};
use std::pin::{pin, Pin};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::prelude::*;
use pingora::upstreams::peer::{HttpPeer, Peer as _};
use tokio::io::AsyncWriteExt;
use tokio::time::timeout;

use std::sync::Arc;

use super::{client_error, ClientSide, Ready};
use crate::config::Limits;
use crate::dialect::Dialect;
use crate::pool::{Held, Unplaced};
use crate::routing::Choice;
use crate::service::ctx::Ctx;
use crate::service::http1::body;
use crate::service::http1::conn::Io;
use crate::service::http1::head::RequestHead;
use crate::service::http1::io::{down, down_io, in_time, read_more, up_err, up_io};
use crate::service::http1::request::BodyKind;
use crate::service::http1::request::{ClientError, Rest};
use crate::service::record::REQUEST_ID_HEADER;
use crate::service::TokenTap;
use crate::state::Upstream;
use crate::usage::{self, Insertion, UsageStripper};

/// Attempts at connecting: a connect that failed in a way pingora marks retryable is tried
/// once more. A request that was sent is never sent again (a generation would run twice),
/// as on pingora-proxy's path and nginx's default for POST.
const ATTEMPTS: usize = 2;

/// How the upstream request's body is framed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum UpBody {
    None,
    Length(u64),
    Chunked,
}

/// A request's bytes as the upstream gets them: its head (with a chunked body's first
/// chunk), then its body in up to three parts, written with one vectored write: the body as
/// read, or its two parts around usage asked for (the client's bytes never copied again,
/// whatever their length, for the request or a mirror's copy of it).
pub(super) struct Wire {
    pub(super) head: BytesMut,
    pub(super) body: [Bytes; 3],
}

impl Wire {
    /// `head`, then `body` with `insertion` written in.
    pub(super) fn new(head: BytesMut, body: &Bytes, insertion: Option<Insertion>) -> Wire {
        let body = match insertion {
            None => [body.clone(), Bytes::new(), Bytes::new()],
            Some(Insertion { at, text }) => {
                [body.slice(..at), Bytes::from_static(text), body.slice(at..)]
            }
        };
        Wire { head, body }
    }

    /// The length of `body` as sent, with `insertion` written in.
    pub(super) fn body_len(body: &[u8], insertion: Option<Insertion>) -> u64 {
        (body.len() + insertion.map_or(0, |i| i.text.len())) as u64
    }

    /// Writes it all to `up`: one system call unless the socket takes less.
    async fn write_to(&self, up: &mut Io) -> io::Result<()> {
        let parts = [&self.head[..], &self.body[0], &self.body[1], &self.body[2]];
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut done = 0;
        while done < total {
            // What is left of the parts, empty ones left out.
            let (mut skip, mut n) = (done, 0);
            let mut slices = [IoSlice::new(&[]); 4];
            for part in parts {
                let from = skip.min(part.len());
                skip -= from;
                if from < part.len() {
                    slices[n] = IoSlice::new(&part[from..]);
                    n += 1;
                }
            }
            match up.write_vectored(&slices[..n]).await? {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                n => done += n,
            }
        }
        Ok(())
    }
}

/// What goes upstream: the client's head and body as read so far.
pub(super) struct Outgoing {
    pub(super) req: RequestHead,
    pub(super) kind: BodyKind,
    pub(super) body: Bytes,
    pub(super) rest: Rest,
}

// === impl TokenTap ===

impl TokenTap {
    /// The upstream request's bytes (usage injected), and the request's record begun.
    pub(super) fn ready(
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
        let operation = ctx
            .dialect
            .map(|d| d.operation(&crate::routing::path::canonical(req.uri.path())));
        let http10 = !req.http11;
        let head_request = req.method == http::Method::HEAD;
        let keep_alive = !shutdown && !http10 && !req.fields.has_token("connection", "close");
        let read_whole = matches!(rest, Rest::Done);
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let insertion = read_whole
            .then(|| usage_asked(ctx, upstream, &body))
            .flatten();
        if insertion.is_some() {
            // The client gets no usage chunk it did not ask for.
            ctx.strip_usage = Some(Box::new(UsageStripper::new(shared.config.max_event_bytes)));
        }
        let body_len = Wire::body_len(&body, insertion);
        let expects_body = matches!(
            req.method,
            http::Method::POST | http::Method::PUT | http::Method::PATCH
        );
        let up_body = match (kind, &rest) {
            // RFC 9110 §8.6: a method that has a body gets a length, 0 for none (some servers
            // answer 411 without one).
            (BodyKind::None, _) if expects_body => UpBody::Length(0),
            (BodyKind::None, _) => UpBody::None,
            (_, Rest::Done) => UpBody::Length(body_len),
            (BodyKind::Length(n), _) => UpBody::Length(n),
            (BodyKind::Chunked, _) => UpBody::Chunked,
        };
        let id = upstream_id(ctx);
        let Some(endpoint) = ctx.endpoint.as_ref().map(|h| Arc::clone(&h.endpoint)) else {
            return Err(Error::explain(
                InternalError,
                "a request sent with no endpoint",
            ));
        };
        let mut head = BytesMut::with_capacity(512);
        let metered = ctx.dialect.is_some();
        let host = &endpoint.at.host_header;
        upstream_request(req, host, id, up_body, metered, &[], &mut head);
        let wire = match up_body {
            // The body so far as its first chunk: its size line in the head, its bytes as
            // they are (up to 8 MiB read for a mirror, not copied into the head).
            UpBody::Chunked if !body.is_empty() => {
                body::put_chunk_size(&mut head, body.len());
                Wire {
                    head,
                    body: [body.clone(), Bytes::from_static(b"\r\n"), Bytes::new()],
                }
            }
            UpBody::Chunked => Wire::new(head, &Bytes::new(), None),
            _ => Wire::new(head, &body, insertion),
        };
        if ctx.dialect.is_some() {
            self.begin_record(ctx, upstream, &endpoint, Some(&body), operation);
        }
        drop(body);
        Ok(Ready {
            wire,
            rest,
            sent_so_far: body_len,
            watch,
            leftover,
            client_side: ClientSide {
                keep_alive,
                http10,
                head_request,
            },
        })
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
            let tls = Box::pin(async {
                let connector = &self.transport.connector;
                if let Some(pooled) = connector.reused_stream(peer).await {
                    return Ok(Io::Pingora(pooled));
                }
                connector.new_stream(peer).await.map(Io::Pingora)
            });
            return tls.await;
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

    /// Gives a clean upstream connection back to its pool (plain TCP: tokentap's; TLS:
    /// pingora's), kept `idle` at most from `now`.
    pub(super) fn release(
        &self,
        up: Io,
        endpoint: &crate::pool::Endpoint,
        idle: Duration,
        now: std::time::Instant,
    ) {
        match up {
            Io::Tcp(tcp) => {
                self.transport
                    .pool
                    .release(endpoint.at.addr, tcp, now, idle);
            }
            Io::Pingora(tls) => {
                let hash = endpoint.peer().reuse_hash();
                self.transport
                    .connector
                    .release_stream(tls, hash, Some(idle));
            }
        }
    }

    /// Connects to the request's endpoint and writes the request head with the body read so
    /// far, in one write. A connect that failed (nothing was sent) ejects the endpoint and is
    /// tried once more, on another endpoint of the pool when one takes requests (the request
    /// moves there, its slot taken within that endpoint's cap: waiting up to
    /// `queue_timeout` for one when all are full), else on the same.
    pub(super) async fn connect_and_write(
        &self,
        upstream: &Upstream,
        ctx: &mut Ctx,
        mut wire: Wire,
    ) -> Result<Io> {
        let (pool, queue_timeout) = (&upstream.pool, upstream.config.queue_timeout);
        let (held, stream) = (&mut ctx.endpoint, &mut ctx.stream);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let Some(endpoint) = held.as_ref().map(|h| Arc::clone(&h.endpoint)) else {
                return Err(Error::explain(
                    InternalError,
                    "a request sent with no endpoint",
                ));
            };
            let peer = endpoint.peer();
            let mut e = match self.connect(endpoint.at.addr, &peer).await {
                Ok(mut up) => {
                    {
                        let write = pin!(async {
                            wire.write_to(&mut up).await?;
                            up.flush().await
                        });
                        within(peer.options.write_timeout, write).await?;
                    }
                    return Ok(up);
                }
                Err(e) => e,
            };
            e.retry.decide_reuse(false);
            pool.unreachable(&endpoint, &connect_cause(&e));
            if !e.retry() || attempt >= ATTEMPTS {
                return Err(e.into_up());
            }
            // Another endpoint, within its cap: with every other one full, the request
            // waits for a slot as a queued one would, and fails as it would have on timeout.
            let slot = held.as_ref().is_some_and(Held::holds_slot);
            let avoid = std::slice::from_ref(&endpoint);
            let next = match pool.pick_within(slot, None, avoid, queue_timeout).await {
                Ok(next) => Some(next),
                Err(Unplaced::Full) => return Err(e.into_up()),
                Err(Unplaced::NoEndpoint) => None, // tried once more where it was
            };
            if let Some(next) = next {
                let next = pool.lease(next, None).await;
                let (from, to) = (&endpoint.at.host_header, &next.endpoint.at.host_header);
                if from != to {
                    wire.head = rehost(&wire.head, from, to);
                }
                TokenTap::moved(stream, &next.endpoint);
                *held = Some(next); // the first endpoint's slot is freed
            }
        }
    }
}

/// The most of a body read whole before it is sent, when something needs it whole (8 MiB:
/// a prompt of some two million tokens); the rest of a longer one is streamed, and it goes
/// without usage asked for and without its mirrors' copies (counted as skipped).
pub(super) const WHOLE_BODY_BYTES: usize = 8 << 20;

/// Whether a request routed to `choice` needs its body whole: a metered request to an
/// upstream that asks OpenAI requests for usage, one a mirror copies (`plan`), or one that
/// may reserve of a tenant's budget (its `max_tokens` may come after a long prompt: SDKs
/// write `messages` first).
pub(super) fn needs_whole(
    shared: &crate::state::Shared,
    choice: Choice,
    dialect: Option<Dialect>,
    plan: u64,
) -> bool {
    let Some(dialect) = dialect else {
        return false;
    };
    let upstream = &shared.upstreams[choice.upstream].config;
    let usage = dialect == Dialect::OpenAi && upstream.inject_usage;
    usage || plan != 0 || shared.tenants.config().budgets()
}

/// Where the body gets `stream_options.include_usage`, when the upstream injects usage and
/// the request is OpenAI's: counted exactly from the stream's own usage chunk.
pub(super) fn usage_asked(ctx: &Ctx, upstream: &Upstream, body: &[u8]) -> Option<Insertion> {
    let ask = ctx.dialect == Some(Dialect::OpenAi) && upstream.config.inject_usage;
    ask.then(|| usage::insertion(body)).flatten()
}

/// tokentap's request id for the upstream: the client's own goes as it came (in its
/// head), tokentap's only when asked to.
pub(super) fn upstream_id(ctx: &Ctx) -> Option<&str> {
    let ours = ctx.request_id.is_ours() && ctx.shared.config.request_id_upstream;
    ours.then(|| ctx.request_id.as_str())
}

/// Why a connect failed, for the endpoint's `last_error`.
fn connect_cause(e: &Error) -> String {
    match e.root_cause().downcast_ref::<io::Error>() {
        Some(io) => format!("connect: {io}"),
        None => format!("connect: {}", e.etype().as_str()),
    }
}

/// The request's bytes with `Host: to` where tokentap wrote `Host: from` (the endpoint of a
/// retry has another name).
fn rehost(wire: &[u8], from: &str, to: &str) -> BytesMut {
    let old = format!("\r\nHost: {from}\r\n");
    let head_end = memchr::memmem::find(wire, b"\r\n\r\n").map_or(wire.len(), |i| i + 2);
    let mut out = BytesMut::with_capacity(wire.len() + to.len());
    match memchr::memmem::find(&wire[..head_end], old.as_bytes()) {
        Some(at) => {
            out.extend_from_slice(&wire[..at]);
            out.extend_from_slice(format!("\r\nHost: {to}\r\n").as_bytes());
            out.extend_from_slice(&wire[at + old.len()..]);
        }
        None => out.extend_from_slice(wire),
    }
    out
}

/// Appends the request as the upstream gets it (with tokentap's request `id` when the
/// client sent none): HTTP/1.1, without hop-by-hop fields and `Expect` (the body is on its
/// way already), its `Host` the upstream's, its body framed by tokentap. A `metered`
/// request (generation) asks for `Accept-Encoding: identity` whatever the client asked:
/// tokentap reads what it forwards, and a compressed stream would be charged nothing.
pub(super) fn upstream_request(
    mut req: RequestHead,
    host: &str,
    id: Option<&str>,
    body: UpBody,
    metered: bool,
    extra: &[(&str, &[u8])],
    out: &mut BytesMut,
) {
    let h = &mut req.fields;
    h.remove_hop_by_hop("");
    h.remove("expect");
    h.remove("content-length");
    if metered {
        h.remove("accept-encoding");
    }
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
    let mut set = [
        Some(("Host", host.as_bytes())),
        id.map(|id| (REQUEST_ID_HEADER, id.as_bytes())),
        metered.then_some(("Accept-Encoding", b"identity".as_slice())),
        framing,
    ];
    if extra.is_empty() {
        req.write(out, &set);
    } else {
        // A mirror's `set_headers` (removed from the head by the caller).
        let mut all: Vec<Option<(&str, &[u8])>> = set.iter_mut().map(|s| s.take()).collect();
        all.extend(extra.iter().map(|&e| Some(e)));
        req.write(out, &all);
    }
}

/// Writes to the upstream within its write timeout.
async fn write_up(up: &mut Io, bytes: &[u8], write_timeout: Option<Duration>) -> Result<()> {
    let write = pin!(async {
        up.write_all(bytes).await?;
        up.flush().await
    });
    within(write_timeout, write).await
}

/// An upstream write, within its write timeout (pinned by the caller, so that it is kept
/// once: kept three times, it made connecting's state 1,312 bytes, 880 so).
async fn within<W: std::future::Future<Output = io::Result<()>> + ?Sized>(
    write_timeout: Option<Duration>,
    write: Pin<&mut W>,
) -> Result<()> {
    match write_timeout {
        Some(t) => match in_time(t, write).await {
            Some(r) => r.map_err(|e| up_io(WriteError, e)),
            None => Err(up_err(WriteTimedout, "writing the request")),
        },
        None => write.await.map_err(|e| up_io(WriteError, e)),
    }
}

/// Streams the rest of a request body the read-ahead did not hold to the upstream: a
/// length's worth as it comes, or chunks decoded strictly and framed again, so that nothing
/// past a malformed chunk is sent. Each read must come within
/// `server.request_body_timeout_secs`; bytes past the body go to `leftover`. `sent`: the
/// payload sent so far, against `server.max_request_body_bytes`.
pub(super) async fn send_rest(
    client: &mut Io,
    up: &mut Io,
    rest: Rest,
    leftover: &mut BytesMut,
    write_timeout: Option<Duration>,
    mut sent: u64,
    limits: Limits,
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
                    body::put_chunk(&mut out, payload);
                })
                .map_err(|_| client_error(ClientError::BadChunk))?;
            if sent > limit {
                return Err(client_error(ClientError::BodyTooLarge));
            }
            if decoder.done() {
                out.extend_from_slice(body::LAST_CHUNK);
                leftover.extend_from_slice(&read[used..]);
                return write_up(up, &out, write_timeout).await;
            }
            write_up(up, &out, write_timeout).await?;
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::http1::Head;

    fn written(raw: &str, id: Option<&str>, body: UpBody) -> String {
        let Head::Complete(req, _) = RequestHead::read(&mut BytesMut::from(raw)) else {
            panic!("not a head: {raw}")
        };
        let mut out = BytesMut::new();
        upstream_request(req, "up:8000", id, body, false, &[], &mut out);
        String::from_utf8(out.to_vec()).unwrap()
    }

    /// The head the upstream gets: HTTP/1.1, origin-form, hop-by-hop and `Expect` gone,
    /// `Host` the upstream's in the client's `Host`'s place, the id and the framing
    /// tokentap chose last (the client's framing fields were removed), the rest in order.
    #[test]
    fn the_upstream_request_head() {
        let raw = "POST http://client.example/v1/chat/completions HTTP/1.0\r\nHost: client.example\r\nX-A: 1\r\nConnection: keep-alive, x-hop\r\nX-Hop: 2\r\nKeep-Alive: 5\r\nTE: trailers\r\nExpect: 100-continue\r\nContent-Length: 2\r\nAuthorization: Bearer k\r\n\r\n";
        assert_eq!(
            written(raw, Some("id-1"), UpBody::Length(2)),
            "POST /v1/chat/completions HTTP/1.1\r\nHost: up:8000\r\nX-A: 1\r\nAuthorization: Bearer k\r\nx-request-id: id-1\r\nContent-Length: 2\r\n\r\n"
        );
        // The client's own id stays where it was; a long body goes on chunked.
        let raw = "POST /v1/x HTTP/1.1\r\nx-request-id: mine\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(
            written(raw, None, UpBody::Chunked),
            "POST /v1/x HTTP/1.1\r\nx-request-id: mine\r\nHost: up:8000\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        assert_eq!(
            written(
                "GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n",
                None,
                UpBody::None
            ),
            "GET /v1/models HTTP/1.1\r\nHost: up:8000\r\n\r\n"
        );
    }

    /// A long body with usage asked for in it goes out as head, body before, the text and
    /// body after, whole, however little the socket takes at a time (the reader starts late:
    /// the socket's buffer fills and the write goes in pieces).
    #[tokio::test]
    async fn a_wire_is_written_whole_in_pieces() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let body = Bytes::from(format!(
            "{{\"stream\":true,\"prompt\":\"{}\"}}",
            "long ".repeat(800_000)
        ));
        let insertion = usage::insertion(&body).unwrap();
        let head = BytesMut::from(&b"POST / HTTP/1.1\r\n\r\n"[..]);
        let want = [&head[..], &usage::request_with_usage(&body).unwrap()[..]].concat();
        let reader = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut got = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut s, &mut got)
                .await
                .unwrap();
            got
        });
        let mut up = Io::Tcp(tokio::net::TcpStream::connect(addr).await.unwrap());
        Wire::new(head, &body, Some(insertion))
            .write_to(&mut up)
            .await
            .unwrap();
        drop(up);
        assert!(reader.await.unwrap() == want, "the bytes as sent");
    }
}
