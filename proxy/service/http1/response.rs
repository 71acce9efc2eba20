//! The response head as the upstream sends it and as the client gets it: read past any
//! 1xx within its deadline (the client watched meanwhile), and the client's framing decided
//! from the response's and the request's side ([`to_client`]).

use std::future::{poll_fn, Future};
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use pingora::prelude::*;

use super::body::BodyFraming;
use super::conn::Io;
use super::head::ResponseHead;
use super::io::{poll_client_gone, poll_read_with, up_err, up_io};
use super::{line_ends, Head, MAX_RESPONSE_HEAD};

/// How the client gets the response body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ToClient {
    /// The upstream's bytes as they came.
    AsIs,
    /// Chunks tokentap frames (usage stripped, or an upstream body ended by close).
    Chunked,
    /// The payload alone, ended by closing the connection (an HTTP/1.0 client).
    Close,
}

/// Reads the response header, past any 1xx, while watching the client (see [`watching`]);
/// hands it, the body bytes read with it and whether its lines ended in a bare LF (a server
/// that ends its chunk lines so too) to `then`, with whether the client is still watched
/// and sent nothing more. A head that comes in one read (the usual case) is parsed in the
/// thread's scratch buffer, and the bytes after it are given from there: only a head split
/// across reads is gathered into a buffer of its own. The first byte of a head must come
/// within `read_timeout`, and the rest of it within `read_timeout` of that byte (a 504).
/// A request with no client (a mirror's copy) passes `None`.
pub(crate) async fn read_response_head<T>(
    up: &mut Io,
    mut client: Option<(&mut Io, &mut bool, &mut BytesMut)>,
    read_timeout: Option<Duration>,
    then: impl FnOnce(ResponseHead, &[u8], bool, bool) -> Result<T>,
) -> Result<T> {
    let mut then = Some(then);
    let mut buf = BytesMut::new();
    let mut head_begun = false;
    // Pinned where it is made.
    let mut timer = std::pin::pin!(tokio::time::sleep(
        read_timeout.unwrap_or(Duration::MAX / 4)
    ));
    poll_fn(|cx| loop {
        let watched = client
            .as_ref()
            .is_some_and(|(_, watch, leftover)| leftover.is_empty() && **watch);
        let mut found = |bytes: &[u8], at: usize, resp, bare_lf| match then.take() {
            Some(then) => then(resp, &bytes[at..], bare_lf, watched).map(Some),
            None => Err(Error::explain(InternalError, "response header read twice")),
        };
        let read = poll_read_with(up, cx, |data, _| {
            if data.is_empty() {
                return Err(up_err(
                    ConnectionClosed,
                    "upstream closed before its header",
                ));
            }
            if buf.is_empty() {
                match find_head(data)? {
                    Found::Head(resp, at, bare_lf) => return found(data, at, resp, bare_lf),
                    Found::Partial(at) => buf.extend_from_slice(&data[at..]),
                }
            } else {
                buf.extend_from_slice(data);
                match find_head(&buf)? {
                    Found::Head(resp, at, bare_lf) => return found(&buf, at, resp, bare_lf),
                    Found::Partial(at) => buf.advance(at),
                }
            }
            Ok(None)
        });
        match read {
            Poll::Ready(Ok(Ok(Some(opened)))) => return Poll::Ready(Ok(opened)),
            Poll::Ready(Ok(Ok(None))) => {
                // Waiting for a head's first byte (a backend's prefill), each read has
                // `read_timeout`; once a head has begun, all of it must arrive within
                // `read_timeout` of its first byte, however it trickles.
                let begun = !buf.is_empty();
                if let (Some(t), false) = (read_timeout, begun && head_begun) {
                    timer.as_mut().reset(tokio::time::Instant::now() + t);
                }
                head_begun = begun;
                continue;
            }
            Poll::Ready(Ok(Err(e))) => return Poll::Ready(Err(e)),
            Poll::Ready(Err(e)) => return Poll::Ready(Err(up_io(ReadError, e))),
            Poll::Pending => {}
        }
        if let Some((client, watch, leftover)) = client.as_mut() {
            if let Some(gone) = poll_client_gone(client, cx, watch, leftover) {
                return Poll::Ready(Err(gone));
            }
        }
        if read_timeout.is_some() && timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(up_err(ReadTimedout, "reading the response header")));
        }
        return Poll::Pending;
    })
    .await
}

/// How the client gets a body framed by `framing`: `http10`, the client is HTTP/1.0;
/// `rewritten`, tokentap changes the body (a usage chunk taken out), so its length is not
/// the upstream's; `bare_lf`, the upstream ended its chunk lines with a bare LF (and no other
/// coding is under the chunks).
pub(crate) fn to_client(
    framing: BodyFraming,
    http10: bool,
    rewritten: bool,
    bare_lf: bool,
) -> ToClient {
    match framing {
        // RFC 9112 §7: an HTTP/1.0 client gets no chunks, but a body ended by close.
        BodyFraming::Chunked | BodyFraming::UntilClose if http10 => ToClient::Close,
        _ if rewritten && http10 => ToClient::Close,
        // As pingora-proxy: a body without a length goes on chunked, so the client
        // connection survives it; so does a body whose length stripping changes.
        BodyFraming::UntilClose => ToClient::Chunked,
        _ if rewritten => ToClient::Chunked,
        // Chunk lines ended by a bare LF are read, and framed again for the client.
        BodyFraming::Chunked if bare_lf => ToClient::Chunked,
        _ => ToClient::AsIs,
    }
}

/// What [`find_head`] found.
enum Found {
    /// The final head, the offset of the bytes after it, and whether a line of it ended in
    /// a bare LF.
    Head(ResponseHead, usize, bool),
    /// No final head yet: more is needed, from this offset on (past any whole 1xx heads).
    Partial(usize),
}

/// The final response head at the start of `bytes`, past any informational ones (the client
/// gets the final one).
fn find_head(bytes: &[u8]) -> Result<Found> {
    let mut at = 0;
    loop {
        let rest = &bytes[at..];
        match ResponseHead::parse(rest) {
            Head::Complete(resp, _) if resp.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                return Err(up_err(
                    InvalidHTTPHeader,
                    "101 to a request without Upgrade",
                ));
            }
            Head::Complete(mut resp, len) => {
                if !resp.status.is_informational() {
                    let ends = line_ends(&rest[..len]);
                    resp.copy_as(rest, len, ends.folded);
                    return Ok(Found::Head(resp, at + len, ends.bare_lf));
                }
                at += len;
            }
            Head::Invalid => return Err(up_err(InvalidHTTPHeader, "upstream response header")),
            Head::Partial if rest.len() > MAX_RESPONSE_HEAD => {
                return Err(up_err(
                    InvalidHTTPHeader,
                    "upstream response header too large",
                ))
            }
            Head::Partial => return Ok(Found::Partial(at)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client's framing for every shape of response body and client.
    #[test]
    fn the_client_s_framing_by_body_and_client() {
        use BodyFraming::*;
        use ToClient::{AsIs, Chunked as Chunks, Close};
        // (framing, HTTP/1.0 client, body rewritten, bare-LF chunk lines) → framing.
        let table = [
            (Empty, false, false, false, AsIs), // 204, 304, a HEAD's answer
            (Empty, true, false, false, AsIs),
            (Length(10), false, false, false, AsIs),
            (Length(10), true, false, false, AsIs),
            (Length(10), false, true, false, Chunks), // the usage chunk taken out
            (Length(10), true, true, false, Close),
            (Chunked, false, false, false, AsIs), // forwarded as it came
            (Chunked, true, false, false, Close), // RFC 9112 §7: no chunks for 1.0
            (Chunked, false, true, false, Chunks),
            (Chunked, false, false, true, Chunks), // bare-LF lines framed again
            (Chunked, true, false, true, Close),
            (UntilClose, false, false, false, Chunks), // kept alive, as pingora-proxy
            (UntilClose, true, false, false, Close),
            (UntilClose, false, true, false, Chunks),
        ];
        for (framing, http10, rewritten, bare_lf, want) in table {
            assert_eq!(
                to_client(framing, http10, rewritten, bare_lf),
                want,
                "{framing:?} http10={http10} rewritten={rewritten} bare_lf={bare_lf}"
            );
        }
    }

    fn found(raw: &[u8]) -> Result<(u16, usize, bool), String> {
        match find_head(raw) {
            Ok(Found::Head(resp, at, bare_lf)) => Ok((resp.status.as_u16(), at, bare_lf)),
            Ok(Found::Partial(at)) => Err(format!("partial from {at}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The final head past any 1xx, where its body starts, and a bare LF noticed.
    #[test]
    fn the_final_head_is_found_past_informational_ones() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi";
        assert_eq!(found(ok), Ok((200, ok.len() - 2, false)));
        let hints = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(found(hints), Ok((204, hints.len(), false)));
        assert_eq!(
            found(b"HTTP/1.1 200 OK\ncontent-length: 0\n\n"),
            Ok((200, 35, true))
        );
        // A whole 1xx and the start of the next: more is needed past the 1xx.
        let partial = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 2";
        assert_eq!(found(partial), Err("partial from 25".into()));
        assert_eq!(
            found(b"HTTP/1.1 200 OK\r\nx: y"),
            Err("partial from 0".into())
        );
        for bad in [
            &b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n"[..],
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"SMTP 220 hello\r\n\r\n",
        ] {
            assert!(
                found(bad).is_err_and(|e| !e.starts_with("partial")),
                "{bad:?}"
            );
        }
        let huge = [
            &b"HTTP/1.1 200 OK\r\nx: "[..],
            &vec![b'a'; MAX_RESPONSE_HEAD + 1],
        ]
        .concat();
        assert!(found(&huge).is_err_and(|e| e.contains("too large")));
    }
}
