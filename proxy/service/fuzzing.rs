//! Invariants of the HTTP/1 parsers, for the fuzz targets in `fuzz/` (feature `fuzzing`):
//! each function panics where an invariant breaks.

use super::h1::{self, Chunked, Framing, Head};
use super::request;

/// A request head: parsing never panics, a head found is found again in exactly its own
/// bytes, and its checks never panic.
pub fn request_head(data: &[u8]) {
    if let Head::Complete(req, len) = h1::request(data) {
        assert!(len <= data.len());
        match h1::request(&data[..len]) {
            Head::Complete(again, l) => {
                assert_eq!(l, len);
                assert_eq!(again.raw_path(), req.raw_path());
            }
            _ => panic!("a head not found again in its own bytes"),
        }
        let _ = request::check(req, 1 << 20);
    }
}

/// A response head: as a request head, and its framing never panics.
pub fn response_head(data: &[u8]) {
    if let Head::Complete(resp, len) = h1::response(data) {
        assert!(len <= data.len());
        assert!(matches!(h1::response(&data[..len]), Head::Complete(_, l) if l == len));
        let _ = Framing::of(&resp);
        let _ = h1::hop_by_hop(&resp.headers, &[]);
    }
}

/// The chunked decoder, strict and lenient: the same payload, length and end whether the
/// input comes whole or split at `data[0]`; whatever strict accepts, lenient reads alike.
pub fn chunked(data: &[u8]) {
    let Some((&split, body)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(body.len());
    let run = |strict: bool, parts: &[&[u8]]| {
        let mut c = if strict {
            Chunked::strict()
        } else {
            Chunked::default()
        };
        let mut payload = Vec::new();
        let mut used = 0;
        for part in parts {
            if c.done() {
                break;
            }
            match c.feed(part, |p| payload.extend_from_slice(p)) {
                Ok(n) => used += n,
                Err(_) => return None,
            }
        }
        Some((payload, used, c.done()))
    };
    for strict in [true, false] {
        let whole = run(strict, &[body]);
        let split = run(strict, &[&body[..split], &body[split..]]);
        assert_eq!(
            whole, split,
            "split at {split:?} changed the decoding (strict {strict})"
        );
        if let Some((payload, used, _)) = &whole {
            assert!(*used <= body.len() && payload.len() <= body.len());
        }
    }
    if let Some(strict) = run(true, &[body]) {
        assert_eq!(
            Some(strict),
            run(false, &[body]),
            "strict accepted what lenient read otherwise"
        );
    }
}
