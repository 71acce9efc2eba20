//! Simulated backends and closed-loop clients, as the scenarios say them:
//! `sim("1:5").model("a").await`, `closed_loop(proxy, Closed { clients: 16, secs: 2.0,
//! ..Closed::default() }).await`.

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokentap::load::{self, LoadArgs, Mode, PhaseReport};
use tokentap::sim::{Curve, Sim, SimArgs, SimDialect, UsageMode};

/// A simulator to start on a free loopback port: a decode step of `curve` ms by batch, 5 ms
/// to the first token, 30 tokens a reply, unless said otherwise.
pub struct SimSpec(SimArgs);

/// What a simulator's curve may be given as: its text (`"1:20,64:26"`) or a [`Curve`].
pub trait IntoCurve {
    fn into_curve(self) -> Curve;
}

impl IntoCurve for &str {
    fn into_curve(self) -> Curve {
        self.parse().unwrap()
    }
}

impl IntoCurve for &String {
    fn into_curve(self) -> Curve {
        self.parse().unwrap()
    }
}

impl IntoCurve for Curve {
    fn into_curve(self) -> Curve {
        self
    }
}

/// A simulator with `curve` (see [`SimSpec`]); `.await` starts it.
pub fn sim(curve: impl IntoCurve) -> SimSpec {
    SimSpec(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: curve.into_curve(),
        ttft_ms: 5.0,
        max_tokens: 30,
        ..SimArgs::defaults()
    })
}

impl SimSpec {
    pub fn ttft(mut self, ms: f64) -> Self {
        self.0.ttft_ms = ms;
        self
    }
    pub fn max_tokens(mut self, n: u64) -> Self {
        self.0.max_tokens = n;
        self
    }
    pub fn model(mut self, name: &str) -> Self {
        self.0.model = name.into();
        self
    }
    pub fn max_batch(mut self, n: Option<usize>) -> Self {
        self.0.max_batch = n;
        self
    }
    pub fn dialect(mut self, d: SimDialect) -> Self {
        self.0.dialect = d;
        self
    }
    pub fn usage(mut self, u: UsageMode) -> Self {
        self.0.usage = u;
        self
    }
    pub fn tokens_per_chunk(mut self, k: u64) -> Self {
        self.0.tokens_per_chunk = k;
        self
    }
    /// A prefix cache of `tokens` tokens, each uncached prompt token costing `ms` on the
    /// one prefill unit.
    pub fn prefix_cache(mut self, tokens: u64, ms: f64) -> Self {
        self.0.prefix_cache_tokens = Some(tokens);
        self.0.prefill_ms_per_token = ms;
        self
    }
    /// On `addr` rather than a free port.
    pub fn on(mut self, addr: SocketAddr) -> Self {
        self.0.listen = addr;
        self
    }
}

impl IntoFuture for SimSpec {
    type Output = Sim;
    type IntoFuture = Pin<Box<dyn Future<Output = Sim> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move { Sim::start(self.0).await.unwrap() })
    }
}

/// A closed loop of streaming chat requests.
#[derive(Debug, Clone)]
pub struct Closed {
    pub clients: usize,
    pub secs: f64,
    pub max_tokens: u64,
    /// Asks for the stream's usage (`stream_options.include_usage`).
    pub usage: bool,
    /// Seconds run before the measured `secs`.
    pub warmup: f64,
    /// Request headers, `K: V`.
    pub headers: Vec<String>,
}

impl Default for Closed {
    fn default() -> Self {
        Closed {
            clients: 1,
            secs: 1.0,
            max_tokens: 30,
            usage: false,
            warmup: 0.0,
            headers: Vec::new(),
        }
    }
}

impl Closed {
    /// `clients` for `secs`, 30 tokens a reply.
    pub fn of(clients: usize, secs: f64) -> Closed {
        Closed {
            clients,
            secs,
            ..Closed::default()
        }
    }

    /// Asking for the stream's usage.
    pub fn with_usage(self) -> Closed {
        Closed {
            usage: true,
            ..self
        }
    }

    /// Sending the header `k_v` (`"x-tenant: a"`) too.
    pub fn header(mut self, k_v: &str) -> Closed {
        self.headers.push(k_v.to_owned());
        self
    }

    /// Measured after `secs` of warm-up.
    pub fn after(self, secs: f64) -> Closed {
        Closed {
            warmup: secs,
            ..self
        }
    }
}

/// `load`'s clients through `proxy` for its time, measured from the start.
pub async fn closed_loop(proxy: SocketAddr, load: Closed) -> PhaseReport {
    let target = LoadArgs {
        duration: load.secs,
        warmup: 0.0,
        max_tokens: load.max_tokens,
        include_usage: load.usage,
        headers: load.headers,
        model: "m".into(),
        prompt: "p".into(),
        ..LoadArgs::for_url(format!("http://{proxy}"))
    }
    .target()
    .unwrap();
    load::phase(
        &target,
        Mode::Closed {
            concurrency: load.clients,
        },
        Duration::from_secs_f64(load.warmup),
        Duration::from_secs_f64(load.secs),
        false,
    )
    .await
}
