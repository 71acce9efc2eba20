//! The direct path's connections: tokio's own sockets on plain TCP, and the idle pool of
//! its plain-TCP upstream connections.
//!
//! A pingora stream wraps its socket in a boxed trait object over read and write buffers,
//! and times every pending read and write; on the direct path, whose every token is one
//! read and one write, that was ~0.5 µs per event (docs/performance-history.md). Here a plain
//! TCP connection is a tokio socket and nothing else. Pingora's streams remain where they
//! are needed: TLS upstreams, and client connections pingora-proxy has served.
//!
//! pingora's pool holds pingora streams, and spawns a task per released connection to watch
//! it while idle; [`Pool`] holds tokio sockets and watches nothing: a connection is checked
//! when it is taken, and the upkeep task drops the expired, the closed and those with bytes
//! waiting every few seconds. The check is a non-blocking peek, except for a connection
//! released a moment ago (see [`TRUST_READINESS`]), which is taken on its socket's readiness
//! alone, as nginx takes a cached connection its event loop has not seen close.

use std::collections::VecDeque;
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// A connection on the direct path.
#[derive(Debug)]
pub(crate) enum Io {
    /// A plain TCP connection.
    Tcp(TcpStream),
    /// A TLS upstream, or a client connection back from pingora-proxy.
    Pingora(pingora::protocols::Stream),
}

impl Io {
    /// The connection as pingora-proxy takes it.
    pub(crate) fn into_pingora(self) -> pingora::protocols::Stream {
        match self {
            Io::Tcp(tcp) => Box::new(pingora::protocols::l4::stream::Stream::from(tcp)),
            Io::Pingora(stream) => stream,
        }
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Io::Pingora(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Io::Pingora(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(tcp) => Pin::new(tcp).poll_write_vectored(cx, bufs),
            Io::Pingora(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Tcp(tcp) => tcp.is_write_vectored(),
            Io::Pingora(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(_) => Poll::Ready(Ok(())), // nothing buffered
            Io::Pingora(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Io::Pingora(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

/// Idle plain-TCP upstream connections, per upstream address, the most recently used taken
/// first; at most `capacity` in all. Keyed by address, not by an upstream's place in the
/// config, which a reload may change.
pub(crate) struct Pool {
    /// Per address, oldest first.
    idle: DashMap<SocketAddr, VecDeque<Idle>, foldhash::fast::RandomState>,
    held: AtomicUsize,
    capacity: usize,
}

/// A connection released less than this long ago, whose socket the reactor has not seen
/// readable since its last read (an upstream's close, or bytes out of step, make it so), is
/// reused without a system call. At many short requests a second this is one socket call of
/// five per request. A server closes an idle keep-alive connection after seconds, not
/// milliseconds, and a response that closes says so (`Connection: close`) and is not pooled;
/// a close the reactor has not polled yet is the race the peek has too, a moment earlier.
const TRUST_READINESS: Duration = Duration::from_millis(20);

struct Idle {
    tcp: TcpStream,
    /// When it was released, and when it is too old to reuse.
    released: Instant,
    expires: Instant,
}

impl Pool {
    pub(crate) fn new(capacity: usize) -> Self {
        Pool {
            idle: DashMap::default(),
            held: AtomicUsize::new(0),
            capacity,
        }
    }

    /// An idle connection to `addr` still open and unexpired at `now`, the most recently
    /// released first; the ones found closed or expired are dropped.
    pub(crate) fn take(&self, addr: SocketAddr, now: Instant) -> Option<TcpStream> {
        loop {
            let idle = self.idle.get_mut(&addr)?.pop_back()?;
            self.held.fetch_sub(1, Ordering::Relaxed);
            if now < idle.expires && idle.is_clean_at(now) {
                return Some(idle.tcp);
            }
        }
    }

    /// Keeps `tcp`, whose last response was read whole, for reuse until `now + idle_for`.
    /// A full pool makes room by dropping the oldest connection to this address, else to
    /// another (as pingora's pool, whose least recently used goes), else drops `tcp`.
    pub(crate) fn release(
        &self,
        addr: SocketAddr,
        tcp: TcpStream,
        now: Instant,
        idle_for: Duration,
    ) {
        let idle = Idle {
            tcp,
            released: now,
            expires: now + idle_for,
        };
        let room = self
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                (held < self.capacity).then_some(held + 1)
            })
            .is_ok();
        // An evicted connection's place (and count) goes to `tcp`.
        let evicted = if room { None } else { self.oldest(addr) };
        if room || evicted.is_some() {
            self.idle.entry(addr).or_default().push_back(idle);
        }
        drop(evicted); // closed outside the lock
    }

    /// Takes out the oldest idle connection to `addr`, else to another address; `held` is
    /// left as it is.
    fn oldest(&self, addr: SocketAddr) -> Option<Idle> {
        if let Some(own) = self.idle.get_mut(&addr).and_then(|mut l| l.pop_front()) {
            return Some(own);
        }
        self.idle
            .iter_mut()
            .filter(|list| *list.key() != addr)
            .find_map(|mut list| list.pop_front())
    }

    /// Drops the connections expired at `now`, closed by their upstream or with bytes
    /// waiting, so that they do not hold file descriptors until they are next taken; an
    /// address left with none is forgotten (a reload may have removed its upstream).
    pub(crate) fn sweep(&self, now: Instant) {
        let mut gone = Vec::new();
        self.idle.retain(|_, list| {
            let (kept, dropped): (VecDeque<Idle>, VecDeque<Idle>) = std::mem::take(list)
                .into_iter()
                .partition(|idle| now < idle.expires && idle.is_clean());
            *list = kept;
            gone.extend(dropped);
            !list.is_empty()
        });
        self.held.fetch_sub(gone.len(), Ordering::Relaxed);
        drop(gone); // closed outside the lock
    }

    /// Idle connections held, in all.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

impl Idle {
    /// Still open and silent: an idle HTTP/1.1 connection the upstream closed reads as end
    /// of stream, and one with bytes waiting is out of step with its responses.
    fn is_clean(&self) -> bool {
        clean(self.peek())
    }

    /// As [`Self::is_clean`] when taken at `now`: a connection released within
    /// [`TRUST_READINESS`] is peeked only if its socket has been seen readable.
    fn is_clean_at(&self, now: Instant) -> bool {
        if now.saturating_duration_since(self.released) >= TRUST_READINESS {
            return self.is_clean();
        }
        // Not readable: `WouldBlock` without calling the peek. A peek that finds nothing
        // clears the readiness it was called on.
        clean(self.tcp.try_io(Interest::READABLE, || self.peek()))
    }

    fn peek(&self) -> io::Result<usize> {
        let mut byte = [MaybeUninit::uninit()];
        socket2::SockRef::from(&self.tcp).peek(&mut byte)
    }
}

/// A peek's answer: nothing to read yet (not end of stream, not bytes out of step).
fn clean(peeked: io::Result<usize>) -> bool {
    match peeked {
        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
        Ok(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    /// A connected pair: (the pool's side, the upstream's side).
    async fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let addr = listener.local_addr().unwrap();
        let (ours, theirs) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (ours.unwrap(), theirs.unwrap().0)
    }

    async fn listener() -> TcpListener {
        TcpListener::bind("127.0.0.1:0").await.unwrap()
    }

    const IDLE: Duration = Duration::from_secs(60);

    /// The address of upstream `i` (the pool never connects to it).
    fn up(i: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 1 + i))
    }

    #[tokio::test]
    async fn takes_the_most_recently_released_first() {
        let l = listener().await;
        let pool = Pool::new(8);
        let now = Instant::now();
        let (a, _a) = pair(&l).await;
        let (b, _b) = pair(&l).await;
        let (a_port, b_port) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        pool.release(up(0), a, now, IDLE);
        pool.release(up(0), b, now, IDLE);
        assert_eq!(pool.len(), 2);
        assert!(pool.take(up(1), now).is_none(), "pools are per upstream");
        assert_eq!(pool.take(up(0), now).unwrap().local_addr().unwrap(), b_port);
        assert_eq!(pool.take(up(0), now).unwrap().local_addr().unwrap(), a_port);
        assert!(pool.take(up(0), now).is_none());
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn expired_connections_are_not_reused() {
        let l = listener().await;
        let pool = Pool::new(8);
        let now = Instant::now();
        let (a, _a) = pair(&l).await;
        pool.release(up(0), a, now, IDLE);
        assert!(pool.take(up(0), now + IDLE).is_none());
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn closed_or_unclean_connections_are_not_reused() {
        let l = listener().await;
        let pool = Pool::new(8);
        let now = Instant::now();
        let (closed, theirs) = pair(&l).await;
        drop(theirs);
        let (chatty, mut theirs_chatty) = pair(&l).await;
        theirs_chatty
            .write_all(b"HTTP/1.1 200 OK\r\n")
            .await
            .unwrap();
        // Wait until both are visible on our side (the kernel's, not a sleep).
        closed.readable().await.unwrap();
        chatty.readable().await.unwrap();
        pool.release(up(0), closed, now, IDLE);
        pool.release(up(0), chatty, now, IDLE);
        assert!(pool.take(up(0), now).is_none());
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn a_connection_released_a_moment_ago_is_taken_on_its_readiness() {
        let l = listener().await;
        let pool = Pool::new(8);
        let now = Instant::now();
        // Closed by its upstream, but not seen readable yet (no await since the close):
        // within the moment it is taken on its readiness, which the reactor has not set;
        // after it, it is peeked and dropped.
        let (fresh, theirs) = pair(&l).await;
        let (old, theirs_old) = pair(&l).await;
        drop((theirs, theirs_old));
        pool.release(up(0), fresh, now, IDLE);
        pool.release(up(1), old, now, IDLE);
        assert!(pool.take(up(0), now + TRUST_READINESS / 2).is_some());
        assert!(pool.take(up(1), now + TRUST_READINESS).is_none());
        // Seen readable (the close reached the reactor): peeked and dropped at once.
        let (seen, theirs) = pair(&l).await;
        drop(theirs);
        seen.readable().await.unwrap();
        pool.release(up(2), seen, now, IDLE);
        assert!(pool.take(up(2), now).is_none());
        // Open and silent: reused either way.
        let (open, _theirs) = pair(&l).await;
        pool.release(up(3), open, now, IDLE);
        assert!(pool.take(up(3), now).is_some());
    }

    #[tokio::test]
    async fn sweep_drops_the_closed_and_the_expired_and_keeps_the_rest() {
        let l = listener().await;
        let pool = Pool::new(8);
        let now = Instant::now();
        let (open, _open) = pair(&l).await;
        let open_port = open.local_addr().unwrap();
        let (closed, theirs) = pair(&l).await;
        drop(theirs);
        closed.readable().await.unwrap();
        let (old, _old) = pair(&l).await;
        pool.release(up(0), old, now, Duration::from_secs(1));
        pool.release(up(0), open, now, IDLE);
        pool.release(up(0), closed, now, IDLE);
        pool.sweep(now + Duration::from_secs(1));
        assert_eq!(pool.len(), 1);
        assert_eq!(
            pool.take(up(0), now).unwrap().local_addr().unwrap(),
            open_port
        );
    }

    #[tokio::test]
    async fn a_full_pool_drops_the_oldest_of_the_upstream_else_of_another() {
        let l = listener().await;
        let pool = Pool::new(2);
        let now = Instant::now();
        let (a, _a) = pair(&l).await;
        let (b, _b) = pair(&l).await;
        let (c, _c) = pair(&l).await;
        let (d, _d) = pair(&l).await;
        let port = |s: &TcpStream| s.local_addr().unwrap();
        let (c_port, d_port) = (port(&c), port(&d));
        pool.release(up(0), a, now, IDLE);
        pool.release(up(0), b, now, IDLE);
        pool.release(up(0), c, now, IDLE); // `a` makes room
        assert_eq!(pool.len(), 2);
        pool.release(up(1), d, now, IDLE); // none of upstream 1's to drop: `b` makes room
        assert_eq!(pool.len(), 2);
        assert_eq!(port(&pool.take(up(1), now).unwrap()), d_port);
        assert_eq!(port(&pool.take(up(0), now).unwrap()), c_port);
        assert!(pool.take(up(0), now).is_none());
    }

    #[tokio::test]
    async fn a_pool_of_none_keeps_nothing() {
        let l = listener().await;
        let pool = Pool::new(0);
        let (a, _a) = pair(&l).await;
        pool.release(up(0), a, Instant::now(), IDLE);
        assert_eq!(pool.len(), 0);
        assert!(pool.take(up(0), Instant::now()).is_none());
    }
}
