//! Keep-alive connections idle past [`PARK_AFTER`], parked with no task of their own.
//!
//! An idle connection in its task holds the task (1.3 KiB: tokio aligns it to 128 bytes)
//! and its socket's registration with tokio (256 bytes). Parked, it is its socket, its
//! standing among the idle ones and its deadline, ~0.2 KiB, in one poller (a thread with
//! its own epoll, through mio) that all parked connections share. It leaves the lot when
//! its socket is readable (its next request's first bytes, or its end): it is sent back to
//! the listener, which serves it in a new task as it does a connection just accepted. It is
//! closed there when its keep-alive deadline passes, when a new client takes its place at
//! `server.max_connections`, or when the server shuts down.
//!
//! A connection that idles for less than a second between requests never parks: parking
//! and leaving cost four `epoll_ctl`s and a task, which a request a second or fewer pays
//! for at most once.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use tokio::sync::mpsc::UnboundedSender;

/// How long a keep-alive connection idles in its own task before it parks.
pub(super) const PARK_AFTER: Duration = Duration::from_secs(1);

/// The poller's own wake-up (a park with the earliest deadline, an eviction, the close).
const WAKE: Token = Token(usize::MAX);

/// What the lot needs of a parked connection.
pub(super) trait Parkable: Send + 'static {
    /// Its socket (open as long as it is).
    fn fd(&self) -> RawFd;
    /// When it idles out.
    fn deadline(&self) -> Instant;
    /// Whether it was closed for a new client.
    fn evicted(&self) -> bool;
    /// Records its key in the lot, where an eviction finds it (see [`Lot::evict`]). With
    /// [`Parkable::evicted`], sequentially consistent against the eviction's mark and read.
    fn parked_as(&self, key: usize);
    /// Marks it busy as its next request comes; false when it was closed for a new client
    /// first.
    fn claim(&self) -> bool;
}

/// The lot of parked connections (a handle: the poller's thread holds it too).
pub struct Lot<C>(Arc<Shared<C>>);

struct Shared<C> {
    registry: mio::Registry,
    waker: Waker,
    state: Mutex<State<C>>,
    /// The keys of connections closed for a new client, for the poller to close. (A lock of
    /// its own, taken with no other: an eviction holds none of the lot's.)
    evicted: Mutex<Vec<usize>>,
    /// The server shuts down: parked connections close, none parks from now on.
    closing: AtomicBool,
    /// Back to the listener, readable.
    resume: UnboundedSender<C>,
}

struct State<C> {
    parked: Slab<C>,
    /// Each parked connection's deadline and key, the earliest on top. An entry whose
    /// connection has left is skipped when it comes up (or when the heap is rebuilt).
    deadlines: BinaryHeap<Reverse<(Instant, usize)>>,
}

// === impl Lot ===

impl<C: Parkable> Lot<C> {
    /// Starts the poller; readable connections are sent to `resume`.
    pub(super) fn start(resume: UnboundedSender<C>) -> io::Result<Lot<C>> {
        let poll = Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let waker = Waker::new(&registry, WAKE)?;
        let shared = Arc::new(Shared {
            registry,
            waker,
            state: Mutex::new(State {
                parked: Slab::new(),
                deadlines: BinaryHeap::new(),
            }),
            evicted: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
            resume,
        });
        let poller = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("tokentap-idle".into())
            .spawn(move || poller.run(poll))?;
        Ok(Lot(shared))
    }

    /// Parks `conn` until it is readable, its deadline passes, it is evicted or the server
    /// shuts down; it is closed at once if the lot is closing or cannot watch it.
    pub(super) fn park(&self, conn: C) {
        let shared = &self.0;
        let (fd, deadline) = (conn.fd(), conn.deadline());
        let mut state = shared.state();
        let key = state.parked.insert(conn);
        // Evicted on its way here, it closes: its key recorded first, an eviction after this
        // look finds it here (and one before, not parked yet, is seen now).
        state.parked[key].parked_as(key);
        if shared.closing.load(Relaxed) || state.parked[key].evicted() {
            let conn = state.parked.remove(key);
            drop(state);
            drop(conn);
            return;
        }
        let watched = shared
            .registry
            .register(&mut SourceFd(&fd), Token(key), Interest::READABLE);
        if let Err(e) = watched {
            let conn = state.parked.remove(key);
            drop(state);
            drop(conn);
            tracing::warn!("cannot park an idle connection: {e}; closed it");
            return;
        }
        let earliest = state
            .deadlines
            .peek()
            .is_none_or(|Reverse((d, _))| deadline < *d);
        state.deadlines.push(Reverse((deadline, key)));
        drop(state);
        if earliest {
            shared.wake();
        }
    }
}

impl<C> Lot<C> {
    /// Connections parked now.
    pub fn parked(&self) -> usize {
        self.0.state().parked.len()
    }

    /// A connection was closed for a new client: it closes if it is the one parked with
    /// `key` (whatever is parked there now is checked first).
    pub(super) fn evict(&self, key: usize) {
        if !self.is_open() {
            return;
        }
        self.0.evicted().push(key);
        self.0.wake();
    }

    /// Whether connections may park: not once it closes (or its poller failed).
    pub(super) fn is_open(&self) -> bool {
        !self.0.closing.load(Relaxed)
    }

    /// Closes every parked connection and stops the poller; none parks from now on.
    pub(super) fn close(&self) {
        self.0.closing.store(true, Relaxed);
        self.0.wake();
    }
}

impl<C> Drop for Lot<C> {
    fn drop(&mut self) {
        self.close();
    }
}

// === impl Shared ===

impl<C> Shared<C> {
    fn state(&self) -> MutexGuard<'_, State<C>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn evicted(&self) -> MutexGuard<'_, Vec<usize>> {
        self.evicted.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!("cannot wake the idle connections' poller: {e}");
        }
    }
}

impl<C: Parkable> Shared<C> {
    /// The poller: until the lot closes, sends readable connections back and closes those
    /// past their deadline or evicted. Connections leave the lot's lock before they are
    /// sent or closed (closing one takes the registry of idle connections' lock, which an
    /// eviction holds while it wakes the lot).
    fn run(self: Arc<Self>, mut poll: Poll) {
        let mut events = Events::with_capacity(256);
        let mut leaving = Vec::new();
        loop {
            let timeout = self.state().next_deadline();
            let timeout = timeout.map(|d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!("the idle connections' poller failed: {e}; closing the parked ones (idle ones keep their task from now on)");
                self.closing.store(true, Relaxed);
            }
            let closing = self.closing.load(Relaxed);
            let mut state = self.state();
            for event in events.iter().filter(|e| e.token() != WAKE) {
                let Some(conn) = state.parked.try_remove(event.token().0) else {
                    continue;
                };
                let _ = self.registry.deregister(&mut SourceFd(&conn.fd()));
                // Busy from here, no longer evictable; one evicted first is closed.
                let back = !closing && conn.claim();
                leaving.push((conn, back));
            }
            if closing {
                leaving.extend(state.parked.drain().map(|conn| (conn, false)));
                state.deadlines.clear();
            }
            let evicted = std::mem::take(&mut *self.evicted());
            for key in evicted {
                if state.parked.get(key).is_some_and(Parkable::evicted) {
                    leaving.push((state.parked.remove(key), false));
                }
            }
            leaving.extend(state.expire(Instant::now()).map(|conn| (conn, false)));
            drop(state);
            for (conn, readable) in leaving.drain(..) {
                if readable {
                    // Fails only when the listener is gone: the connection is closed.
                    let _ = self.resume.send(conn);
                }
            }
            if closing {
                return;
            }
        }
    }
}

// === impl State ===

impl<C: Parkable> State<C> {
    /// The earliest deadline of a connection still parked.
    fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(&Reverse((deadline, key))) = self.deadlines.peek() {
            if self
                .parked
                .get(key)
                .is_some_and(|c| c.deadline() == deadline)
            {
                return Some(deadline);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Takes out the connections whose deadline is past at `now`. (Two with one key and
    /// one deadline are the same: a key taken again has a later deadline, or the same one.)
    fn expire(&mut self, now: Instant) -> impl Iterator<Item = C> + '_ {
        // Entries of connections that left are dropped when they outnumber the parked ones.
        if self.deadlines.len() > 2 * self.parked.len() + 64 {
            let parked = &self.parked;
            self.deadlines
                .retain(|Reverse((d, k))| parked.get(*k).is_some_and(|c| c.deadline() == *d));
        }
        std::iter::from_fn(move || {
            let deadline = self.next_deadline()?;
            if deadline > now {
                return None;
            }
            let Reverse((_, key)) = self.deadlines.pop()?;
            Some(self.parked.remove(key))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

    use super::*;

    /// A connection as the lot sees it, with a socket or without.
    struct Conn {
        tcp: Option<TcpStream>,
        deadline: Instant,
        evicted: Arc<AtomicBool>,
        key: Arc<AtomicUsize>,
    }

    impl Parkable for Conn {
        fn fd(&self) -> RawFd {
            self.tcp.as_ref().map_or(-1, |t| t.as_raw_fd())
        }
        fn deadline(&self) -> Instant {
            self.deadline
        }
        fn evicted(&self) -> bool {
            self.evicted.load(SeqCst)
        }
        fn parked_as(&self, key: usize) {
            self.key.store(key, SeqCst);
        }
        fn claim(&self) -> bool {
            !self.evicted.load(Relaxed)
        }
    }

    fn conn(deadline: Instant) -> Conn {
        let evicted = Arc::new(AtomicBool::new(false));
        Conn {
            tcp: None,
            deadline,
            evicted,
            key: Arc::default(),
        }
    }

    fn state() -> State<Conn> {
        State {
            parked: Slab::new(),
            deadlines: BinaryHeap::new(),
        }
    }

    fn put(state: &mut State<Conn>, c: Conn) -> usize {
        let deadline = c.deadline;
        let key = state.parked.insert(c);
        state.deadlines.push(Reverse((deadline, key)));
        key
    }

    #[test]
    fn connections_expire_at_their_own_deadline_whatever_left_before_them() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut s = state();
        let a = put(&mut s, conn(at(10)));
        let b = put(&mut s, conn(at(30)));
        put(&mut s, conn(at(20)));
        assert_eq!(s.next_deadline(), Some(at(10)));
        // `a` leaves (readable), and its key is taken by one with a later deadline: the
        // stale entry neither closes it early nor comes up as a deadline.
        s.parked.remove(a);
        let a2 = put(&mut s, conn(at(40)));
        assert_eq!(a2, a);
        assert_eq!(s.next_deadline(), Some(at(20)));
        let gone: Vec<Instant> = s.expire(at(25)).map(|c| c.deadline).collect();
        assert_eq!(gone, [at(20)]);
        // `b` leaves: nothing is due until the reused key's own deadline.
        s.parked.remove(b);
        assert_eq!(s.expire(at(35)).count(), 0);
        let gone: Vec<Instant> = s.expire(at(40)).map(|c| c.deadline).collect();
        assert_eq!(gone, [at(40)]);
        assert!(s.parked.is_empty());
        assert_eq!(s.next_deadline(), None);
    }

    #[test]
    fn entries_of_connections_that_left_do_not_pile_up() {
        let t0 = Instant::now();
        let mut s = state();
        let stays = put(&mut s, conn(t0 + Duration::from_secs(100)));
        for i in 0..10_000 {
            let key = put(
                &mut s,
                conn(t0 + Duration::from_secs(50) + Duration::from_nanos(i)),
            );
            s.parked.remove(key);
            assert_eq!(s.expire(t0).count(), 0);
        }
        assert!(
            s.deadlines.len() <= 2 * s.parked.len() + 65,
            "{}",
            s.deadlines.len()
        );
        assert_eq!(s.next_deadline(), Some(s.parked[stays].deadline));
    }

    /// A pair of connected sockets: the client's end, and the server's (non-blocking, as
    /// tokio leaves it).
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        (client, server)
    }

    /// A parked connection, its eviction's mark and its key in the lot.
    fn parked(server: TcpStream, deadline: Instant) -> (Conn, Arc<AtomicBool>, Arc<AtomicUsize>) {
        let (evicted, key) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let c = Conn {
            tcp: Some(server),
            deadline,
            evicted: Arc::clone(&evicted),
            key: Arc::clone(&key),
        };
        (c, evicted, key)
    }

    /// Whether the server closed `client`'s connection within five seconds.
    fn closed(client: &mut TcpStream) -> bool {
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        // Closed with the client's bytes unread, the connection is reset.
        match client.read(&mut [0u8; 16]) {
            Ok(n) => n == 0,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
        }
    }

    #[tokio::test]
    async fn a_parked_socket_comes_back_readable_or_is_closed() {
        let (resume, mut resumed) = tokio::sync::mpsc::unbounded_channel();
        let lot = Lot::start(resume).unwrap();
        let later = Instant::now() + Duration::from_secs(60);
        // Readable: back, with its bytes unread.
        let (mut client, server) = pair();
        lot.park(parked(server, later).0);
        assert_eq!(lot.parked(), 1);
        client.write_all(b"GET").unwrap();
        let back = tokio::time::timeout(Duration::from_secs(5), resumed.recv()).await;
        let mut back = back.unwrap().unwrap();
        assert_eq!(lot.parked(), 0);
        let mut got = [0u8; 3];
        back.tcp.as_mut().unwrap().read_exact(&mut got).unwrap();
        assert_eq!(&got, b"GET");
        // Past its deadline: closed.
        let (mut client, server) = pair();
        lot.park(parked(server, Instant::now() + Duration::from_millis(50)).0);
        assert!(closed(&mut client), "kept past its deadline");
        // Evicted: closed when the lot is told its key; another parked is told of in vain
        // (it is not evicted), and stays.
        let (mut client, server) = pair();
        let (c, evicted, key) = parked(server, later);
        lot.park(c);
        let (mut other, server) = pair();
        let (c, _, other_key) = parked(server, later);
        lot.park(c);
        lot.evict(other_key.load(SeqCst));
        evicted.store(true, SeqCst);
        lot.evict(key.load(SeqCst));
        assert!(closed(&mut client), "kept after its eviction");
        assert_eq!(lot.parked(), 1);
        other.write_all(b"GET").unwrap();
        let back = tokio::time::timeout(Duration::from_secs(5), resumed.recv()).await;
        assert!(back.unwrap().is_some(), "the one not evicted was closed");
        // Evicted on its way to the lot: closed at once.
        let (mut client, server) = pair();
        let (c, evicted, _) = parked(server, later);
        evicted.store(true, Relaxed);
        lot.park(c);
        assert!(closed(&mut client), "parked though evicted");
        // Evicted as its next request comes: closed, not sent back.
        let (mut client, server) = pair();
        let (c, evicted, _) = parked(server, later);
        lot.park(c);
        evicted.store(true, Relaxed);
        client.write_all(b"GET").unwrap();
        assert!(closed(&mut client), "kept though evicted");
        assert!(resumed.try_recv().is_err(), "sent back though evicted");
        // The lot closes: parked ones close, and one parked after is closed at once.
        let (mut client, server) = pair();
        lot.park(parked(server, later).0);
        lot.close();
        assert!(closed(&mut client), "kept after the lot closed");
        let (mut client, server) = pair();
        lot.park(parked(server, later).0);
        assert!(closed(&mut client), "parked after the lot closed");
        assert_eq!(lot.parked(), 0);
    }
}
