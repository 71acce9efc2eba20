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
