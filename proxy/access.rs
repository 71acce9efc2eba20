//! The access log: one JSON line per request when it ends (`[log] access`), written by a
//! thread of its own so that a slow disk never holds a request. Lines go through a bounded
//! queue; when it is full (the disk cannot keep up) a line is dropped and counted, never
//! waited for. A file is appended to, and reopened on SIGUSR1 (after logrotate moved it).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::OnceLock;

use crate::config::AccessLog;

/// Lines queued for the writer at most.
const QUEUE: usize = 16 * 1024;

/// How long the writer lets lines gather after the first of a batch: woken at most this
/// often, it costs a request no wake-up of its own (a request queues its line without a
/// system call while the writer sleeps), and a batch is one write. A line reaches the
/// file at most this late.
const BATCH: std::time::Duration = std::time::Duration::from_millis(10);

/// The access log of one proxy.
pub struct Access {
    on: AtomicBool,
    /// The writer thread's queue, started with the first target that is not off.
    tx: OnceLock<SyncSender<Msg>>,
    dropped: AtomicU64,
}

enum Msg {
    Line(String),
    Target(AccessLog),
    Reopen,
    /// Everything before it is written and flushed when this is answered.
    Flush(mpsc::Sender<()>),
}

impl Access {
    pub fn new(target: &AccessLog) -> Access {
        let access = Access {
            on: AtomicBool::new(false),
            tx: OnceLock::new(),
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
        if on {
            self.tx.get_or_init(|| {
                let (sender, rx) = mpsc::sync_channel(QUEUE);
                let spawned = std::thread::Builder::new()
                    .name("tokentap-access".into())
                    .spawn(move || writer(rx));
                if let Err(e) = spawned {
                    // The receiver is gone: every line is counted as dropped.
                    tracing::error!("access log: cannot start its writer thread: {e}");
                }
                sender
            });
        }
        if let Some(tx) = self.tx.get() {
            let _ = tx.send(Msg::Target(target.clone()));
        }
        self.on.store(on, Relaxed);
    }

    /// Queues one line (without its newline).
    pub fn write(&self, line: String) {
        let Some(tx) = self.tx.get() else { return };
        match tx.try_send(Msg::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Relaxed);
            }
        }
    }

    /// Lines dropped because the writer could not keep up.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }

    /// Reopens the file (SIGUSR1).
    pub fn reopen(&self) {
        self.send(Msg::Reopen);
    }

    /// Waits until every line queued so far is written and flushed.
    pub fn flush(&self) {
        let (done, wait) = mpsc::channel();
        if self.send(Msg::Flush(done)) {
            let _ = wait.recv_timeout(std::time::Duration::from_secs(5));
        }
    }

    fn send(&self, msg: Msg) -> bool {
        self.tx.get().is_some_and(|tx| tx.send(msg).is_ok())
    }
}

/// Where lines go now.
enum Sink {
    Off,
    Stdout(io::Stdout),
    Stderr(io::Stderr),
    File(std::path::PathBuf, BufWriter<File>),
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
                Ok(f) => Sink::File(path.clone(), BufWriter::with_capacity(64 * 1024, f)),
                Err(e) => {
                    tracing::error!(path = %path.display(), "access log: cannot open: {e}");
                    Sink::Off
                }
            }
        }
    }
}

fn writer(rx: Receiver<Msg>) {
    let mut sink = Sink::Off;
    let mut failed = false;
    while let Ok(first) = rx.recv() {
        if matches!(first, Msg::Line(_)) {
            std::thread::sleep(BATCH);
        }
        let mut next = Some(first);
        // Everything queued is written before one flush.
        while let Some(msg) = next.take().or_else(|| rx.try_recv().ok()) {
            match msg {
                Msg::Line(line) => {
                    let written = match &mut sink {
                        Sink::Off => Ok(()),
                        Sink::Stdout(out) => writeln!(out.lock(), "{line}"),
                        Sink::Stderr(err) => writeln!(err.lock(), "{line}"),
                        Sink::File(_, file) => writeln!(file, "{line}"),
                    };
                    match written {
                        Err(e) if !failed => {
                            failed = true;
                            tracing::error!("access log: cannot write: {e}");
                        }
                        Ok(()) => failed = false,
                        Err(_) => {}
                    }
                }
                Msg::Target(target) => {
                    flush(&mut sink);
                    sink = open(&target);
                }
                Msg::Reopen => {
                    flush(&mut sink);
                    if let Sink::File(path, _) = &sink {
                        sink = open(&AccessLog::File(path.clone()));
                        tracing::info!("access log reopened");
                    }
                }
                Msg::Flush(done) => {
                    flush(&mut sink);
                    let _ = done.send(());
                }
            }
        }
        flush(&mut sink);
    }
}

fn flush(sink: &mut Sink) {
    let _ = match sink {
        Sink::Off => Ok(()),
        Sink::Stdout(out) => out.flush(),
        Sink::Stderr(err) => err.flush(),
        Sink::File(_, file) => file.flush(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_reach_the_file_and_a_reopen_follows_a_rotation() {
        let dir = std::env::temp_dir().join(format!("tokentap-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let _ = std::fs::remove_file(&path);
        let access = Access::new(&AccessLog::File(path.clone()));
        assert!(access.on());
        access.write("one".into());
        access.flush();
        std::fs::rename(&path, dir.join("access.log.1")).unwrap();
        access.reopen();
        access.write("two".into());
        access.flush();
        assert_eq!(
            std::fs::read_to_string(dir.join("access.log.1")).unwrap(),
            "one\n"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
        access.set(&AccessLog::Off);
        assert!(!access.on());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
