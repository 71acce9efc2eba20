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
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".writing");
    let tmp = std::path::PathBuf::from(tmp);
    let written = serde_json::to_vec_pretty(&file)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        tracing::warn!(file = %path.display(), cause = %e, "rollouts: cannot write the state file");
    }
}
