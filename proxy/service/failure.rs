//! Why a request failed, named once for the client (the status and the error body's
//! `code`), the log line (the `cause`) and the access log (`outcome`).

use std::io;

use pingora::{Error, ErrorSource, ErrorType};

/// A failed request's cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    /// The log's name for it: `connect_refused`, `tls`, `read_timeout`, `client_stalled`…
    pub(super) cause: &'static str,
    /// The answer's status, when the client can still get one.
    pub(super) status: u16,
    /// The error body's `code`.
    pub(super) code: &'static str,
    /// What happened, in words (the log line; the error body's `message` after
    /// `tokentap: `).
    pub(super) message: String,
    /// The upstream's part in it: the client, not the upstream, ended the request.
    pub(super) client: bool,
}

/// What `e`, ending a request to `upstream`, means.
pub(super) fn of(e: &Error, upstream: &str) -> Failure {
    use ErrorType::*;
    let client = e.esource() == &ErrorSource::Downstream;
    let root = root_cause(e);
    let io_kind = e
        .root_cause()
        .downcast_ref::<io::Error>()
        .map(io::Error::kind);
    let (cause, status, code, message) = match e.etype() {
        _ if client => match e.etype() {
            WriteTimedout => (
                "client_stalled",
                0,
                "client_stalled",
                "the client took no response bytes for server.client_write_timeout_secs".into(),
            ),
            _ => (
                "client_gone",
                0,
                "client_gone",
                format!("the client went away ({root})"),
            ),
        },
        ConnectRefused => (
            "connect_refused",
            502,
            "upstream_connect_failed",
            format!("upstream {upstream} refused the connection"),
        ),
        ConnectTimedout => (
            "connect_timeout",
            504,
            "upstream_timeout",
            format!("connecting to upstream {upstream} timed out"),
        ),
        ConnectError | ConnectNoRoute | SocketError | BindError | ConnectProxyFailure => (
            "connect_failed",
            502,
            "upstream_connect_failed",
            format!("cannot connect to upstream {upstream}: {root}"),
        ),
        TLSHandshakeFailure | InvalidCert | HandshakeError | TLSWantX509Lookup => (
            "tls",
            502,
            "upstream_tls_error",
            format!("TLS with upstream {upstream} failed: {root}"),
        ),
        TLSHandshakeTimedout => (
            "tls",
            504,
            "upstream_timeout",
            format!("the TLS handshake with upstream {upstream} timed out"),
        ),
        ReadTimedout => (
            "read_timeout",
            504,
            "upstream_timeout",
            format!("upstream {upstream} sent nothing for its read_timeout_secs"),
        ),
        WriteTimedout => (
            "write_timeout",
            504,
            "upstream_timeout",
            format!("upstream {upstream} took no request bytes for its write_timeout_secs"),
        ),
        _ if io_kind == Some(io::ErrorKind::ConnectionReset) => (
            "reset",
            502,
            "upstream_reset",
            format!("upstream {upstream} reset the connection"),
        ),
        ConnectionClosed | ReadError | WriteError => (
            "closed",
            502,
            "upstream_closed",
            format!("upstream {upstream} closed the connection: {root}"),
        ),
        InvalidHTTPHeader | H1Error | InvalidH2 | H2Error => (
            "malformed_response",
            502,
            "upstream_protocol_error",
            format!("upstream {upstream} sent a malformed response ({root})"),
        ),
        _ => (
            "internal",
            500,
            "internal_error",
            format!("tokentap failed to proxy the request ({root})"),
        ),
    };
    Failure {
        cause,
        status,
        code,
        message,
        client,
    }
}

/// The innermost words of `e`: the I/O or TLS error at the bottom of its chain, else the
/// innermost context.
fn root_cause(e: &Error) -> String {
    let mut words = e.context.as_ref().map(|c| c.as_str().to_owned());
    let mut next: Option<&(dyn std::error::Error + 'static)> = match e.cause.as_deref() {
        Some(c) => Some(c),
        None => None,
    };
    while let Some(c) = next {
        next = match c.downcast_ref::<Error>() {
            Some(inner) => {
                if let Some(ctx) = &inner.context {
                    words = Some(ctx.as_str().to_owned());
                }
                match inner.cause.as_deref() {
                    Some(c) => Some(c),
                    None => None,
                }
            }
            // A wrapper (pingora's connect details) has its error as its source.
            None => match c.source() {
                Some(source) => Some(source),
                None => {
                    let said = c.to_string();
                    // pingora's connect details with nothing wrapped name only the local
                    // address; the handshake's error is in the context above.
                    if !said.starts_with("local address ") {
                        words = Some(said);
                    }
                    None
                }
            },
        };
    }
    words.unwrap_or_else(|| e.etype().as_str().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_name_what_happened() {
        let refused = Error::because(
            ErrorType::ConnectRefused,
            "connecting to 127.0.0.1:1",
            io::Error::from(io::ErrorKind::ConnectionRefused),
        )
        .into_up();
        let f = of(&refused, "a");
        assert_eq!(
            (f.cause, f.status, f.code),
            ("connect_refused", 502, "upstream_connect_failed")
        );
        assert_eq!(f.message, "upstream a refused the connection");

        let timeout = Error::explain(ErrorType::ReadTimedout, "reading").into_up();
        assert_eq!(of(&timeout, "a").status, 504);

        let reset = Error::because(
            ErrorType::ReadError,
            "upstream connection",
            io::Error::from(io::ErrorKind::ConnectionReset),
        )
        .into_up();
        assert_eq!(of(&reset, "a").cause, "reset");

        let stalled = Error::explain(ErrorType::WriteTimedout, "client").into_down();
        let f = of(&stalled, "a");
        assert!(f.client);
        assert_eq!(f.cause, "client_stalled");

        let tls = Error::because(
            ErrorType::TLSHandshakeFailure,
            "handshake",
            io::Error::other("invalid peer certificate: UnknownIssuer"),
        )
        .into_up();
        let f = of(&tls, "b");
        assert_eq!((f.cause, f.code), ("tls", "upstream_tls_error"));
        assert!(
            f.message
                .ends_with("invalid peer certificate: UnknownIssuer"),
            "{}",
            f.message
        );
    }
}
