//! Active health checks: a GET of `health.path` on an endpoint, 2xx within the timeout.

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;

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
