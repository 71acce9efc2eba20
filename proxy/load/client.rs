//! Sending requests and reading their streams, with the phase's shared tallies.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use indicatif::{ProgressBar, ProgressStyle};
use rand::Rng;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::report::{LoadGoodput, PhaseReport, Quantiles, RequestRecord, Slo};
use super::Mode;
use crate::ndjson::NdjsonParser;
use crate::sim::SimDialect;
use crate::sse::SseParser;

/// Where and what to send.
#[derive(Debug)]
pub struct Target {
    pub addr: SocketAddr,
    pub host: String,
    pub path: String,
    pub dialect: SimDialect,
    pub headers: Vec<(String, String)>,
    /// What each request asks.
    pub workload: super::workload::Workload,
}

type Sender = SendRequest<Full<Bytes>>;

/// What a phase measures besides its figures.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Judge each request by these SLOs.
    pub slo: Option<Slo>,
    /// Keep a record of each request.
    pub records: bool,
    /// Show a progress bar.
    pub progress: bool,
    /// How long requests still running when the window ends may go on (none sent after
    /// it): zero cuts them there; with records, those that finish are recorded too, so
    /// that every request sent in the window has its record, as `vllm bench serve` waits
    /// for every request it sent.
    pub drain: Duration,
}

/// The measured window of a phase and what landed in it.
struct Phase {
    label: String,
    start: Instant,
    window_start: Instant,
    window_end: Instant,
    window_tokens: AtomicU64,
    slo: Option<Slo>,
    keep_records: bool,
    tally: Mutex<Tally>,
}

#[derive(Default)]
struct Tally {
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    itl: Vec<f64>,
    requests: u64,
    output_tokens: u64,
    errors: BTreeMap<String, u64>,
    judged: u64,
    good: u64,
    good_tokens: u64,
    records: Vec<RequestRecord>,
}

impl Phase {
    fn inside(&self, t: Instant) -> bool {
        t >= self.window_start && t <= self.window_end
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn error(&self, kind: String) {
        if self.inside(Instant::now()) {
            let mut t = self.tally();
            if self.slo.is_some() {
                t.judged += 1;
            }
            if self.keep_records {
                t.records.push(RequestRecord {
                    phase: self.label.clone(),
                    start_ms: None,
                    error: Some(kind.clone()),
                    ttft_ms: None,
                    tpot_ms: None,
                    e2e_ms: None,
                    output_tokens: 0,
                    good: self.slo.map(|_| false),
                    after_window: false,
                });
            }
            *t.errors.entry(kind).or_insert(0) += 1;
        }
    }
}

/// Runs one phase: `warmup` of load, then `duration` measured.
pub async fn run_phase(
    target: &Arc<Target>,
    mode: Mode,
    warmup: Duration,
    duration: Duration,
    progress: bool,
) -> PhaseReport {
    let options = Options {
        progress,
        ..Options::default()
    };
    run_phase_with(target, mode, warmup, duration, &options)
        .await
        .0
}

/// [`run_phase`] with `options`: also the records of the requests that ended inside the
/// measured window.
pub async fn run_phase_with(
    target: &Arc<Target>,
    mode: Mode,
    warmup: Duration,
    duration: Duration,
    options: &Options,
) -> (PhaseReport, Vec<RequestRecord>) {
    let start = Instant::now();
    let phase = Arc::new(Phase {
        label: match mode {
            Mode::Closed { concurrency } => format!("c={concurrency}"),
            Mode::Open { rate } => format!("rate={rate}/s"),
        },
        start,
        window_start: start + warmup,
        window_end: start + warmup + duration,
        window_tokens: AtomicU64::new(0),
        slo: options.slo,
        keep_records: options.records,
        tally: Mutex::new(Tally::default()),
    });
    let bar = progress_bar(options.progress, warmup + duration, mode);
    let mut tasks = JoinSet::new();
    match mode {
        Mode::Closed { concurrency } => {
            for _ in 0..concurrency {
                tasks.spawn(worker(Arc::clone(target), Arc::clone(&phase)));
            }
        }
        Mode::Open { rate } => {
            tasks.spawn(arrivals(Arc::clone(target), Arc::clone(&phase), rate));
        }
    }
    // The load stops the moment the window ends: a request still running is cut there,
    // and none ends unrecorded after it.
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let end = tokio::time::sleep_until(phase.window_end);
    tokio::pin!(end);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                bar.set_position(start.elapsed().as_millis() as u64);
                bar.set_message(format!("{} done", phase.tally().requests));
            }
            () = &mut end => break,
        }
    }
    if !options.drain.is_zero() {
        let _ = tokio::time::timeout(options.drain, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
    }
    tasks.shutdown().await;
    bar.finish_and_clear();

    let mut t = std::mem::take(&mut *phase.tally());
    let secs = duration.as_secs_f64();
    let tpot = Quantiles::of(std::mem::take(&mut t.tpot));
    let goodput = phase.slo.map(|_| LoadGoodput {
        good: t.good,
        judged: t.judged,
        requests_per_sec: t.good as f64 / secs,
        output_tokens_per_sec: t.good_tokens as f64 / secs,
        attainment_pct: (t.judged > 0).then(|| 100.0 * t.good as f64 / t.judged as f64),
    });
    let records = std::mem::take(&mut t.records);
    let report = PhaseReport {
        concurrency: match mode {
            Mode::Closed { concurrency } => Some(concurrency),
            Mode::Open { .. } => None,
        },
        rate: match mode {
            Mode::Open { rate } => Some(rate),
            Mode::Closed { .. } => None,
        },
        duration_secs: secs,
        requests: t.requests,
        errors: t.errors,
        ttft_ms: Quantiles::of(t.ttft),
        single_stream_tps: tpot.mean.filter(|m| *m > 0.0).map(|m| 1000.0 / m),
        tpot_ms: tpot,
        itl_ms: Quantiles::of(t.itl),
        system_tps: Some(phase.window_tokens.load(Relaxed) as f64 / secs),
        output_tokens: t.output_tokens,
        goodput,
    };
    (report, records)
}

fn progress_bar(show: bool, total: Duration, mode: Mode) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total.as_millis() as u64);
    let label = match mode {
        Mode::Closed { concurrency } => format!("c={concurrency}"),
        Mode::Open { rate } => format!("rate={rate}/s"),
    };
    if let Ok(style) =
        ProgressStyle::with_template(&format!("{label:>10} [{{bar:30}}] {{elapsed:>4}} {{msg}}"))
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// A closed-loop worker: one keep-alive connection, one request after another.
async fn worker(target: Arc<Target>, phase: Arc<Phase>) {
    let mut sender: Option<Sender> = None;
    // Its own conversation, with a shared-prefix workload.
    let mut conversation = super::workload::Conversation::default();
    while Instant::now() < phase.window_end {
        let s = match sender.as_mut() {
            Some(s) => s,
            None => match connect(target.addr).await {
                Ok(s) => sender.insert(s),
                Err(kind) => {
                    phase.error(kind.into());
                    // Back off: a refused connection would otherwise spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let asked = target.workload.next(Some(&mut conversation));
        match one(s, &target, asked, &phase).await {
            Ok(()) => {}
            Err(kind) => {
                phase.error(kind);
                sender = None;
            }
        }
    }
}

/// Open loop: Poisson arrivals, each request on its own connection.
async fn arrivals(target: Arc<Target>, phase: Arc<Phase>, rate: f64) {
    let mut inflight = JoinSet::new();
    let mut next = Instant::now();
    while next < phase.window_end {
        tokio::time::sleep_until(next).await;
        let (t, p) = (Arc::clone(&target), Arc::clone(&phase));
        inflight.spawn(async move {
            match connect(t.addr).await {
                Ok(mut s) => {
                    let asked = t.workload.next(None);
                    if let Err(kind) = one(&mut s, &t, asked, &p).await {
                        p.error(kind);
                    }
                }
                Err(kind) => p.error(kind.into()),
            }
        });
        while inflight.try_join_next().is_some() {}
        let u: f64 = rand::thread_rng().gen_range(f64::EPSILON..1.0);
        next += Duration::from_secs_f64(-u.ln() / rate);
    }
    while inflight.join_next().await.is_some() {}
}

async fn connect(addr: SocketAddr) -> Result<Sender, &'static str> {
    let stream = TcpStream::connect(addr).await.map_err(|_| "connect")?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|_| "connect")?;
    tokio::spawn(conn);
    Ok(sender)
}

/// One streamed request; `Err` names the kind of failure.
async fn one(
    sender: &mut Sender,
    target: &Target,
    (body, conversation): (Bytes, Option<u64>),
    phase: &Phase,
) -> Result<(), String> {
    let mut req = Request::post(target.path.as_str())
        .header(hyper::header::HOST, target.host.as_str())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::ACCEPT, "text/event-stream");
    for (k, v) in &target.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    if let Some(id) = conversation {
        req = req.header("x-conversation-id", format!("{id:016x}"));
    }
    let req = req
        .body(Full::new(body))
        .map_err(|_| "bad_header".to_owned())?;
    sender
        .ready()
        .await
        .map_err(|_| "connection_closed".to_owned())?;
    let start = Instant::now();
    let resp = sender
        .send_request(req)
        .await
        .map_err(|_| "send".to_owned())?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        while let Some(Ok(_)) = body.frame().await {}
        return Err(format!("http_{}", status.as_u16()));
    }

    let mut reader = Reader::new(target.dialect);
    let (mut first, mut last) = (None::<Instant>, start);
    let (mut tokens, mut exact, mut done) = (0u64, None::<u64>, false);
    let mut itl = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| "read".to_owned())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        let seen = reader.push(&data, tokens);
        exact = seen.exact.or(exact);
        done |= seen.done;
        let n = seen.tokens;
        if n == 0 {
            continue;
        }
        if phase.inside(now) {
            phase.window_tokens.fetch_add(n, Relaxed);
            if first.is_some() {
                itl.push(now.duration_since(last).as_secs_f64() * 1e3 / n as f64);
            }
        }
        first.get_or_insert(now);
        last = now;
        tokens += n;
    }
    if let Some(seen) = reader.finish(tokens) {
        exact = seen.exact.or(exact);
        done |= seen.done;
    }
    if !done {
        return Err("ended_early".into());
    }
    let end = Instant::now();
    let total = exact.unwrap_or(tokens);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // vLLM's TPOT; a response that was not streamed has its first token at its end.
    let tpot = first
        .filter(|&f| total >= 2 && last > f)
        .map(|f| ms(last.duration_since(f)) / (total - 1) as f64);
    let ttft = ms(first.unwrap_or(end).duration_since(start));
    let e2e = ms(end.duration_since(start));
    let mut t = phase.tally();
    let good = phase.slo.map(|slo| slo.good(ttft, tpot, e2e));
    if phase.inside(end) {
        if let Some(good) = good {
            t.judged += 1;
            if good {
                t.good += 1;
                t.good_tokens += total;
            }
        }
    }
    // Recorded when it ended in the window, or (drained) when it was sent in it.
    let sent_in_window = start >= phase.window_start && end > phase.window_end;
    if phase.keep_records && (phase.inside(end) || sent_in_window) {
        t.records.push(RequestRecord {
            phase: phase.label.clone(),
            start_ms: Some(ms(start.duration_since(phase.start))),
            error: None,
            ttft_ms: Some(ttft),
            tpot_ms: tpot,
            e2e_ms: Some(e2e),
            output_tokens: total,
            good,
            after_window: !phase.inside(end),
        });
    }
    t.itl.extend(itl);
    if let Some(first) = first {
        if phase.inside(start) {
            t.ttft.push(first.duration_since(start).as_secs_f64() * 1e3);
        }
        if phase.inside(end) {
            t.requests += 1;
            t.output_tokens += total;
            if total >= 2 && last > first {
                t.tpot
                    .push(last.duration_since(first).as_secs_f64() * 1e3 / (total - 1) as f64);
            }
        }
    } else if phase.inside(end) {
        t.requests += 1;
    }
    Ok(())
}

/// The path each dialect is served at.
pub fn default_path(dialect: SimDialect) -> &'static str {
    match dialect {
        SimDialect::Openai => "/v1/chat/completions",
        SimDialect::Responses => "/v1/responses",
        SimDialect::Anthropic => "/v1/messages",
        SimDialect::Tgi => "/generate_stream",
        SimDialect::Ollama => "/api/chat",
        SimDialect::Llamacpp => "/completion",
    }
}

/// What the client read from one fragment.
#[derive(Default)]
struct Seen {
    tokens: u64,
    exact: Option<u64>,
    done: bool,
}

/// Reads tokens the way a client of each API would, with its own rules (it shares only the
/// framing helpers with the proxy).
struct Reader {
    dialect: SimDialect,
    sse: SseParser,
    ndjson: NdjsonParser,
}

impl Reader {
    fn new(dialect: SimDialect) -> Self {
        Reader {
            dialect,
            sse: SseParser::new(1 << 20),
            ndjson: NdjsonParser::new(1 << 20),
        }
    }

    /// `counted`: tokens of this request so far (a running exact count carries the rest).
    fn push(&mut self, data: &[u8], counted: u64) -> Seen {
        let mut seen = Seen::default();
        let dialect = self.dialect;
        let mut on = |e: crate::sse::Event<'_>| read_event(dialect, e.data, counted, &mut seen);
        if dialect == SimDialect::Ollama {
            self.ndjson.push(data, &mut on);
        } else {
            self.sse.push(data, &mut on);
        }
        seen
    }

    fn finish(&mut self, counted: u64) -> Option<Seen> {
        if self.dialect != SimDialect::Ollama {
            return None;
        }
        let mut seen = Seen::default();
        self.ndjson
            .finish(|e| read_event(SimDialect::Ollama, e.data, counted, &mut seen));
        Some(seen)
    }
}

fn read_event(dialect: SimDialect, data: &[u8], counted: u64, seen: &mut Seen) {
    if data == b"[DONE]" {
        seen.done = true;
        return;
    }
    let Ok(v) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let s = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty())
    };
    let u = |p: &str| v.pointer(p).and_then(Value::as_u64);
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
    let (n, exact, done) = match dialect {
        SimDialect::Openai => {
            let n = v.get("choices").and_then(Value::as_array).map_or(0, |cs| {
                cs.iter()
                    .filter(|c| {
                        c.pointer("/delta/content")
                            .or_else(|| c.get("text"))
                            .and_then(Value::as_str)
                            .is_some_and(|t| !t.is_empty())
                    })
                    .count() as u64
            });
            let usage = u("/usage/completion_tokens");
            // A running count on content chunks (continuous usage) says how many arrived.
            let n = match usage {
                Some(c) if n > 0 && c > counted + seen.tokens => c - counted - seen.tokens,
                _ => n,
            };
            (n, usage, false)
        }
        SimDialect::Responses => {
            let terminal = matches!(
                kind,
                "response.completed" | "response.incomplete" | "response.failed"
            );
            (
                u64::from(kind == "response.output_text.delta" && s("/delta")),
                u("/response/usage/output_tokens").filter(|_| terminal),
                terminal,
            )
        }
        SimDialect::Anthropic => (
            u64::from(
                kind == "content_block_delta"
                    && (s("/delta/text") || s("/delta/thinking") || s("/delta/partial_json")),
            ),
            u("/usage/output_tokens").filter(|_| kind == "message_delta"),
            kind == "message_stop",
        ),
        SimDialect::Tgi => (
            u64::from(v.get("token").is_some()),
            u("/details/generated_tokens"),
            v.get("generated_text").is_some_and(|g| !g.is_null()),
        ),
        SimDialect::Ollama => {
            let done = v.get("done").and_then(Value::as_bool).unwrap_or(false);
            (
                u64::from(s("/message/content") || s("/response")),
                u("/eval_count").filter(|_| done),
                done,
            )
        }
        SimDialect::Llamacpp => {
            let stop = v.get("stop").and_then(Value::as_bool).unwrap_or(false);
            let ids = v
                .get("tokens")
                .and_then(Value::as_array)
                .map_or(0, |a| a.len() as u64);
            let n = if stop {
                0
            } else if ids > 0 {
                ids
            } else {
                u64::from(s("/content"))
            };
            (
                n,
                u("/timings/predicted_n")
                    .or(u("/tokens_predicted"))
                    .filter(|_| stop),
                stop,
            )
        }
    };
    seen.tokens += n;
    if exact.is_some() {
        seen.exact = exact;
    }
    seen.done |= done;
}
