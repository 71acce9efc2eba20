//! The proxy's front door: accepts client connections, reads each request head, and either
//! serves the request on the direct path or hands the connection, with the bytes already
//! read, to pingora-proxy.
//!
//! It is a pingora service of its own rather than pingora's listening service, whose task
//! per connection is ~9 KiB (room for a TLS handshake) plus a 1.4 KiB write buffer: here a
//! connection is one small task, and between requests it waits with no buffer at all, its
//! next bytes landing in the worker thread's scratch buffer before being copied out.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use http::header;
use pingora::apps::HttpServerApp;
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::protocols::http::ServerSession;
use pingora::proxy::HttpProxy;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::Service;
use tokio::net::{TcpListener, TcpSocket};

use super::conn::Io;
use super::direct::{read_more, Admitted, After};
use super::h1::{self, Head};
use super::{TokenTap, RETRY_BUFFER};
use crate::dialect::Dialect;
use crate::routing::Choice;

/// How long an idle client connection is kept (pingora's default keep-alive).
const KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a client may take to send a request body, in all.
const BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// The listen backlog (pingora's default): a burst of thousands of new streams is queued,
/// not dropped into SYN retries.
const BACKLOG: u32 = 65_535;

/// What the front door already did for a request it hands to pingora-proxy.
#[derive(Default)]
pub(super) struct Routed {
    /// The upstream chosen.
    pub(super) choice: Option<Choice>,
    /// `100 Continue` sent, and the body read.
    pub(super) continued: bool,
}

/// The proxy listener: tokentap's direct path in front of pingora-proxy.
pub struct Front {
    tap: TokenTap,
    proxy: Arc<HttpProxy<TokenTap>>,
}

impl Front {
    pub fn new(tap: TokenTap, proxy: HttpProxy<TokenTap>) -> Self {
        Front {
            tap,
            proxy: Arc::new(proxy),
        }
    }

    /// Serves one client connection until it closes, fails, idles out or the server shuts
    /// down.
    async fn connection(self: Arc<Self>, mut client: Io, shutdown: ShutdownWatch) {
        loop {
            let Some((read, head_len, req)) = read_head(&mut client, &shutdown).await else {
                return;
            };
            let t0 = self.tap.now();
            let Some((req, body_len)) = self.tap.eligible(req) else {
                let routed = Routed::default();
                match Box::pin(self.hand_over(client, read, routed, &shutdown)).await {
                    Some(reused) => client = reused,
                    None => return,
                }
                continue;
            };
            // The whole body before the upstream is chosen and a concurrency slot taken: a
            // client trickling its body holds no slot, and a split's spill sees the slots
            // free when the request is ready to go.
            let mut read = read;
            let continued = req.headers.contains_key(header::EXPECT);
            let whole = head_len + body_len;
            if let Err(e) = read_body(&mut client, &mut read, whole, continued).await {
                if e.etype() == &ReadTimedout {
                    let _ = super::direct::write_error(&mut client, 400).await;
                }
                return;
            }
            let routed = self.tap.route(&req);
            let admitted = routed.and_then(|choice| {
                let permit = self.tap.shared.limiters[choice.upstream].try_acquire()?;
                Some(Box::new(Admitted {
                    req,
                    body_len,
                    choice,
                    permit,
                    t0,
                }))
            });
            let Some(admitted) = admitted else {
                // No route (pingora-proxy answers 404), or no free slot (it queues or answers
                // 429); the client already has its `100 Continue`.
                let routed = Routed {
                    choice: routed,
                    continued,
                };
                match Box::pin(self.hand_over(client, read, routed, &shutdown)).await {
                    Some(reused) => client = reused,
                    None => return,
                }
                continue;
            };
            let body = read.split_off(head_len);
            let shutting_down = *shutdown.borrow();
            // Boxed, as pingora-proxy's path is: inline, every connection's task held room for
            // both paths' state, 2.9 KiB, idle or not (valgrind massif); now 1.0 KiB, plus
            // 1.5 KiB while a request streams.
            let serve = self
                .tap
                .serve_direct(&mut client, admitted, body, shutting_down);
            let after = Box::pin(serve).await;
            match after {
                After::KeepAlive => {}
                After::Close => return,
                After::Linger => return linger(client).await,
            }
        }
    }

    /// Lets pingora-proxy serve the request whose first bytes are `read`.
    async fn hand_over(
        &self,
        client: Io,
        read: BytesMut,
        routed: Routed,
        shutdown: &ShutdownWatch,
    ) -> Option<Io> {
        let mut session = ServerSession::new_http1(client.into_pingora());
        session.set_keepalive((!*shutdown.borrow()).then_some(KEEPALIVE.as_secs()));
        session.set_pipelined_prefix(read);
        if routed.choice.is_some() || routed.continued {
            session.set_connection_user_context(Some(Box::new(routed)));
        }
        let reused = self.proxy.process_new_http(session, shutdown).await?;
        Some(Io::Pingora(reused.consume().0))
    }
}

/// Reads a request head: the bytes read (the head and any body bytes after it), the head's
/// length, and the head parsed. `None` when the connection closed, failed or idled out, or
/// the server is shutting down; a head tokentap does not parse itself (malformed, HTTP/1.0,
/// huge) is returned unparsed, for pingora-proxy to answer.
async fn read_head(
    client: &mut Io,
    shutdown: &ShutdownWatch,
) -> Option<(BytesMut, usize, Option<RequestHeader>)> {
    let mut read = BytesMut::new();
    let mut stop = shutdown.clone();
    loop {
        if *stop.borrow_and_update() {
            return None;
        }
        let more = tokio::select! {
            biased;
            more = tokio::time::timeout(KEEPALIVE, read_more(client, &mut read)) => more,
            _ = stop.changed() => return None,
        };
        match more {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
            Ok(Ok(_)) => {}
        }
        match h1::request(&read) {
            Head::Complete(req, len) => return Some((read, len, Some(req))),
            Head::Partial if read.len() <= h1::MAX_HEAD => {}
            _ => return Some((read, 0, None)),
        }
    }
}

/// Reads the request body until `read` holds `whole` bytes, within [`BODY_TIMEOUT`] in all;
/// a client waiting for `100 Continue` gets it first (the upstream gets no `Expect`: the
/// body it gets is already complete).
async fn read_body(
    client: &mut Io,
    read: &mut BytesMut,
    whole: usize,
    expects_continue: bool,
) -> pingora::Result<()> {
    use tokio::io::AsyncWriteExt;
    if read.len() >= whole {
        return Ok(());
    }
    let body = async {
        if expects_continue {
            client.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
            client.flush().await?;
        }
        while read.len() < whole {
            if read_more(client, read).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
        }
        Ok::<(), std::io::Error>(())
    };
    match tokio::time::timeout(BODY_TIMEOUT, body).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::because(ReadError, "reading the request body", e).into_down()),
        Err(_) => Err(Error::explain(ReadTimedout, "reading the request body").into_down()),
    }
}

/// After a response the client was sent past its request: the connection's write side is
/// closed, and what the client still sends is read and dropped for a while, so that closing
/// with unread bytes does not reset the connection before the client has the response
/// (nginx's lingering close).
async fn linger(mut client: Io) {
    use tokio::io::AsyncWriteExt;
    const LINGER: Duration = Duration::from_secs(5);
    if client.shutdown().await.is_err() {
        return;
    }
    let mut drop_all = BytesMut::new();
    let drain = async {
        while let Ok(n) = read_more(&mut client, &mut drop_all).await {
            if n == 0 {
                return;
            }
            drop_all.clear();
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

impl TokenTap {
    /// The head and the body's length of a request the direct path takes (see `direct`'s
    /// module docs); `None` for pingora-proxy.
    fn eligible(&self, req: Option<RequestHeader>) -> Option<(RequestHeader, usize)> {
        let req = req?;
        let h = &req.headers;
        let body_len = h1::content_length(h).and_then(|l| usize::try_from(l).ok());
        let eligible = self.shared.config.direct_streaming
            && req.method == http::Method::POST
            && req.raw_path().first() == Some(&b'/')
            && Dialect::from_path(req.uri.path()).is_some()
            && body_len.is_some_and(|l| l > 0 && l <= RETRY_BUFFER)
            && !h.contains_key(header::TRANSFER_ENCODING)
            && !h.contains_key(header::UPGRADE)
            && h.get_all(header::EXPECT)
                .iter()
                .all(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let body_len = body_len.filter(|_| eligible)?;
        Some((req, body_len))
    }

    /// The upstream of a request, if a route matches.
    fn route(&self, req: &RequestHeader) -> Option<Choice> {
        let limiters = &self.shared.limiters;
        self.shared
            .router
            .choose(req.uri.path(), &req.headers, |u| limiters[u].has_headroom())
    }
}

/// The listener as a pingora service: pingora runs it on a runtime of `server.threads`
/// workers (work stealing as configured) and signals its shutdown.
pub struct FrontService(Option<Front>);

impl FrontService {
    pub fn new(front: Front) -> Self {
        FrontService(Some(front))
    }
}

#[async_trait]
impl Service for FrontService {
    async fn start_service(
        &mut self,
        _fds: Option<ListenFds>,
        mut shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        let Some(front) = self.0.take() else { return };
        let front = Arc::new(front);
        let addr = front.tap.shared.config.listen.proxy;
        let listener = match listen(addr) {
            Ok(l) => l,
            Err(e) => {
                // As pingora's listening service: a proxy that cannot listen stops.
                eprintln!("tokentap: cannot listen on {addr}: {e}");
                std::process::exit(1);
            }
        };
        loop {
            let accepted = tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((tcp, _peer)) => {
                    let _ = tcp.set_nodelay(true);
                    let client = Io::Tcp(tcp);
                    // On a random worker with `work_stealing = false` (tokio::spawn would put
                    // every connection on the accept loop's thread), as pingora's listener.
                    let connection = Arc::clone(&front).connection(client, shutdown.clone());
                    pingora_runtime::current_handle().spawn(connection);
                }
                // Out of file descriptors (or a connection reset while queued): accept
                // returns at once again, so back off briefly instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        // Keep-alive connections idling on pingora-proxy's path close now.
        front.proxy.http_cleanup().await;
    }

    fn name(&self) -> &str {
        "tokentap proxy"
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}
