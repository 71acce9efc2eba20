//! HTTP/1.1 on the wire, and nothing else: the thread's scratch buffer and the reads into
//! it ([`io`]), request and response heads kept as their own bytes ([`head`]), the client
//! side of a request — its head checked, its body read ahead ([`request`]) — the response
//! head read and the client's framing decided ([`response`]), body framing ([`body`]) and
//! the answers tokentap makes itself ([`answer`]).
//!
//! This layer knows sockets and bytes. It imports nothing from the meter, routing, limits
//! or the config's upstreams: the request's flow (`exchange`) calls it, and hands what it
//! reads to the tap.

pub(crate) mod answer;
pub(crate) mod body;
pub(crate) mod conn;
pub(crate) mod head;
pub(crate) mod io;
pub(crate) mod request;
pub(crate) mod response;

/// The largest response head read (pingora's limit).
pub(crate) const MAX_RESPONSE_HEAD: usize = 1024 * 1024;
/// The most header fields parsed (pingora's limit).
pub(crate) const MAX_HEADERS: usize = 256;

/// What a buffer holds so far.
pub(crate) enum Head<T> {
    /// A whole head, and its length in bytes.
    Complete(T, usize),
    /// Not yet a whole head.
    Partial,
    /// Not a head tokentap reads itself (malformed, too many fields, an odd version).
    Invalid,
}

/// Whether `a` and `b` are the same but for the case of ASCII letters, as
/// `<[u8]>::eq_ignore_ascii_case` says, eight bytes at a time: a head's names are looked up
/// several times a request, and a byte at a time a 14-byte name cost ~100 instructions.
#[inline]
pub(crate) fn eq_ignore_case(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if a.len() < 8 {
        let (mut wa, mut wb) = ([0u8; 8], [0u8; 8]);
        wa[..a.len()].copy_from_slice(a);
        wb[..b.len()].copy_from_slice(b);
        return words_eq_ignore_case(u64::from_le_bytes(wa), u64::from_le_bytes(wb));
    }
    // Whole words, and the last eight bytes (which may overlap the word before).
    let word = |s: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let last = a.len() - 8;
    let mut at = 0;
    while at < last {
        if !words_eq_ignore_case(word(a, at), word(b, at)) {
            return false;
        }
        at += 8;
    }
    words_eq_ignore_case(word(a, last), word(b, last))
}

/// [`eq_ignore_case`] of eight bytes: each pair equal, or differing in the case bit
/// (0x20) alone where the byte is a letter.
fn words_eq_ignore_case(a: u64, b: u64) -> bool {
    const CASE: u64 = u64::from_ne_bytes([0x20; 8]);
    const LOW7: u64 = u64::from_ne_bytes([0x7f; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let x = a ^ b;
    if x == 0 {
        return true;
    }
    if x & !CASE != 0 {
        return false;
    }
    // The bytes that differ (in 0x20 alone), marked in their high bit.
    let differ = x << 2;
    // Those of `a | 0x20` in `a`..=`z`: ≥ 0x61 and not ≥ 0x7b in their low seven bits,
    // and no high bit (no carry crosses a byte: a low seven bits' sum stays under 0x100).
    let lower = a | CASE;
    let low = lower & LOW7;
    let at_least_a = low + u64::from_ne_bytes([0x80 - 0x61; 8]);
    let past_z = low + u64::from_ne_bytes([0x80 - 0x7b; 8]);
    let letter = at_least_a & !past_z & !lower & HIGH;
    differ & !letter == 0
}

/// What a head's line ends say: whether one is a bare LF (no CR before it), and whether a
/// line starts with a space or tab (a fold, obs-fold).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct LineEnds {
    pub(crate) bare_lf: bool,
    pub(crate) folded: bool,
}

/// The [`LineEnds`] of `head`, found eight bytes at a time in one pass: a short head has a
/// few lines, and a `memchr` call a line cost more than the line.
pub(crate) fn line_ends(head: &[u8]) -> LineEnds {
    const LOW7: u64 = u64::from_ne_bytes([0x7f; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    const LF: u64 = u64::from_ne_bytes([b'\n'; 8]);
    let mut ends = LineEnds::default();
    let mut at_lf = |i: usize| {
        ends.bare_lf |= i == 0 || head[i - 1] != b'\r';
        ends.folded |= matches!(head.get(i + 1), Some(b' ' | b'\t'));
    };
    let mut words = head.chunks_exact(8);
    for (n, word) in words.by_ref().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        // A byte's high bit set where it is an LF: its low seven bits plus 0x7f carry into
        // the high bit unless they are zero, and no carry crosses into the next byte.
        let x = u64::from_le_bytes(w) ^ LF;
        let mut lfs = !(((x & LOW7) + LOW7) | x) & HIGH;
        while lfs != 0 {
            at_lf(n * 8 + lfs.trailing_zeros() as usize / 8);
            lfs &= lfs - 1;
        }
    }
    let tail = head.len() - words.remainder().len();
    for (i, _) in words
        .remainder()
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
    {
        at_lf(tail + i);
    }
    ends
}

/// The `Content-Length`, when it is well formed: one number, or the same number repeated
/// (in several fields or a list, RFC 9110 §8.6).
pub(crate) fn content_length<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Option<u64> {
    let mut length = None;
    for value in values {
        for digits in value.split(|&b| b == b',') {
            let digits = digits.trim_ascii();
            if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            // At most 18 digits: below 10^18, no overflow.
            let n = digits
                .iter()
                .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
            if length.is_some_and(|l| l != n) {
                return None;
            }
            length = Some(n);
        }
    }
    length
}

/// Whether `Transfer-Encoding` names `chunked` once and nothing else: no other coding under
/// the framing.
pub(crate) fn only_chunked<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> bool {
    let mut codings = values
        .into_iter()
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty());
    codings
        .next()
        .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"))
        && codings.next().is_none()
}

/// Hop-by-hop fields (RFC 9110 §7.6.1, and the obsolete ones proxies still meet): never
/// forwarded, in either direction, with the fields `Connection` names.
pub(crate) const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair of bytes, at every place a word can hold it (the short path, whole words,
    /// the overlapping last word), with names around it in either case: the same answer as
    /// the standard library's byte-at-a-time compare.
    #[test]
    fn eq_ignore_case_is_the_standard_compare() {
        let base = b"Content-Length: x-Request-ID~^_`@[{|}";
        for len in [1, 2, 7, 8, 9, 12, 14, 16, 17, 24, 31] {
            let a: Vec<u8> = base.iter().cycle().take(len).copied().collect();
            let b: Vec<u8> = a.iter().map(u8::to_ascii_lowercase).collect();
            for at in [0, len / 2, len - 1] {
                for x in 0..=255u8 {
                    for y in 0..=255u8 {
                        let (mut a, mut b) = (a.clone(), b.clone());
                        a[at] = x;
                        b[at] = y;
                        assert_eq!(
                            eq_ignore_case(&a, &b),
                            a.eq_ignore_ascii_case(&b),
                            "{x:#04x} {y:#04x} at {at} of {len}"
                        );
                    }
                }
            }
        }
        assert!(!eq_ignore_case(b"host", b"hosts"));
        assert!(eq_ignore_case(b"", b""));
    }

    /// Random names, case flipped at random and now and then a byte changed.
    #[test]
    fn eq_ignore_case_on_random_names() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(48);
        for _ in 0..200_000 {
            let len = rng.gen_range(0..40);
            let a: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let mut b: Vec<u8> = a
                .iter()
                .map(|&c| match rng.gen_bool(0.5) {
                    true => c.to_ascii_uppercase(),
                    false => c.to_ascii_lowercase(),
                })
                .collect();
            if len > 0 && rng.gen_bool(0.3) {
                let i = rng.gen_range(0..len);
                b[i] ^= 1 << rng.gen_range(0..8);
            }
            assert_eq!(eq_ignore_case(&a, &b), a.eq_ignore_ascii_case(&b));
        }
    }

    /// `line_ends` agrees with a byte-at-a-time reading on heads of CR, LF, space, tab,
    /// letters and bytes one off from an LF (0x09, 0x0b, 0x8a), at every length and place.
    #[test]
    fn line_ends_agree_with_a_byte_at_a_time_reading() {
        use rand::{Rng, SeedableRng};
        let plain = |head: &[u8]| {
            let lfs = || head.iter().enumerate().filter(|(_, &b)| b == b'\n');
            LineEnds {
                bare_lf: lfs().any(|(i, _)| i == 0 || head[i - 1] != b'\r'),
                folded: lfs().any(|(i, _)| matches!(head.get(i + 1), Some(b' ' | b'\t'))),
            }
        };
        let alphabet = b"\r\n\r\n \tab:\x09\x0b\x8a\x00\xff";
        let mut rng = rand::rngs::SmallRng::seed_from_u64(48);
        let mut seen = [[false; 2]; 2];
        for _ in 0..200_000 {
            let len = rng.gen_range(0..40);
            let head: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
                .collect();
            let want = plain(&head);
            assert_eq!(line_ends(&head), want, "{head:?}");
            seen[usize::from(want.bare_lf)][usize::from(want.folded)] = true;
        }
        assert_eq!(seen, [[true; 2]; 2], "every answer met");
        let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n folded\r\nx: y\n\r\n";
        assert_eq!(
            line_ends(head),
            LineEnds {
                bare_lf: true,
                folded: true
            }
        );
        let head = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(line_ends(head), LineEnds::default());
    }
}
