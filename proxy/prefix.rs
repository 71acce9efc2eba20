//! Prompt prefixes as chains of block hashes, and a bounded set of them kept least
//! recently used first out: what a backend's prefix cache holds (the simulator's), and
//! what tokentap believes each replica holds (`balance = "prefix"`). A block's hash covers
//! the block and, through the one before it, everything before it, so one lookup per
//! block says whether the whole prompt up to there was seen. Plain helpers: no I/O, no
//! figures.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

/// The chained hashes of `bytes`' whole blocks of `block` bytes, at most `max` of them (a
/// partial last block has none: nothing is known of what follows it).
pub fn blocks(bytes: &[u8], block: usize, max: usize) -> impl Iterator<Item = u64> + '_ {
    let mut chain = 0x7072_6566_6978_u64;
    bytes.chunks_exact(block.max(1)).take(max).map(move |b| {
        let mut h = foldhash::fast::FixedState::with_seed(chain).build_hasher();
        h.write(b);
        chain = h.finish();
        chain
    })
}

/// A block's hash is its own key in a map: hashed already, it is not hashed again (a
/// lookup per block of a 32 KiB prompt costs 13 ns with SipHash, 2 without).
#[derive(Debug, Default, Clone, Copy)]
pub struct Hashed(u64);

impl Hasher for Hashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; anything else is folded in, not lost.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Block hashes kept, least recently used first out.
#[derive(Debug, Default)]
pub struct BlockLru {
    capacity: usize,
    used: HashMap<u64, u64, BuildHasherDefault<Hashed>>,
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

impl BlockLru {
    /// A set of at most `capacity` blocks.
    pub fn new(capacity: usize) -> BlockLru {
        BlockLru {
            capacity,
            ..BlockLru::default()
        }
    }

    /// How many of `chain`'s leading blocks are held (stops at the first that is not).
    pub fn leading(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.used.contains_key(h))
            .count()
    }

    /// Keeps `chain`'s blocks as the most recently used; the leading ones it held before.
    /// A chain's head is kept as more recent than its tail, so that, full, the set lets a
    /// chain's last blocks go first (a prefix without its head is worth nothing), as vLLM
    /// frees a sequence's blocks from its end.
    pub fn admit(&mut self, chain: impl IntoIterator<Item = u64>) -> usize {
        let chain: Vec<u64> = chain.into_iter().collect();
        let leading = self.leading(&chain);
        for &hash in chain.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.used.insert(hash, self.clock) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.clock, hash);
        }
        while self.used.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.used.remove(&oldest);
        }
        leading
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }
}

/// Where a generation request's prompt starts in its body: at the first of the keys that
/// hold it (`"system"`, `"instructions"`, `"messages"`, `"prompt"`, `"input"`), so that the
/// fields before it (model, limits, sampling) do not split one conversation into many.
/// `None` when the body names none of them.
pub fn prompt_start(body: &[u8]) -> Option<&[u8]> {
    use memchr::memmem::Finder;
    // The likeliest first; each later key is looked for only before the earliest found,
    // so a long prompt is not searched five times. The searchers are built once: building
    // one costs more than running it over a short body.
    static KEYS: std::sync::LazyLock<[Finder<'static>; 5]> = std::sync::LazyLock::new(|| {
        [
            &b"\"messages\""[..],
            b"\"prompt\"",
            b"\"input\"",
            b"\"system\"",
            b"\"instructions\"",
        ]
        .map(Finder::new)
    });
    let mut first: Option<usize> = None;
    for key in KEYS.iter() {
        let upto = first.map_or(body.len(), |at| at);
        if let Some(at) = key.find(&body[..upto]) {
            first = Some(at);
        }
    }
    first.map(|at| &body[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain is a hit up to its first unknown block; the oldest blocks leave first.
    #[test]
    fn leading_blocks_and_least_recently_used_out() {
        let mut lru = BlockLru::new(4);
        let a: Vec<u64> = blocks(&[b'a'; 40], 8, 16).collect();
        assert_eq!(a.len(), 5);
        assert_eq!(lru.admit(a.iter().copied().take(3)), 0);
        assert_eq!(lru.leading(&a), 3);
        // The same start, then another tail: the shared blocks hash alike.
        let mut b_bytes = vec![b'a'; 16];
        b_bytes.extend_from_slice(&[b'b'; 24]);
        let b: Vec<u64> = blocks(&b_bytes, 8, 16).collect();
        assert_eq!((b[0], b[1]), (a[0], a[1]));
        assert_ne!(b[2], a[2]);
        assert_eq!(lru.admit(b.iter().copied()), 2);
        // Capacity 4: the oldest went, tails first (a's third block, then b's last), and
        // the shared head stays.
        assert_eq!(lru.len(), 4);
        assert_eq!(lru.leading(&a), 2);
        assert_eq!(lru.leading(&b), 4);
        // At most `max` blocks are hashed.
        assert_eq!(blocks(&[0; 1000], 10, 7).count(), 7);
    }

    /// Bad input never grows the index past its bound nor panics: 100,000 distinct
    /// prefixes into an index of 8,192 blocks; an empty or short prompt has no blocks.
    #[test]
    fn the_index_stays_bounded_and_odd_prompts_have_no_chain() {
        let mut lru = BlockLru::new(8192);
        for k in 0..100_000u32 {
            let prompt = format!("{k}-{}", "x".repeat(600));
            lru.admit(blocks(prompt.as_bytes(), 256, 64));
        }
        assert_eq!(lru.len(), 8192);
        assert_eq!(blocks(br#""messages":[]}"#, 256, 64).count(), 0);
        assert_eq!(prompt_start(&[0xff; 1000]), None);
    }

    #[test]
    fn the_prompt_starts_at_its_first_key() {
        let body = br#"{"model":"m","max_tokens":9,"messages":[{"role":"system","content":"S"}]}"#;
        assert_eq!(
            prompt_start(body).map(|b| &b[..11]),
            Some(&br#""messages":"#[..])
        );
        let anthropic = br#"{"model":"m","system":"S","messages":[]}"#;
        assert!(prompt_start(anthropic).is_some_and(|b| b.starts_with(b"\"system\"")));
        assert_eq!(prompt_start(br#"{"model":"m"}"#), None);
        assert_eq!(prompt_start(b"not json"), None);
    }
}
