//! The tokenizer fallback (`estimate = "tokenizer"`): cost per token of counting streamed
//! text with OpenAI's o200k vocabulary, `bpe-openai` (what tokentap uses) against
//! `tiktoken-rs` (measured to choose).
//!
//! Run: `cargo bench --bench tokenizer`
//!
//! Measured on the development machine (2 cores, release build, 2026-11-29), 73 tokens of
//! prose in 56 word-sized deltas:
//! - per streamed delta: bpe-openai 6.40 µs (88 ns/token, 11.4 M tokens/s);
//!   tiktoken-rs 36.4 µs (499 ns/token, 2.0 M tokens/s)
//! - whole text: bpe-openai 6.02 µs (82 ns/token); tiktoken-rs 36.8 µs (505 ns/token)
//!
//! bpe-openai is 5.7× cheaper, and its vocabulary is built in with no regex engine at run
//! time: tokentap uses it. In tokenizer mode the event's JSON is also read into a value to
//! find its text (about 1 µs per event on top).
#![allow(clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// Streamed deltas as a chat model sends them: a token or two of text each.
fn deltas() -> Vec<String> {
    let text = "The lighthouse keeper climbed the spiral stairs at dusk, as he had every evening for thirty years. \
                Below, the sea pressed grey against the rocks; above, the great lens waited, cold and patient, for its flame. \
                He trimmed the wick, wound the clockwork, and watched the beam sweep out across the water — café, naïve, 灯台.";
    let mut out = Vec::new();
    let mut word = String::new();
    for ch in text.chars() {
        if ch == ' ' && !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        word.push(ch);
    }
    out.push(word);
    out
}

fn bench(c: &mut Criterion) {
    let deltas = deltas();
    let whole: String = deltas.concat();
    let bpe = bpe_openai::o200k_base();
    let tik = tiktoken_rs::o200k_base().expect("o200k vocabulary");
    let tokens = bpe.count(whole.as_str()) as u64;
    let delta_tokens: u64 = deltas.iter().map(|d| bpe.count(d.as_str()) as u64).sum();

    let mut g = c.benchmark_group("o200k, per streamed delta");
    g.throughput(Throughput::Elements(delta_tokens));
    g.bench_function("bpe-openai", |b| {
        b.iter(|| deltas.iter().map(|d| bpe.count(d.as_str())).sum::<usize>())
    });
    g.bench_function("tiktoken-rs", |b| {
        b.iter(|| {
            deltas
                .iter()
                .map(|d| tik.encode_ordinary(d).len())
                .sum::<usize>()
        })
    });
    g.finish();

    let mut g = c.benchmark_group("o200k, whole text");
    g.throughput(Throughput::Elements(tokens));
    g.bench_function("bpe-openai", |b| b.iter(|| bpe.count(whole.as_str())));
    g.bench_function("tiktoken-rs", |b| {
        b.iter(|| tik.encode_ordinary(&whole).len())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
