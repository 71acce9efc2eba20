//! tokentap: a transparent reverse proxy, built on pingora, that meters LLM token streams.
//!
//! It forwards every byte unchanged and unbuffered, parses streamed responses as they pass,
//! attributes each token arrival to its request and upstream, and keeps live sliding-window
//! single-stream T/s, system T/s, TTFT, TPOT and ITL per upstream, plus the live
//! concurrency→TPOT curve.
//!
//! The data flow, and the module of each step:
//!
//! ```text
//! client ─▶ service::front (accept, head) ─▶ service::exchange (route, admit, send) ─▶ upstream
//!              │             routing (route, weighted split, sticky key), limit (caps, queue)
//!              │                                                                      │
//!              ◀── service::exchange::relay: each body fragment, forwarded at once ◀──┘
//!              │        (read and framed by service::http1)
//!              └─▶ service::tap ─▶ sse / ndjson (framing) ─▶ dialect (event → facts)
//!                                   ─▶ meter (stream → records, shards, windows, curve)
//!                                                                   │
//!                         admin (/, /stats, /stats/history, /events, /metrics) ◀┘
//! ```
//!
//! - [`config`]: the TOML file → a validated runtime config; `tokentap check`.
//! - [`service`]: the proxy in layers. `service::front` accepts client connections and
//!   reads each request head; `service::exchange` is the request's flow (route and admit,
//!   send, relay): one path for every request, metered or not. `service::http1` is the wire
//!   it reads and writes with (heads, body framing, the thread's scratch buffer, tokentap's
//!   own answers), and knows nothing of meters, routes or caps; `service::tap` hands each
//!   payload run to the framing, dialect and meter. Only upgrades go through pingora-proxy
//!   (`service::upgrade`).
//! - [`sse`]: incremental SSE framing, no I/O, never alters a byte.
//! - [`dialect`]: one file per API dialect; facts, never figures.
//! - [`meter`]: per-request records and per-upstream windows; time is an argument. Each
//!   finished request is judged against the upstream's latency SLOs (goodput).
//! - [`decide`]: what follows from the figures: cost per token, the decode roofline, the
//!   endpoints a pool needs at its SLO. Arithmetic only.
//! - [`routing`]: which upstream serves a request.
//! - [`admin`]: the admin listener; reads the meter, never the proxy. Its dashboard (`/`)
//!   and [`top`] (the terminal view) read the snapshots it pushes on `/events`.
//! - [`state`]: what everything shares: the config and one struct per upstream (config,
//!   peer, meter, limiter, adaptive cap), found by name. [`telemetry`]: every metric.
//! - [`server`]: assembles the pingora server from a config.
//! - [`sim`], [`load`], [`demo`]: a simulated batching backend, a load generator and the
//!   embedded demo; they stand apart from the proxy like a real backend and client.

pub mod access;
pub mod admin;
pub mod backend;
pub mod compare;
pub mod config;
pub mod decide;
pub mod demo;
pub mod dialect;
pub mod estimate;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod limit;
pub mod load;
pub mod logs;
pub mod meter;
pub mod ndjson;
pub mod pool;
pub mod prefix;
pub mod rollout;
pub mod routing;
pub mod server;
pub mod service;
pub mod sim;
pub mod sse;
pub mod state;
pub mod telemetry;
pub mod tenant;
pub mod top;
pub mod usage;
