//! Invariants of the HTTP/1 parsers, for the fuzz targets in `fuzz/` (feature `fuzzing`):
//! each function panics where an invariant breaks.

use super::http1::body::Chunked;
use super::http1::head::{RequestHead, ResponseHead};
use super::http1::{request, Head};

/// A request head: parsing never panics, a head found is found again in exactly its own
/// bytes, and its checks never panic.
pub fn request_head(data: &[u8]) {
    if let Head::Complete(req, len) = RequestHead::read(&mut bytes::BytesMut::from(data)) {
        assert!(len <= data.len());
        match RequestHead::read(&mut bytes::BytesMut::from(&data[..len])) {
            Head::Complete(again, l) => {
                assert_eq!(l, len);
                assert_eq!(again.raw_path(), req.raw_path());
                // The upstream gets origin-form (asterisk-form for OPTIONS; CONNECT is
                // refused by the checks below).
                let target = req.raw_path();
                assert!(
                    target.starts_with(b"/")
                        || (target == b"*" && req.method == http::Method::OPTIONS)
                        || req.method == http::Method::CONNECT,
                    "a target not in origin-form: {target:?}"
                );
            }
            _ => panic!("a head not found again in its own bytes"),
        }
        let _ = request::check(req, 1 << 20);
    }
}

/// A response head: as a request head, its framing never panics, and the head written for
/// the client is read back with the fields it kept, in their order.
pub fn response_head(data: &[u8]) {
    if let Head::Complete(mut resp, len) = ResponseHead::parse(data) {
        assert!(len <= data.len());
        assert!(matches!(ResponseHead::parse(&data[..len]), Head::Complete(_, l) if l == len));
        resp.copy(data, len);
        let _ = resp.framing();
        resp.fields.remove_hop_by_hop("");
        let kept: Vec<(Vec<u8>, Vec<u8>)> = resp
            .fields
            .iter()
            .map(|(n, v)| (n.to_vec(), v.to_vec()))
            .collect();
        let mut out = bytes::BytesMut::new();
        resp.write(&mut out, &[Some(("Date", b"now"))]);
        let folded = out
            .windows(2)
            .any(|w| w[0] == b'\n' && matches!(w[1], b' ' | b'\t'));
        assert!(!folded, "a folded line reached the client's head");
        match ResponseHead::parse(&out) {
            Head::Complete(mut again, l) => {
                assert_eq!(l, out.len());
                again.copy(&out, l);
                let dated = |(n, _): &(Vec<u8>, Vec<u8>)| !n.eq_ignore_ascii_case(b"date");
                let again: Vec<_> = again
                    .fields
                    .iter()
                    .map(|(n, v)| (n.to_vec(), v.to_vec()))
                    .filter(dated)
                    .collect();
                let kept: Vec<_> = kept.into_iter().filter(dated).collect();
                assert_eq!(again, kept, "the written head reads back otherwise");
            }
            _ => panic!("the written head does not parse"),
        }
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
