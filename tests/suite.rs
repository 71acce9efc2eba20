//! tokentap's integration tests, one binary: each file of `tests/` is a module here (one
//! link of the whole crate instead of one a file), run together by libtest's threads.
//! Tests that measure shares or latencies under load take [`common::load_slot`]; the rest
//! run beside them, on four threads (`.cargo/config.toml`). One file's tests:
//! `cargo test --test suite fleet::`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

mod admin;
mod backend;
mod bypass;
mod check;
mod compare;
mod conformance;
mod curve;
mod dashboard;
mod decisions;
mod dialects;
mod dialects_e2e;
mod direct;
mod fleet;
mod head_flood;
mod hostile;
mod limit;
mod llamacpp;
mod mirror;
mod operate;
mod pool;
mod prometheus;
mod proxy;
mod reload;
mod rollout;
mod shutdown;
mod sweep;
mod tenants;
mod usage;
