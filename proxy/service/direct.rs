//! The direct streaming path: a metered generation request proxied by one loop of
//! tokentap's own, on pingora's connection pool and HTTP/1 sessions.
//!
//! pingora-proxy runs every request as an upstream half and a downstream half that hand
//! each body fragment over a channel, through its cache, module and range machinery; for a
//! token stream that is most of the proxy's CPU per event and a re-scheduling per event
//! (README, "Against nginx"). Here one task reads a fragment from the upstream session,
//! meters it and writes it to the client session, nothing in between.
//!
//! It takes only what it can do exactly as pingora-proxy would: an HTTP/1.1 request
//! without `Upgrade` whose body (`Content-Length`, at most 64 KiB) was already read whole.
//! The upstream request is the client's minus its hop-by-hop fields, with the upstream's
//! `Host` and the length of the body actually sent, so framing cannot be smuggled. The
//! response is forwarded as pingora-proxy forwards it (pingora's server session sets
//! `Date`, `Connection` and the framing), through the same filters. Everything else, and
//! everything when `server.direct_streaming = false`, goes through pingora-proxy.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::protocols::http::client::HttpSession as UpstreamSession;
use pingora::protocols::http::ServerSession;
use pingora::proxy::{ProxyHttp, Session};
use tokio::time::Instant;

use super::{Ctx, TokenTap, HOST};
use crate::routing::Choice;

/// Whether a request can take the direct path (its body is checked separately): HTTP/1.1,
/// origin-form (an absolute-form target's authority would need reconciling with `Host`,
/// which pingora-proxy does), no `Upgrade`.
pub(super) fn eligible(req: &RequestHeader) -> bool {
    req.version == http::Version::HTTP_11
        && req.raw_path().first() == Some(&b'/')
        && !req.headers.contains_key(header::UPGRADE)
}

/// Hop-by-hop fields (RFC 9110 §7.6.1, and the obsolete ones proxies still meet), never
/// forwarded; the fields the client's `Connection` names are removed too.
const HOP_BY_HOP: [&str; 11] = [
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
    "expect",
];

/// Attempts at connecting: a connect that failed in a way pingora marks retryable is tried
/// once more. A request that was sent is never sent again (a generation would run twice),
/// as on pingora-proxy's path and nginx's default for POST.
const ATTEMPTS: usize = 2;

// === impl TokenTap ===

impl TokenTap {
    /// Proxies the request whose whole body is `body` (the client's; the rewritten one from
    /// `ctx` when usage is injected). An error before the response header reached the
    /// client answers 502 (pingora's error path); after, the connection is cut, as
    /// pingora-proxy does.
    pub(super) async fn stream_through(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        body: Bytes,
    ) -> Result<()> {
        let choice = ctx
            .choice
            .ok_or_else(|| Error::explain(InternalError, "no upstream chosen"))?;
        let peer = &self.shared.peers[choice.upstream];
        let body = ctx.rewritten_body.clone().unwrap_or(body);
        let req = self.upstream_request(session.req_header(), choice, body.len())?;
        ctx.stream = Some(self.shared.meters[choice.upstream].begin(ctx.t0, self.now()));

        let mut watch = true;
        // Boxed: connecting (TCP, TLS, the pool) is a large future, needed only until the
        // response header; kept inline, every open stream would hold its space.
        let send = Box::pin(self.send(&req, &body, choice));
        let mut up = watching(session.as_mut(), &mut watch, send).await?;
        let mut resp = match up.response_header() {
            Some(r) => r.clone(),
            None => return Error::e_explain(InternalError, "no upstream response header"),
        };
        // As pingora-proxy: a body without a length (HTTP/1.0 style, ended by close) goes on
        // chunked, so the client connection survives it.
        let no_body = matches!(resp.status.as_u16(), 204 | 304);
        if !no_body
            && !resp.headers.contains_key(header::TRANSFER_ENCODING)
            && !resp.headers.contains_key(header::CONTENT_LENGTH)
        {
            resp.set_version(http::Version::HTTP_11);
            resp.insert_header(header::TRANSFER_ENCODING, "chunked")?;
        }
        self.response_filter(session, &mut resp, ctx).await?;
        session
            .write_response_header(Box::new(resp), false)
            .await
            .map_err(|e| e.into_down())?;

        // The read timeout, kept lazily: pingora's arms a timer on every read; here one timer
        // runs per timeout period and, when it fires, checks the time of the last fragment.
        let read_timeout = peer.options.read_timeout;
        up.set_read_timeout(None);
        let mut last = Instant::now();
        let timer = tokio::time::sleep(read_timeout.unwrap_or(Duration::MAX / 4));
        tokio::pin!(timer);
        loop {
            let mut chunk = tokio::select! {
                biased;
                chunk = watching(session.as_mut(), &mut watch, up.read_response_body()) => chunk?,
                () = &mut timer, if read_timeout.is_some() => {
                    let deadline = last + read_timeout.unwrap_or_default();
                    if Instant::now() >= deadline {
                        return Error::e_explain(ReadTimedout, "reading the upstream response body")
                            .map_err(|e| e.into_up());
                    }
                    timer.as_mut().reset(deadline);
                    continue;
                }
            };
            let end = chunk.is_none() || up.response_done();
            self.upstream_response_body_filter(session, &mut chunk, end, ctx)?;
            session
                .write_response_body(chunk, end)
                .await
                .map_err(|e| e.into_down())?;
            // After the write: time spent on a slow client is not upstream silence.
            last = Instant::now();
            if end {
                break;
            }
        }
        self.shared
            .connector
            .release_http_session(up, peer, peer.options.idle_timeout)
            .await;
        Ok(())
    }

    /// The request as the upstream gets it.
    fn upstream_request(
        &self,
        client: &RequestHeader,
        choice: Choice,
        body_len: usize,
    ) -> Result<RequestHeader> {
        let mut req = client.clone();
        let named: Vec<HeaderName> = req
            .headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::try_from(t.trim()).ok())
            .collect();
        for name in named.iter().chain(&HOP_BY_HOP.map(HeaderName::from_static)) {
            req.remove_header(name);
        }
        let host = &self.shared.config.upstreams[choice.upstream].host_header;
        req.insert_header(HOST, host.as_str())?;
        req.insert_header(header::CONTENT_LENGTH, body_len.to_string())?;
        Ok(req)
    }

    /// Sends the request and reads the response header (past any 1xx).
    async fn send(
        &self,
        req: &RequestHeader,
        body: &Bytes,
        choice: Choice,
    ) -> Result<UpstreamSession> {
        let peer = &self.shared.peers[choice.upstream];
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut up = match self.shared.connector.get_http_session(peer).await {
                Ok((up, _reused)) => up,
                Err(mut e) => {
                    e.retry.decide_reuse(false);
                    if e.retry() && attempt < ATTEMPTS {
                        continue;
                    }
                    return Err(e.into_up());
                }
            };
            up.set_read_timeout(peer.options.read_timeout);
            up.set_write_timeout(peer.options.write_timeout);
            return match exchange(&mut up, req, body).await {
                Ok(()) => Ok(up),
                Err(e) => Err(e.into_up()),
            };
        }
    }
}

/// Writes the request and reads the response header, skipping informational responses.
async fn exchange(up: &mut UpstreamSession, req: &RequestHeader, body: &Bytes) -> Result<()> {
    up.write_request_header(Box::new(req.clone())).await?;
    up.write_request_body(body.clone(), true).await?;
    up.finish_request_body().await?;
    loop {
        up.read_response_header().await?;
        match up.response_header().map(|r| r.status) {
            Some(s) if s == http::StatusCode::SWITCHING_PROTOCOLS => {
                return Error::e_explain(InvalidHTTPHeader, "101 to a request without Upgrade");
            }
            Some(s) if s.is_informational() => continue,
            _ => return Ok(()),
        }
    }
}

/// Runs `work` while watching the client: a client that goes away ends it with a downstream
/// error (so does a client that sends bytes after its request, unless pipelining is on:
/// then pingora keeps them for the next request and the watching stops for good).
async fn watching<T>(
    downstream: &mut ServerSession,
    watch: &mut bool,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    if !*watch {
        return work.await.map_err(|e| e.into_up());
    }
    tokio::pin!(work);
    tokio::select! {
        biased;
        done = &mut work => done.map_err(|e| e.into_up()),
        gone = downstream.read_body_or_idle(true) => match gone {
            Err(e) => Err(e.into_down()),
            Ok(_) => {
                *watch = false;
                work.await.map_err(|e| e.into_up())
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(target: &str, version: http::Version) -> RequestHeader {
        let mut r = RequestHeader::build("POST", target.as_bytes(), None)
            .unwrap_or_else(|_| unreachable!());
        r.set_version(version);
        r
    }

    #[test]
    fn eligibility() {
        assert!(eligible(&req(
            "/v1/chat/completions",
            http::Version::HTTP_11
        )));
        assert!(!eligible(&req(
            "/v1/chat/completions",
            http::Version::HTTP_10
        )));
        assert!(!eligible(&req(
            "http://h/v1/chat/completions",
            http::Version::HTTP_11
        )));
        let mut up = req("/v1/chat/completions", http::Version::HTTP_11);
        up.insert_header("upgrade", "websocket")
            .unwrap_or_else(|_| unreachable!());
        assert!(!eligible(&up));
    }
}
