//! A response head as the upstream sent it, kept as its own bytes: each field found by its
//! offsets, the client's head written from them with tokentap's changes. No header map is
//! built: a short reply's head is read once, changed in a few places and written once, and
//! pingora's maps (a copy of every name and value, hashed, and a map of the names' case)
//! cost as much as metering the reply's tokens.
//!
//! What the client gets is what pingora's server session wrote from pingora's
//! `ResponseHeader` after the same changes, except the order of fields: an upstream's
//! fields keep their order here (pingora's map moved the last field into a removed one's
//! place). A field tokentap [sets](ResponseHead::set) takes the place of the upstream's
//! first field of that name, the others of that name dropped, as pingora's
//! `insert_header` did; a field the upstream did not send comes after the upstream's.

use std::mem::MaybeUninit;

use bytes::{BufMut, Bytes, BytesMut};
use http::StatusCode;

use super::h1::{self, Framing, Head, HOP_BY_HOP, MAX_HEADERS};

/// One field of the head: where its name and value are in the head's bytes.
#[derive(Clone, Copy)]
struct Field {
    name: (u32, u32),
    value: (u32, u32),
    /// Removed: not written to the client.
    removed: bool,
}

/// A response head read from the upstream.
pub(super) struct ResponseHead {
    bytes: Bytes,
    pub(super) status: StatusCode,
    /// HTTP/1.1 (else 1.0).
    pub(super) http11: bool,
    /// The reason phrase when it is not the status's canonical one.
    reason: Option<Box<str>>,
    fields: Vec<Field>,
}

// === impl ResponseHead ===

impl ResponseHead {
    /// Parses a response head at the start of `buf`, as leniently as pingora's client reads
    /// what upstreams send.
    pub(super) fn parse(buf: &[u8]) -> Head<ResponseHead> {
        let mut fields = [const { MaybeUninit::uninit() }; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut []);
        let mut parser = httparse::ParserConfig::default();
        parser
            .allow_spaces_after_header_name_in_responses(true)
            .allow_obsolete_multiline_headers_in_responses(true);
        let len = match parser.parse_response_with_uninit_headers(&mut resp, buf, &mut fields) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Head::Partial,
            Err(_) => return Head::Invalid,
        };
        let (Some(code), Some(version)) = (resp.code, resp.version) else {
            return Head::Invalid;
        };
        let Ok(status) = StatusCode::from_u16(code) else {
            return Head::Invalid;
        };
        let reason = resp
            .reason
            .filter(|&r| Some(r) != status.canonical_reason())
            .map(Box::from);
        let base = buf.as_ptr() as usize;
        // httparse's names and values are slices of `buf`: their offsets locate them.
        let at = |s: &[u8]| ((s.as_ptr() as usize - base) as u32, s.len() as u32);
        let fields = resp
            .headers
            .iter()
            .map(|f| Field {
                name: at(f.name.as_bytes()),
                value: at(f.value),
                removed: false,
            })
            .collect();
        Head::Complete(
            ResponseHead {
                bytes: Bytes::new(),
                status,
                http11: version == 1,
                reason,
                fields,
            },
            len,
        )
    }

    /// Takes the head's bytes, the `len` that [`parse`](Self::parse) found at the start of
    /// the buffer it parsed (the buffer keeps what follows).
    pub(super) fn own(&mut self, buf: &mut BytesMut, len: usize) {
        self.bytes = buf.split_to(len).freeze();
    }

    fn slice(&self, (at, len): (u32, u32)) -> &[u8] {
        &self.bytes[at as usize..][..len as usize]
    }

    /// The fields present (not removed), name and value.
    pub(super) fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields
            .iter()
            .filter(|f| !f.removed)
            .map(|f| (self.slice(f.name), self.slice(f.value)))
    }

    /// The values of the fields named `name` (case-insensitive).
    pub(super) fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.fields()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The first value of the field named `name`.
    pub(super) fn get<'a>(&'a self, name: &'a str) -> Option<&'a [u8]> {
        self.get_all(name).next()
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Whether a comma-separated field holds `token` (case-insensitive).
    pub(super) fn has_token(&self, name: &str, token: &str) -> bool {
        self.get_all(name)
            .flat_map(|v| v.split(|&b| b == b','))
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    }

    /// Removes every field named `name`.
    pub(super) fn remove(&mut self, name: &str) {
        let Self { bytes, fields, .. } = self;
        for f in fields.iter_mut() {
            let (at, len) = f.name;
            if bytes[at as usize..][..len as usize].eq_ignore_ascii_case(name.as_bytes()) {
                f.removed = true;
            }
        }
    }

    /// Removes the hop-by-hop fields (RFC 9110 §7.6.1, and those `Connection` names) but
    /// `keep`.
    pub(super) fn remove_hop_by_hop(&mut self, keep: &str) {
        for i in 0..self.fields.len() {
            let name = self.slice(self.fields[i].name);
            // `Connection` as the upstream sent it, though it is itself removed on the way.
            let named = || {
                self.fields
                    .iter()
                    .filter(|f| self.slice(f.name).eq_ignore_ascii_case(b"connection"))
                    .flat_map(|f| self.slice(f.value).split(|&b| b == b','))
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(name))
            };
            let hop = !name.eq_ignore_ascii_case(keep.as_bytes())
                && (HOP_BY_HOP
                    .iter()
                    .any(|h| name.eq_ignore_ascii_case(h.as_bytes()))
                    || named());
            self.fields[i].removed |= hop;
        }
    }

    /// How the body ends, or `None` when that cannot be trusted (a transfer coding other
    /// than chunked last, or a bad `Content-Length`); RFC 9112 §6.3.
    pub(super) fn framing(&self) -> Option<Framing> {
        let status = self.status.as_u16();
        if status == 204 || status == 304 {
            return Some(Framing::Empty);
        }
        if self.contains("transfer-encoding") {
            let last = self
                .get_all("transfer-encoding")
                .flat_map(|v| v.split(|&b| b == b','))
                .map(<[u8]>::trim_ascii)
                .filter(|t| !t.is_empty())
                .last();
            return match last {
                Some(t) if t.eq_ignore_ascii_case(b"chunked") => Some(Framing::Chunked),
                _ => None,
            };
        }
        if self.contains("content-length") {
            return h1::content_length(self.get_all("content-length")).map(Framing::Length);
        }
        Some(Framing::UntilClose)
    }

    /// Whether `Transfer-Encoding` names `chunked` once and nothing else.
    pub(super) fn only_chunked(&self) -> bool {
        h1::only_chunked(self.get_all("transfer-encoding"))
    }

    /// Appends the head as the client gets it: HTTP/1.1, the upstream's fields but those
    /// removed, and the fields in `set` (`None`s skipped). A field set takes the place of
    /// the upstream's first field of its name, the others of that name dropped, as
    /// pingora's `insert_header` did; one the upstream did not send comes after the
    /// upstream's. Names are written as given, and compared without case.
    pub(super) fn write(&self, out: &mut BytesMut, set: &[Option<(&str, &[u8])>]) {
        out.put_slice(b"HTTP/1.1 ");
        out.put_slice(self.status.as_str().as_bytes());
        out.put_u8(b' ');
        let reason = self.reason.as_deref();
        if let Some(reason) = reason.or_else(|| self.status.canonical_reason()) {
            out.put_slice(reason.as_bytes());
        }
        out.put_slice(b"\r\n");
        debug_assert!(set.len() <= 64, "the fields written are tracked in a u64");
        let mut written = 0u64;
        let find = |name: &[u8]| {
            set.iter().enumerate().find_map(|(i, s)| match s {
                Some((n, v)) if name.eq_ignore_ascii_case(n.as_bytes()) => Some((i, *n, *v)),
                _ => None,
            })
        };
        for f in self.fields.iter().filter(|f| !f.removed) {
            let name = self.slice(f.name);
            match find(name) {
                None => put_field(out, name, self.slice(f.value)),
                Some((i, _, _)) if written & (1 << i) != 0 => {}
                Some((i, name, value)) => {
                    written |= 1 << i;
                    put_field(out, name.as_bytes(), value);
                }
            }
        }
        for (i, s) in set.iter().enumerate() {
            if let (Some((name, value)), 0) = (s, written & (1 << i)) {
                put_field(out, name.as_bytes(), value);
            }
        }
        out.put_slice(b"\r\n");
    }
}

fn put_field(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    out.put_slice(name);
    out.put_slice(b": ");
    out.put_slice(value);
    out.put_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(raw: &[u8]) -> ResponseHead {
        let Head::Complete(mut resp, len) = ResponseHead::parse(raw) else {
            panic!("not parsed: {raw:?}")
        };
        resp.own(&mut BytesMut::from(raw), len);
        resp
    }

    fn with(fields: &[(&str, &str)], status: u16) -> ResponseHead {
        let mut raw = format!("HTTP/1.1 {status} X\r\n");
        for (n, v) in fields {
            raw += &format!("{n}: {v}\r\n");
        }
        head(format!("{raw}\r\n").as_bytes())
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let f = |fields: &[(&str, &str)]| with(fields, 200).framing();
        assert_eq!(f(&[]), Some(Framing::UntilClose));
        assert_eq!(f(&[("content-length", "12")]), Some(Framing::Length(12)));
        assert_eq!(
            f(&[("Content-Length", "1"), ("content-length", "1, 1")]),
            Some(Framing::Length(1))
        );
        assert_eq!(f(&[("content-length", "1"), ("content-length", "2")]), None);
        assert_eq!(f(&[("content-length", "+1")]), None);
        assert_eq!(
            f(&[("transfer-encoding", "gzip, chunked")]),
            Some(Framing::Chunked)
        );
        assert_eq!(
            f(&[("Transfer-Encoding", "chunked"), ("content-length", "3")]),
            Some(Framing::Chunked)
        );
        assert_eq!(f(&[("transfer-encoding", "chunked, gzip")]), None);
        assert_eq!(
            f(&[("transfer-encoding", "chunked,")]),
            Some(Framing::Chunked)
        );
        assert_eq!(with(&[], 204).framing(), Some(Framing::Empty));
        assert_eq!(
            with(&[("content-length", "5")], 304).framing(),
            Some(Framing::Empty)
        );
        let only = |v: &str| with(&[("transfer-encoding", v)], 200).only_chunked();
        assert!(only("chunked") && only(" Chunked "));
        assert!(!only("gzip, chunked") && !only("chunked, chunked"));
    }

    #[test]
    fn hop_by_hop_fields_are_the_fixed_ones_and_those_connection_names() {
        let mut resp = with(
            &[
                ("Host", "a"),
                (
                    "Connection",
                    "keep-alive, X-Private ,Upgrade, bad name, absent",
                ),
                ("connection", "x-other"),
                ("Keep-Alive", "timeout=5"),
                ("x-private", "1"),
                ("X-Private", "2"),
                ("x-other", "3"),
                ("Transfer-Encoding", "chunked"),
                ("TE", "trailers"),
                ("Content-Type", "text/event-stream"),
            ],
            200,
        );
        resp.remove_hop_by_hop("transfer-encoding");
        let names: Vec<&[u8]> = resp.fields().map(|(n, _)| n).collect();
        assert_eq!(names, [&b"Host"[..], b"Transfer-Encoding", b"Content-Type"]);
        resp.remove_hop_by_hop("");
        assert!(!resp.contains("transfer-encoding"));
    }

    #[test]
    fn the_client_s_head_keeps_the_upstream_s_fields_in_order_with_tokentap_s_set() {
        let mut resp = head(
            b"HTTP/1.0 200 OK\r\nX-B: 1\r\nDate: then\r\nx-a:  2 \r\ndate: again\r\nContent-Length: 3\r\n\r\nabc",
        );
        assert_eq!(resp.get("X-A"), Some(&b"2"[..]));
        assert!(!resp.http11);
        resp.remove("content-length");
        let mut out = BytesMut::new();
        resp.write(
            &mut out,
            &[
                Some(("x-tokentap-upstream", b"a")),
                None,
                Some(("Date", b"now")),
                Some(("Connection", b"close")),
            ],
        );
        assert_eq!(
            &out[..],
            b"HTTP/1.1 200 OK\r\nX-B: 1\r\nDate: now\r\nx-a: 2\r\nx-tokentap-upstream: a\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn reason_phrases_are_kept_as_sent() {
        let written = |raw: &[u8]| {
            let mut out = BytesMut::new();
            head(raw).write(&mut out, &[]);
            out
        };
        assert_eq!(
            &written(b"HTTP/1.1 404 Nope\r\n\r\n")[..],
            b"HTTP/1.1 404 Nope\r\n\r\n"
        );
        assert_eq!(
            &written(b"HTTP/1.1 200 \r\n\r\n")[..],
            b"HTTP/1.1 200 \r\n\r\n"
        );
        assert_eq!(
            &written(b"HTTP/1.1 599 \r\n\r\n")[..],
            b"HTTP/1.1 599 \r\n\r\n"
        );
        // obs-text: httparse gives no phrase, nor did pingora write one.
        assert_eq!(
            &written(b"HTTP/1.1 200 \xffk\r\n\r\n")[..],
            b"HTTP/1.1 200 \r\n\r\n"
        );
        assert!(matches!(
            ResponseHead::parse(b"HTTP/1.1 099 X\r\n\r\n"),
            Head::Invalid
        ));
        assert!(matches!(
            ResponseHead::parse(b"HTTP/1.1 200 OK\r\nA: b"),
            Head::Partial
        ));
    }
}
