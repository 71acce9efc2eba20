//! Open client connections against `server.max_connections`, and the idle ones among
//! them that a new client may take the place of.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst},
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
/// atomic writes. A new client at the limit takes the oldest of the idle ones, in the order
/// of a snapshot (see [`Registry`]): a flood of new clients pays for one scan of the
/// registry per snapshot, not one per client.
pub struct Connections {
    open: AtomicUsize,
    refused: AtomicU64,
    evicted: AtomicU64,
    registry: Mutex<Registry>,
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

    fn parked_as(&self, key: usize) {
        self.keeper.standing.parked.store(key, SeqCst);
    }

    fn claim(&self) -> bool {
        self.keeper.standing.parked.store(NOT_PARKED, Relaxed);
        self.keeper.leave(self.since)
    }
}

/// A connection busy with a request (or not idle yet).
const BUSY: u64 = 0;
/// A connection closed for a new client.
const EVICTED: u64 = u64::MAX;
/// A connection in a task of its own.
const NOT_PARKED: usize = usize::MAX;

/// Where a registered connection stands: [`BUSY`], [`EVICTED`], or idle since the turn
/// given (the lowest is the longest idle); and its key in the lot while it is parked there.
struct Standing {
    since: AtomicU64,
    evict: Notify,
    parked: AtomicUsize,
}

/// The connections that have gone idle once and are still open, and the idle ones in the
/// order they went idle as of the last snapshot.
///
/// The snapshot is exact for the oldest: a connection that goes idle after it has a later
/// turn than every one in it (turns only grow), and one in it that has been busy since has
/// a new turn, so the first one in it still idle at its turn is the longest idle of all.
/// Those that are not are dropped as they come up, and a new snapshot is taken when it runs
/// out. (One caught between taking its turn and storing it as the snapshot was taken waits
/// for the next snapshot, behind younger ones.) It holds the standings of connections
/// closed since it was taken until then, at most one per connection open when it was taken.
#[derive(Default)]
struct Registry {
    standings: Slab<Arc<Standing>>,
    oldest: VecDeque<(u64, Arc<Standing>)>,
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
            parked: AtomicUsize::new(NOT_PARKED),
        });
        let key = transport
            .connections
            .registry()
            .standings
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
        // SeqCst: against an eviction that finds it not parked yet (see `Lot::park`).
        self.standing.since.load(SeqCst) == EVICTED
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // Closed: no longer one a snapshot may take.
        self.standing.since.store(BUSY, Release);
        let mut registry = self.transport.connections.registry();
        registry.standings.try_remove(self.key);
    }
}

// === impl Registry ===

impl Registry {
    /// Marks the connection idle longest evicted and returns its standing; `None` when none
    /// is idle.
    fn evict_oldest(&mut self) -> Option<Arc<Standing>> {
        loop {
            if self.oldest.is_empty() {
                let mut idle: Vec<(u64, Arc<Standing>)> = (self.standings.iter())
                    .map(|(_, s)| (s.since.load(Acquire), Arc::clone(s)))
                    .filter(|(since, _)| !matches!(*since, BUSY | EVICTED))
                    .collect();
                idle.sort_unstable_by_key(|(since, _)| *since);
                self.oldest = idle.into();
            }
            let (since, standing) = self.oldest.pop_front()?;
            // Busy since, or closed: the next one. (Lost to its next request's first bytes
            // as well.)
            let s = &standing.since;
            if s.compare_exchange(since, EVICTED, SeqCst, Acquire).is_ok() {
                return Some(standing);
            }
        }
    }
}

// === impl Connections ===

impl Connections {
    pub fn new(max: usize) -> Self {
        Connections {
            open: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            registry: Mutex::new(Registry::default()),
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
        let registry = self.registry();
        registry.standings.iter().filter(|(_, s)| idle(s)).count()
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the connection idle longest; false when none is idle.
    fn evict_longest_idle(&self) -> bool {
        let Some(standing) = self.registry().evict_oldest() else {
            return false;
        };
        // A permit is kept if it is not waiting yet: it closes as soon as it looks.
        standing.evict.notify_one();
        // Parked, the lot closes it; on its way there, the lot sees it evicted.
        let parked = standing.parked.load(SeqCst);
        if let Some(lot) = self.lot.get().filter(|_| parked != NOT_PARKED) {
            lot.evict(parked);
        }
        self.evicted.fetch_add(1, Relaxed);
        true
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

#[cfg(test)]
mod tests {
    use super::*;

    fn standing(since: u64) -> Arc<Standing> {
        Arc::new(Standing {
            since: AtomicU64::new(since),
            evict: Notify::new(),
            parked: AtomicUsize::new(NOT_PARKED),
        })
    }

    /// Evictions from a snapshot take what a scan of every connection would: the longest
    /// idle at each, whatever went busy, idle again or closed since the snapshot.
    #[test]
    fn each_eviction_takes_the_longest_idle_of_all() {
        let mut r = Registry::default();
        let s: Vec<Arc<Standing>> = [5, 3, BUSY, 4, 1].into_iter().map(standing).collect();
        let keys: Vec<usize> = s
            .iter()
            .map(|x| r.standings.insert(Arc::clone(x)))
            .collect();
        let which = |taken: Option<Arc<Standing>>, all: &[Arc<Standing>]| {
            taken.and_then(|t| all.iter().position(|x| Arc::ptr_eq(x, &t)))
        };
        assert_eq!(which(r.evict_oldest(), &s), Some(4));
        assert_eq!(s[4].since.load(Relaxed), EVICTED);
        // Since the snapshot: 1 was busy and is idle again, 2 went idle, a new one went
        // idle, 0 closed (as a keeper's drop leaves it).
        s[1].since.store(6, Relaxed);
        s[2].since.store(7, Relaxed);
        let new = standing(8);
        r.standings.insert(Arc::clone(&new));
        s[0].since.store(BUSY, Relaxed);
        r.standings.remove(keys[0]);
        let mut all = s.clone();
        all.push(new);
        let order: Vec<Option<usize>> = (0..5).map(|_| which(r.evict_oldest(), &all)).collect();
        assert_eq!(order, [Some(3), Some(1), Some(2), Some(5), None]);
    }
}
