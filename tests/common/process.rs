//! `tokentap run` as a process of its own: its config file, its stderr and stdout kept, and
//! signals sent to it, as an operator runs it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::free_addr;

/// A directory of its own under the system's temp dir, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "tokentap-{name}-{}-{:x}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

/// A running `tokentap run -c FILE`.
pub struct Tokentap {
    pub child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub config: PathBuf,
    pub stderr: Arc<Mutex<String>>,
    pub stdout: Arc<Mutex<String>>,
}

/// The `[listen]` section of a config on free ports: (text, proxy, admin).
pub fn listen_section() -> (String, SocketAddr, SocketAddr) {
    let (proxy, admin) = (free_addr(), free_addr());
    (
        format!("[listen]\nproxy = \"{proxy}\"\nadmin = \"{admin}\"\n"),
        proxy,
        admin,
    )
}

impl Tokentap {
    /// Writes `config` (which must hold the `[listen]` of `proxy` and `admin`) to
    /// `dir/tokentap.toml` and starts tokentap on it with `env`; returns once the admin
    /// answers `/healthz`.
    pub fn start(
        dir: &Path,
        config: &str,
        proxy: SocketAddr,
        admin: SocketAddr,
        env: &[(&str, &str)],
    ) -> Tokentap {
        let path = dir.join("tokentap.toml");
        std::fs::write(&path, config).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokentap"));
        cmd.args(["run", "--config"])
            .arg(&path)
            .env_remove("RUST_LOG")
            .env_remove("TOKENTAP_ADMIN_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = keep(child.stderr.take().unwrap());
        let stdout = keep(child.stdout.take().unwrap());
        let t = Tokentap {
            child,
            proxy,
            admin,
            config: path,
            stderr,
            stdout,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(admin).is_err()
            || std::net::TcpStream::connect(proxy).is_err()
        {
            assert!(
                Instant::now() < deadline,
                "tokentap did not start: {}",
                t.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        t
    }

    pub fn signal(&self, s: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), s).unwrap();
    }

    /// Waits up to `limit` for the process to exit: its status and how long it took.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<(ExitStatus, Duration)> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some((status, start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// Waits until stderr holds a line with every one of `parts`; the line.
    pub fn log_line(&self, parts: &[&str], limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(line) = self
                .stderr()
                .lines()
                .find(|l| parts.iter().all(|p| l.contains(p)))
            {
                return line.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {parts:?} in:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Tokentap {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keep(from: impl std::io::Read + Send + 'static) -> Arc<Mutex<String>> {
    let kept = Arc::new(Mutex::new(String::new()));
    let into = Arc::clone(&kept);
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            let mut k = into.lock().unwrap();
            k.push_str(&line);
            k.push('\n');
        }
    });
    kept
}
