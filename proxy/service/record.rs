//! What is written about a request when it ends: its id (the client's `x-request-id`, or
//! one tokentap makes), the failure line when it failed, and the access-log line.

use std::net::SocketAddr;

use crate::routing::Fields;
use serde::Serialize;

use super::failure::Failure;
use crate::meter::Summary;

/// The header a request's id travels in, both ways.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The longest client request id kept; a longer or odd one is replaced by tokentap's.
const MAX_CLIENT_ID: usize = 128;

/// A request's id: the client's `x-request-id`, or one tokentap made (a random UUID, v4),
/// as it goes on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RequestId {
    /// The client's.
    Given(Box<str>),
    /// tokentap's, its text kept in place: no allocation a request.
    Ours([u8; uuid::fmt::Hyphenated::LENGTH]),
}

impl Default for RequestId {
    /// None (an upgrade's): empty.
    fn default() -> Self {
        RequestId::Given(Box::default())
    }
}

impl RequestId {
    /// The client's id when it sent a usable one (1–128 visible ASCII characters), else a
    /// new one.
    pub(crate) fn of(headers: &(impl Fields + ?Sized)) -> RequestId {
        match headers.first(REQUEST_ID_HEADER) {
            Some(id)
                if (1..=MAX_CLIENT_ID).contains(&id.len())
                    && id.iter().all(|b| b.is_ascii_graphic()) =>
            {
                // Visible ASCII is UTF-8.
                RequestId::Given(String::from_utf8_lossy(id).into())
            }
            _ => RequestId::Ours(new_id()),
        }
    }

    /// Whether tokentap made it (and so must add it to the upstream request).
    pub(crate) fn is_ours(&self) -> bool {
        matches!(self, RequestId::Ours(_))
    }

    /// Empty for a request that got none (an upgrade).
    pub(crate) fn as_str(&self) -> &str {
        match self {
            RequestId::Given(id) => id,
            // A UUID's text is ASCII.
            RequestId::Ours(text) => std::str::from_utf8(text).unwrap_or_default(),
        }
    }
}

/// A new request id: a random (version 4) UUID, as Envoy makes for `x-request-id`, since
/// servers that check the header (Starlette's `starlette-context`, under llama.cpp's Python
/// server among others) refuse anything else. Its 122 random bits come from the thread's
/// ChaCha generator, seeded from the OS once and reseeded every 64 KiB it gives: no system
/// call per id, and two ids from any threads or starts are the same only by a chance of
/// about 1 in 10^19 among a billion. Its text, hyphenated and in lower case.
fn new_id() -> [u8; uuid::fmt::Hyphenated::LENGTH] {
    let uuid = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    uuid.hyphenated().encode_lower(&mut text);
    text
}

/// What the access log needs of a request beyond its ctx, gathered only when it is on.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// A standard method is kept without an allocation.
    pub(crate) method: http::Method,
    /// Without the query.
    pub(crate) path: String,
    pub(crate) client: Option<SocketAddr>,
    /// The request body's `model`, at most 128 characters.
    pub(crate) model: Option<String>,
    pub(crate) queue_ms: f64,
    pub(crate) summary: Option<Summary>,
    pub(crate) stream: bool,
}

/// One access-log line (every field always present; `null` when unknown).
#[derive(Serialize)]
pub(crate) struct Line<'a> {
    pub(crate) ts: String,
    pub(crate) request_id: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    pub(crate) upstream: Option<&'a str>,
    /// The endpoint of its pool it went to.
    pub(crate) endpoint: Option<&'a str>,
    pub(crate) route: Option<&'a str>,
    pub(crate) status: Option<u16>,
    pub(crate) outcome: &'a str,
    pub(crate) cause: Option<&'a str>,
    pub(crate) dialect: Option<&'a str>,
    pub(crate) model: Option<&'a str>,
    pub(crate) stream: bool,
    pub(crate) queue_ms: f64,
    pub(crate) ttft_ms: Option<f64>,
    pub(crate) tpot_ms: Option<f64>,
    pub(crate) e2e_ms: f64,
    pub(crate) input_tokens: Option<u64>,
    pub(crate) output_tokens: Option<u64>,
    pub(crate) counts: Option<&'a str>,
    pub(crate) bytes_out: u64,
    pub(crate) client: Option<String>,
}

/// The body's top-level `model`, cut to 128 characters. The body may be only the start of
/// one (a large body is read ahead 64 KiB): the object's members are read in order up to
/// `model`, and what follows is never looked at.
pub(crate) fn model_of(body: &[u8]) -> Option<String> {
    use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};

    struct Model<'a>(&'a mut Option<String>);
    impl<'de> Visitor<'de> for Model<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == "model" {
                    *self.0 = map.next_value::<Option<String>>()?;
                    return Ok(());
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }
    }
    let mut found = None;
    // Stopping at `model` leaves the object unfinished, which serde_json reports as an
    // error; what was found stands.
    let _ = serde_json::Deserializer::from_slice(body).deserialize_map(Model(&mut found));
    found.map(|m| m.chars().take(128).collect())
}

/// The RFC 3339 time now, in ms.
pub(crate) fn timestamp() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Logs a failed request: one line with its id, upstream and cause, at most one a second
/// per upstream and cause (the next says how many were held back). A client that went away
/// is an ordinary event (debug); everything else is a warning.
pub(crate) fn log_failure(
    throttle: &crate::logs::Throttle,
    id: &RequestId,
    upstream: &str,
    endpoint: Option<&str>,
    f: &Failure,
) {
    let request_id = id.as_str();
    if f.cause == "client_gone" {
        tracing::debug!(request_id, upstream, cause = f.cause, "{}", f.message);
        return;
    }
    let Some(held) = throttle.admit(upstream, f.cause) else {
        return;
    };
    let status = (f.status > 0).then_some(f.status);
    let similar_held_back = (held > 0).then_some(held);
    tracing::warn!(
        request_id,
        upstream,
        endpoint,
        cause = f.cause,
        status,
        similar_held_back,
        "{}",
        f.message
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    #[test]
    fn a_client_id_is_kept_when_it_is_plain_and_short() {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID_HEADER, "abc-123".parse().unwrap());
        assert_eq!(RequestId::of(&h).as_str(), "abc-123");
        assert!(!RequestId::of(&h).is_ours());
        h.insert(REQUEST_ID_HEADER, "a b".parse().unwrap());
        assert!(RequestId::of(&h).is_ours());
        h.insert(REQUEST_ID_HEADER, "x".repeat(129).parse().unwrap());
        assert!(RequestId::of(&h).is_ours());
        let (a, b) = (
            RequestId::of(&HeaderMap::new()),
            RequestId::of(&HeaderMap::new()),
        );
        assert_ne!(a, b);
        assert!(a.is_ours() && b.is_ours());
    }

    /// The ids tokentap makes are version 4 UUIDs in their hyphenated lower-case form, and
    /// none repeats across threads.
    #[test]
    fn our_ids_are_uuid_v4_and_unique_across_threads() {
        const THREADS: usize = 4;
        const EACH: usize = 50_000;
        let ids: Vec<Vec<String>> = std::thread::scope(|s| {
            let text = || RequestId::Ours(new_id()).as_str().to_owned();
            let made: Vec<_> = (0..THREADS)
                .map(|_| s.spawn(move || (0..EACH).map(|_| text()).collect::<Vec<_>>()))
                .collect();
            made.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let mut seen = std::collections::HashSet::new();
        for id in ids.iter().flatten() {
            let uuid = uuid::Uuid::parse_str(id).unwrap();
            assert_eq!(uuid.get_version(), Some(uuid::Version::Random), "{id}");
            assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
            assert_eq!(uuid.hyphenated().to_string(), *id, "lower case, hyphenated");
            assert!(seen.insert(id.clone()), "{id} made twice");
        }
        assert_eq!(seen.len(), THREADS * EACH);
    }

    #[test]
    fn the_model_is_read_and_bounded() {
        assert_eq!(
            model_of(br#"{"messages":[],"model":"llama"}"#),
            Some("llama".into())
        );
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(300));
        assert_eq!(model_of(long.as_bytes()).map(|m| m.len()), Some(128));
        assert_eq!(model_of(b"{broken"), None);
        // The start of a large body: read up to the model, never past it.
        assert_eq!(
            model_of(br#"{"stream":true,"model":"m","messages":[{"role":"user","content":"tru"#),
            Some("m".into())
        );
        assert_eq!(
            model_of(br#"{"messages":[{"content":"\"model\":\"x\""}]"#),
            None
        );
        assert_eq!(
            model_of(br#"{"messages":[{"model":"inner"}],"model":"outer"}"#),
            Some("outer".into())
        );
    }
}
