//! The access log: one JSON line per request when it ends (`[log] access`), written by a
//! thread of its own so that a slow disk never holds a request. A request builds its line
//! in its thread's scratch buffer and appends it to the batch, under a lock held for the
//! copy alone; the writer takes the whole batch every [`BATCH`] and writes it in one call.
//! When the batch is full (the disk cannot keep up) a line is dropped and counted, never
//! waited for. A file is appended to, and reopened on SIGUSR1 (after logrotate moved it).
//!
//! An operator's message (a new target, a reopen, a flush) takes the lines queued before
//! it with it, under the batch's lock: each line goes where the log went when it was
//! queued, in the order queued.

use std::cell::RefCell;
use std::fs::File;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::config::AccessLog;

/// The most a batch holds, in bytes (some 10,000 lines): past it, lines are dropped. The
/// writer keeps two batches' room at most, the one it writes and the one filling.
const BATCH_BYTES: usize = 4 << 20;

/// The room a batch keeps between bursts (some 600 lines).
const KEPT_BYTES: usize = 256 << 10;

/// How long the writer lets lines gather after the first of a batch: woken at most this
/// often, it costs a request no wake-up of its own (a request appends its line without a
/// system call while the writer sleeps), and a batch is one write. A line reaches the
/// file at most this late.
const BATCH: std::time::Duration = std::time::Duration::from_millis(10);

/// The access log of one proxy.
pub struct Access {
    on: AtomicBool,
    /// The writer thread, started with the first target that is not off.
    writer: OnceLock<Writer>,
    dropped: AtomicU64,
}

/// What requests share with the writer thread.
struct Writer {
    /// Lines written since the writer last took them, each ending in a newline.
    batch: Arc<Mutex<Vec<u8>>>,
    /// Wakes the writer: for a batch begun, and for the operator's messages. Unbounded: a
    /// batch sends one wake-up at most, and it is sent under the batch's lock (an
    /// operator's message), where nothing may wait.
    tx: Sender<Msg>,
}

enum Msg {
    /// A batch was begun: the writer takes it after [`BATCH`].
    Lines,
    /// An operator's message, with the lines queued before it (see the module's doc).
    Op(Vec<u8>, Op),
}

enum Op {
    Target(AccessLog),
    Reopen,
    /// Everything before it is written and flushed when this is answered.
    Flush(mpsc::Sender<()>),
}

thread_local! {
    /// A line is built here, outside the batch's lock; its room is kept for the next.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Access {
    pub fn new(target: &AccessLog) -> Access {
        let access = Access {
            on: AtomicBool::new(false),
            writer: OnceLock::new(),
            dropped: AtomicU64::new(0),
        };
        access.set(target);
        access
    }

    /// Whether lines are written: a request builds its line only then.
    pub fn on(&self) -> bool {
        self.on.load(Relaxed)
    }

    /// Writes to `target` from now on (a reload).
    pub fn set(&self, target: &AccessLog) {
        let on = *target != AccessLog::Off;
        if on && self.writer.get().is_none() {
            let batch = Arc::new(Mutex::new(Vec::new()));
            let (tx, rx) = mpsc::channel();
            let theirs = Arc::clone(&batch);
            let spawned = std::thread::Builder::new()
                .name("tokentap-access".into())
                .spawn(move || writer(rx, &theirs));
            match spawned {
                Ok(_) => {
                    let _ = self.writer.set(Writer { batch, tx });
                }
                // No writer: every line is counted as dropped.
                Err(e) => tracing::error!("access log: cannot start its writer thread: {e}"),
            }
        }
        self.send(Op::Target(target.clone()));
        self.on.store(on, Relaxed);
    }

    /// Queues one line, which `build` appends (without its newline) to an empty buffer.
    pub fn write(&self, build: impl FnOnce(&mut Vec<u8>)) {
        let Some(w) = self.writer.get() else {
            self.dropped.fetch_add(1, Relaxed);
            return;
        };
        SCRATCH.with_borrow_mut(|line| {
            line.clear();
            build(line);
            line.push(b'\n');
            let begun = {
                let mut batch = w.batch.lock().unwrap_or_else(PoisonError::into_inner);
                if batch.len() + line.len() > BATCH_BYTES {
                    self.dropped.fetch_add(1, Relaxed);
                    return;
                }
                batch.extend_from_slice(line);
                batch.len() == line.len()
            };
            if begun {
                let _ = w.tx.send(Msg::Lines);
            }
        });
    }

    /// Lines dropped because the writer could not keep up.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }

    /// Reopens the file (SIGUSR1).
    pub fn reopen(&self) {
        self.send(Op::Reopen);
    }

    /// Waits until every line queued so far is written and flushed.
    pub fn flush(&self) {
        let (done, wait) = mpsc::channel();
        if self.send(Op::Flush(done)) {
            let _ = wait.recv_timeout(std::time::Duration::from_secs(5));
        }
    }

    /// Sends an operator's message with the lines queued before it, under the batch's
    /// lock: a line queued after is in the next batch.
    fn send(&self, op: Op) -> bool {
        let Some(w) = self.writer.get() else {
            return false;
        };
        let mut batch = w.batch.lock().unwrap_or_else(PoisonError::into_inner);
        let before = std::mem::take(&mut *batch);
        w.tx.send(Msg::Op(before, op)).is_ok()
    }
}

/// Where lines go now.
enum Sink {
    Off,
    Stdout(io::Stdout),
    Stderr(io::Stderr),
    File(std::path::PathBuf, File),
}

fn open(target: &AccessLog) -> Sink {
    match target {
        AccessLog::Off => Sink::Off,
        AccessLog::Stdout => Sink::Stdout(io::stdout()),
        AccessLog::Stderr => Sink::Stderr(io::stderr()),
        AccessLog::File(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path);
            match file {
                Ok(f) => Sink::File(path.clone(), f),
                Err(e) => {
                    tracing::error!(path = %path.display(), "access log: cannot open: {e}");
                    Sink::Off
                }
            }
        }
    }
}

/// The writer thread: each batch in one write; an operator's message handled after the
/// lines it carries are written where the log went before it.
fn writer(rx: Receiver<Msg>, batch: &Mutex<Vec<u8>>) {
    let mut sink = Sink::Off;
    let mut taken = Vec::new();
    let mut failed = false;
    while let Ok(first) = rx.recv() {
        if matches!(first, Msg::Lines) {
            std::thread::sleep(BATCH);
        }
        let mut next = Some(first);
        loop {
            let msg = match next.take() {
                Some(msg) => msg,
                None => {
                    // The batch is taken only when no message is waiting (they are sent
                    // under its lock): lines queued after a message stay after it.
                    let mut lines = batch.lock().unwrap_or_else(PoisonError::into_inner);
                    match rx.try_recv() {
                        Ok(msg) => msg,
                        Err(_) => {
                            std::mem::swap(&mut *lines, &mut taken);
                            break;
                        }
                    }
                }
            };
            // A `Lines` is taken with the batch: a batch begun while the last was written
            // waits for the next wake-up, not a write of its own.
            let Msg::Op(before, op) = msg else { continue };
            write_to(&mut sink, &before, &mut failed);
            flush(&mut sink);
            match op {
                Op::Target(target) => sink = open(&target),
                Op::Reopen => {
                    if let Sink::File(path, _) = &sink {
                        sink = open(&AccessLog::File(path.clone()));
                        tracing::info!("access log reopened");
                    }
                }
                Op::Flush(done) => {
                    let _ = done.send(());
                }
            }
        }
        write_to(&mut sink, &taken, &mut failed);
        flush(&mut sink);
        taken.clear();
        // After a burst, a few hundred KiB of room is kept, not the burst's.
        if taken.capacity() > KEPT_BYTES * 4 {
            taken = Vec::with_capacity(KEPT_BYTES);
        }
    }
}

/// Writes `lines` in one call; a failure is logged once until a write succeeds again.
fn write_to(sink: &mut Sink, lines: &[u8], failed: &mut bool) {
    if lines.is_empty() {
        return;
    }
    let written = match sink {
        Sink::Off => Ok(()),
        Sink::Stdout(out) => out.lock().write_all(lines),
        Sink::Stderr(err) => err.lock().write_all(lines),
        Sink::File(_, file) => file.write_all(lines),
    };
    match written {
        Err(e) if !*failed => {
            *failed = true;
            tracing::error!("access log: cannot write: {e}");
        }
        Ok(()) => *failed = false,
        Err(_) => {}
    }
}

fn flush(sink: &mut Sink) {
    let _ = match sink {
        Sink::Off | Sink::File(..) => Ok(()), // a file is written unbuffered
        Sink::Stdout(out) => out.flush(),
        Sink::Stderr(err) => err.flush(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines from several threads at once, in bursts past the room a batch keeps, reach the
    /// file whole and once each, each thread's in its order.
    /// An access log to a file of its own: (its directory, the file, the log).
    fn log_in(name: &str) -> (std::path::PathBuf, std::path::PathBuf, Access) {
        let dir = std::env::temp_dir().join(format!("tokentap-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let _ = std::fs::remove_file(&path);
        let access = Access::new(&AccessLog::File(path.clone()));
        (dir, path, access)
    }

    #[test]
    fn lines_from_many_threads_arrive_whole_and_once() {
        let (dir, path, access) = log_in("access-many");
        const THREADS: usize = 4;
        // 3.1 MB in all: under the 4 MiB a batch holds (none dropped however the writer
        // keeps up), over the 1 MiB after which its room is given back.
        const EACH: usize = 2_500;
        let pad = "x".repeat(300);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (access, pad) = (&access, &pad);
                s.spawn(move || {
                    for i in 0..EACH {
                        access.write(|line| {
                            line.extend_from_slice(format!("{t} {i} {pad}").as_bytes())
                        });
                    }
                });
            }
        });
        access.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut next = [0usize; THREADS];
        for line in text.lines() {
            let mut parts = line.split(' ');
            let t: usize = parts.next().unwrap().parse().unwrap();
            let i: usize = parts.next().unwrap().parse().unwrap();
            assert_eq!(parts.next(), Some(pad.as_str()), "{line}");
            assert_eq!(i, next[t], "thread {t}'s lines in order, once each");
            next[t] += 1;
        }
        assert_eq!(next, [EACH; THREADS], "dropped: {}", access.dropped());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lines_reach_the_file_and_a_reopen_follows_a_rotation() {
        let (dir, path, access) = log_in("access");
        assert!(access.on());
        access.write(|line| line.extend_from_slice(b"one"));
        access.flush();
        std::fs::rename(&path, dir.join("access.log.1")).unwrap();
        access.reopen();
        access.write(|line| line.extend_from_slice(b"two"));
        access.flush();
        assert_eq!(
            std::fs::read_to_string(dir.join("access.log.1")).unwrap(),
            "one\n"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
        // A line queued before the log is turned off goes where the log went then.
        access.write(|line| line.extend_from_slice(b"three"));
        access.set(&AccessLog::Off);
        assert!(!access.on());
        access.flush();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\nthree\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
