//! Tenants: who a request belongs to (`[tenants] key`), its priority, its weight in the
//! fair queue ([`crate::limit::fair`]), its output-token budget ([`budget`]), and the
//! figures kept per tenant ([`book`]).
//!
//! A tenant is named by a header's value. A secret (`authorization`, an API key, a cookie)
//! or a value that is long or not plain text is never kept, logged or shown: it is reduced
//! to `key-` and the first 16 hex digits of its SHA-256, stable across restarts and
//! replicas, so that an override or a dashboard can name it.

pub mod book;
pub mod budget;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;

/// A tenant's name, as `/stats` shows it.
pub type Tenant = Arc<str>;

/// A tenant name's longest form (a longer header value is hashed).
pub const MAX_NAME: usize = 64;

/// The default of `tenants.ageing_ms`: how long a `normal` or `low` request may wait behind
/// higher bands before it is served first.
pub const AGEING_MS: u64 = 5000;

/// A request's priority band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    High = 0,
    #[default]
    Normal = 1,
    Low = 2,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// `high`, `normal` or `low` (any case, trimmed).
    pub fn parse(v: &[u8]) -> Option<Priority> {
        let v = v.trim_ascii();
        [
            (&b"high"[..], Priority::High),
            (b"normal", Priority::Normal),
            (b"low", Priority::Low),
        ]
        .into_iter()
        .find(|(name, _)| v.eq_ignore_ascii_case(name))
        .map(|(_, p)| p)
    }

    pub fn label(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

/// What a tenant is given: its weight, its priority when a request gives none, its budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Terms {
    pub weight: f64,
    pub priority: Option<Priority>,
    pub output_tokens_per_minute: Option<u64>,
}

/// `[tenants]` as the runtime takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantsConfig {
    pub key: Option<HeaderName>,
    pub priority: Option<HeaderName>,
    /// Every tenant's terms but those overridden.
    pub default: Terms,
    pub overrides: Vec<(String, Terms)>,
    pub ageing: Duration,
}

impl Default for TenantsConfig {
    fn default() -> Self {
        TenantsConfig {
            key: None,
            priority: None,
            default: Terms {
                weight: 1.0,
                priority: None,
                output_tokens_per_minute: None,
            },
            overrides: Vec::new(),
            ageing: Duration::from_millis(AGEING_MS),
        }
    }
}

impl TenantsConfig {
    /// Whether requests are told apart at all (a key, a priority, or a budget).
    pub fn any(&self) -> bool {
        self.key.is_some()
            || self.priority.is_some()
            || self.default.output_tokens_per_minute.is_some()
    }

    /// Whether any tenant has an output-token budget.
    pub fn budgets(&self) -> bool {
        self.default.output_tokens_per_minute.is_some()
            || (self.overrides.iter()).any(|(_, t)| t.output_tokens_per_minute.is_some())
    }
}

/// Who a request is, for the queue and the budgets.
#[derive(Debug, Clone, PartialEq)]
pub struct Who {
    pub tenant: Tenant,
    pub priority: Priority,
    pub weight: f64,
    /// Its tenant's output tokens a minute.
    pub budget: Option<u64>,
}

impl Default for Who {
    fn default() -> Self {
        Who {
            tenant: default_tenant(),
            priority: Priority::Normal,
            weight: 1.0,
            budget: None,
        }
    }
}

/// The tenant of a request without the key's header (and of every request without a key).
pub fn default_tenant() -> Tenant {
    // One for the process: its clones compare by pointer, not by their text.
    static DEFAULT: std::sync::LazyLock<Tenant> = std::sync::LazyLock::new(|| Arc::from("default"));
    Arc::clone(&DEFAULT)
}

/// Tells requests apart by `[tenants]`.
#[derive(Debug)]
pub struct Tenants {
    config: TenantsConfig,
    /// `key` holds a secret (its values hashed whatever they are).
    secret: bool,
    /// Where a bad priority header is counted.
    book: std::sync::Arc<book::Book>,
}

impl Tenants {
    pub fn new(config: TenantsConfig, book: std::sync::Arc<book::Book>) -> Tenants {
        let secret = config.key.as_ref().is_some_and(|k| {
            matches!(
                k.as_str(),
                "authorization" | "proxy-authorization" | "x-api-key" | "api-key" | "cookie"
            ) || k.as_str().contains("key")
                || k.as_str().contains("token")
                || k.as_str().contains("secret")
        });
        Tenants {
            config,
            secret,
            book,
        }
    }

    pub fn config(&self) -> &TenantsConfig {
        &self.config
    }

    /// Who a request with these headers is (`get`: a header's first value).
    pub fn who<'a>(&self, get: impl Fn(&str) -> Option<&'a [u8]>) -> Who {
        let c = &self.config;
        let tenant = match c.key.as_ref().and_then(|k| get(k.as_str())) {
            Some(v) if !v.trim_ascii().is_empty() => self.name(v.trim_ascii()),
            _ => default_tenant(),
        };
        let terms = (c.overrides.iter())
            .find(|(name, _)| **name == *tenant)
            .map_or(&c.default, |(_, t)| t);
        let asked = c.priority.as_ref().and_then(|h| get(h.as_str()));
        let priority = match asked.map(Priority::parse) {
            Some(Some(p)) => p,
            Some(None) => {
                self.book.invalid_priority.fetch_add(1, Relaxed);
                terms.priority.unwrap_or_default()
            }
            None => terms.priority.unwrap_or_default(),
        };
        Who {
            tenant,
            priority,
            weight: terms.weight,
            budget: terms.output_tokens_per_minute,
        }
    }

    /// A header value as a tenant's name: itself when it is short plain text, not a
    /// secret and not a name tokentap gives ([`reserved`]), else `key-` and its hash.
    fn name(&self, v: &[u8]) -> Tenant {
        let plain = v.len() <= MAX_NAME
            && !reserved(v)
            && v.iter()
                .all(|&b| b.is_ascii_alphanumeric() || b"-_.:@/".contains(&b));
        match std::str::from_utf8(v) {
            Ok(s) if plain && !self.secret => Arc::from(s),
            _ => Arc::from(hashed(v)),
        }
    }
}

/// The output tokens a request body asks for at most (`max_tokens`,
/// `max_completion_tokens`, `max_output_tokens`, `max_new_tokens`, `num_predict`,
/// `n_predict`, the first of these there is), read without parsing the body: a key as a
/// JSON key (not inside a string's escaped quotes), followed by a number.
pub fn max_tokens(body: &[u8]) -> Option<u64> {
    use memchr::memmem::Finder;
    const KEYS: [&[u8]; 6] = [
        b"\"max_tokens\"",
        b"\"max_completion_tokens\"",
        b"\"max_output_tokens\"",
        b"\"max_new_tokens\"",
        b"\"num_predict\"",
        b"\"n_predict\"",
    ];
    // Every key ends in one of two words: a pass over a long prompt for each, not one for
    // each key. Built once: a searcher costs more to build than to run over a short body.
    static ENDS: std::sync::LazyLock<[Finder<'static>; 2]> =
        std::sync::LazyLock::new(|| [&b"tokens\""[..], b"predict\""].map(Finder::new));
    let number = |after: usize| {
        let rest = body[after..].trim_ascii_start();
        let rest = rest.strip_prefix(b":")?.trim_ascii_start();
        // Its digits (none, or past u64: not read).
        let mut digits = rest.iter().take_while(|b| b.is_ascii_digit());
        let (n, any) = digits.try_fold((0u64, false), |(n, _), d| {
            Some((n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?, true))
        })?;
        any.then_some(n)
    };
    // Where each key first ends.
    let mut ends: [Option<usize>; KEYS.len()] = [None; KEYS.len()];
    for word in ENDS.iter() {
        // The keys the first pass found outrank those the second would.
        if let Some(n) = ends.iter().find_map(|end| number((*end)?)) {
            return Some(n);
        }
        for at in word.find_iter(body) {
            let end = at + word.needle().len();
            for (k, key) in KEYS.iter().enumerate() {
                let start = end.wrapping_sub(key.len());
                if ends[k].is_none()
                    && body[..end].ends_with(key)
                    && (start == 0 || body[start - 1] != b'\\')
                {
                    ends[k] = Some(end);
                    // The first key's number: no other is read.
                    if k == 0 && number(end).is_some() {
                        return number(end);
                    }
                }
            }
        }
    }
    ends.iter().find_map(|end| number((*end)?))
}

/// `key-` and the first 16 hex digits of `v`'s SHA-256.
/// Whether a client's value would take a name tokentap gives itself: `default` (requests
/// without the key), `other` (the tenants `/metrics` folds together), or the `key-` of a
/// hashed name. Such a value is hashed too, so that a client cannot join the fold (two
/// series of one name, one dropped by Prometheus), the keyless, or another's hashed key.
pub fn reserved(v: &[u8]) -> bool {
    v.eq_ignore_ascii_case(b"default")
        || v.eq_ignore_ascii_case(b"other")
        || v.get(..4).is_some_and(|p| p.eq_ignore_ascii_case(b"key-"))
}

pub fn hashed(v: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, v);
    let mut out = String::with_capacity(20);
    out.push_str("key-");
    for b in &digest.as_ref()[..8] {
        use std::fmt::Write as _;
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(key: &str) -> Tenants {
        Tenants::new(
            TenantsConfig {
                key: Some(key.parse().unwrap()),
                priority: Some("x-priority".parse().unwrap()),
                overrides: vec![(
                    "team-a".into(),
                    Terms {
                        weight: 3.0,
                        priority: Some(Priority::High),
                        output_tokens_per_minute: Some(100),
                    },
                )],
                ..TenantsConfig::default()
            },
            Default::default(),
        )
    }

    #[test]
    fn a_secret_is_hashed_and_a_name_kept() {
        let t = tenants("authorization");
        let who = t.who(|h| (h == "authorization").then_some(&b"Bearer sk-abc"[..]));
        assert_eq!(&*who.tenant, hashed(b"Bearer sk-abc"));
        assert!(who.tenant.starts_with("key-") && who.tenant.len() == 20);
        assert!(!who.tenant.contains("sk-"));
        let t = tenants("x-tenant");
        let who = t.who(|h| (h == "x-tenant").then_some(&b"team-a"[..]));
        assert_eq!(&*who.tenant, "team-a");
        assert_eq!(
            (who.weight, who.priority, who.budget),
            (3.0, Priority::High, Some(100))
        );
        // A long value, or one that is not plain text, is hashed too.
        let long = vec![b'a'; 64 * 1024];
        let who = t.who(|h| (h == "x-tenant").then_some(&long[..]));
        assert!(who.tenant.starts_with("key-"));
        let who = t.who(|h| (h == "x-tenant").then_some(&b"a b"[..]));
        assert!(who.tenant.starts_with("key-"));
        // No header: the default tenant.
        assert_eq!(&*t.who(|_| None).tenant, "default");
    }

    /// A client cannot take a name tokentap gives: the fold, the keyless, a hashed key.
    #[test]
    fn names_tokentap_gives_are_not_a_clients() {
        let t = tenants("x-tenant");
        let secret = tenants("authorization");
        let hashed_key = &*secret
            .who(|h| (h == "authorization").then_some(&b"Bearer sk-abc"[..]))
            .tenant
            .to_owned();
        for v in [
            &b"other"[..],
            b"Other",
            b"default",
            b"DEFAULT",
            hashed_key.as_bytes(),
        ] {
            let who = t.who(|h| (h == "x-tenant").then_some(v));
            assert!(
                who.tenant.starts_with("key-"),
                "{}",
                String::from_utf8_lossy(v)
            );
            assert_ne!(&*who.tenant, hashed_key);
            assert_eq!(&*who.tenant, hashed(v));
        }
        // Names that only look alike are kept.
        for v in ["others", "default-2", "keys"] {
            assert_eq!(
                &*t.who(|h| (h == "x-tenant").then_some(v.as_bytes())).tenant,
                v
            );
        }
    }

    /// The six keys searched for one at a time, as `max_tokens` did before it read them in
    /// two passes.
    fn max_tokens_key_by_key(body: &[u8]) -> Option<u64> {
        [
            &b"\"max_tokens\""[..],
            b"\"max_completion_tokens\"",
            b"\"max_output_tokens\"",
            b"\"max_new_tokens\"",
            b"\"num_predict\"",
            b"\"n_predict\"",
        ]
        .iter()
        .find_map(|key| {
            let at = (memchr::memmem::find_iter(body, key))
                .find(|&at| at == 0 || body[at - 1] != b'\\')?;
            let rest = body[at + key.len()..].trim_ascii_start();
            let rest = rest.strip_prefix(b":")?.trim_ascii_start();
            let digits: Vec<u8> = rest
                .iter()
                .copied()
                .take_while(u8::is_ascii_digit)
                .collect();
            std::str::from_utf8(&digits).ok()?.parse().ok()
        })
    }

    /// Bodies made of the keys, their look-alikes, escapes and values in every order: the
    /// same answer as the key-by-key search.
    #[test]
    fn max_tokens_in_two_passes_reads_what_six_did() {
        use rand::{Rng, SeedableRng};
        let parts = [
            r#""max_tokens":5"#,
            r#""max_tokens":null"#,
            r#""max_completion_tokens": 9"#,
            r#""max_output_tokens" : 11"#,
            r#""max_new_tokens":12"#,
            r#""num_predict":7"#,
            r#""n_predict":8"#,
            r#""n_predict":"x""#,
            r#"\"max_tokens\":3"#,
            r#"\\"max_tokens":4"#,
            r#""xmax_tokens":6"#,
            r#""tokens":1"#,
            r#""predict":2"#,
            r#""content":"say max_tokens\": 5""#,
            r#""max_tokens":99999999999999999999999"#,
            r#""max_completion_tokens""#,
            "tokens\"",
            ",",
            " ",
        ];
        let mut rng = rand::rngs::SmallRng::seed_from_u64(48);
        for _ in 0..50_000 {
            let n = rng.gen_range(0..8);
            let body: String = (0..n)
                .map(|_| parts[rng.gen_range(0..parts.len())])
                .collect();
            let body = format!("{{{body}}}");
            assert_eq!(
                max_tokens(body.as_bytes()),
                max_tokens_key_by_key(body.as_bytes()),
                "{body}"
            );
        }
    }

    #[test]
    fn max_tokens_is_read_from_any_dialects_key_and_not_from_a_prompt() {
        assert_eq!(
            max_tokens(br#"{"model":"m","max_tokens": 30,"stream":true}"#),
            Some(30)
        );
        assert_eq!(max_tokens(br#"{"options":{"num_predict":7}}"#), Some(7));
        assert_eq!(
            max_tokens(
                br#"{"messages":[{"content":"say \"max_tokens\": 5"}],"max_completion_tokens":9}"#
            ),
            Some(9)
        );
        assert_eq!(max_tokens(br#"{"max_tokens":null}"#), None);
        assert_eq!(max_tokens(b"not json"), None);
        assert_eq!(
            max_tokens(br#"{"max_tokens":99999999999999999999999}"#),
            None
        );
        assert_eq!(
            max_tokens(br#"{"max_tokens":18446744073709551615}"#),
            Some(u64::MAX)
        );
    }

    #[test]
    fn a_priority_header_wins_and_a_bad_one_is_normal_and_counted() {
        let t = tenants("x-tenant");
        let get = |p: &'static [u8]| {
            move |h: &str| match h {
                "x-tenant" => Some(&b"team-a"[..]),
                "x-priority" => Some(p),
                _ => None,
            }
        };
        assert_eq!(t.who(get(b" LOW ")).priority, Priority::Low);
        // An unknown value: the tenant's own priority (team-a's is high), counted.
        assert_eq!(t.who(get(b"urgent")).priority, Priority::High);
        assert_eq!(t.book.invalid_priority.load(Relaxed), 1);
        let other = t.who(|h| (h == "x-priority").then_some(&b"nope"[..]));
        assert_eq!(other.priority, Priority::Normal);
    }
}
