//! The client side of a request, the same for every request whatever its shape: the head
//! checked as RFC 9110/9112 ask (one `Host`, one body length, a target without whitespace
//! or control bytes, `chunked` alone), and the body read ahead — up to [`READ_AHEAD`] bytes,
//! decoded when chunked — before the upstream is chosen, the rest left to stream. What a
//! client got wrong is a [`ClientError`], which knows its status and its error body.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::AsyncReadExt as _;

use super::body::Chunked;
use super::conn::Io;
use super::head::RequestHead;
use super::io::read_more;
use crate::config::Limits;

/// The body read before the upstream is chosen and a slot taken: a whole generation request
/// as a rule (usage injection rewrites only a body read whole); a longer one streams on.
pub(crate) const READ_AHEAD: usize = 64 * 1024;

/// A request a client got wrong, answered with its status and the connection closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("malformed request head")]
    BadHead,
    #[error("the request head is larger than server.max_request_head_bytes")]
    HeadTooLarge,
    #[error("the request head did not arrive within server.request_head_timeout_secs")]
    HeadTimeout,
    #[error("an HTTP/1.1 request needs exactly one Host field")]
    Host,
    #[error("malformed or conflicting Content-Length")]
    BadLength,
    #[error("both Transfer-Encoding and Content-Length")]
    AmbiguousLength,
    #[error("a transfer coding other than chunked")]
    UnsupportedCoding,
    #[error("malformed chunked request body")]
    BadChunk,
    #[error("the request body is larger than server.max_request_body_bytes")]
    BodyTooLarge,
    #[error("the request body did not arrive in time")]
    BodyTimeout,
    #[error("an Expect other than 100-continue")]
    Expectation,
    #[error("CONNECT is not supported")]
    Connect,
}

impl ClientError {
    pub fn status(self) -> u16 {
        match self {
            ClientError::HeadTooLarge => 431,
            ClientError::HeadTimeout | ClientError::BodyTimeout => 408,
            ClientError::BodyTooLarge => 413,
            ClientError::Expectation => 417,
            ClientError::UnsupportedCoding | ClientError::Connect => 501,
            ClientError::BadHead
            | ClientError::Host
            | ClientError::BadLength
            | ClientError::AmbiguousLength
            | ClientError::BadChunk => 400,
        }
    }

    /// The `code` of the error body.
    pub fn code(self) -> &'static str {
        match self {
            ClientError::BadHead => "bad_request",
            ClientError::HeadTooLarge => "head_too_large",
            ClientError::HeadTimeout => "head_timeout",
            ClientError::Host => "bad_host",
            ClientError::BadLength | ClientError::AmbiguousLength => "bad_length",
            ClientError::UnsupportedCoding => "unsupported_coding",
            ClientError::BadChunk => "bad_chunk",
            ClientError::BodyTooLarge => "body_too_large",
            ClientError::BodyTimeout => "body_timeout",
            ClientError::Expectation => "expectation_failed",
            ClientError::Connect => "method_not_supported",
        }
    }
}

/// How a request's body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyKind {
    None,
    Length(u64),
    Chunked,
}

/// A request head that passed the checks.
pub(crate) struct Checked {
    pub(crate) req: RequestHead,
    pub(crate) body: BodyKind,
    /// The client waits for `100 Continue` before it sends its body.
    pub(crate) expects_continue: bool,
    /// An upgrade (WebSocket and the like): pingora-proxy carries it.
    pub(crate) upgrade: bool,
}

/// Checks a parsed request head (RFC 9112 §3, §6; RFC 9110 §7.2, §8.6).
pub(crate) fn check(req: RequestHead, max_body: u64) -> Result<Checked, ClientError> {
    let h = &req.fields;
    let http11 = req.http11;
    let hosts = h.get_all("host").count();
    if hosts > 1 || (http11 && hosts == 0) {
        return Err(ClientError::Host);
    }
    if req.method == http::Method::CONNECT {
        return Err(ClientError::Connect);
    }
    let chunked = h.contains("transfer-encoding");
    let length = h.contains("content-length");
    let body = if chunked {
        if length {
            return Err(ClientError::AmbiguousLength);
        }
        if !http11 || !super::only_chunked(h.get_all("transfer-encoding")) {
            return Err(ClientError::UnsupportedCoding);
        }
        BodyKind::Chunked
    } else if length {
        match super::content_length(h.get_all("content-length")) {
            Some(0) => BodyKind::Length(0),
            Some(n) => BodyKind::Length(n),
            None => return Err(ClientError::BadLength),
        }
    } else {
        BodyKind::None
    };
    if matches!(body, BodyKind::Length(n) if n > max_body) {
        return Err(ClientError::BodyTooLarge);
    }
    let mut expects_continue = false;
    for v in h.get_all("expect") {
        if !v.eq_ignore_ascii_case(b"100-continue") {
            return Err(ClientError::Expectation);
        }
        // An HTTP/1.0 client's expectation is ignored (RFC 9110 §10.1.1).
        expects_continue = http11;
    }
    // An upgrade with a chunked body is not handed to pingora-proxy, whose chunked decoder
    // is lenient: it takes this path, without the upgrade (a hop-by-hop field).
    let upgrade =
        h.contains("upgrade") && h.has_token("connection", "upgrade") && body != BodyKind::Chunked;
    Ok(Checked {
        req,
        body,
        expects_continue,
        upgrade,
    })
}

/// What a request's body still holds after the read-ahead.
#[derive(Debug)]
pub(crate) enum Rest {
    /// The body was read whole.
    Done,
    /// This many bytes are still to come.
    Length(u64),
    /// Chunks are still to come, decoded by this.
    Chunked(Chunked),
}

/// A body read ahead: its payload so far (decoded, when chunked) and what is still to come.
pub(crate) struct Ahead {
    pub(crate) bytes: BytesMut,
    pub(crate) rest: Rest,
    /// Bytes the client sent past its body (a pipelined next request).
    pub(crate) leftover: BytesMut,
    /// What a body read whole ([`read_whole`]) holds of [`WHOLE_BODIES_BYTES`].
    pub(crate) room: Option<Room>,
}

/// What the bodies read whole may hold at once, in all: past it a long body streams on as
/// it comes (without usage asked for or a mirror's copy, as one over the bound), so that
/// clients declaring long bodies cannot make the proxy hold their bytes without end.
pub(crate) const WHOLE_BODIES_BYTES: usize = 256 << 20;

static WHOLE_HELD: AtomicUsize = AtomicUsize::new(0);

/// Room taken of [`WHOLE_BODIES_BYTES`], given back when dropped (with the last of the
/// body's bytes: see [`Ahead::into_bytes`]).
#[derive(Debug)]
pub(crate) struct Room(usize);

impl Room {
    /// `n` more bytes of room, if there is that much left.
    fn grow(&mut self, n: usize) -> bool {
        let taken = WHOLE_HELD.fetch_update(Relaxed, Relaxed, |held| {
            let more = held.checked_add(n)?;
            (more <= WHOLE_BODIES_BYTES).then_some(more)
        });
        if taken.is_ok() {
            self.0 += n;
        }
        taken.is_ok()
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        WHOLE_HELD.fetch_sub(self.0, Relaxed);
    }
}

/// A body's bytes with the room they hold.
struct Held {
    bytes: BytesMut,
    _room: Room,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Ahead {
    /// The body read so far, shared (a mirror's copy takes it too): a body read whole
    /// gives its room back with the last of its bytes.
    pub(crate) fn into_bytes(bytes: BytesMut, room: Option<Room>) -> Bytes {
        match room {
            Some(room) if room.0 > 0 => Bytes::from_owner(Held { bytes, _room: room }),
            _ => bytes.freeze(),
        }
    }
}

/// Reads the body ahead: until it ends or [`READ_AHEAD`] bytes of it are in, within
/// `server.request_body_timeout_secs` in all. `read` holds what arrived after the head. A client waiting for
/// `100 Continue` gets it first (the upstream then gets no `Expect`: it gets the body).
/// `Ok(None)`: the client went away.
pub(crate) async fn read_ahead(
    client: &mut Io,
    mut read: BytesMut,
    checked: &Checked,
    limits: &Limits,
) -> Result<Option<Ahead>, ClientError> {
    let max_body = limits.max_request_body_bytes;
    let write_timeout = limits.client_write_timeout;
    let whole_in_buffer = match checked.body {
        BodyKind::None => true,
        BodyKind::Length(n) => read.len() as u64 >= n,
        BodyKind::Chunked => false,
    };
    if checked.expects_continue && !whole_in_buffer {
        let continued = b"HTTP/1.1 100 Continue\r\n\r\n";
        if super::io::write_within(client, continued, write_timeout)
            .await
            .is_err()
        {
            return Ok(None);
        }
    }
    let reading = async {
        match checked.body {
            BodyKind::None => Ok(Some(Ahead {
                bytes: BytesMut::new(),
                rest: Rest::Done,
                leftover: read,
                room: None,
            })),
            BodyKind::Length(n) => {
                let want = n.min(READ_AHEAD as u64) as usize;
                read.reserve(want.saturating_sub(read.len()));
                while read.len() < want {
                    // Straight into the room made (no scratch buffer between).
                    if !matches!(client.read_buf(&mut read).await, Ok(n) if n > 0) {
                        return Ok(None);
                    }
                }
                if read.len() as u64 >= n {
                    let leftover = read.split_off(n as usize);
                    return Ok(Some(Ahead {
                        bytes: read,
                        rest: Rest::Done,
                        leftover,
                        room: None,
                    }));
                }
                let left = n - read.len() as u64;
                Ok(Some(Ahead {
                    bytes: read,
                    rest: Rest::Length(left),
                    leftover: BytesMut::new(),
                    room: None,
                }))
            }
            BodyKind::Chunked => {
                let mut decoder = Chunked::strict();
                let mut bytes = BytesMut::new();
                loop {
                    let used = decoder
                        .feed(&read, |p| bytes.extend_from_slice(p))
                        .map_err(|_| ClientError::BadChunk)?;
                    read.advance(used);
                    if bytes.len() as u64 > max_body {
                        return Err(ClientError::BodyTooLarge);
                    }
                    if decoder.done() {
                        return Ok(Some(Ahead {
                            bytes,
                            rest: Rest::Done,
                            leftover: read,
                            room: None,
                        }));
                    }
                    if bytes.len() >= READ_AHEAD {
                        return Ok(Some(Ahead {
                            bytes,
                            rest: Rest::Chunked(decoder),
                            leftover: BytesMut::new(),
                            room: None,
                        }));
                    }
                    read.clear(); // all of it was fed
                    if !more(client, &mut read).await {
                        return Ok(None);
                    }
                }
            }
        }
    };
    tokio::time::timeout(limits.request_body_timeout, reading)
        .await
        .unwrap_or(Err(ClientError::BodyTimeout))
}

/// Reads the rest of a body read ahead, when all of it fits in `bound` bytes and in what is
/// left of [`WHOLE_BODIES_BYTES`] (a chunked body: until it ends, or once past either),
/// each read within `server.request_body_timeout_secs`: for what needs the body whole
/// (usage asked for, a mirror's copy). A longer body keeps its rest to be streamed. A known
/// length is read into room made once for it, straight from the socket. `Ok(false)`: the
/// client went away.
pub(crate) async fn read_whole(
    client: &mut Io,
    ahead: &mut Ahead,
    bound: usize,
    limits: &Limits,
) -> Result<bool, ClientError> {
    let Ahead {
        bytes,
        rest,
        leftover,
        room,
    } = ahead;
    let max_body = limits.max_request_body_bytes;
    let t = limits.request_body_timeout;
    match rest {
        Rest::Done => Ok(true),
        Rest::Length(left) => {
            let whole = bytes.len() as u64 + *left;
            let whole = usize::try_from(whole).unwrap_or(usize::MAX);
            if whole > bound || !room.get_or_insert(Room(0)).grow(whole) {
                return Ok(true);
            }
            bytes.reserve(whole - bytes.len());
            while bytes.len() < whole {
                // Straight into the room made (no scratch buffer between).
                if !within(t, client.read_buf(bytes)).await? {
                    return Ok(false);
                }
            }
            *leftover = bytes.split_off(whole);
            *rest = Rest::Done;
            Ok(true)
        }
        Rest::Chunked(decoder) => {
            let mut read = BytesMut::new();
            let held = room.get_or_insert(Room(0));
            if !held.grow(bytes.len()) {
                return Ok(true); // the read-ahead's bytes, held from now on too
            }
            while bytes.len() <= bound {
                if !within(t, read_more(client, &mut read)).await? {
                    return Ok(false);
                }
                let before = bytes.len();
                let used = decoder
                    .feed(&read, |p| bytes.extend_from_slice(p))
                    .map_err(|_| ClientError::BadChunk)?;
                read.advance(used);
                // Past what is left of the room, the rest streams (this read's bytes held).
                let roomy = held.grow(bytes.len() - before);
                if bytes.len() as u64 > max_body {
                    return Err(ClientError::BodyTooLarge);
                }
                if decoder.done() {
                    *leftover = read;
                    *rest = Rest::Done;
                    return Ok(true);
                }
                read.clear(); // all of it was fed
                if !roomy {
                    break;
                }
            }
            Ok(true)
        }
    }
}

/// A read of the body's rest within the body timeout: whether it brought bytes.
async fn within(
    t: std::time::Duration,
    read: impl std::future::Future<Output = std::io::Result<usize>>,
) -> Result<bool, ClientError> {
    match tokio::time::timeout(t, read).await {
        Ok(Ok(n)) => Ok(n > 0),
        Ok(Err(_)) => Ok(false),
        Err(_) => Err(ClientError::BodyTimeout),
    }
}

/// Reads more of the client's bytes onto `read`; false at its end or on an error.
async fn more(client: &mut Io, read: &mut BytesMut) -> bool {
    matches!(read_more(client, read).await, Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Room for bodies read whole is taken while there is some, and given back with the
    /// last of a body's bytes.
    #[test]
    fn room_for_whole_bodies_is_bounded_and_given_back() {
        let mut room = Room(0);
        assert!(!room.grow(WHOLE_BODIES_BYTES + 1), "more than all of it");
        assert!(room.grow(1000));
        let held = WHOLE_HELD.load(Relaxed);
        let bytes = Ahead::into_bytes(BytesMut::from(&b"body"[..]), Some(room));
        let copy = bytes.clone();
        drop(bytes);
        assert_eq!(WHOLE_HELD.load(Relaxed), held, "a copy still holds it");
        assert_eq!(&copy[..], b"body");
        drop(copy);
        assert_eq!(WHOLE_HELD.load(Relaxed), held - 1000);
    }

    fn head(raw: &str) -> Result<Checked, ClientError> {
        match RequestHead::read(&mut BytesMut::from(raw)) {
            crate::service::http1::Head::Complete(req, _) => check(req, 1000),
            _ => Err(ClientError::BadHead),
        }
    }

    #[test]
    fn heads_are_checked_as_rfc_9112_asks() {
        let ok = |raw: &str| head(raw).map(|c| c.body);
        assert_eq!(ok("GET / HTTP/1.1\r\nHost: a\r\n\r\n"), Ok(BodyKind::None));
        assert_eq!(ok("GET / HTTP/1.0\r\n\r\n"), Ok(BodyKind::None));
        assert_eq!(
            ok("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n"),
            Ok(BodyKind::Length(3))
        );
        assert_eq!(
            ok("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Ok(BodyKind::Chunked)
        );
        let bad = |raw: &str| head(raw).err();
        for (raw, want) in [
            ("GET / HTTP/1.1\r\n\r\n", ClientError::Host),
            ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", ClientError::Host),
            ("GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", ClientError::Host),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                ClientError::BadLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +3\r\n\r\n",
                ClientError::BadLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                ClientError::AmbiguousLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                ClientError::UnsupportedCoding,
            ),
            (
                "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                ClientError::UnsupportedCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1001\r\n\r\n",
                ClientError::BodyTooLarge,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nExpect: magic\r\n\r\n",
                ClientError::Expectation,
            ),
            ("CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n", ClientError::Connect),
            ("GET /a\x01b HTTP/1.1\r\nHost: a\r\n\r\n", ClientError::BadHead),
            ("GET /a\x7fb HTTP/1.1\r\nHost: a\r\n\r\n", ClientError::BadHead),
        ] {
            assert_eq!(bad(raw), Some(want), "{raw:?}");
        }
    }

    #[test]
    fn strict_chunks_refuse_every_bare_line_end() {
        let decode = |body: &[u8]| {
            let mut c = Chunked::strict();
            let mut got = Vec::new();
            c.feed(body, |p| got.extend_from_slice(p))
                .ok()
                .filter(|_| c.done())
                .map(|_| got)
        };
        assert_eq!(
            decode(b"2;a=b;c=\"d e\"\r\nhi\r\n1 ;x\r\n!\r\n0\r\nT: 1\r\n\r\n").as_deref(),
            Some(&b"hi!"[..])
        );
        let long_ext = format!("1;{}\r\nx\r\n0\r\n\r\n", "a".repeat(9000));
        let long_trailer = format!("1\r\nx\r\n0\r\nT: {}\r\n\r\n", "a".repeat(9000));
        let many_trailers = format!("1\r\nx\r\n0\r\n{}\r\n", "T: 1\r\n".repeat(3000));
        for bad in [
            long_ext.as_bytes(),
            long_trailer.as_bytes(),
            many_trailers.as_bytes(),
            &b"2;\nxx\r\n28\r\n0\r\n\r\n"[..], // the smuggling differential
            b"2\nhi\r\n0\r\n\r\n",
            b"2\r\nhi\n0\r\n\r\n",
            b"2\r\nhi\r\n0\n\r\n",
            b"2\r\nhi\r\n0\r\n\n",
            b"2\r\nhi\r\n0\r\nT: 1\n\r\n",
            b"2;a\rb\r\nhi\r\n0\r\n\r\n",
            b"2;a\x00\r\nhi\r\n0\r\n\r\n",
            b"2 \r\nhi\r\n0\r\n\r\n",
            b"\r\n",
        ] {
            let shown = String::from_utf8_lossy(&bad[..bad.len().min(40)]).into_owned();
            assert_eq!(decode(bad), None, "{shown:?}… ({} bytes)", bad.len());
        }
    }
}
