//! What `balance = "prefix"` costs a request: finding where the prompt starts in the body,
//! hashing its leading blocks, and looking them up in four endpoints' indexes.
//!
//! Run: `cargo bench --bench prefix`
//!
//! Measured on the development machine (2 cores, release build, 2026-12-04), a chat body
//! with a 33 KiB system prompt, four endpoints with full indexes (8,192 blocks each), the
//! prompt held by one:
//! - where the prompt starts (`prompt_start`): 0.26 µs
//! - its first 64 blocks (16 KiB) hashed in a chain: 0.87 µs (1.76 µs for 128)
//! - the chain looked up in four indexes: 0.10 µs (0.20 µs for 128 blocks with the block
//!   hash as its own map key; 1.74 µs with SipHash)
//! - the whole choice: 1.25 µs (2.30 µs over 128 blocks, 4.24 µs with SipHash as well)
//!
//! Target (issue 45): ≤ 2 µs a request with a 32 KB prompt.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

use tokentap::prefix::{blocks, prompt_start, BlockLru};

fn bench(c: &mut Criterion) {
    let system = "You are a careful assistant who answers briefly. ".repeat(680);
    let body = format!(
        r#"{{"model":"llama","stream":true,"max_tokens":256,"temperature":0.2,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"What is 2+2?"}}]}}"#
    );
    let body = body.as_bytes();
    let start = prompt_start(body).unwrap_or(body);
    let chain: Vec<u64> = blocks(start, 256, 64).collect();
    let mut indexes: Vec<BlockLru> = (0..4).map(|_| BlockLru::new(8192)).collect();
    for (i, idx) in indexes.iter_mut().enumerate() {
        for k in 0..(8192 / 64) {
            let other = format!("{i} {k} {system}");
            idx.admit(blocks(other.as_bytes(), 256, 64));
        }
    }
    indexes[2].admit(chain.iter().copied());

    let mut g = c.benchmark_group("prefix");
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("start", |b| b.iter(|| prompt_start(black_box(body))));
    g.bench_function("blocks", |b| {
        b.iter(|| blocks(black_box(start), 256, 64).collect::<Vec<u64>>())
    });
    g.bench_function("lookup", |b| {
        b.iter(|| indexes.iter().map(|i| i.leading(black_box(&chain))).max())
    });
    g.bench_function("whole choice", |b| {
        b.iter(|| {
            let start = prompt_start(black_box(body)).unwrap_or(body);
            let chain: Vec<u64> = blocks(start, 256, 64).collect();
            indexes.iter().map(|i| i.leading(&chain)).max()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
