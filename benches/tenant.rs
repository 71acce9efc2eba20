//! What a tenant's budget costs a request before it is sent: finding the output tokens its
//! body asks for (`max_tokens` and the other dialects' keys) without parsing the body.
//!
//! Run: `cargo bench --bench tenant`
//!
//! Measured on the development machine (2 cores, release build, 2026-12-05), a chat body
//! with a 200 KB system prompt:
//! - no key in it: 13.0 µs (33.5 µs when each of the six keys had a pass of its own)
//! - `max_completion_tokens` after the prompt: 5.6 µs (9.7)
//! - a short body with `max_tokens` first: 18 ns (14)
//!
//! Every key ends in `tokens"` or `predict"`: one pass for each word, and the second only
//! when the first found no key with a number (a `…tokens` key outranks a `…predict` one).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

use tokentap::tenant::max_tokens;

fn bench(c: &mut Criterion) {
    // A 200 KB system prompt of prose with quotes and JSON-like text in it, as long
    // prompts carry.
    let system = r#"The assistant reads \"tokens\" and \"predict\" as words; "#.repeat(3_400);
    let body = |tail: &str| {
        format!(
            r#"{{"model":"llama","stream":true,"temperature":0.2,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"What is 2+2?"}}]{tail}}}"#
        )
    };
    let none = body("");
    let last = body(r#","max_completion_tokens":256"#);
    let short = r#"{"model":"m","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}"#;

    let mut g = c.benchmark_group("max_tokens");
    for (name, b) in [
        ("200 KB, none", none.as_str()),
        ("200 KB, at the end", last.as_str()),
    ] {
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_function(name, |x| x.iter(|| max_tokens(black_box(b.as_bytes()))));
    }
    g.throughput(Throughput::Bytes(short.len() as u64));
    g.bench_function("short, first", |x| {
        x.iter(|| max_tokens(black_box(short.as_bytes())))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
