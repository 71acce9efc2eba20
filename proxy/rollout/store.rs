//! `[rollouts] state_file`: each rollout's state written at each transition (whole, to a
//! temporary file renamed over it), read at start to resume.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Rollout, State, Transition};

/// One rollout as the file keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Saved {
    pub(super) route: String,
    /// The rollout as configured: a changed one is not resumed.
    pub(super) fingerprint: String,
    pub(super) state: State,
    pub(super) step: usize,
    pub(super) history: Vec<Transition>,
}

impl Saved {
    pub(super) fn of(r: &Rollout) -> Saved {
        let inner = r.lock();
        Saved {
            route: r.route.clone(),
            fingerprint: r.fingerprint.clone(),
            state: inner.state,
            step: inner.step,
            history: inner.history.iter().cloned().collect(),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct File {
    rollouts: Vec<Saved>,
}

/// The rollouts saved at `path`, by route; none (logged) when it is missing or unreadable.
pub(super) fn load(path: &Path) -> HashMap<String, Saved> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HashMap::new(),
        Err(e) => {
            tracing::warn!(file = %path.display(), cause = %e, "rollouts: cannot read the state file; every rollout starts afresh");
            return HashMap::new();
        }
    };
    match serde_json::from_slice::<File>(&text) {
        Ok(f) => f
            .rollouts
            .into_iter()
            .map(|s| (s.route.clone(), s))
            .collect(),
        Err(e) => {
            tracing::warn!(file = %path.display(), cause = %e, "rollouts: the state file is not tokentap's; every rollout starts afresh");
            HashMap::new()
        }
    }
}

/// Writes `rollouts` to `path` (logged when it cannot).
pub(super) fn save(path: &Path, rollouts: impl Iterator<Item = Saved>) {
    let file = File {
        rollouts: rollouts.collect(),
    };
    let written = serde_json::to_vec_pretty(&file)
        .map_err(std::io::Error::other)
        .and_then(|bytes| replace(path, &bytes));
    if let Err(e) = written {
        tracing::warn!(file = %path.display(), cause = %e, "rollouts: cannot write the state file");
    }
}

/// Replaces `path` with `bytes` whole: written to a temporary beside it, then renamed over
/// it. The temporary's name is new each time (the process id and 64 random bits) and it is
/// created only if nothing is there (`O_CREAT | O_EXCL`, which follows no symlink), `0600`:
/// a file or symlink planted where the temporary goes is never written through.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(
        ".{}.{:016x}.writing",
        std::process::id(),
        rand::random::<u64>()
    ));
    let tmp = std::path::PathBuf::from(tmp);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    let done = out
        .write_all(bytes)
        .and_then(|()| out.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt as _};

    /// A symlink planted where the temporary went (`STATE_FILE.writing`) is not followed:
    /// the file it points at is left as it was, the state file is written, `0600`, and no
    /// temporary is left behind.
    #[test]
    fn a_planted_symlink_is_not_followed() {
        let dir =
            std::env::temp_dir().join(format!("tokentap-store-{:016x}", rand::random::<u64>()));
        std::fs::create_dir(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"not tokentap's").unwrap();
        let path = dir.join("rollouts.json");
        symlink(&victim, dir.join("rollouts.json.writing")).unwrap();
        replace(&path, b"{}").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"not tokentap's");
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".writing") && n != "rollouts.json.writing")
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // Written again over itself: still whole.
        replace(&path, b"[]").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"[]");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
