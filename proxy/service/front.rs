//! The proxy's front door: accepts client connections (up to `server.max_connections`),
//! reads and checks each request head within its limits, reads the body ahead, and serves
//! the request on the direct path; only an upgrade (WebSocket and the like) is handed, with
//! the bytes already read, to pingora-proxy.
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
use pingora::apps::HttpServerApp;
use pingora::protocols::http::ServerSession;
use pingora::proxy::HttpProxy;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::Service;
use tokio::net::{TcpListener, TcpSocket};
use tokio::time::Instant;

use super::exchange::{After, Incoming};
use super::http1::answer;
use super::http1::conn::Io;
use super::http1::head::RequestHead;
use super::http1::io::{discard, read_more_upto};
use super::http1::request::{self, ClientError};
use super::http1::Head;
use super::TokenTap;
use crate::config::Limits;
pub use connections::Connections;
use connections::{Keeper, Open, Parked};
use lot::{Lot, PARK_AFTER};

mod connections;
mod lot;

/// The listen backlog (pingora's default): a burst of thousands of new streams is queued,
/// not dropped into SYN retries.
const BACKLOG: u32 = 65_535;

/// The proxy listener: tokentap's own HTTP/1.1 loop, with pingora-proxy for upgrades.
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

    /// Serves one client connection, counted by `open`, from `begin` until it closes,
    /// fails, idles out, is closed for a new client (see [`Connections`]), parks (see
    /// [`Lot`]) or the server shuts down.
    async fn connection(
        self: Arc<Self>,
        mut client: Io,
        peer: Option<SocketAddr>,
        shutdown: ShutdownWatch,
        open: Open,
        begin: Begin,
    ) {
        // With `listen.tls_cert`, a connection accepted is served after its TLS handshake
        // (boxed, in a statement of its own, not to keep its room in the task: the
        // handshake's state is needed only until done).
        let tls = self.tap.live.load().config.listen.tls.is_some();
        if tls && matches!(begin, Begin::Accepted(_)) {
            let (Io::Tcp(tcp), Some(at)) = (client, peer) else {
                return;
            };
            let secure = Box::pin(self.secure(tcp, at));
            match secure.await {
                Some(secured) => client = secured,
                None => return,
            }
        }
        // Its standing among the idle connections, registered when it first goes idle.
        let mut keeper = None;
        // Its first request's head is due within `request_head_timeout` of the accept (a
        // connection that sends nothing holds its place no longer); each later one may
        // come after an idle `keepalive_timeout`, during which the connection may be
        // closed for a new client. One back from the lot is readable, and busy again.
        let mut begin = Some(begin);
        let (since, deadline) = loop {
            let wait = match begin.take() {
                Some(Begin::Accepted(accepted)) => Wait::First(accepted),
                Some(Begin::Resumed(back)) => {
                    keeper = Some(*back);
                    Wait::Back
                }
                // Idle from now, after its last response.
                None => {
                    let keeper = keeper.get_or_insert_with(|| Keeper::new(&self.tap.transport));
                    let limit = self.tap.live.load().config.limits.keepalive_timeout;
                    let now = Instant::now();
                    let deadline = now + limit;
                    // Idle, it holds this wait alone (a few hundred bytes, boxed), not the
                    // ~1 KiB of reading a head: that is made once it is readable.
                    let since = keeper.go_idle();
                    let mut park_at = None;
                    if let Io::Tcp(tcp) = &client {
                        let lot = self.tap.transport.connections.lot().filter(|l| l.is_open());
                        park_at = lot.map(|_| now + PARK_AFTER).filter(|&at| at < deadline);
                        // Boxed: inline, the wait's ~580 bytes would be room every open
                        // stream keeps in its task (1,280 bytes a task, 640 so).
                        let idling = Box::pin(idle(tcp, &shutdown, keeper, deadline, park_at));
                        match idling.await {
                            Idle::Readable => {}
                            Idle::Over => return,
                            Idle::Long => break (since, deadline),
                        }
                    }
                    Wait::Idle {
                        keeper,
                        since,
                        deadline,
                        park_at,
                    }
                }
            };
            // Boxed, as is serving it: reading and checking a request is ~2 KiB of state
            // needed until it is served, and inline every open stream would keep its room.
            // Made in a statement of its own, as serving below: a future built in the
            // statement that awaits it keeps its room in the connection's own state.
            let next = Box::pin(self.next_request(&mut client, peer, &shutdown, wait));
            let next = next.await;
            let incoming = match next {
                Next::Serve(incoming) => incoming,
                Next::StillIdle => match wait {
                    Wait::Idle {
                        since, deadline, ..
                    } => break (since, deadline),
                    Wait::First(_) | Wait::Back => return,
                },
                Next::Upgrade(read) => {
                    let hand_over = Box::pin(self.hand_over(client, read, &shutdown));
                    match hand_over.await {
                        Some(reused) => client = reused,
                        None => return,
                    }
                    continue;
                }
                Next::Refuse(e, limits) => {
                    let refuse = Box::pin(refuse(client, e, &limits));
                    return refuse.await;
                }
                Next::Closed => return,
            };
            let shutting_down = *shutdown.borrow();
            let serve = Box::pin(self.tap.serve(&mut client, incoming, shutting_down));
            match serve.await {
                After::KeepAlive => {}
                After::Close => return,
                After::Linger => {
                    let linger = Box::pin(linger(client));
                    return linger.await;
                }
            }
        };
        // Idle past `PARK_AFTER`: parked with no task, a plain socket until it is readable
        // (taken from tokio's poller; one that cannot be is closed, as idle ones may be).
        let connections = &self.tap.transport.connections;
        let (Io::Tcp(tcp), Some(keeper), Some(lot)) = (client, keeper, connections.lot()) else {
            return;
        };
        let tcp = match tcp.into_std() {
            Ok(tcp) => tcp,
            Err(e) => {
                let line = || format!("cannot park an idle client connection: {e}; closed it");
                return connections.log_at_most_every_second(line);
            }
        };
        lot.park(Parked {
            tcp,
            peer,
            open,
            keeper,
            since,
            deadline: deadline.into_std(),
        });
    }

    /// The connection's next request, read and checked, its body read ahead: before the
    /// upstream is chosen and a slot taken, so a client trickling its body holds no slot,
    /// and a split's spill sees the slots free when the request is ready to go.
    async fn next_request(
        &self,
        client: &mut Io,
        peer: Option<SocketAddr>,
        shutdown: &ShutdownWatch,
        wait: Wait<'_>,
    ) -> Next {
        // Per request: a reload changes the limits of the requests that follow.
        let limits = self.tap.live.load().config.limits;
        // Not named: a named result keeps its room in this future while the body is read
        // ahead (1,240 bytes, 936 now; a box over 1,032 bytes misses glibc's cache).
        let (after_head, req) = match read_head(client, shutdown, &limits, wait).await {
            Ok(HeadRead::Head(after_head, req)) => (after_head, req),
            Ok(HeadRead::Closed) => return Next::Closed,
            Ok(HeadRead::StillIdle) => return Next::StillIdle,
            Err(e) => return Next::Refuse(e, limits),
        };
        let t0 = self.tap.now();
        let checked = match request::check(req, limits.max_request_body_bytes) {
            Ok(checked) => checked,
            Err(e) => return Next::Refuse(e, limits),
        };
        if checked.upgrade {
            // pingora-proxy reads the head again, from the bytes as they came.
            let mut read = BytesMut::from(&checked.req.bytes()[..]);
            read.extend_from_slice(&after_head);
            return Next::Upgrade(read);
        }
        let ahead = match request::read_ahead(client, after_head, &checked, &limits).await {
            Ok(Some(ahead)) => ahead,
            Ok(None) => return Next::Closed,
            Err(e) => return Next::Refuse(e, limits),
        };
        Next::Serve(Box::new(Incoming {
            checked,
            ahead,
            t0,
            peer,
        }))
    }

    /// The client connection as requests are read from it: with `listen.tls_cert`, after
    /// the TLS handshake (within `server.request_head_timeout_secs`), else as it is. A
    /// failed handshake closes it, logged at debug (scanners fail handshakes all day).
    async fn secure(&self, tcp: tokio::net::TcpStream, peer: SocketAddr) -> Option<Io> {
        let shared = self.tap.live.load();
        let Some(tls) = &shared.config.listen.tls else {
            return Some(Io::Tcp(tcp));
        };
        let limit = shared.config.limits.request_head_timeout;
        let stream = pingora::protocols::l4::stream::Stream::from(tcp);
        // A ~7 KiB future: the caller boxes this one, so that it does not size every
        // connection's task, TLS or not, for the connection's whole life.
        let handshake = pingora::protocols::tls::server::handshake(&tls.acceptor, stream);
        match tokio::time::timeout(limit, handshake).await {
            Ok(Ok(tls)) => Some(Io::Pingora(Box::new(tls))),
            Ok(Err(e)) => {
                tracing::debug!(client = %peer, "TLS handshake failed: {e}");
                None
            }
            Err(_) => {
                tracing::debug!(client = %peer, "TLS handshake timed out");
                None
            }
        }
    }

    /// Serves a connection back from the lot, readable, in a task of its own again.
    fn resume(self: &Arc<Self>, back: Parked, shutdown: &ShutdownWatch) {
        let front = Arc::clone(self);
        let shutdown = shutdown.clone();
        // Registered with tokio's poller again; one that cannot be is closed.
        let tcp = match tokio::net::TcpStream::from_std(back.tcp) {
            Ok(tcp) => tcp,
            Err(e) => {
                let connections = &self.tap.transport.connections;
                let line =
                    || format!("cannot serve a parked client connection again: {e}; closed it");
                return connections.log_at_most_every_second(line);
            }
        };
        let begin = Begin::Resumed(Box::new(back.keeper));
        let connection = front.connection(Io::Tcp(tcp), back.peer, shutdown, back.open, begin);
        pingora_runtime::current_handle().spawn(connection);
    }

    /// Lets pingora-proxy serve the (upgrade) request whose first bytes are `read`.
    async fn hand_over(&self, client: Io, read: BytesMut, shutdown: &ShutdownWatch) -> Option<Io> {
        let limits = self.tap.live.load().config.limits;
        let mut session = ServerSession::new_http1(client.into_pingora());
        let keepalive = limits.keepalive_timeout.as_secs();
        session.set_keepalive((!*shutdown.borrow()).then_some(keepalive));
        session.set_write_timeout(Some(limits.client_write_timeout));
        session.set_pipelined_prefix(read);
        let reused = self.proxy.process_new_http(session, shutdown).await?;
        Some(Io::Pingora(reused.consume().0))
    }
}

/// What a connection does next.
enum Next {
    Serve(Box<Incoming>),
    /// An upgrade, handed to pingora-proxy with the bytes read so far.
    Upgrade(BytesMut),
    /// A client's mistake, answered within the limits in force when it was read.
    Refuse(ClientError, Limits),
    /// Closed, failed, idled out or shutting down before a request.
    Closed,
    /// No byte yet at the time to park (its readiness was left from its last request).
    StillIdle,
}

/// Answers a client's mistake and closes.
async fn refuse(mut client: Io, e: ClientError, limits: &Limits) {
    let _ = answer::refuse(&mut client, e, limits.client_write_timeout).await;
    linger(client).await;
}

/// Where a connection's serving begins.
enum Begin {
    /// Accepted then.
    Accepted(Instant),
    /// Back from the lot, readable and busy again, with its standing among the idle ones
    /// (boxed: the task keeps its room for its whole life).
    Resumed(Box<Keeper>),
}

/// What a connection waits for its next request in.
#[derive(Clone, Copy)]
enum Wait<'a> {
    /// Its first request, since the connection was accepted then.
    First(Instant),
    /// A later one, idle since its turn `since` among the idle ones (until `deadline`,
    /// `keepalive_timeout` after the last response), and perhaps closed for a new client
    /// meanwhile; still idle at `park_at`, it parks.
    Idle {
        keeper: &'a Keeper,
        since: u64,
        deadline: Instant,
        park_at: Option<Instant>,
    },
    /// A later one, its first bytes (or its end) come while it was parked: busy since then,
    /// its head due within `request_head_timeout`.
    Back,
}

/// What waiting for a request head came to, short of a client's mistake. (Returned by
/// value once a request, as the head was in an `Option`: boxing it would allocate.)
#[allow(clippy::large_enum_variant)]
enum HeadRead {
    /// The head, and the bytes read after it (body bytes, or a pipelined request).
    Head(BytesMut, RequestHead),
    /// The connection closed, failed or idled out before a head began (a first head within
    /// `request_head_timeout` of the accept, a later one within `keepalive_timeout`), was
    /// closed for a new client while idle, or the server is shutting down.
    Closed,
    /// An idle connection had no byte yet at its `park_at`: a readiness left from its last
    /// request brought none (the wait for it found it readable at once).
    StillIdle,
}

/// Reads a request head. Once its first byte is in, the whole head must arrive within
/// `request_head_timeout` (of the accept, for the first) and fit `max_request_head_bytes`.
async fn read_head(
    client: &mut Io,
    shutdown: &ShutdownWatch,
    limits: &Limits,
    wait: Wait<'_>,
) -> Result<HeadRead, ClientError> {
    let max = limits.max_request_head_bytes;
    let mut read = BytesMut::new();
    let mut stop = shutdown.clone();
    // `None` once a later head has begun: its limit starts at its first byte, and the clock
    // is read only if that read did not bring all of it.
    let (mut deadline, mut idle, park_at) = match wait {
        Wait::First(accepted) => (Some(accepted + limits.request_head_timeout), None, None),
        Wait::Idle {
            keeper,
            since,
            deadline,
            park_at,
        } => (
            Some(park_at.unwrap_or(deadline)),
            Some((keeper, since)),
            park_at,
        ),
        Wait::Back => (None, None, None),
    };
    loop {
        if *stop.borrow_and_update() {
            return Ok(HeadRead::Closed);
        }
        let due = *deadline.get_or_insert_with(|| Instant::now() + limits.request_head_timeout);
        let before = read.len();
        let evicted = async {
            match idle {
                Some((keeper, _)) => keeper.evicted().await,
                None => std::future::pending().await,
            }
        };
        let more = tokio::select! {
            biased;
            more = tokio::time::timeout_at(due, read_more_upto(client, &mut read, max)) => more,
            _ = stop.changed() => return Ok(HeadRead::Closed),
            _ = evicted => return Ok(HeadRead::Closed),
        };
        match more {
            Err(_) if read.is_empty() && park_at.is_some() => return Ok(HeadRead::StillIdle),
            // A connection that sent nothing is closed without an answer.
            Err(_) if read.is_empty() => return Ok(HeadRead::Closed),
            Err(_) => return Err(ClientError::HeadTimeout),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(HeadRead::Closed),
            Ok(Ok(_)) => {}
        }
        if let Some((keeper, since)) = idle.take() {
            // Busy again, unless it was closed for a new client as its bytes came.
            if !keeper.leave(since) {
                return Ok(HeadRead::Closed);
            }
            deadline = None;
        }
        // A head can only end at a line feed: a head trickled a byte at a time is not parsed
        // again for every byte.
        if memchr::memchr(b'\n', &read[before..]).is_none() {
            if read.len() > max {
                return Err(ClientError::HeadTooLarge);
            }
            continue;
        }
        match RequestHead::parse(&read) {
            Head::Complete(_, len) if len > max => return Err(ClientError::HeadTooLarge),
            Head::Complete(mut req, len) => match req.own(&mut read, len) {
                true => return Ok(HeadRead::Head(read, req)),
                false => return Err(ClientError::BadHead),
            },
            Head::Partial if read.len() <= max => {}
            Head::Partial => return Err(ClientError::HeadTooLarge),
            Head::Invalid => return Err(ClientError::BadHead),
        }
    }
}

/// How a keep-alive connection's wait between requests ended.
enum Idle {
    /// Its socket is readable.
    Readable,
    /// It idled out, was closed for a new client, or the server shuts down.
    Over,
    /// Still idle at `park_at`: it parks.
    Long,
}

/// A keep-alive connection between requests: waits until its socket is readable (its next
/// request's first bytes, or its end), with no system call of its own: the readiness is
/// the poller's. Over when it idled out (`deadline`), was closed for a new client or the
/// server shuts down; long at `park_at`, if that comes first. It stays idle until the
/// head's reading has a byte: a readiness that brought none (left from reading its last
/// request) leaves it idle there, evictable, within the same deadline, and it parks from
/// there at `park_at` all the same.
async fn idle(
    tcp: &tokio::net::TcpStream,
    shutdown: &ShutdownWatch,
    keeper: &Keeper,
    deadline: Instant,
    park_at: Option<Instant>,
) -> Idle {
    let mut stop = shutdown.clone();
    if *stop.borrow_and_update() {
        return Idle::Over;
    }
    let until = park_at.unwrap_or(deadline);
    tokio::select! {
        biased;
        r = tokio::time::timeout_at(until, tcp.readable()) => match r {
            Ok(Ok(())) => Idle::Readable,
            Ok(Err(_)) => Idle::Over,
            Err(_) if park_at.is_some() => Idle::Long,
            Err(_) => Idle::Over,
        },
        _ = stop.changed() => Idle::Over,
        () = keeper.evicted() => Idle::Over,
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
    let drain = async { while matches!(discard(&mut client).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(LINGER, drain).await;
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
        pingora_shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        let Some(front) = self.0.take() else { return };
        let front = Arc::new(front);
        // pingora's shutdown, or tokentap's own drain (SIGTERM), stops the listener and the
        // connections alike.
        let mut shutdown = either(pingora_shutdown, front.tap.transport.draining());
        let addr = front.tap.live.load().config.listen.proxy;
        let listener = match listen(addr) {
            Ok(l) => l,
            Err(e) => {
                // As pingora's listening service: a proxy that cannot listen stops.
                tracing::error!("cannot listen on {addr}: {e}");
                eprintln!("tokentap: cannot listen on {addr}: {e}");
                std::process::exit(1);
            }
        };
        // Keep-alive connections idle past a second park there, and come back readable.
        let (resume, mut resumed) = tokio::sync::mpsc::unbounded_channel();
        let connections = &front.tap.transport.connections;
        match Lot::start(resume) {
            Ok(lot) => connections.start_lot(lot),
            Err(e) => tracing::warn!("idle connections will not park: {e}"),
        }
        // Parked connections close when the listener stops, or when its runtime drops it
        // (a fast shutdown may not poll it again).
        let _closes = CloseLot(connections);
        loop {
            let accepted = tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                Some(back) = resumed.recv() => {
                    front.resume(back, &shutdown);
                    continue;
                }
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((tcp, peer)) => {
                    let accepted = Instant::now();
                    // Over the limit: closed at once (dropped), counted and logged.
                    let Some(open) = Connections::admit(&front.tap.transport) else {
                        continue;
                    };
                    let _ = tcp.set_nodelay(true);
                    let front = Arc::clone(&front);
                    let shutdown = shutdown.clone();
                    // On a random worker with `work_stealing = false` (tokio::spawn would put
                    // every connection on the accept loop's thread), as pingora's listener.
                    // The task is the connection's own future, nothing around it.
                    let begin = Begin::Accepted(accepted);
                    let connection =
                        front.connection(Io::Tcp(tcp), Some(peer), shutdown, open, begin);
                    pingora_runtime::current_handle().spawn(connection);
                }
                // Out of file descriptors (or a connection reset while queued): accept
                // returns at once again, so back off briefly instead of spinning.
                Err(e) => {
                    front
                        .tap
                        .transport
                        .connections
                        .log_at_most_every_second(|| {
                            format!("cannot accept a client connection: {e}")
                        });
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        // Parked connections close now, as do those coming back from the lot, and
        // keep-alive connections idling on pingora-proxy's path.
        drop(_closes);
        drop(resumed);
        front.proxy.http_cleanup().await;
    }

    fn name(&self) -> &str {
        "tokentap proxy"
    }
}

/// Closes the listener's lot when dropped.
struct CloseLot<'a>(&'a Connections);

impl Drop for CloseLot<'_> {
    fn drop(&mut self) {
        if let Some(lot) = self.0.lot() {
            lot.close();
        }
    }
}

/// A watch that turns true when either of `a` and `b` does.
fn either(mut a: ShutdownWatch, mut b: ShutdownWatch) -> ShutdownWatch {
    let (tx, rx) = tokio::sync::watch::channel(*a.borrow() || *b.borrow());
    tokio::spawn(async move {
        tokio::select! {
            _ = a.wait_for(|&v| v) => {}
            _ = b.wait_for(|&v| v) => {}
            _ = tx.closed() => return,
        }
        tx.send_replace(true);
    });
    rx
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::service::Transport;

    /// An idle connection whose wait found it readable with no byte to read (a readiness
    /// left from reading its last request) parks at `park_at` all the same, still idle at
    /// its turn; and one whose request comes before then reads it.
    #[tokio::test]
    async fn a_readiness_without_a_byte_still_parks() {
        let config = "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n";
        let config = Config::parse(config, "t.toml").unwrap();
        let transport = Transport::new(&config);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let mut server = Io::Tcp(listener.accept().await.unwrap().0);
        let (_stop, shutdown) = tokio::sync::watch::channel(false);
        let keeper = Keeper::new(&transport);
        let wait = |since, now: Instant| Wait::Idle {
            keeper: &keeper,
            since,
            deadline: now + Duration::from_secs(60),
            park_at: Some(now + Duration::from_millis(50)),
        };
        let (since, now) = (keeper.go_idle(), Instant::now());
        let read = read_head(&mut server, &shutdown, &config.limits, wait(since, now)).await;
        assert!(matches!(read, Ok(HeadRead::StillIdle)));
        assert!(now.elapsed() >= Duration::from_millis(50));
        assert!(keeper.leave(since), "not idle at its turn");
        // Its request comes before `park_at`: read, and busy.
        let (since, now) = (keeper.go_idle(), Instant::now());
        tokio::io::AsyncWriteExt::write_all(&mut client, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let read = read_head(&mut server, &shutdown, &config.limits, wait(since, now)).await;
        assert!(matches!(read, Ok(HeadRead::Head(..))));
        assert!(!keeper.leave(since), "not busy after its head came");
    }
}
