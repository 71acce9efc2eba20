//! What is written about a request when it ends: its id (the client's `x-request-id`, or
//! one tokentap makes), the failure line when it failed, and the access-log line.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::routing::Fields;
use arrayvec::ArrayString;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
#[cfg(test)]
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
    Ours(ArrayString<{ uuid::fmt::Hyphenated::LENGTH }>),
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
            RequestId::Ours(text) => text,
        }
    }
}

/// A new request id: a random (version 4) UUID, as Envoy makes for `x-request-id`, since
/// servers that check the header (Starlette's `starlette-context`, under llama.cpp's Python
/// server among others) refuse anything else. Its 122 random bits come from the thread's
/// own generator (xoshiro256++, 256 bits of state seeded from the OS once a thread): no
/// system call per id, and two ids from any threads or starts are the same only by a chance
/// of about 1 in 10^19 among a billion. An id is a name, not a secret, so it need not be
/// unpredictable (ChaCha, as `rand::random`, cost ~240 instructions an id). Its text,
/// hyphenated and in lower case.
fn new_id() -> ArrayString<{ uuid::fmt::Hyphenated::LENGTH }> {
    thread_local! {
        static IDS: RefCell<SmallRng> = RefCell::new(SmallRng::from_entropy());
    }
    let bytes = IDS.with(|rng| rng.borrow_mut().gen());
    let uuid = uuid::Builder::from_random_bytes(bytes).into_uuid();
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let mut id = ArrayString::new();
    id.push_str(uuid.hyphenated().encode_lower(&mut text));
    id
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
    /// Set as it ends, kept for the stream's whole life: the four figures the line has
    /// of its record's [`Summary`] (48 bytes, not 88).
    pub(crate) metered: Option<Metered>,
    pub(crate) stream: bool,
}

/// What the access-log line says of a metered request's record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Metered {
    pub(crate) ttft_ms: Option<f64>,
    pub(crate) tpot_ms: Option<f64>,
    pub(crate) output_tokens: u64,
    pub(crate) exact: bool,
}

impl From<Summary> for Metered {
    fn from(s: Summary) -> Metered {
        Metered {
            ttft_ms: s.ttft_ms,
            tpot_ms: s.tpot_ms,
            output_tokens: s.output_tokens,
            exact: s.exact,
        }
    }
}

/// One access-log line (every field always present; `null` when unknown), written as
/// serde_json would write it (the tests hold the two to the same bytes), without its
/// general path: the keys are literals, a string with nothing to escape is copied whole,
/// and the time's text is made once a second.
#[cfg_attr(test, derive(Serialize))]
pub(crate) struct Line<'a> {
    pub(crate) ts: Timestamp,
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
    pub(crate) client: Option<SocketAddr>,
}

impl Line<'_> {
    /// Appends the line's JSON object (without a newline) to `out`.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"ts\":");
        self.ts.write(out);
        out.extend_from_slice(b",\"request_id\":");
        json::str(out, self.request_id);
        out.extend_from_slice(b",\"method\":");
        json::str(out, self.method);
        out.extend_from_slice(b",\"path\":");
        json::str(out, self.path);
        out.extend_from_slice(b",\"upstream\":");
        json::opt(out, self.upstream, json::str);
        out.extend_from_slice(b",\"endpoint\":");
        json::opt(out, self.endpoint, json::str);
        out.extend_from_slice(b",\"route\":");
        json::opt(out, self.route, json::str);
        out.extend_from_slice(b",\"status\":");
        json::opt(out, self.status, json::int);
        out.extend_from_slice(b",\"outcome\":");
        json::str(out, self.outcome);
        out.extend_from_slice(b",\"cause\":");
        json::opt(out, self.cause, json::str);
        out.extend_from_slice(b",\"dialect\":");
        json::opt(out, self.dialect, json::str);
        out.extend_from_slice(b",\"model\":");
        json::opt(out, self.model, json::str);
        out.extend_from_slice(if self.stream {
            b",\"stream\":true,\"queue_ms\":"
        } else {
            b",\"stream\":false,\"queue_ms\":"
        });
        json::float(out, self.queue_ms);
        out.extend_from_slice(b",\"ttft_ms\":");
        json::opt(out, self.ttft_ms, json::float);
        out.extend_from_slice(b",\"tpot_ms\":");
        json::opt(out, self.tpot_ms, json::float);
        out.extend_from_slice(b",\"e2e_ms\":");
        json::float(out, self.e2e_ms);
        out.extend_from_slice(b",\"input_tokens\":");
        json::opt(out, self.input_tokens, json::int);
        out.extend_from_slice(b",\"output_tokens\":");
        json::opt(out, self.output_tokens, json::int);
        out.extend_from_slice(b",\"counts\":");
        json::opt(out, self.counts, json::str);
        out.extend_from_slice(b",\"bytes_out\":");
        json::int(out, self.bytes_out);
        out.extend_from_slice(b",\"client\":");
        json::opt(out, self.client, json::addr);
        out.push(b'}');
    }
}

/// A line's time: written in RFC 3339, UTC, to the millisecond.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timestamp(pub(crate) SystemTime);

/// This thread's last second and its text up to the seconds (`2026-12-05T14:23:46`).
type Second = (u64, [u8; 19]);

thread_local! {
    static SECOND: Cell<Second> = const { Cell::new((u64::MAX, [0; 19])) };
}

impl Timestamp {
    pub(crate) fn now() -> Timestamp {
        Timestamp(SystemTime::now())
    }

    /// The quoted text chrono's `to_rfc3339_opts(Millis, true)` gives; the date and time
    /// are formatted once a second per thread, the milliseconds each time.
    fn write(self, out: &mut Vec<u8>) {
        let Ok(since) = self.0.duration_since(UNIX_EPOCH) else {
            return json::str(out, &self.chrono());
        };
        let secs = since.as_secs();
        let mut second = SECOND.get();
        if second.0 != secs {
            // `2026-12-05T14:23:46Z`: years 0–9999 only, the rest through chrono whole.
            let text =
                chrono::DateTime::<chrono::Utc>::from(UNIX_EPOCH + Duration::from_secs(secs))
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            let Some(head) = text.as_bytes().first_chunk().filter(|_| text.len() == 20) else {
                return json::str(out, &self.chrono());
            };
            second = (secs, *head);
            SECOND.set(second);
        }
        let ms = since.subsec_millis();
        out.push(b'"');
        out.extend_from_slice(&second.1);
        let digits = [
            b'0' + (ms / 100) as u8,
            b'0' + (ms / 10 % 10) as u8,
            b'0' + (ms % 10) as u8,
        ];
        out.push(b'.');
        out.extend_from_slice(&digits);
        out.extend_from_slice(b"Z\"");
    }

    fn chrono(self) -> String {
        chrono::DateTime::<chrono::Utc>::from(self.0)
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }
}

#[cfg(test)]
impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.chrono())
    }
}

/// JSON values written as serde_json writes them.
mod json {
    use std::io::Write as _;
    use std::net::SocketAddr;

    /// A string: copied whole when no byte needs an escape (one pass without a branch a
    /// byte, which the compiler vectorises), else through serde_json itself.
    pub(super) fn str(out: &mut Vec<u8>, s: &str) {
        let plain = s.bytes().fold(true, |plain, b| {
            plain & (b >= 0x20 && b != b'"' && b != b'\\')
        });
        if plain {
            out.push(b'"');
            out.extend_from_slice(s.as_bytes());
            out.push(b'"');
        } else {
            serde(out, s);
        }
    }

    pub(super) fn int(out: &mut Vec<u8>, n: impl itoa::Integer) {
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    }

    /// Through serde_json itself: its shortest round-trip form, `null` when not finite.
    pub(super) fn float(out: &mut Vec<u8>, f: f64) {
        serde(out, &f);
    }

    /// `value` as `write` writes it, or `null`.
    pub(super) fn opt<T>(out: &mut Vec<u8>, value: Option<T>, write: fn(&mut Vec<u8>, T)) {
        match value {
            Some(v) => write(out, v),
            None => out.extend_from_slice(b"null"),
        }
    }

    fn serde(out: &mut Vec<u8>, value: &(impl serde::Serialize + ?Sized)) {
        if serde_json::to_writer(&mut *out, value).is_err() {
            out.extend_from_slice(b"null"); // not reached: a Vec takes every write
        }
    }

    /// As its `Display` (serde's form for an address): an IPv4 one digit by digit.
    pub(super) fn addr(out: &mut Vec<u8>, addr: SocketAddr) {
        out.push(b'"');
        match addr {
            SocketAddr::V4(v4) => {
                let [a, b, c, d] = v4.ip().octets();
                for (i, octet) in [a, b, c, d].into_iter().enumerate() {
                    if i > 0 {
                        out.push(b'.');
                    }
                    int(out, octet);
                }
                out.push(b':');
                int(out, v4.port());
            }
            SocketAddr::V6(v6) => {
                let _ = write!(out, "{v6}"); // a Vec takes every write
            }
        }
        out.push(b'"');
    }
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

    /// A string of the characters that matter to JSON: controls, quotes, backslashes,
    /// DEL, multi-byte characters and plain text.
    fn odd_string(rng: &mut impl rand::Rng) -> String {
        const PIECES: &[&str] = &[
            "a",
            "Z",
            "/",
            "\"",
            "\\",
            "\n",
            "\r",
            "\t",
            "\u{8}",
            "\u{c}",
            "\u{0}",
            "\u{1f}",
            "\u{7f}",
            "é",
            "\u{2028}",
            "🦀",
            " ",
            "v1/chat/completions",
            "{}",
            ":",
        ];
        let len = rng.gen_range(0..24);
        (0..len)
            .map(|_| PIECES[rng.gen_range(0..PIECES.len())])
            .collect()
    }

    fn odd_float(rng: &mut impl rand::Rng) -> f64 {
        match rng.gen_range(0..8) {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => -0.0,
            3 => f64::MIN_POSITIVE / 3.0,
            4 => rng.gen::<f64>() * 1e21,
            5 => f64::from(rng.gen_range(0u32..100_000)) / 1e3,
            _ => rng.gen::<f64>() * 1e4,
        }
    }

    /// The line is the bytes serde_json writes for the same fields, over many odd ones.
    #[test]
    fn a_line_is_what_serde_json_writes() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(48);
        let addrs: [SocketAddr; 4] = [
            "10.0.0.7:53254".parse().unwrap(),
            "0.0.0.0:0".parse().unwrap(),
            "[::1]:8080".parse().unwrap(),
            "[fe80::1%3]:65535".parse().unwrap(),
        ];
        let mut out = Vec::new();
        for _ in 0..20_000 {
            let strings: Vec<String> = (0..10).map(|_| odd_string(&mut rng)).collect();
            let maybe = |rng: &mut rand::rngs::SmallRng, i: usize| {
                rng.gen_bool(0.7).then_some(strings[i].as_str())
            };
            let secs = rng.gen_range(0..253_402_300_799u64); // to the end of year 9999
            let line = Line {
                ts: Timestamp(
                    UNIX_EPOCH + Duration::from_millis(secs * 1000 + rng.gen_range(0..1000)),
                ),
                request_id: &strings[0],
                method: &strings[1],
                path: &strings[2],
                upstream: maybe(&mut rng, 3),
                endpoint: maybe(&mut rng, 4),
                route: maybe(&mut rng, 5),
                status: rng.gen_bool(0.8).then(|| rng.gen()),
                outcome: &strings[6],
                cause: maybe(&mut rng, 7),
                dialect: maybe(&mut rng, 8),
                model: maybe(&mut rng, 9),
                stream: rng.gen(),
                queue_ms: odd_float(&mut rng),
                ttft_ms: rng.gen_bool(0.8).then(|| odd_float(&mut rng)),
                tpot_ms: rng.gen_bool(0.8).then(|| odd_float(&mut rng)),
                e2e_ms: odd_float(&mut rng),
                input_tokens: rng
                    .gen_bool(0.8)
                    .then(|| rng.gen::<u64>() >> rng.gen_range(0..64)),
                output_tokens: rng.gen_bool(0.8).then(|| rng.gen()),
                counts: maybe(&mut rng, 0),
                bytes_out: rng.gen(),
                client: rng
                    .gen_bool(0.8)
                    .then(|| addrs[rng.gen_range(0..addrs.len())]),
            };
            out.clear();
            line.write(&mut out);
            let want = serde_json::to_string(&line).unwrap();
            assert_eq!(String::from_utf8_lossy(&out), want);
        }
    }

    /// The time's text, made once a second, is chrono's to the millisecond, across a
    /// second's turn, a day's and a year's.
    #[test]
    fn the_time_is_chronos_across_seconds() {
        let mut out = Vec::new();
        let start = UNIX_EPOCH + Duration::from_secs(1_798_761_599); // 2026-12-31T23:59:59Z
        for ms in (0..3_000).step_by(7) {
            let t = Timestamp(start + Duration::from_millis(ms));
            out.clear();
            t.write(&mut out);
            assert_eq!(String::from_utf8_lossy(&out), format!("\"{}\"", t.chrono()));
        }
        assert!(
            t_text(start + Duration::from_millis(1_500)).starts_with("\"2027-01-01T00:00:00.500Z")
        );
        // Before 1970, and past year 9999: chrono's whole.
        for t in [
            UNIX_EPOCH - Duration::from_millis(1_500),
            UNIX_EPOCH + Duration::from_secs(253_402_300_800),
        ] {
            assert_eq!(t_text(t), format!("\"{}\"", Timestamp(t).chrono()));
        }
    }

    fn t_text(t: SystemTime) -> String {
        let mut out = Vec::new();
        Timestamp(t).write(&mut out);
        String::from_utf8(out).unwrap()
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
