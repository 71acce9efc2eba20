//! The batching engine: one task that owns the batch and runs decode steps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use super::{Curve, SimArgs};

/// A generation request handed to the engine.
pub struct Job {
    pub max_tokens: u64,
    pub prompt_tokens: u64,
    /// Of those, held in the prefix cache: not prefilled again.
    pub cached_tokens: u64,
    /// Where the engine sends each event's tokens; dropped receiver = client gone.
    pub out: mpsc::UnboundedSender<Emit>,
}

/// One event's worth of output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Emit {
    pub tokens: u64,
    /// The request's last event: it reached `max_tokens`.
    pub last: bool,
}

/// The engine's own figures (`GET /sim/stats`).
#[derive(Debug, Default, Serialize)]
pub struct SimStats {
    pub decoding: u64,
    pub prefilling: u64,
    pub waiting: u64,
    /// The most requests ever prefilling or decoding at once.
    pub peak_batch: u64,
    pub completed: u64,
    /// Requests whose client went away before the end.
    pub aborted: u64,
    pub tokens: u64,
    /// Prompt tokens of the requests admitted, and of those the ones the prefix cache held.
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    /// Generation requests received, and those of them marked as shadow copies
    /// (`x-tokentap-shadow`: a rollout's or a mirror's copy, never served to a client).
    pub requests: u64,
    pub shadow_requests: u64,
    /// Requests answered 500 on purpose (`POST /sim/fail`).
    pub failed: u64,
    /// The geometric mean of the completed requests' time per output token as the engine
    /// sent them (first event to last, over the tokens after the first), and how many
    /// requests it is of: what the backend did, to check a meter's figures against.
    pub sent_tpot_ms_geomean: Option<f64>,
    pub sent_tpots: u64,
}

#[derive(Default)]
struct Counters {
    decoding: AtomicU64,
    prefilling: AtomicU64,
    waiting: AtomicU64,
    peak_batch: AtomicU64,
    completed: AtomicU64,
    aborted: AtomicU64,
    tokens: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    requests: AtomicU64,
    shadow_requests: AtomicU64,
    failed: AtomicU64,
    /// Percent of generation requests to answer 500 (an f64's bits).
    fail_pct: AtomicU64,
    /// The sum of the sent TPOTs' logs (an f64's bits; only the engine's task adds to it)
    /// and how many.
    sent_log_tpot: AtomicU64,
    sent_tpots: AtomicU64,
}

pub struct Engine {
    pub args: SimArgs,
    /// The TPOT curve in force (starts as `args.tpot_curve`; changeable while running).
    curve: std::sync::Mutex<Curve>,
    jobs: mpsc::UnboundedSender<Job>,
    counters: Counters,
    stop: Notify,
    /// `--prefix-cache-tokens`.
    cache: Option<std::sync::Mutex<super::cache::PrefixCache>>,
}

struct Active {
    job: Job,
    produced: u64,
    /// When its first event was sent.
    first: Instant,
}

/// The prefix cache `--prefix-cache-tokens` asks for.
fn args_cache(args: &SimArgs) -> Option<std::sync::Mutex<super::cache::PrefixCache>> {
    let tokens = args.prefix_cache_tokens?;
    Some(std::sync::Mutex::new(super::cache::PrefixCache::new(
        tokens,
    )))
}

// === impl Engine ===

impl Engine {
    /// Starts the engine task on the current runtime.
    pub fn start(args: SimArgs) -> Arc<Engine> {
        let cache = args_cache(&args);
        let (tx, rx) = mpsc::unbounded_channel();
        let engine = Arc::new(Engine {
            curve: std::sync::Mutex::new(args.tpot_curve.clone()),
            args,
            jobs: tx,
            counters: Counters::default(),
            stop: Notify::new(),
            cache,
        });
        let e = Arc::clone(&engine);
        tokio::spawn(async move {
            tokio::select! {
                _ = e.run(rx) => {}
                _ = e.stop.notified() => {}
            }
        });
        engine
    }

    /// Changes the TPOT curve from the next decode step on.
    pub fn set_curve(&self, curve: Curve) {
        *self
            .curve
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = curve;
    }

    fn step_ms(&self, batch: usize) -> f64 {
        self.curve
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .tpot_ms(batch as f64)
    }

    pub fn shutdown(&self) {
        self.stop.notify_one();
    }

    /// Queues a request; `false` if the engine has stopped.
    pub fn submit(&self, job: Job) -> bool {
        let c = &self.counters;
        c.prompt_tokens.fetch_add(job.prompt_tokens, Relaxed);
        c.cached_prompt_tokens.fetch_add(job.cached_tokens, Relaxed);
        self.jobs.send(job).is_ok()
    }

    /// With a prefix cache, the tokens of `prompt` it holds (and now keeps); `None`
    /// without one.
    pub fn cached(&self, prompt: &[u8]) -> Option<u64> {
        let cache = self.cache.as_ref()?;
        let mut c = cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(c.admit(prompt))
    }

    /// Starts the peak batch again from the batch now (`POST /sim/peak/reset`).
    /// A generation request arrived (`shadow`: marked as a copy); whether to fail it (500).
    pub fn arrived(&self, shadow: bool) -> bool {
        let c = &self.counters;
        c.requests.fetch_add(1, Relaxed);
        if shadow {
            c.shadow_requests.fetch_add(1, Relaxed);
        }
        let pct = f64::from_bits(c.fail_pct.load(Relaxed));
        let fail = pct > 0.0 && rand::random::<f64>() * 100.0 < pct;
        if fail {
            c.failed.fetch_add(1, Relaxed);
        }
        fail
    }

    /// From now on, `pct` percent of generation requests are answered 500.
    pub fn set_fail(&self, pct: f64) {
        self.counters
            .fail_pct
            .store(pct.clamp(0.0, 100.0).to_bits(), Relaxed);
    }

    pub fn reset_peak(&self) {
        let c = &self.counters;
        let now = c.prefilling.load(Relaxed) + c.decoding.load(Relaxed);
        c.peak_batch.store(now, Relaxed);
    }

    pub fn stats(&self) -> SimStats {
        let c = &self.counters;
        SimStats {
            decoding: c.decoding.load(Relaxed),
            prefilling: c.prefilling.load(Relaxed),
            waiting: c.waiting.load(Relaxed),
            peak_batch: c.peak_batch.load(Relaxed),
            completed: c.completed.load(Relaxed),
            aborted: c.aborted.load(Relaxed),
            tokens: c.tokens.load(Relaxed),
            prompt_tokens: c.prompt_tokens.load(Relaxed),
            cached_prompt_tokens: c.cached_prompt_tokens.load(Relaxed),
            requests: c.requests.load(Relaxed),
            shadow_requests: c.shadow_requests.load(Relaxed),
            failed: c.failed.load(Relaxed),
            sent_tpot_ms_geomean: match c.sent_tpots.load(Relaxed) {
                0 => None,
                n => Some((f64::from_bits(c.sent_log_tpot.load(Relaxed)) / n as f64).exp()),
            },
            sent_tpots: c.sent_tpots.load(Relaxed),
        }
    }

    /// When `job`, starting its prefill at `now`, has its first token. Without a prefix
    /// cache every prompt token costs `prefill_ms_per_token`, prefills running side by
    /// side; with one only the uncached tokens do, on the one prefill unit (`unit`: when it
    /// is free next), so misses queue behind each other.
    fn prefill_done(&self, job: &Job, now: Instant, unit: &mut Instant) -> Instant {
        let ms = |x: f64| Duration::from_secs_f64(x.max(0.0) / 1e3);
        let per_token = self.args.prefill_ms_per_token;
        if self.cache.is_none() {
            return now + ms(self.args.ttft_ms + per_token * job.prompt_tokens as f64);
        }
        let uncached = job.prompt_tokens.saturating_sub(job.cached_tokens);
        *unit = (*unit).max(now) + ms(per_token * uncached as f64);
        (*unit).max(now + ms(self.args.ttft_ms))
    }

    async fn run(&self, mut rx: mpsc::UnboundedReceiver<Job>) {
        let max_batch = self.args.max_batch.unwrap_or(usize::MAX);
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut prefilling: Vec<(Instant, Job)> = Vec::new();
        let mut decoding: Vec<Active> = Vec::new();
        let mut step_start = Instant::now();
        let mut prefill_unit = Instant::now();
        loop {
            while let Ok(job) = rx.try_recv() {
                waiting.push_back(job);
            }
            let now = Instant::now();
            while prefilling.len() + decoding.len() < max_batch {
                let Some(job) = waiting.pop_front() else {
                    break;
                };
                if job.out.is_closed() {
                    self.counters.aborted.fetch_add(1, Relaxed);
                    continue;
                }
                let done = self.prefill_done(&job, now, &mut prefill_unit);
                prefilling.push((done, job));
            }
            // Prefill ends with the first token, then the request joins the decode batch.
            let mut i = 0;
            while i < prefilling.len() {
                if prefilling[i].0 <= now {
                    let (_, job) = prefilling.swap_remove(i);
                    let mut active = Active {
                        job,
                        produced: 0,
                        first: now,
                    };
                    if self.emit(&mut active) {
                        decoding.push(active);
                    }
                } else {
                    i += 1;
                }
            }
            self.publish(&waiting, &prefilling, &decoding);

            if decoding.is_empty() {
                let next_prefill = prefilling.iter().map(|(t, _)| *t).min();
                tokio::select! {
                    job = rx.recv() => match job {
                        Some(job) => waiting.push_back(job),
                        None => return,
                    },
                    _ = sleep_until_opt(next_prefill) => {}
                }
                step_start = Instant::now();
                continue;
            }

            let step = Duration::from_secs_f64(self.step_ms(decoding.len()) / 1e3);
            let deadline = step_start + step;
            tokio::time::sleep_until(deadline).await;
            decoding.retain_mut(|a| self.emit(a));
            // Absolute deadlines: the next step starts when this one was due, unless the
            // engine fell a whole step behind (then it does not try to catch up in a burst).
            let now = Instant::now();
            step_start = if now.duration_since(deadline) > step {
                now
            } else {
                deadline
            };
        }
    }

    /// Sends a request its next event; `false` when it is done or its client is gone.
    fn emit(&self, a: &mut Active) -> bool {
        let k = self
            .args
            .tokens_per_chunk
            .max(1)
            .min(a.job.max_tokens - a.produced);
        a.produced += k;
        let last = a.produced >= a.job.max_tokens;
        if a.job.out.send(Emit { tokens: k, last }).is_err() {
            self.counters.aborted.fetch_add(1, Relaxed);
            return false;
        }
        self.counters.tokens.fetch_add(k, Relaxed);
        if last {
            let c = &self.counters;
            c.completed.fetch_add(1, Relaxed);
            let after_first = a.job.max_tokens.saturating_sub(1);
            let elapsed_ms = a.first.elapsed().as_secs_f64() * 1e3;
            if after_first > 0 && elapsed_ms > 0.0 {
                let ms = elapsed_ms / after_first as f64;
                let sum = f64::from_bits(c.sent_log_tpot.load(Relaxed)) + ms.ln();
                c.sent_log_tpot.store(sum.to_bits(), Relaxed);
                c.sent_tpots.fetch_add(1, Relaxed);
            }
        }
        !last
    }

    fn publish(&self, waiting: &VecDeque<Job>, prefilling: &[(Instant, Job)], decoding: &[Active]) {
        let c = &self.counters;
        c.waiting.store(waiting.len() as u64, Relaxed);
        c.prefilling.store(prefilling.len() as u64, Relaxed);
        c.decoding.store(decoding.len() as u64, Relaxed);
        c.peak_batch
            .fetch_max((prefilling.len() + decoding.len()) as u64, Relaxed);
    }
}

async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sent TPOT is each request's first event to its last over the tokens after the
    /// first, never shorter than the curve's step; a request of one token has none.
    #[tokio::test]
    async fn the_sent_tpot_is_the_steps_it_took() {
        let engine = Engine::start(SimArgs {
            tpot_curve: "1:10".parse().unwrap(),
            ttft_ms: 1.0,
            ..SimArgs::defaults()
        });
        let mut outs = Vec::new();
        for max_tokens in [5, 9, 1] {
            let (out, rx) = mpsc::unbounded_channel();
            assert!(engine.submit(Job {
                max_tokens,
                prompt_tokens: 4,
                cached_tokens: 0,
                out,
            }));
            outs.push(rx);
        }
        for mut rx in outs {
            while let Some(e) = rx.recv().await {
                if e.last {
                    break;
                }
            }
        }
        let s = engine.stats();
        assert_eq!((s.completed, s.sent_tpots), (3, 2));
        let ms = s.sent_tpot_ms_geomean.unwrap();
        assert!((10.0..50.0).contains(&ms), "{ms}");
        engine.shutdown();
    }
}
