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
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use tokio::sync::mpsc::UnboundedSender;

use super::connections::{Keeper, Open};

/// How long a keep-alive connection idles in its own task before it parks.
pub(super) const PARK_AFTER: Duration = Duration::from_secs(1);

/// The poller's own wake-up (a park with the earliest deadline, an eviction, the close).
const WAKE: Token = Token(usize::MAX);

/// A parked connection: all that serving its next request needs.
pub(super) struct Parked {
    pub tcp: std::net::TcpStream,
    pub peer: Option<SocketAddr>,
    pub open: Open,
    pub keeper: Keeper,
    /// Its turn among the idle ones (see [`Keeper::go_idle`]).
    pub since: u64,
    /// `keepalive_timeout` after its last response.
    pub deadline: Instant,
}

/// The lot of parked connections (a handle: the poller's thread holds it too).
pub struct Lot(Arc<Shared>);

struct Shared {
    registry: mio::Registry,
    waker: Waker,
    state: Mutex<State>,
    /// Connections parked now.
    parked: AtomicUsize,
    /// A connection was closed for a new client: the poller looks for parked ones.
    evicted: AtomicBool,
    /// The server shuts down: parked connections close, none parks from now on.
    closing: AtomicBool,
    /// Back to the listener, readable.
    resume: UnboundedSender<Parked>,
}

struct State {
    parked: Slab<Parked>,
    /// Each parked connection's deadline and key, the earliest on top. An entry whose
    /// connection has left is skipped when it comes up (or when the heap is rebuilt).
    deadlines: BinaryHeap<Reverse<(Instant, usize)>>,
}

// === impl Lot ===

impl Lot {
    /// Starts the poller; readable connections are sent to `resume`.
    pub(super) fn start(resume: UnboundedSender<Parked>) -> io::Result<Lot> {
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
            parked: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
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
    pub(super) fn park(&self, conn: Parked) {
        let shared = &self.0;
        let fd = conn.tcp.as_raw_fd();
        let deadline = conn.deadline;
        let mut state = shared.state();
        if shared.closing.load(Relaxed) {
            return;
        }
        let key = state.parked.insert(conn);
        let watched = shared
            .registry
            .register(&mut SourceFd(&fd), Token(key), Interest::READABLE);
        if let Err(e) = watched {
            let conn = state.parked.remove(key);
            drop(state);
            tracing::warn!(client = ?conn.peer, "cannot park an idle connection: {e}; closing it");
            return;
        }
        shared.parked.fetch_add(1, Relaxed);
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

    /// Connections parked now.
    pub fn parked(&self) -> usize {
        self.0.parked.load(Relaxed)
    }

    /// A connection was closed for a new client: if it is parked, it closes.
    pub(super) fn look_for_evicted(&self) {
        self.0.evicted.store(true, Relaxed);
        self.0.wake();
    }

    /// Closes every parked connection and stops the poller; none parks from now on.
    pub(super) fn close(&self) {
        self.0.closing.store(true, Relaxed);
        self.0.wake();
    }
}

impl Drop for Lot {
    fn drop(&mut self) {
        self.close();
    }
}

// === impl Shared ===

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!("cannot wake the idle connections' poller: {e}");
        }
    }

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
                tracing::error!("the idle connections' poller failed: {e}; closing them");
                self.closing.store(true, Relaxed);
            }
            let closing = self.closing.load(Relaxed);
            let mut state = self.state();
            for event in events.iter().filter(|e| e.token() != WAKE) {
                let Some(conn) = state.parked.try_remove(event.token().0) else {
                    continue;
                };
                let _ = self
                    .registry
                    .deregister(&mut SourceFd(&conn.tcp.as_raw_fd()));
                leaving.push((conn, !closing));
            }
            if closing {
                leaving.extend(state.parked.drain().map(|conn| (conn, false)));
                state.deadlines.clear();
            }
            if self.evicted.swap(false, Relaxed) {
                let evicted: Vec<usize> = (state.parked.iter())
                    .filter(|(_, conn)| conn.keeper.is_evicted())
                    .map(|(key, _)| key)
                    .collect();
                leaving.extend(evicted.into_iter().map(|k| (state.parked.remove(k), false)));
            }
            leaving.extend(state.expire(Instant::now()).map(|conn| (conn, false)));
            drop(state);
            self.parked.fetch_sub(leaving.len(), Relaxed);
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

impl State {
    /// The earliest deadline of a connection still parked.
    fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(&Reverse((deadline, key))) = self.deadlines.peek() {
            if self.parked.get(key).is_some_and(|c| c.deadline == deadline) {
                return Some(deadline);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Takes out the connections whose deadline is past at `now`. (Two with one key and
    /// one deadline are the same: a key taken again has a later deadline, or the same one.)
    fn expire(&mut self, now: Instant) -> impl Iterator<Item = Parked> + '_ {
        // Entries of connections that left are dropped when they outnumber the parked ones.
        if self.deadlines.len() > 2 * self.parked.len() + 64 {
            let parked = &self.parked;
            self.deadlines
                .retain(|Reverse((d, k))| parked.get(*k).is_some_and(|c| c.deadline == *d));
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
