//! Progressive rollouts (`route[].rollout`): the route's traffic moves from one upstream of
//! its split to another in steps, each step taken only when the measured comparison shows
//! the new one is not worse, and undone at once when it is worse or fails.
//!
//! - **Steps**: `to` serves `steps[i]` percent of the route's requests (the rest goes to
//!   `from`; other arms of the split keep their weights). An evaluation every `every_secs`
//!   judges the step so far ([`judge`]): advance to the next step (the last, 100, ends
//!   `promoted`), roll back to 0 (`rolled_back`), or wait for evidence.
//! - **Matched concurrency at a small share**: at 10% `to` runs at a tenth of `from`'s
//!   load, and its TPOT would look better for that alone. While `to` serves less than half,
//!   it is also sent copies of `from`'s requests (shadow traffic, answers discarded, marked
//!   `x-tokentap-shadow: rollout`), as many as bring its load to `from`'s: a share `p`
//!   gets copies of (100 − 2p) ÷ (100 − p) of `from`'s requests. The comparison is then the
//!   A/B regression at matched concurrency `/compare` makes, on the step's requests. A
//!   mirror to `to` the route configures is that shadow (its own headers and cap, its
//!   percent an upper bound on the copies). A copy takes a slot of `to`'s own cap too, free
//!   at once or not at all: a cap is the operator's promise to the backend, so a copy that
//!   finds none is not sent (counted), and never waits in `to`'s queue.
//! - **Held share**: the step's share is of the requests the two arms serve. `spill` never
//!   moves a request into or out of the pair while the rollout holds a share
//!   ([`crate::routing`]), and `GET /rollout` shows the share `to` was actually sent
//!   (`served_percent`) and what the copies cost (`shadow_rps`), over the last 10 s.
//! - **Steered**: `POST /rollout/ROUTE` pauses (the share held), resumes (the step's
//!   evidence starts afresh), aborts (rolled back) or promotes (100%).
//! - **Kept**: a reload that keeps a route's rollout as it was keeps its state — the same
//!   state, shared by both generations, not a copy, so a steer or an evaluation made
//!   through the generation a reload replaces is not lost. A changed rollout starts afresh.
//!   A steer looks its rollout up when it is applied, one reload at a time with it
//!   ([`crate::state::Live::steer`]). With `[rollouts] state_file` each transition is
//!   written there, and a restart resumes each unchanged rollout where it was.

pub mod judge;
mod shadow;
mod store;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub use crate::config::RolloutConfig;
use crate::config::Route;
use crate::meter::Nanos;
use judge::{Counts, Decision, Evaluation};
pub use shadow::{copies_cost, copies_per_request};
use shadow::{rates, shadow, Seen, Traffic};

/// Where a rollout is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Running,
    Paused,
    Promoted,
    RolledBack,
}

impl State {
    pub const ALL: [State; 4] = [
        State::Running,
        State::Paused,
        State::Promoted,
        State::RolledBack,
    ];

    pub fn label(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Paused => "paused",
            State::Promoted => "promoted",
            State::RolledBack => "rolled_back",
        }
    }

    fn done(self) -> bool {
        matches!(self, State::Promoted | State::RolledBack)
    }
}

/// A steer of `POST /rollout/ROUTE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Pause,
    Resume,
    Abort,
    Promote,
}

impl Action {
    pub fn parse(s: &str) -> Option<Action> {
        match s.trim() {
            "pause" => Some(Action::Pause),
            "resume" => Some(Action::Resume),
            "abort" => Some(Action::Abort),
            "promote" => Some(Action::Promote),
            _ => None,
        }
    }
}

/// A change of state or share, as the history keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    /// Seconds since the Unix epoch.
    pub at: u64,
    pub state: State,
    pub percent: f64,
    pub why: String,
}

/// Evaluations and transitions kept, at most.
const KEPT: usize = 64;

/// Readings of the traffic counts kept for the rates `GET /rollout` shows: one a tick (a
/// second), so the rates are over the last 10 s.
const SEEN_KEPT: usize = 11;

/// One route's rollout.
pub struct Rollout {
    pub route: String,
    pub from: String,
    pub to: String,
    pub config: RolloutConfig,
    /// What it was configured as, to tell a kept rollout from a changed one.
    fingerprint: String,
    /// Where it is: shared with the generations of the state that keep it.
    progress: Arc<Progress>,
}

/// A rollout's state, shared (not copied) by every generation of the running state that
/// keeps the rollout: a steer or an evaluation through any of them is the one rollout's.
struct Progress {
    /// `to`'s share now (an f64's bits), read by every routing choice.
    percent: AtomicU64,
    inner: Mutex<Inner>,
    traffic: Traffic,
}

struct Inner {
    state: State,
    step: usize,
    /// When the step's evidence began, and the counts then (`None`: taken at the next
    /// tick).
    since: Nanos,
    base: Option<(Counts, Counts)>,
    last_evaluation: Nanos,
    evaluations: VecDeque<Evaluation>,
    history: VecDeque<Transition>,
    /// The traffic's counts at the last ticks, oldest first (at most [`SEEN_KEPT`]).
    seen: VecDeque<Seen>,
}

/// What `GET /rollout` shows of one rollout.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RolloutStats {
    pub route: String,
    pub from: String,
    pub to: String,
    pub state: State,
    pub percent: f64,
    pub step: usize,
    pub steps: Vec<f64>,
    /// Copies of `from`'s requests `to` is sent now, percent (its load matched to
    /// `from`'s while it serves less than half).
    pub shadow_percent: f64,
    /// `to`'s share of the live requests the two arms were sent over the last 10 s,
    /// percent (`null`: none were).
    pub served_percent: Option<f64>,
    /// What the copies cost `to`: copies sent to it a second, over the last 10 s (`null`:
    /// not measured yet).
    pub shadow_rps: Option<f64>,
    /// Copies sent to `to` since the rollout began.
    pub shadow_sent_total: u64,
    /// Copies the share asked for that were not sent: no free slot under `to`'s cap (or
    /// the shadow mirror's `max_in_flight`), no endpoint, or a body not read whole.
    pub shadow_skipped_total: u64,
    pub every_secs: u64,
    pub max_tpot_ratio: f64,
    pub max_ttft_ratio: Option<f64>,
    pub max_error_pct: f64,
    pub min_requests: u64,
    pub evaluations: Vec<Evaluation>,
    pub history: Vec<Transition>,
}

/// A rollout as configured, in words: the same words, the same rollout.
fn fingerprint(c: &RolloutConfig, names: &[String]) -> String {
    format!(
        "{}>{} steps {:?} every {:?} tpot {} ttft {:?} errors {} min {}",
        names[c.from],
        names[c.to],
        c.steps,
        c.every,
        c.max_tpot_ratio,
        c.max_ttft_ratio,
        c.max_error_pct,
        c.min_requests
    )
}

/// What `/stats` shows of a rollout (the dashboard, `top` and `/metrics` read it).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RolloutSummary {
    pub route: String,
    pub from: String,
    pub to: String,
    pub state: State,
    pub percent: f64,
    pub shadow_percent: f64,
    /// The last evaluation's decision and reason.
    pub last: Option<Evaluation>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Rollout {
    /// A rollout starting at its first step, or resumed where `saved` left it (`why`).
    fn new(
        route: &Route,
        c: &RolloutConfig,
        names: &[String],
        now: Nanos,
        saved: Option<(&store::Saved, String)>,
    ) -> Rollout {
        let (from, to) = (names[c.from].clone(), names[c.to].clone());
        let r = Rollout {
            route: route.name.clone(),
            from,
            to,
            config: c.clone(),
            fingerprint: fingerprint(c, names),
            progress: Arc::new(Progress {
                percent: AtomicU64::new(0),
                inner: Mutex::new(Inner {
                    state: State::Running,
                    step: 0,
                    since: now,
                    base: None,
                    last_evaluation: now,
                    evaluations: VecDeque::new(),
                    history: VecDeque::new(),
                    seen: VecDeque::new(),
                }),
                traffic: Traffic::default(),
            }),
        };
        let mut inner = r.lock();
        match saved {
            Some((s, why)) => {
                inner.history = s.history.iter().cloned().collect();
                r.enter(&mut inner, s.state, s.step, now, why);
            }
            None => r.enter(&mut inner, State::Running, 0, now, "started".into()),
        }
        drop(inner);
        r
    }

    /// This rollout under `route`'s config as reloaded (the same rollout, its upstreams
    /// perhaps at other places): its state shared, not copied, so what is done through
    /// the generation being replaced (a steer whose body came after the reload began, an
    /// evaluation that was under way) is this one's too.
    fn successor(&self, route: &Route, c: &RolloutConfig, names: &[String]) -> Rollout {
        Rollout {
            route: route.name.clone(),
            from: names[c.from].clone(),
            to: names[c.to].clone(),
            config: c.clone(),
            fingerprint: self.fingerprint.clone(),
            progress: Arc::clone(&self.progress),
        }
    }

    /// `to`'s share of the route's requests now, percent.
    pub fn percent(&self) -> f64 {
        f64::from_bits(self.progress.percent.load(Relaxed))
    }

    /// Whether the rollout holds a share between its arms now (a step under 100, not
    /// ended): then `spill` moves no request into or out of the pair.
    pub fn holds_share(&self) -> bool {
        let p = self.percent();
        p > 0.0 && p < 100.0
    }

    /// A live request (not a copy) was sent to `upstream` on the rollout's route.
    pub fn sent(&self, upstream: usize) {
        let t = &self.progress.traffic;
        if upstream == self.config.to {
            t.to.fetch_add(1, Relaxed);
        } else if upstream == self.config.from {
            t.from.fetch_add(1, Relaxed);
        }
    }

    /// A copy was sent to `to` (`true`), or the share asked for one that was not sent.
    pub fn copy(&self, sent: bool) {
        let t = &self.progress.traffic;
        let count = if sent { &t.copies } else { &t.skipped };
        count.fetch_add(1, Relaxed);
    }

    /// Reads the traffic's counts at `now`, for the rates over the last ticks.
    fn see(&self, now: Nanos) {
        let t = &self.progress.traffic;
        let seen = Seen {
            at: now,
            from: t.from.load(Relaxed),
            to: t.to.load(Relaxed),
            copies: t.copies.load(Relaxed),
        };
        let mut inner = self.lock();
        if inner.seen.len() == SEEN_KEPT {
            inner.seen.pop_front();
        }
        inner.seen.push_back(seen);
    }

    /// Copies of `from`'s requests to send `to` now, percent (0 at half or more, or done).
    pub fn shadow_percent(&self) -> f64 {
        shadow(self.lock().state, self.percent())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        (self.progress.inner.lock()).unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves to `state` at step `step`, its evidence starting afresh; logged and kept.
    fn enter(&self, inner: &mut Inner, state: State, step: usize, now: Nanos, why: String) {
        let percent = match state {
            State::Promoted => 100.0,
            State::RolledBack => 0.0,
            _ => self.config.steps[step.min(self.config.steps.len() - 1)],
        };
        let before = (inner.state, self.percent());
        inner.state = state;
        inner.step = step;
        inner.since = now;
        inner.base = None;
        inner.last_evaluation = now;
        self.progress.percent.store(percent.to_bits(), Relaxed);
        tracing::info!(
            route = %self.route,
            from = %self.from,
            to = %self.to,
            state = state.label(),
            percent,
            was = before.0.label(),
            was_percent = before.1,
            why = %why,
            "rollout"
        );
        if inner.history.len() == KEPT {
            inner.history.pop_front();
        }
        inner.history.push_back(Transition {
            at: unix_now(),
            state,
            percent,
            why,
        });
    }

    /// Evaluates the step when it is due (running, `every` since the last); whether it
    /// moved. `counts` reads (from's, to's) counters now; `compare` the step's comparison
    /// of the samples finished since the given time.
    fn tick(
        &self,
        now: Nanos,
        counts: impl FnOnce() -> (Counts, Counts),
        compare: impl FnOnce(Nanos) -> crate::compare::Comparison,
    ) -> bool {
        let every = u64::try_from(self.config.every.as_nanos()).unwrap_or(u64::MAX);
        let (step, base, since) = {
            let mut inner = self.lock();
            if inner.state != State::Running || now.saturating_sub(inner.last_evaluation) < every {
                return false;
            }
            inner.last_evaluation = now;
            (inner.step, inner.base, inner.since)
        };
        // Read and compared without the lock: every request to `from` asks it for the
        // shadow's share.
        let (f, t) = counts();
        let Some((bf, bt)) = base else {
            // The step's counts start here (after a resume, a restart or a reload).
            let mut inner = self.lock();
            if inner.state == State::Running && inner.step == step && inner.base.is_none() {
                inner.base = Some((f, t));
                inner.since = now;
            }
            return false;
        };
        let cmp = compare(since);
        let e = judge::judge(
            &self.config,
            self.percent(),
            unix_now(),
            &cmp,
            f.since(bf),
            t.since(bt),
        );
        let mut inner = self.lock();
        if inner.state != State::Running || inner.step != step {
            // Steered while it was judged: the steer stands.
            return false;
        }
        let (decision, why) = (e.decision, e.reason.clone());
        if inner.evaluations.len() == KEPT {
            inner.evaluations.pop_front();
        }
        inner.evaluations.push_back(e);
        match decision {
            Decision::Wait => return false,
            Decision::RollBack => self.enter(&mut inner, State::RolledBack, step, now, why),
            Decision::Advance => {
                let next = (step + 1).min(self.config.steps.len() - 1);
                let state = if next == step || self.config.steps[next] >= 100.0 {
                    State::Promoted
                } else {
                    State::Running
                };
                self.enter(&mut inner, state, next, now, why);
            }
        }
        inner.base = Some((f, t));
        true
    }

    /// Applies a steer; `Err`: why it does not apply in this state.
    fn act(&self, action: Action, now: Nanos) -> Result<(), String> {
        let mut inner = self.lock();
        let (state, step) = (inner.state, inner.step);
        let next = match (action, state) {
            (_, State::Promoted | State::RolledBack) => {
                return Err(format!("the rollout has ended ({})", state.label()))
            }
            (Action::Pause, State::Running) => State::Paused,
            (Action::Resume, State::Paused) => State::Running,
            (Action::Pause | Action::Resume, _) => {
                return Err(format!("the rollout is {}", state.label()))
            }
            (Action::Abort, _) => State::RolledBack,
            (Action::Promote, _) => State::Promoted,
        };
        let why = format!(
            "{} by POST /rollout",
            match action {
                Action::Pause => "paused",
                Action::Resume => "resumed",
                Action::Abort => "aborted",
                Action::Promote => "promoted",
            }
        );
        self.enter(&mut inner, next, step, now, why);
        Ok(())
    }

    pub fn summary(&self) -> RolloutSummary {
        let inner = self.lock();
        RolloutSummary {
            route: self.route.clone(),
            from: self.from.clone(),
            to: self.to.clone(),
            state: inner.state,
            percent: self.percent(),
            shadow_percent: shadow(inner.state, self.percent()),
            last: inner.evaluations.back().cloned(),
        }
    }

    pub fn stats(&self) -> RolloutStats {
        let inner = self.lock();
        let c = &self.config;
        let t = &self.progress.traffic;
        let (served_percent, shadow_rps) = rates(&inner.seen);
        RolloutStats {
            route: self.route.clone(),
            from: self.from.clone(),
            to: self.to.clone(),
            state: inner.state,
            percent: self.percent(),
            step: inner.step,
            steps: c.steps.clone(),
            shadow_percent: shadow(inner.state, self.percent()),
            served_percent,
            shadow_rps,
            shadow_sent_total: t.copies.load(Relaxed),
            shadow_skipped_total: t.skipped.load(Relaxed),
            every_secs: c.every.as_secs(),
            max_tpot_ratio: c.max_tpot_ratio,
            max_ttft_ratio: c.max_ttft_ratio,
            max_error_pct: c.max_error_pct,
            min_requests: c.min_requests,
            evaluations: inner.evaluations.iter().cloned().collect(),
            history: inner.history.iter().cloned().collect(),
        }
    }
}

/// Every route's rollout (`None` for a route without one), and where their state is kept.
#[derive(Default)]
pub struct Rollouts {
    by_route: Vec<Option<Arc<Rollout>>>,
    file: Option<std::path::PathBuf>,
}

/// One writer of the state file at a time (the evaluator and a steer may both move).
static SAVING: Mutex<()> = Mutex::new(());

impl Rollouts {
    /// The rollouts of `routes` at `now`: each kept from `old` when unchanged (a reload),
    /// else resumed from the state file when it holds it unchanged (a restart), else new.
    pub fn new(
        routes: &[Route],
        names: &[String],
        file: Option<&std::path::Path>,
        old: Option<&Rollouts>,
        now: Nanos,
    ) -> Rollouts {
        let saved = match (old, file) {
            (None, Some(path)) => store::load(path),
            _ => Default::default(),
        };
        let by_route = routes
            .iter()
            .map(|r| {
                let c = r.rollout.as_ref()?;
                let fp = fingerprint(c, names);
                let kept = (old.into_iter())
                    .flat_map(|o| o.by_route.iter().flatten())
                    .find(|o| o.route == r.name && o.fingerprint == fp);
                if let Some(kept) = kept {
                    return Some(Arc::new(kept.successor(r, c, names)));
                }
                let resumed = (saved.get(&r.name))
                    .filter(|s| s.fingerprint == fp)
                    .zip(file)
                    .map(|(s, f)| (s, format!("resumed from {}", f.display())));
                Some(Arc::new(Rollout::new(r, c, names, now, resumed)))
            })
            .collect();
        Rollouts {
            by_route,
            file: file.map(std::path::Path::to_path_buf),
        }
    }

    /// Route `route`'s rollout, if it has one.
    pub fn of(&self, route: usize) -> Option<&Arc<Rollout>> {
        self.by_route.get(route).and_then(Option::as_ref)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Rollout>> {
        self.by_route.iter().flatten()
    }

    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// Evaluates each rollout that is due; the state file written when one moved.
    pub fn tick(
        &self,
        now: Nanos,
        counts: impl Fn(usize) -> Counts,
        compare: impl Fn(&Rollout, Nanos) -> crate::compare::Comparison,
    ) {
        let mut moved = false;
        for r in self.iter() {
            r.see(now);
            moved |= r.tick(
                now,
                || (counts(r.config.from), counts(r.config.to)),
                |since| compare(r, since),
            );
        }
        if moved {
            self.save();
        }
    }

    /// `POST /rollout/ROUTE`: the steer applied to the rollout of the route named `route`,
    /// the state file written, and the rollout as it is then. Call it on the state in
    /// force, one reload at a time with it ([`crate::state::Live::steer`]).
    pub fn act(&self, route: &str, action: Action, now: Nanos) -> Result<RolloutStats, ActError> {
        let r = self
            .iter()
            .find(|r| r.route == route)
            .ok_or(ActError::NoRollout)?;
        r.act(action, now).map_err(ActError::Refused)?;
        self.save();
        Ok(r.stats())
    }

    fn save(&self) {
        if let Some(path) = &self.file {
            let _one = SAVING.lock().unwrap_or_else(PoisonError::into_inner);
            store::save(path, self.iter().map(|r| store::Saved::of(r)));
        }
    }
}

/// Why a steer was not applied.
#[derive(Debug, Clone, PartialEq)]
pub enum ActError {
    NoRollout,
    Refused(String),
}

#[cfg(test)]
mod tests;
