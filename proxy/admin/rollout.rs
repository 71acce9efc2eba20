//! `GET /rollout` (each route's rollout: its state, share, evaluations and history) and
//! `POST /rollout/ROUTE` (a steer: `pause`, `resume`, `abort` or `promote`, as the body —
//! the word, or `{"action": "…"}` — or `?action=`). A steer is applied to the rollout in
//! force once its body has come, not to the one in force when its head came: a reload may
//! have replaced it meanwhile.

use std::time::Duration;

use http::{Response, StatusCode};
use pingora::protocols::http::ServerSession;

use super::query::bounded;
use super::{json_error, respond};
use crate::rollout::{ActError, Action};
use crate::state::{Live, Shared};

/// The longest steer body read.
const MAX_BODY: usize = 1024;

/// `GET /rollout`.
pub(super) fn list(shared: &Shared) -> Response<Vec<u8>> {
    let rollouts: Vec<_> = shared.rollouts.iter().map(|r| r.stats()).collect();
    match serde_json::to_vec_pretty(&serde_json::json!({ "rollouts": rollouts })) {
        Ok(body) => respond(StatusCode::OK, "application/json", body),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// `POST /rollout/ROUTE`: the steer read (its body bounded and timed), then applied to the
/// rollout live at that moment ([`Live::steer`]).
pub(super) async fn steer(live: &Live, session: &mut ServerSession) -> Response<Vec<u8>> {
    let req = session.req_header();
    let path = req.uri.path().to_owned();
    let query = req.uri.query().map(str::to_owned);
    let Some(route) = path.strip_prefix("/rollout/").map(decode) else {
        return json_error(StatusCode::NOT_FOUND, "POST /rollout/ROUTE");
    };
    let body = match read_body(session).await {
        Ok(b) => b,
        Err(resp) => {
            // What is left of the body is not drained: the connection closes.
            session.set_keepalive(None);
            return resp;
        }
    };
    let from_query = (query.as_deref().unwrap_or("").split('&'))
        .find_map(|kv| kv.strip_prefix("action="))
        .filter(|a| !a.is_empty())
        .map(str::to_owned);
    let text = String::from_utf8_lossy(&body);
    let from_body = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["action"].as_str().map(str::to_owned))
        .unwrap_or_else(|| text.trim().to_owned());
    let word = from_query.unwrap_or(from_body);
    let Some(action) = Action::parse(&word) else {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!(
                "unknown action `{}`: pause, resume, abort or promote",
                bounded(&word)
            ),
        );
    };
    match live.steer(&route, action) {
        Ok(stats) => match serde_json::to_vec_pretty(&stats) {
            Ok(body) => respond(StatusCode::OK, "application/json", body),
            Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        },
        Err(ActError::NoRollout) => json_error(
            StatusCode::NOT_FOUND,
            &format!("no rollout on a route named `{}`", bounded(&route)),
        ),
        Err(ActError::Refused(why)) => json_error(StatusCode::CONFLICT, &why),
    }
}

/// The request's body, at most [`MAX_BODY`] bytes, within 5 s.
async fn read_body(session: &mut ServerSession) -> Result<Vec<u8>, Response<Vec<u8>>> {
    let mut body = Vec::new();
    let read = async {
        while let Some(chunk) = session.read_request_body().await.ok().flatten() {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_BODY {
                return Err(json_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "a steer is one word: pause, resume, abort or promote",
                ));
            }
        }
        Ok(())
    };
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Ok(Ok(())) => Ok(body),
        Ok(Err(resp)) => Err(resp),
        Err(_) => Err(json_error(
            StatusCode::REQUEST_TIMEOUT,
            "the body did not arrive within 5 s",
        )),
    }
}

/// A path segment percent-decoded (`%2Fv1%2F` → `/v1/`); bytes that do not decode kept.
fn decode(s: &str) -> String {
    String::from_utf8_lossy(&crate::routing::path::percent_decode(s.as_bytes())).into_owned()
}
