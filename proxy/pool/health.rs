//! Active health checks: a GET of `health.path` on an endpoint, 2xx within the timeout.

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;

use std::sync::atomic::Ordering::Relaxed;

use super::{lock, Endpoint};
use crate::config::{EndpointAddr, HealthCheck};

/// Whether `at` answers its health check; `Err` says why not.
pub(super) async fn probe(at: &EndpointAddr, h: &HealthCheck) -> Result<(), String> {
    if at.tls {
        // Checked passively only: the check speaks plain HTTP.
        return Ok(());
    }
    let ask = async {
        let stream = tokio::net::TcpStream::connect(at.addr)
            .await
            .map_err(|e| format!("health check: cannot connect: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("health check: {e}"))?;
        tokio::spawn(conn);
        let req = http::Request::builder()
            .uri(h.path.as_str())
            .header(http::header::HOST, at.host_header.as_str())
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("health check: {e}"))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("health check: {e}"))?;
        match resp.status() {
            s if s.is_success() => Ok(()),
            s => Err(format!("health check answered {}", s.as_u16())),
        }
    };
    match tokio::time::timeout(h.timeout, ask).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "health check: no answer within {} ms",
            h.timeout.as_millis()
        )),
    }
}

// === impl Pool ===

impl super::Pool {
    /// An active check of `e` came back.
    pub(super) fn checked(&self, e: &Endpoint, h: &HealthCheck, result: Result<(), String>) {
        let mut c = lock(&e.checks);
        match result {
            Ok(()) => {
                c.failed = 0;
                c.ok = c.ok.saturating_add(1);
                if !e.healthy.load(Relaxed) && c.ok >= h.healthy_after {
                    e.healthy.store(true, Relaxed);
                    tracing::info!(upstream = %self.name, endpoint = %e.at.url, "endpoint healthy again");
                }
                if e.healthy.load(Relaxed) && c.down_while_ejected && e.ejected(self.clock.now()) {
                    // Its checks failed during the ejection and pass again (a replica
                    // restarted): it takes requests again at once. An ejection its checks
                    // never saw runs its length.
                    e.ejected_until.store(0, Relaxed);
                    c.down_while_ejected = false;
                    tracing::info!(upstream = %self.name, endpoint = %e.at.url, "endpoint passes its health check again after failing it while ejected: ejection ended");
                }
            }
            Err(cause) => {
                c.ok = 0;
                c.failed = c.failed.saturating_add(1);
                if e.ejected(self.clock.now()) {
                    c.down_while_ejected = true;
                }
                e.set_error(&cause);
                if e.healthy.load(Relaxed) && c.failed >= h.unhealthy_after {
                    e.healthy.store(false, Relaxed);
                    tracing::warn!(
                        upstream = %self.name,
                        endpoint = %e.at.url,
                        cause = %cause,
                        "endpoint unhealthy: {} failed health checks in a row",
                        c.failed
                    );
                }
            }
        }
    }
}
