//! The answers tokentap makes itself, whole: an OpenAI-style JSON error body (so an SDK
//! raises its typed error with tokentap's message), written within the client write
//! timeout.

use std::time::Duration;

use bytes::{BufMut, BytesMut};

use super::conn::Io;
use super::io::write_within;
use super::request::ClientError;

/// The error body of a response tokentap makes itself (OpenAI's shape).
pub(crate) fn error_body(message: &str, kind: &str, code: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "code": code}}).to_string()
}

/// A whole response tokentap makes itself: a JSON body, `extra` fields, and `Connection`.
pub(crate) fn json_response(
    status: u16,
    body: &str,
    extra: &[(&str, &str)],
    keep_alive: bool,
) -> BytesMut {
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let mut out = BytesMut::with_capacity(256 + body.len());
    out.put_slice(format!("HTTP/1.1 {status} {reason}\r\n").as_bytes());
    out.put_slice(b"Content-Type: application/json\r\n");
    out.put_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    out.put_slice(b"Date: ");
    out.put_slice(pingora::protocols::http::date::get_cached_date().as_bytes());
    out.put_slice(b"\r\n");
    for (name, value) in extra {
        out.put_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    out.put_slice(if keep_alive {
        b"Connection: keep-alive\r\n\r\n".as_slice()
    } else {
        b"Connection: close\r\n\r\n".as_slice()
    });
    out.put_slice(body.as_bytes());
    out
}

/// Answers a client's mistake; the connection is closed after.
pub(crate) async fn refuse(client: &mut Io, e: ClientError, write_timeout: Duration) -> u64 {
    let body = error_body(&format!("tokentap: {e}"), "invalid_request_error", e.code());
    let out = json_response(e.status(), &body, &[], false);
    answer(client, &out, write_timeout).await
}

/// Writes a whole answer tokentap made, within the client write timeout; the bytes that
/// reached the client (none counted if the write failed).
pub(crate) async fn answer(client: &mut Io, bytes: &[u8], limit: Duration) -> u64 {
    match write_within(client, bytes, limit).await {
        Ok(()) => bytes.len() as u64,
        Err(_) => 0,
    }
}
