//! Request and response heads kept as their own bytes: httparse finds the fields, each is
//! kept as offsets into the head, and the head for the other side is written from them with
//! tokentap's changes. No header map is built: a short reply's heads are read once, changed
//! in a few places and written once, and pingora's maps (a copy of every name and value,
//! hashed, and a map of the names' case) cost as much as metering the reply's tokens.
//!
//! What the other side gets is what pingora wrote from its `RequestHeader` and
//! `ResponseHeader` after the same changes, except the order of fields: fields keep the
//! order they came in (pingora's map moved the last field into a removed one's place). A
//! field tokentap sets ([`Fields::write`]) takes the place of the first field of that name,
//! the others of that name dropped, as pingora's `insert_header` did; a field the head did
//! not have comes last. A request target in absolute-form goes upstream in origin-form.

use std::mem::MaybeUninit;

use bytes::{BufMut, Bytes, BytesMut};
use http::uri::PathAndQuery;
use http::{Method, StatusCode, Uri};

use super::body::BodyFraming;
use super::{content_length, eq_ignore_case, only_chunked, Head, HOP_BY_HOP, MAX_HEADERS};

/// One field of a head: where its name and value are in the head's bytes.
#[derive(Clone, Copy)]
struct Field {
    name: (u32, u32),
    value: (u32, u32),
    /// Removed: not forwarded.
    removed: bool,
}

/// A head's fields, found by offset in its bytes.
#[derive(Clone)]
pub(crate) struct Fields {
    bytes: Bytes,
    list: Vec<Field>,
    /// A bit for each name's [shape](name_bit) the head has: most names looked up are
    /// not there (`transfer-encoding`, `expect`, `upgrade`, tokentap's own…), and a clear
    /// bit answers that without a pass over the fields. Removing a field leaves its bit.
    names: u64,
}

/// A response head read from the upstream.
pub(crate) struct ResponseHead {
    pub(crate) status: StatusCode,
    /// HTTP/1.1 (else 1.0).
    pub(crate) http11: bool,
    /// The reason phrase when it is not the status's canonical one.
    reason: Option<Box<str>>,
    pub(crate) fields: Fields,
}

/// A request head read from the client.
#[derive(Clone)]
pub(crate) struct RequestHead {
    pub(crate) method: Method,
    /// The target as the upstream gets it (without a fragment); until the head owns its
    /// bytes, where the target is in them.
    target: Bytes,
    target_at: (u32, u32),
    /// The target parsed, for its path.
    pub(crate) uri: Uri,
    /// HTTP/1.1 (else 1.0).
    pub(crate) http11: bool,
    pub(crate) fields: Fields,
}

// === impl Fields ===

impl Fields {
    /// The fields httparse found in `buf` (its names and values are slices of it).
    fn of(buf: &[u8], headers: &[httparse::Header<'_>]) -> Fields {
        let base = buf.as_ptr() as usize;
        let at = |s: &[u8]| ((s.as_ptr() as usize - base) as u32, s.len() as u32);
        let mut names = 0;
        let list = headers
            .iter()
            .map(|f| {
                names |= name_bit(f.name.as_bytes());
                Field {
                    name: at(f.name.as_bytes()),
                    value: at(f.value),
                    removed: false,
                }
            })
            .collect();
        Fields {
            bytes: Bytes::new(),
            list,
            names,
        }
    }

    /// Whether a field named `name` may be there: false only when none is.
    fn may_have(&self, name: &[u8]) -> bool {
        self.names & name_bit(name) != 0
    }

    fn slice(&self, at: (u32, u32)) -> &[u8] {
        &self.bytes[range(at)]
    }

    /// The fields present (not removed), name and value.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.list
            .iter()
            .filter(|f| !f.removed)
            .map(|f| (self.slice(f.name), self.slice(f.value)))
    }

    /// The fields named `name` (case-insensitive) present. A field's name is compared only
    /// when its length is the name's: most are not, and are passed over without a slice.
    fn named<'a>(&'a self, name: &'a [u8]) -> impl Iterator<Item = &'a Field> + 'a {
        let list = if self.may_have(name) {
            &self.list[..]
        } else {
            &[]
        };
        list.iter().filter(move |f| {
            f.name.1 as usize == name.len()
                && !f.removed
                && eq_ignore_case(self.slice(f.name), name)
        })
    }

    /// The values of the fields named `name` (case-insensitive).
    pub(crate) fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.named(name.as_bytes()).map(|f| self.slice(f.value))
    }

    /// The first value of the field named `name`.
    pub(crate) fn get(&self, name: &str) -> Option<&[u8]> {
        self.named(name.as_bytes())
            .next()
            .map(|f| self.slice(f.value))
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Whether a comma-separated field holds `token` (case-insensitive).
    pub(crate) fn has_token(&self, name: &str, token: &str) -> bool {
        self.get_all(name)
            .flat_map(|v| v.split(|&b| b == b','))
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    }

    /// Removes every field named `name`.
    pub(crate) fn remove(&mut self, name: &str) {
        if !self.may_have(name.as_bytes()) {
            return;
        }
        let Self { bytes, list, .. } = self;
        for f in list.iter_mut() {
            let named = |f: &Field| eq_ignore_case(&bytes[range(f.name)], name.as_bytes());
            if f.name.1 as usize == name.len() && named(f) {
                f.removed = true;
            }
        }
    }

    /// Removes the hop-by-hop fields (RFC 9110 §7.6.1, and those `Connection` names) but
    /// `keep`.
    pub(crate) fn remove_hop_by_hop(&mut self, keep: &str) {
        // Most heads have no field that could be one (nor a `Connection`, one of them).
        if self.names & HOP_BY_HOP_BITS == 0 {
            return;
        }
        let Self { bytes, list, .. } = self;
        let kept = |name: &[u8]| eq_ignore_case(name, keep.as_bytes());
        for f in list.iter_mut() {
            let name = &bytes[range(f.name)];
            if !kept(name)
                && HOP_BY_HOP
                    .iter()
                    .any(|h| eq_ignore_case(name, h.as_bytes()))
            {
                f.removed = true;
            }
        }
        // Each token of each `Connection` (read as it came, though it is removed by now)
        // against every field: one pass over the fields a token.
        for c in 0..list.len() {
            let connection = list[c];
            if !eq_ignore_case(&bytes[range(connection.name)], b"connection") {
                continue;
            }
            for token in bytes[range(connection.value)].split(|&b| b == b',') {
                let token = token.trim_ascii();
                for f in list.iter_mut() {
                    let name = &bytes[range(f.name)];
                    if eq_ignore_case(name, token) && !kept(name) {
                        f.removed = true;
                    }
                }
            }
        }
    }

    /// Appends the fields but those removed, and those in `set` (`None`s skipped), then
    /// the head's empty line. A field set takes the place of the first field of its name,
    /// the others of that name dropped, as pingora's `insert_header` did; one the head
    /// did not have comes last. Names are written as given, and compared without case.
    fn write(&self, out: &mut BytesMut, set: &[Option<(&str, &[u8])>]) {
        debug_assert!(set.len() <= 64, "the fields written are tracked in a u64");
        let mut written = 0u64;
        let find = |name: &[u8]| {
            set.iter().enumerate().find_map(|(i, s)| match s {
                Some((n, v)) if eq_ignore_case(name, n.as_bytes()) => Some((i, *n, *v)),
                _ => None,
            })
        };
        for f in self.list.iter().filter(|f| !f.removed) {
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

// === impl ResponseHead ===

impl ResponseHead {
    /// Parses a response head at the start of `buf`, as leniently as pingora's client reads
    /// what upstreams send. A head found is not usable until it [keeps](Self::copy) its bytes.
    pub(crate) fn parse(buf: &[u8]) -> Head<ResponseHead> {
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
        let head = ResponseHead {
            status,
            http11: version == 1,
            reason,
            fields: Fields::of(buf, resp.headers),
        };
        Head::Complete(head, len)
    }

    /// Keeps a copy of the head's bytes, the `len` that [`parse`](Self::parse) found at the
    /// start of `buf`: a head read in the thread's scratch buffer.
    /// A field value folded over lines (obs-fold, which the parse allows from upstreams
    /// as pingora's client does) has each fold's CR and LF replaced by spaces (RFC 9112
    /// §5.2), so the client gets one line: a fold can neither reach it nor start a field of
    /// its own there.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn copy(&mut self, buf: &[u8], len: usize) {
        self.copy_as(buf, len, super::line_ends(&buf[..len]).folded);
    }

    /// [`copy`](Self::copy), where the caller has read whether the head has a fold (a line
    /// that starts with a space or tab: there is none in most heads).
    pub(crate) fn copy_as(&mut self, buf: &[u8], len: usize, folded: bool) {
        let head = &buf[..len];
        if !folded {
            self.fields.bytes = Bytes::copy_from_slice(head);
            return;
        }
        let mut bytes = head.to_vec();
        for f in &mut self.fields.list {
            let value = &mut bytes[range(f.value)];
            for b in value.iter_mut() {
                if matches!(*b, b'\r' | b'\n') {
                    *b = b' ';
                }
            }
            // A fold at the value's end leaves spaces there, which a field's value never
            // ends with.
            let trimmed = value.trim_ascii_end().len();
            f.value.1 = trimmed as u32;
        }
        self.fields.bytes = Bytes::from(bytes);
    }

    /// How the body ends, or `None` when that cannot be trusted (a transfer coding other
    /// than chunked last, or a bad `Content-Length`); RFC 9112 §6.3.
    pub(crate) fn framing(&self) -> Option<BodyFraming> {
        let status = self.status.as_u16();
        if status == 204 || status == 304 {
            return Some(BodyFraming::Empty);
        }
        let h = &self.fields;
        if h.contains("transfer-encoding") {
            let last = h
                .get_all("transfer-encoding")
                .flat_map(|v| v.split(|&b| b == b','))
                .map(<[u8]>::trim_ascii)
                .filter(|t| !t.is_empty())
                .last();
            return match last {
                Some(t) if t.eq_ignore_ascii_case(b"chunked") => Some(BodyFraming::Chunked),
                _ => None,
            };
        }
        if h.contains("content-length") {
            return content_length(h.get_all("content-length")).map(BodyFraming::Length);
        }
        Some(BodyFraming::UntilClose)
    }

    /// Whether `Transfer-Encoding` names `chunked` once and nothing else.
    pub(crate) fn only_chunked(&self) -> bool {
        only_chunked(self.fields.get_all("transfer-encoding"))
    }

    /// Appends the head as the client gets it: HTTP/1.1, the upstream's fields but those
    /// removed, and the fields in `set` (see [`Fields::write`]).
    pub(crate) fn write(&self, out: &mut BytesMut, set: &[Option<(&str, &[u8])>]) {
        out.put_slice(b"HTTP/1.1 ");
        out.put_slice(self.status.as_str().as_bytes());
        out.put_u8(b' ');
        let reason = self.reason.as_deref();
        if let Some(reason) = reason.or_else(|| self.status.canonical_reason()) {
            out.put_slice(reason.as_bytes());
        }
        out.put_slice(b"\r\n");
        self.fields.write(out, set);
    }
}

// === impl RequestHead ===

impl RequestHead {
    /// Parses a request head (HTTP/1.0 or 1.1) at the start of `buf`, strictly. A head found
    /// is not usable until it [owns](Self::own) its bytes.
    pub(crate) fn parse(buf: &[u8]) -> Head<RequestHead> {
        let mut fields = [const { MaybeUninit::uninit() }; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        let len = match req.parse_with_uninit_headers(buf, &mut fields) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Head::Partial,
            Err(_) => return Head::Invalid,
        };
        let (Some(method), Some(path), Some(version)) = (req.method, req.path, req.version) else {
            return Head::Invalid;
        };
        // RFC 9112 §3.2: the target is visible ASCII; pingora would percent-encode the rest.
        if path.is_empty() || !path.bytes().all(|b| b.is_ascii_graphic()) {
            return Head::Invalid;
        }
        let Ok(method) = Method::from_bytes(method.as_bytes()) else {
            return Head::Invalid;
        };
        let at = (path.as_ptr() as usize - buf.as_ptr() as usize) as u32;
        let head = RequestHead {
            method,
            target: Bytes::new(),
            target_at: (at, path.len() as u32),
            uri: Uri::default(),
            http11: version == 1,
            fields: Fields::of(buf, req.headers),
        };
        Head::Complete(head, len)
    }

    /// A whole head at the start of `buf`, parsed and taken from it (`buf` keeps what
    /// follows); invalid also when its target is not a URI.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn read(buf: &mut BytesMut) -> Head<RequestHead> {
        match RequestHead::parse(buf) {
            Head::Complete(mut head, len) => match head.own(buf, len) {
                true => Head::Complete(head, len),
                false => Head::Invalid,
            },
            Head::Invalid => Head::Invalid,
            Head::Partial => Head::Partial,
        }
    }

    /// Takes the head's bytes, the `len` that [`parse`](Self::parse) found at the start of
    /// the buffer it parsed (the buffer keeps what follows), and reads its target: false
    /// when it is in none of the forms a proxy takes (RFC 9112 §3.2).
    pub(crate) fn own(&mut self, buf: &mut BytesMut, len: usize) -> bool {
        let bytes = buf.split_to(len).freeze();
        let (at, n) = self.target_at;
        let raw = bytes.slice(at as usize..(at + n) as usize);
        self.fields.bytes = bytes;
        match self.origin_form(raw) {
            Some((target, path)) => {
                self.uri = Uri::from(path);
                self.target = target;
                true
            }
            None => false,
        }
    }

    /// The target in origin-form as the upstream gets it, and its path, from any form a
    /// reverse proxy takes: origin-form (`/v1/x?q`, the usual one, read in place);
    /// absolute-form (`http://host/v1/x`), whose authority the client chose and which the
    /// upstream must never see (its path and query go on, as nginx sends them);
    /// asterisk-form (`*`) for `OPTIONS` only. A fragment is dropped. Authority-form is
    /// CONNECT's, which the checks refuse; anything else (`v1/x`, `x:y/z`) is no target.
    fn origin_form(&self, raw: Bytes) -> Option<(Bytes, PathAndQuery)> {
        if raw.starts_with(b"/") {
            let fragment = raw.contains(&b'#');
            let path = PathAndQuery::from_maybe_shared(raw.clone()).ok()?;
            // The parser stops at `#`: the target is what it kept.
            let target = match fragment {
                false => raw,
                true => Bytes::copy_from_slice(path.as_str().as_bytes()),
            };
            return Some((target, path));
        }
        if self.method == Method::CONNECT {
            // Authority-form, CONNECT's alone: read, to be refused as CONNECT.
            return Some((raw, PathAndQuery::from_static("/")));
        }
        if &raw[..] == b"*" {
            return (self.method == Method::OPTIONS).then(|| (raw, PathAndQuery::from_static("*")));
        }
        let uri = Uri::from_maybe_shared(raw).ok()?;
        let web = uri
            .scheme_str()
            .is_some_and(|s| s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https"));
        if !web || uri.authority().is_none_or(|a| a.host().is_empty()) {
            return None;
        }
        let path = match uri.path_and_query() {
            Some(p) if p.as_str().starts_with('/') => p.clone(),
            // `http://host` and `http://host?q`: the path is `/` (RFC 9112 §3.2.1).
            Some(p) => PathAndQuery::from_maybe_shared(format!("/{}", p.as_str())).ok()?,
            None => PathAndQuery::from_static("/"),
        };
        Some((Bytes::copy_from_slice(path.as_str().as_bytes()), path))
    }

    /// The target as the upstream gets it.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn raw_path(&self) -> &[u8] {
        &self.target
    }

    /// The head's bytes as they came (an upgrade hands them to pingora-proxy).
    pub(crate) fn bytes(&self) -> &Bytes {
        &self.fields.bytes
    }

    /// Appends the request line and head as the upstream gets them: HTTP/1.1, the client's
    /// fields but those removed, and the fields in `set` (see [`Fields::write`]).
    pub(crate) fn write(&self, out: &mut BytesMut, set: &[Option<(&str, &[u8])>]) {
        out.put_slice(self.method.as_str().as_bytes());
        out.put_u8(b' ');
        out.put_slice(&self.target);
        out.put_slice(b" HTTP/1.1\r\n");
        self.fields.write(out, set);
    }
}

/// One of 64 bits for a field name, from its length and its last byte (either case): two
/// names that are equal without case get the same bit.
const fn name_bit(name: &[u8]) -> u64 {
    let last = match name.last() {
        Some(&b) => b | 0x20,
        None => 0,
    };
    1 << ((name.len() as u32)
        .wrapping_mul(7)
        .wrapping_add(last as u32)
        & 63)
}

/// The [`name_bit`]s of the hop-by-hop fields.
const HOP_BY_HOP_BITS: u64 = {
    let mut bits = 0;
    let mut i = 0;
    while i < HOP_BY_HOP.len() {
        bits |= name_bit(HOP_BY_HOP[i].as_bytes());
        i += 1;
    }
    bits
};

/// Where an (offset, length) pair is in the head's bytes.
fn range((at, len): (u32, u32)) -> std::ops::Range<usize> {
    at as usize..at as usize + len as usize
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
        resp.copy(raw, len);
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
    fn a_lookup_finds_what_a_pass_over_the_fields_finds() {
        // Names of the same length and last byte share a bit; case is ignored both ways.
        let fields = [
            ("Content-Length", "5"),
            ("X-Request-Id", "a"),
            ("x-request-ID", "b"),
            ("Trailer", "c"),
            ("Connection", "keep-alive, Upgrade"),
            ("Host", "h"),
        ];
        let h = with(&fields, 200);
        let h = &h.fields;
        let looked = [
            "content-length",
            "CONTENT-LENGTH",
            "x-request-id",
            "trailer",
            "connection",
            "host",
            "transfer-encoding",
            "expect",
            "upgrade",
            "content-type",
            "x-request-iD",
            "content-lengtH",
            "content-lengti",
            "hosT",
            "post",
            "hast",
            "",
            "x",
        ];
        for name in looked {
            let by_pass: Vec<&[u8]> = (h.iter())
                .filter(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
                .map(|(_, v)| v)
                .collect();
            assert_eq!(h.get(name), by_pass.first().copied(), "{name}");
            assert_eq!(h.get_all(name).collect::<Vec<_>>(), by_pass, "{name}");
            assert_eq!(h.contains(name), !by_pass.is_empty(), "{name}");
        }
        assert!(h.has_token("connection", "upgrade"));
        let mut removed = h.clone();
        removed.remove("X-REQUEST-ID");
        removed.remove("expect");
        assert_eq!(removed.get("x-request-id"), None);
        assert_eq!(removed.get("host"), Some(&b"h"[..]));
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let f = |fields: &[(&str, &str)]| with(fields, 200).framing();
        assert_eq!(f(&[]), Some(BodyFraming::UntilClose));
        assert_eq!(
            f(&[("content-length", "12")]),
            Some(BodyFraming::Length(12))
        );
        assert_eq!(
            f(&[("Content-Length", "1"), ("content-length", "1, 1")]),
            Some(BodyFraming::Length(1))
        );
        assert_eq!(f(&[("content-length", "1"), ("content-length", "2")]), None);
        assert_eq!(f(&[("content-length", "+1")]), None);
        assert_eq!(
            f(&[("transfer-encoding", "gzip, chunked")]),
            Some(BodyFraming::Chunked)
        );
        assert_eq!(
            f(&[("Transfer-Encoding", "chunked"), ("content-length", "3")]),
            Some(BodyFraming::Chunked)
        );
        assert_eq!(f(&[("transfer-encoding", "chunked, gzip")]), None);
        assert_eq!(
            f(&[("transfer-encoding", "chunked,")]),
            Some(BodyFraming::Chunked)
        );
        assert_eq!(with(&[], 204).framing(), Some(BodyFraming::Empty));
        assert_eq!(
            with(&[("content-length", "5")], 304).framing(),
            Some(BodyFraming::Empty)
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
        resp.fields.remove_hop_by_hop("transfer-encoding");
        let names: Vec<&[u8]> = resp.fields.iter().map(|(n, _)| n).collect();
        assert_eq!(names, [&b"Host"[..], b"Transfer-Encoding", b"Content-Type"]);
        resp.fields.remove_hop_by_hop("");
        assert!(!resp.fields.contains("transfer-encoding"));
    }

    #[test]
    fn the_client_s_head_keeps_the_upstream_s_fields_in_order_with_tokentap_s_set() {
        let mut resp = head(
            b"HTTP/1.0 200 OK\r\nX-B: 1\r\nDate: then\r\nx-a:  2 \r\ndate: again\r\nContent-Length: 3\r\n\r\nabc",
        );
        assert_eq!(resp.fields.get("X-A"), Some(&b"2"[..]));
        assert!(!resp.http11);
        resp.fields.remove("content-length");
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

    #[test]
    fn a_request_head_is_written_with_its_fields_in_their_case_and_order() {
        let mut buf = BytesMut::from(
            &b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: a\r\nX-Mixed-Case: 1\r\nConnection: x-mixed-case\r\nContent-Length: 2\r\n\r\n{}"[..],
        );
        let Head::Complete(mut req, _) = RequestHead::read(&mut buf) else {
            panic!("not parsed")
        };
        assert_eq!(&buf[..], b"{}");
        assert_eq!(req.uri.path(), "/v1/chat/completions");
        assert_eq!(req.raw_path(), b"/v1/chat/completions?x=1");
        assert!(req.http11 && req.method == Method::POST);
        req.fields.remove_hop_by_hop("");
        req.fields.remove("content-length");
        let mut out = BytesMut::new();
        req.write(
            &mut out,
            &[Some(("Host", b"up")), Some(("Content-Length", b"2"))],
        );
        assert_eq!(
            &out[..],
            b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: up\r\nContent-Length: 2\r\n\r\n"
        );

        let read = |raw: &[u8]| RequestHead::read(&mut BytesMut::from(raw));
        let Head::Complete(old, _) = read(b"GET / HTTP/1.0\r\n\r\n") else {
            panic!("HTTP/1.0 not parsed")
        };
        assert!(!old.http11);
        assert!(matches!(read(b"GET /\x01 HTTP/1.1\r\n\r\n"), Head::Invalid));
        assert!(matches!(read(b"GET /a<b HTTP/1.1\r\n\r\n"), Head::Invalid));
        assert!(matches!(read(b"GET /a HTTP/1.1\r\nHost"), Head::Partial));
    }

    /// Every form of request-target (RFC 9112 §3.2): what the upstream gets in the request
    /// line and the path routing sees, or `None` for a head refused with 400.
    #[test]
    fn request_targets_go_upstream_in_origin_form() {
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("GET /a?b", Some(("/a?b", "/a"))),
            ("GET /a?b#c", Some(("/a?b", "/a"))),
            ("GET /", Some(("/", "/"))),
            // Absolute-form: the authority the client chose never reaches the upstream.
            ("GET http://other.example/echo", Some(("/echo", "/echo"))),
            ("POST http://h/v1/x?y", Some(("/v1/x?y", "/v1/x"))),
            ("GET HTTPS://h:8443/v1/x#f", Some(("/v1/x", "/v1/x"))),
            ("GET http://h", Some(("/", "/"))),
            ("GET http://u:p@h/a", Some(("/a", "/a"))),
            ("OPTIONS *", Some(("*", "*"))),
            // Forms a proxy does not take.
            ("GET *", None),
            ("GET private/x", None),
            ("GET echo", None),
            ("GET x:y/private/z", None),
            ("GET ftp://h/a", None),
            ("GET h:80", None),
            ("GET http:/a", None),
            ("GET //h/a", Some(("//h/a", "//h/a"))),
        ];
        for (line, want) in cases {
            let raw = format!("{line} HTTP/1.1\r\nHost: h\r\n\r\n");
            let got = match RequestHead::read(&mut BytesMut::from(raw.as_bytes())) {
                Head::Complete(req, _) => {
                    Some((req.raw_path().to_vec(), req.uri.path().to_owned()))
                }
                Head::Invalid => None,
                Head::Partial => panic!("{line}: partial"),
            };
            let want = want.map(|(t, p)| (t.as_bytes().to_vec(), p.to_owned()));
            assert_eq!(got, want, "{line}");
        }
    }

    /// An obs-fold in an upstream's field value reaches the client as spaces, on one line.
    #[test]
    fn a_folded_response_field_is_unfolded_with_spaces() {
        let raw = b"HTTP/1.1 200 OK\r\nX-Fold: a\r\n Injected: yes\r\nX-Tab: b\r\n\tc\r\nContent-Length: 0\r\n\r\n";
        let resp = head(raw);
        let mut out = BytesMut::new();
        resp.write(&mut out, &[]);
        assert_eq!(
            &out[..],
            &b"HTTP/1.1 200 OK\r\nX-Fold: a   Injected: yes\r\nX-Tab: b  \tc\r\nContent-Length: 0\r\n\r\n"[..]
        );
        assert_eq!(resp.fields.get("x-fold"), Some(&b"a   Injected: yes"[..]));
        assert!(resp.fields.get("injected").is_none());
        // A fold at a value's end: written and read back alike.
        let raw = b"HTTP/1.1 200 OK\r\nX-End: z\r\n \r\nX-Next: 1\r\n\r\n";
        let resp = head(raw);
        let mut out = BytesMut::new();
        resp.write(&mut out, &[]);
        assert_eq!(
            &out[..],
            &b"HTTP/1.1 200 OK\r\nX-End: z\r\nX-Next: 1\r\n\r\n"[..]
        );
    }
}
