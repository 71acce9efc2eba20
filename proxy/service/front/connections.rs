//! Open client connections against `server.max_connections`, and the idle ones among
//! them that a new client may take the place of.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use slab::Slab;
use tokio::sync::Notify;

use super::lot::{Lot, Parkable};
use crate::service::Transport;

/// Open client connections, against `server.max_connections`. At the limit, a new client
/// takes the place of the connection that has been idle longest between requests (a
/// keep-alive connection, which is closed); only when none is idle is it refused.
///
/// Each connection that has gone idle once is registered here (a [`Keeper`]), and marks in
/// an atomic of its own when it went idle and when it is busy again: a request costs two
/// atomic writes, and only a new client at the limit scans the registry for the connection
/// idle longest.
pub struct Connections {
    open: AtomicUsize,
    refused: AtomicU64,
    evicted: AtomicU64,
    /// The connections that have gone idle once and are still open.
    registry: Mutex<Slab<Arc<Standing>>>,
    /// The order in which connections go idle (0 is [`BUSY`]).
    next_idle: AtomicU64,
    max: usize,
    /// The second of the last log line about refused connections (since `start`).
    logged: AtomicU64,
    start: std::time::Instant,
    /// Where connections idle past a second wait, once the listener has started it.
    lot: OnceLock<Lot<Parked>>,
}

/// One open client connection, counted until dropped.
pub(super) struct Open(Arc<Transport>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.connections.open.fetch_sub(1, Relaxed);
    }
}

/// A connection parked with no task of its own (see [`Lot`]): all that serving its next
/// request needs.
pub(super) struct Parked {
    pub tcp: std::net::TcpStream,
    pub peer: Option<SocketAddr>,
    pub open: Open,
    pub keeper: Keeper,
    /// Its turn among the idle ones (see [`Keeper::go_idle`]).
    pub since: u64,
    /// `keepalive_timeout` after its last response.
    pub deadline: std::time::Instant,
}

impl Parkable for Parked {
    fn fd(&self) -> RawFd {
        self.tcp.as_raw_fd()
    }

    fn deadline(&self) -> std::time::Instant {
        self.deadline
    }

    fn evicted(&self) -> bool {
        self.keeper.is_evicted()
    }

    fn claim(&self) -> bool {
        self.keeper.leave(self.since)
    }
}

/// A connection busy with a request (or not idle yet).
const BUSY: u64 = 0;
/// A connection closed for a new client.
const EVICTED: u64 = u64::MAX;

/// Where a registered connection stands: [`BUSY`], [`EVICTED`], or idle since the turn
/// given (the lowest is the longest idle).
struct Standing {
    since: AtomicU64,
    evict: Notify,
}

/// A connection's registration among those that may idle; removed when dropped.
pub(super) struct Keeper {
    transport: Arc<Transport>,
    key: usize,
    standing: Arc<Standing>,
}

// === impl Keeper ===

impl Keeper {
    /// Registers a connection that is about to go idle for the first time.
    pub(super) fn new(transport: &Arc<Transport>) -> Keeper {
        let standing = Arc::new(Standing {
            since: AtomicU64::new(BUSY),
            evict: Notify::new(),
        });
        let key = transport
            .connections
            .registry()
            .insert(Arc::clone(&standing));
        Keeper {
            transport: Arc::clone(transport),
            key,
            standing,
        }
    }

    /// The connection waits for its next request: its turn among the idle ones.
    pub(super) fn go_idle(&self) -> u64 {
        let since = self.transport.connections.next_idle.fetch_add(1, Relaxed);
        self.standing.since.store(since, Release);
        since
    }

    /// Its next request began: false when it was closed for a new client first.
    pub(super) fn leave(&self, since: u64) -> bool {
        let s = &self.standing.since;
        s.compare_exchange(since, BUSY, AcqRel, Acquire).is_ok()
    }

    /// Resolves when the connection is closed for a new client.
    pub(super) async fn evicted(&self) {
        self.standing.evict.notified().await;
    }

    /// Whether the connection was closed for a new client.
    pub(super) fn is_evicted(&self) -> bool {
        self.standing.since.load(Acquire) == EVICTED
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.transport.connections.registry().try_remove(self.key);
    }
}

// === impl Connections ===

impl Connections {
    pub fn new(max: usize) -> Self {
        Connections {
            open: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            registry: Mutex::new(Slab::new()),
            next_idle: AtomicU64::new(1),
            max,
            logged: AtomicU64::new(u64::MAX),
            start: std::time::Instant::now(),
            lot: OnceLock::new(),
        }
    }

    /// The most open client connections.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Open client connections now.
    pub fn open(&self) -> usize {
        self.open.load(Relaxed)
    }

    /// Connections closed at once because `max` were open.
    pub fn refused(&self) -> u64 {
        self.refused.load(Relaxed)
    }

    /// Idle keep-alive connections closed to make room for a new client.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Relaxed)
    }

    /// Idle connections parked now, with no task of their own (see [`Lot`]).
    pub fn parked(&self) -> usize {
        self.lot.get().map_or(0, Lot::parked)
    }

    /// Where connections idle past a second wait: none before the listener starts it.
    pub(super) fn lot(&self) -> Option<&Lot<Parked>> {
        self.lot.get()
    }

    /// The listener's lot, once (a second closes as it drops).
    pub(super) fn start_lot(&self, lot: Lot<Parked>) {
        let _ = self.lot.set(lot);
    }

    /// Connections idle between requests now (parked ones too).
    pub fn idle_now(&self) -> usize {
        let idle = |s: &Arc<Standing>| !matches!(s.since.load(Relaxed), BUSY | EVICTED);
        self.registry().iter().filter(|(_, s)| idle(s)).count()
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Slab<Arc<Standing>>> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the connection idle longest; false when none is idle.
    fn evict_longest_idle(&self) -> bool {
        let registry = self.registry();
        loop {
            let oldest = registry
                .iter()
                .map(|(_, s)| (s.since.load(Acquire), s))
                .filter(|(since, _)| !matches!(*since, BUSY | EVICTED))
                .min_by_key(|(since, _)| *since);
            let Some((since, standing)) = oldest else {
                return false;
            };
            // Lost to its next request's first bytes: look again.
            let s = &standing.since;
            if s.compare_exchange(since, EVICTED, AcqRel, Acquire).is_ok() {
                // A permit is kept if it is not waiting yet: it closes as soon as it looks.
                standing.evict.notify_one();
                if let Some(lot) = self.lot.get() {
                    lot.look_for_evicted();
                }
                self.evicted.fetch_add(1, Relaxed);
                return true;
            }
        }
    }

    /// Counts a new connection in, in the place of the longest-idle one at the limit, or
    /// refuses it. (The idle one closes a moment later: the count is over `max` by the
    /// connections closing so.)
    pub(super) fn admit(transport: &Arc<Transport>) -> Option<Open> {
        let c = &transport.connections;
        if c.open.fetch_add(1, Relaxed) >= c.max && !c.evict_longest_idle() {
            c.open.fetch_sub(1, Relaxed);
            let refused = c.refused.fetch_add(1, Relaxed) + 1;
            c.log_at_most_every_second(|| {
                format!(
                    "refusing new client connections: server.max_connections ({}) are open ({refused} refused so far)",
                    c.max
                )
            });
            return None;
        }
        Some(Open(Arc::clone(transport)))
    }

    /// Prints a line unless one was printed this second (a flood must not flood the log).
    pub(super) fn log_at_most_every_second(&self, line: impl FnOnce() -> String) {
        let now = self.start.elapsed().as_secs();
        let last = self.logged.swap(now, Relaxed);
        if last != now {
            tracing::warn!("{}", line());
        }
    }
}
