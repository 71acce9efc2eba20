//! tokentap: a transparent reverse proxy, built on pingora, that meters LLM token streams.
//!
//! It forwards every byte unchanged and unbuffered, parses streamed responses as they pass,
//! attributes each token arrival to its request and upstream, and keeps live sliding-window
//! single-stream T/s, system T/s, TTFT, TPOT and ITL per upstream, plus the live
//! concurrency→TPOT curve.
//!
//! The data flow (DESIGN §2), and the module of each step:
//!
//! ```text
//! client ─▶ service (front door, phases) ─▶ routing (route, weighted split, sticky key) ─▶ upstream
//!              │                                                                      │
//!              ◀──────── each body fragment, forwarded the moment it arrives ◀────────┘
//!              │
//!              └─▶ sse (framing) ─▶ dialect (event → facts) ─▶ meter (record → windows, curve)
//!                                                                   │
//!                         admin (/, /stats, /stats/history, /events, /metrics) ◀┘
//! ```
//!
//! - [`config`]: the TOML file → a validated runtime config; `tokentap check`.
//! - [`service`]: tokentap's listener (`service::front`) reads each request head within its
//!   limits, `service::request` checks it (strict HTTP/1.1) and reads the body ahead, and
//!   `service::direct`'s HTTP/1.1 loop on tokio's sockets routes, admits (cap, queue) and
//!   proxies it: one path for every request, metered or not. Only upgrades go through
//!   pingora-proxy, whose `impl ProxyHttp` phases are a few lines each.
//! - [`sse`]: incremental SSE framing, no I/O, never alters a byte.
//! - [`dialect`]: one file per API dialect; facts, never figures.
//! - [`meter`]: per-request records and per-upstream windows; time is an argument.
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
pub mod routing;
pub mod server;
pub mod service;
pub mod sim;
pub mod sse;
pub mod state;
pub mod telemetry;
pub mod top;
pub mod usage;
