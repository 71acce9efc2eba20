//! An append-only log of finished requests' figures, oldest first, that a reader takes
//! without copying it under its lock: all but the newest entries are sealed in chunks of
//! [`CHUNK`] that the reader holds by reference count and walks after letting the lock go.
//! Each request's end writes to it under that lock; at tens of thousands of requests a
//! second it holds hundreds of thousands, and a walk or a copy of them all under the lock
//! stopped those requests for milliseconds.

use std::collections::VecDeque;
use std::sync::Arc;

/// Entries in a sealed chunk.
pub(super) const CHUNK: usize = 512;

pub(super) struct ChunkLog<T> {
    sealed: VecDeque<Arc<Vec<T>>>,
    /// Of the oldest sealed chunk, the entries already dropped.
    gone: usize,
    open: VecDeque<T>,
    len: usize,
}

/// A reader's hold on a log's sealed chunks: its entries, oldest first, walked without the
/// log's lock.
pub(super) struct Sealed<T> {
    chunks: Vec<Arc<Vec<T>>>,
    gone: usize,
}

impl<T> Default for ChunkLog<T> {
    fn default() -> Self {
        ChunkLog {
            sealed: VecDeque::new(),
            gone: 0,
            open: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> ChunkLog<T> {
    pub(super) fn push(&mut self, entry: T) {
        self.open.push_back(entry);
        self.len += 1;
        if self.open.len() == CHUNK {
            let open = std::mem::replace(&mut self.open, VecDeque::with_capacity(CHUNK));
            self.sealed.push_back(Arc::new(Vec::from(open)));
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Drops the oldest entries while `old` says so of them: a sealed chunk once all of its
    /// entries are dropped.
    pub(super) fn drop_while(&mut self, old: impl Fn(&T) -> bool) {
        while let Some(front) = self.sealed.front() {
            match front[self.gone..].iter().position(|e| !old(e)) {
                Some(i) => {
                    self.gone += i;
                    self.len -= i;
                    return;
                }
                None => {
                    self.len -= front.len() - self.gone;
                    self.sealed.pop_front();
                    self.gone = 0;
                }
            }
        }
        while self.open.front().is_some_and(&old) {
            self.open.pop_front();
            self.len -= 1;
        }
    }

    /// Drops the oldest entry.
    pub(super) fn drop_oldest(&mut self) {
        match self.sealed.front() {
            Some(front) => {
                self.gone += 1;
                self.len -= 1;
                if self.gone == front.len() {
                    self.sealed.pop_front();
                    self.gone = 0;
                }
            }
            None => {
                if self.open.pop_front().is_some() {
                    self.len -= 1;
                }
            }
        }
    }

    pub(super) fn clear(&mut self) {
        *self = ChunkLog::default();
    }

    /// The sealed chunks, to walk once the lock is let go.
    pub(super) fn sealed(&self) -> Sealed<T> {
        Sealed {
            chunks: self.sealed.iter().cloned().collect(),
            gone: self.gone,
        }
    }

    /// The newest entries, not yet sealed: walked under the lock (fewer than [`CHUNK`]).
    pub(super) fn open(&self) -> impl Iterator<Item = &T> {
        self.open.iter()
    }
}

impl<T> Sealed<T> {
    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        let mut skip = self.gone;
        self.chunks
            .iter()
            .flat_map(move |c| c[std::mem::take(&mut skip)..].iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log keeps what a plain queue would, through drops by age and one at a time:
    /// the sealed entries and then the open ones, oldest first, and a sealed chunk is let
    /// go once all of its entries are dropped.
    #[test]
    fn the_log_holds_what_a_queue_would() {
        let mut log = ChunkLog::default();
        let mut queue = VecDeque::new();
        let n = 3 * CHUNK as u64 + 7;
        for t in 0..n {
            log.push(t);
            queue.push_back(t);
            if t % 97 == 0 {
                let start = t.saturating_sub(2 * CHUNK as u64 - 13);
                log.drop_while(|&e| e < start);
                while queue.front().is_some_and(|&e| e < start) {
                    queue.pop_front();
                }
            }
            if t % 5 == 0 {
                log.drop_oldest();
                queue.pop_front();
            }
            let sealed = log.sealed();
            let read: Vec<u64> = sealed.iter().chain(log.open()).copied().collect();
            assert_eq!(read, Vec::from(queue.clone()), "at {t}");
            assert_eq!(log.len(), queue.len());
            // No sealed chunk is held once all of its entries are dropped.
            assert!(log.gone < log.sealed.front().map_or(1, |c| c.len()));
        }
        log.drop_while(|_| true);
        assert_eq!((log.len(), log.sealed().iter().count()), (0, 0));
        log.push(1);
        log.clear();
        assert_eq!(log.len(), 0);
    }
}
