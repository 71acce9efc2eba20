//! A request path as the server behind tokentap will read it, so that what tokentap routes,
//! meters, caps and budgets is what the backend serves. The path still goes upstream as the
//! client sent it; only the decisions read this form.
//!
//! The servers in front of which tokentap runs decode a path before they route it: vLLM and
//! SGLang on uvicorn (Starlette routes on the percent-decoded path, `%2F` included), any
//! ASGI or WSGI app, most Go and C++ routers after a cleaning step. A path that is not
//! read so is a bypass: `POST /v1/chat/%63ompletions` would be forwarded unmetered,
//! uncapped and unbudgeted, and generate all the same. So the path is read as the most
//! lenient of them reads it: every `%XX` decoded, empty segments (`//`) dropped, `.` and
//! `..` segments resolved (never above the root), a trailing `/` dropped. Case is kept
//! here (routes match the operator's prefixes as written); [`Dialect`](crate::dialect::Dialect)
//! classification reads it case-blind, since a server may ignore case.

use std::borrow::Cow;

/// `path` (no query) as a server reads it; borrowed when it is already so (the usual case:
/// one pass over its bytes, no allocation), or when it is no path (`*`).
pub fn canonical(path: &str) -> Cow<'_, str> {
    // Not a path (`OPTIONS *`'s asterisk, none at all): read as it is.
    if !path.starts_with('/') || is_canonical(path.as_bytes()) {
        return Cow::Borrowed(path);
    }
    Cow::Owned(read(path))
}

/// `path` read as a server reads it, always made anew: decoded, its empty and `.`
/// segments dropped, each `..` taking the one before it away.
fn read(path: &str) -> String {
    let decoded = percent_decode(path.as_bytes());
    let decoded = String::from_utf8_lossy(&decoded);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Whether `canonical` would return `path` unchanged: it starts with `/`, holds no `%`, no
/// empty, `.` or `..` segment, and does not end with `/` (but for the root itself).
fn is_canonical(path: &[u8]) -> bool {
    if path == b"/" {
        return true;
    }
    if path.first() != Some(&b'/') || path.last() == Some(&b'/') {
        return false;
    }
    let mut at_start = true; // just after a `/`
    let mut dots = 0; // the segment so far is this many dots
    for &b in &path[1..] {
        match b {
            b'%' => return false,
            b'/' if at_start || (1..=2).contains(&dots) => return false,
            b'/' => {
                at_start = true;
                dots = 0;
            }
            b'.' if at_start || dots > 0 => {
                at_start = false;
                dots += 1;
            }
            _ => {
                at_start = false;
                dots = usize::MAX / 2; // not a dot segment
            }
        }
    }
    // The last segment: `.` or `..`.
    !(1..=2).contains(&dots)
}

/// Every `%XX` (hex, either case) decoded; a `%` not followed by two hex digits kept.
pub fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_read_as_a_server_reads_them() {
        for (sent, read) in [
            ("/v1/chat/completions", "/v1/chat/completions"),
            ("/", "/"),
            ("", ""),
            ("*", "*"),
            ("/v1/chat/%63ompletions", "/v1/chat/completions"),
            ("/v1/chat/%63%6F%6d%70letions", "/v1/chat/completions"),
            ("/v1%2Fchat%2fcompletions", "/v1/chat/completions"),
            ("//v1/chat/completions", "/v1/chat/completions"),
            ("/v1//chat///completions", "/v1/chat/completions"),
            ("/v1/./chat/completions", "/v1/chat/completions"),
            ("/v1/x/../chat/completions", "/v1/chat/completions"),
            ("/../../v1/chat/completions", "/v1/chat/completions"),
            ("/v1/%2e%2E/v1/chat/completions", "/v1/chat/completions"),
            ("/v1/chat/completions/", "/v1/chat/completions"),
            ("/v1/chat/completions/.", "/v1/chat/completions"),
            ("/v1/chat/completions/..", "/v1/chat"),
            // Dots that are not a segment of their own stay.
            ("/v1/.well-known/x", "/v1/.well-known/x"),
            ("/v1/a..b/...", "/v1/a..b/..."),
            // A `%` without two hex digits after it is kept as it is.
            ("/v1/100%", "/v1/100%"),
            ("/v1/%zz", "/v1/%zz"),
            ("/v1/%4", "/v1/%4"),
            ("/V1/Chat/Completions", "/V1/Chat/Completions"),
        ] {
            assert_eq!(canonical(sent), read, "{sent}");
        }
    }

    /// The fast check agrees with the full reading on every path made of these pieces.
    #[test]
    fn the_fast_check_agrees_with_the_full_reading() {
        let pieces = ["/", "a", ".", "..", "%", "%2e", "b.", "...", "//"];
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            let mut next = Vec::new();
            for p in &paths {
                for piece in pieces {
                    next.push(format!("{p}{piece}"));
                }
            }
            paths.extend(next);
        }
        for p in paths {
            let fast = is_canonical(p.as_bytes());
            let full = read(&p);
            if !p.starts_with('/') {
                assert_eq!(canonical(&p), p);
                continue;
            }
            if fast {
                assert_eq!(full, p, "{p:?} passed the fast check but reads as {full:?}");
            }
            assert_eq!(canonical(&p), full, "{p:?}");
        }
    }
}
