//! The shape of the config file, checked on the parsed document before it is read into
//! structs: every unknown key (with the closest known one suggested) and every value of
//! the wrong type is a problem with its dotted path, in the user's words ("a whole number
//! of seconds"), and is taken out, so that one bad value never hides the rest. Lines come
//! from the text's spans, for every problem found here or later.

use std::collections::HashMap;

use toml::Value;

use super::Problems;

/// What a key holds.
#[derive(Clone, Copy)]
enum Kind {
    Text,
    /// A non-negative integer, described as in "a whole number of seconds".
    Count(&'static str),
    /// Any number.
    Number(&'static str),
    Bool,
    Table(&'static [Field]),
    /// `[[name]]`: a list of tables.
    Tables(&'static [Field]),
    /// A table of any keys, each holding this.
    Map(&'static Kind),
}

type Field = (&'static str, Kind);

const SECS: Kind = Kind::Count("a whole number of seconds");
const MS: Kind = Kind::Count("a whole number of milliseconds");
const BYTES: Kind = Kind::Count("a whole number of bytes");
const COUNT: Kind = Kind::Count("a whole number");

const FILE: &[Field] = &[
    (
        "listen",
        Kind::Table(&[
            ("proxy", Kind::Text),
            ("admin", Kind::Text),
            ("tls_cert", Kind::Text),
            ("tls_key", Kind::Text),
        ]),
    ),
    (
        "metrics",
        Kind::Table(&[
            ("window_secs", SECS),
            ("max_event_bytes", BYTES),
            ("model_label", Kind::Bool),
            ("curve_window_secs", SECS),
        ]),
    ),
    (
        "server",
        Kind::Table(&[
            ("threads", COUNT),
            ("grace_period_secs", SECS),
            ("upstream_keepalive_pool_size", COUNT),
            ("work_stealing", Kind::Bool),
            ("client_write_timeout_secs", SECS),
            ("request_head_timeout_secs", SECS),
            ("request_body_timeout_secs", SECS),
            ("max_request_head_bytes", BYTES),
            ("max_connections", COUNT),
            ("max_request_body_bytes", BYTES),
            ("keepalive_timeout_secs", SECS),
            ("request_id_upstream", Kind::Bool),
        ]),
    ),
    ("compare", Kind::Table(&[("window_secs", SECS)])),
    (
        "cluster",
        Kind::Table(&[("redis_url", Kind::Text), ("lease_secs", SECS)]),
    ),
    (
        "admin",
        Kind::Table(&[("token_file", Kind::Text), ("metrics_public", Kind::Bool)]),
    ),
    (
        "log",
        Kind::Table(&[
            ("filter", Kind::Text),
            ("format", Kind::Text),
            ("access", Kind::Text),
        ]),
    ),
    (
        "upstream",
        Kind::Tables(&[
            ("name", Kind::Text),
            ("url", Kind::Text),
            ("max_concurrency", COUNT),
            ("max_queue", COUNT),
            ("queue_timeout_ms", MS),
            ("inject_usage", Kind::Bool),
            ("estimate", Kind::Text),
            (
                "slo",
                Kind::Table(&[
                    ("tpot_ms", Kind::Number("a number of milliseconds")),
                    (
                        "percentile",
                        Kind::Number("a percentile between 1 and 99.9"),
                    ),
                    ("min_concurrency", COUNT),
                    ("max_concurrency", COUNT),
                ]),
            ),
            ("connect_timeout_ms", MS),
            ("read_timeout_secs", SECS),
            ("write_timeout_secs", SECS),
            ("idle_timeout_secs", SECS),
            ("ca_file", Kind::Text),
            ("tls_verify", Kind::Bool),
            ("backend_metrics", Kind::Text),
            ("backend_scrape_ms", MS),
        ]),
    ),
    (
        "route",
        Kind::Tables(&[
            ("name", Kind::Text),
            ("path_prefix", Kind::Text),
            ("headers", Kind::Map(&Kind::Text)),
            ("split", Kind::Map(&Kind::Count("a whole-number weight"))),
            ("sticky", Kind::Text),
            ("spill", Kind::Bool),
        ]),
    ),
];

/// Checks `doc` against the file's shape, adding a problem for each unknown key and each
/// value of the wrong type, and taking those out of `doc`. Returns the paths it reported.
pub(crate) fn check(doc: &mut toml::Table, p: &mut Problems) -> Vec<String> {
    let mut reported = Vec::new();
    table(doc, FILE, "", p, &mut reported);
    reported
}

fn table(t: &mut toml::Table, fields: &[Field], at: &str, p: &mut Problems, out: &mut Vec<String>) {
    let keys: Vec<String> = t.keys().cloned().collect();
    for key in keys {
        let path = join(at, &key);
        let Some(&(_, kind)) = fields.iter().find(|(k, _)| *k == key) else {
            let known = fields.iter().map(|(k, _)| *k);
            let message = match suggest(&key, known) {
                Some(close) => format!("unknown key; did you mean `{close}`?"),
                None => {
                    let all: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
                    format!("unknown key (known here: {})", all.join(", "))
                }
            };
            p.add(path.clone(), message);
            out.push(path);
            t.remove(&key);
            continue;
        };
        let keep = match t.get_mut(&key) {
            Some(v) => value(v, kind, &path, p, out),
            None => true,
        };
        if !keep {
            t.remove(&key);
        }
    }
}

/// Checks one value; `false`: it is of the wrong type (reported) and must go.
fn value(v: &mut Value, kind: Kind, path: &str, p: &mut Problems, out: &mut Vec<String>) -> bool {
    let ok = match (kind, &mut *v) {
        (Kind::Text, Value::String(_)) | (Kind::Bool, Value::Boolean(_)) => true,
        (Kind::Count(_), Value::Integer(n)) => *n >= 0,
        (Kind::Number(_), Value::Integer(_) | Value::Float(_)) => true,
        (Kind::Table(fields), Value::Table(t)) => {
            table(t, fields, path, p, out);
            true
        }
        (Kind::Tables(fields), Value::Array(items)) if items.iter().all(Value::is_table) => {
            for (i, item) in items.iter_mut().enumerate() {
                if let Value::Table(t) = item {
                    table(t, fields, &format!("{path}[{i}]"), p, out);
                }
            }
            true
        }
        (Kind::Map(each), Value::Table(t)) => {
            let keys: Vec<String> = t.keys().cloned().collect();
            for key in keys {
                let at = join(path, &key);
                let keep = t
                    .get_mut(&key)
                    .is_some_and(|v| value(v, *each, &at, p, out));
                if !keep {
                    t.remove(&key);
                }
            }
            true
        }
        _ => false,
    };
    if !ok {
        p.add(path, format!("must be {}, not {}", wanted(kind), found(v)));
        out.push(path.to_owned());
    }
    ok
}

fn wanted(kind: Kind) -> String {
    match kind {
        Kind::Text => "text in quotes".into(),
        Kind::Count(words) | Kind::Number(words) => words.into(),
        Kind::Bool => "true or false".into(),
        Kind::Table(_) => "a table".into(),
        Kind::Tables(_) => "a list of tables ([[…]])".into(),
        Kind::Map(_) => "a table such as { name = value }".into(),
    }
}

fn found(v: &Value) -> String {
    match v {
        Value::String(s) => format!("the text \"{}\"", s.chars().take(40).collect::<String>()),
        Value::Integer(n) => format!("{n}"),
        Value::Float(f) => format!("{f}"),
        Value::Boolean(b) => format!("{b}"),
        Value::Datetime(d) => format!("the date {d}"),
        Value::Array(_) => "a list".into(),
        Value::Table(_) => "a table".into(),
    }
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_owned()
    } else {
        format!("{at}.{key}")
    }
}

/// The known key closest to a misspelt one, if one is close enough to be meant.
fn suggest<'a>(key: &str, known: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    known
        .map(|k| (strsim::damerau_levenshtein(key, k), k))
        .filter(|&(d, k)| d <= (k.len() / 4).max(1) + 1)
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k)
}

/// The line (from 1) of every key of the document `text`, by dotted path.
pub(crate) fn lines(text: &str) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    if let Ok(doc) = toml_edit::ImDocument::parse(text) {
        let line = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        walk(doc.as_table(), "", &line, &mut out);
    }
    out
}

fn walk(
    t: &dyn toml_edit::TableLike,
    at: &str,
    line: &dyn Fn(usize) -> usize,
    out: &mut HashMap<String, usize>,
) {
    for (key, item) in t.iter() {
        let path = join(at, key);
        let span = t
            .get_key_value(key)
            .and_then(|(k, _)| k.span())
            .or_else(|| item.span());
        if let Some(span) = span {
            out.entry(path.clone()).or_insert_with(|| line(span.start));
        }
        match item {
            toml_edit::Item::Table(inner) => walk(inner, &path, line, out),
            toml_edit::Item::Value(toml_edit::Value::InlineTable(inner)) => {
                walk(inner, &path, line, out)
            }
            toml_edit::Item::ArrayOfTables(list) => {
                for (i, inner) in list.iter().enumerate() {
                    let at = format!("{path}[{i}]");
                    if let Some(span) = inner.span() {
                        out.entry(at.clone()).or_insert_with(|| line(span.start));
                    }
                    walk(inner, &at, line, out);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of `kind` for `key`, as the structs take it.
    fn sample(key: &str, kind: Kind) -> Value {
        match kind {
            Kind::Text if key == "estimate" => Value::String("events".into()),
            Kind::Text => Value::String("x".into()),
            Kind::Count(_) => Value::Integer(1),
            Kind::Number(_) => Value::Float(1.5),
            Kind::Bool => Value::Boolean(true),
            Kind::Table(fields) => Value::Table(sample_table(fields)),
            Kind::Tables(fields) => Value::Array(vec![Value::Table(sample_table(fields))]),
            Kind::Map(each) => {
                Value::Table(toml::Table::from_iter([("k".into(), sample("k", *each))]))
            }
        }
    }

    fn sample_table(fields: &[Field]) -> toml::Table {
        fields
            .iter()
            .map(|(k, kind)| ((*k).to_owned(), sample(k, *kind)))
            .collect()
    }

    #[test]
    fn every_key_the_shape_knows_is_one_the_structs_read() {
        use serde::Deserialize;
        let doc = sample_table(FILE);
        let read = super::super::FileConfig::deserialize(Value::Table(doc));
        assert!(read.is_ok(), "{:?}", read.err());
    }

    #[test]
    fn misspelt_keys_get_the_closest_known_one() {
        let known = [
            "read_timeout_secs",
            "write_timeout_secs",
            "idle_timeout_secs",
            "name",
        ];
        assert_eq!(
            suggest("read_timout_secs", known.iter().copied()),
            Some("read_timeout_secs")
        );
        assert_eq!(suggest("nmae", known.iter().copied()), Some("name"));
        assert_eq!(suggest("weight", known.iter().copied()), None);
    }

    #[test]
    fn lines_are_found_for_keys_tables_and_list_items() {
        let text = "[listen]\nproxy = \"x\"\n\n[[upstream]]\nname = \"a\"\n[[upstream]]\nname = \"b\"\n[[route]]\nsplit = { a = 1 }\n";
        let l = lines(text);
        assert_eq!(l["listen.proxy"], 2);
        assert_eq!(l["upstream[1].name"], 7);
        assert_eq!(l["route[0].split.a"], 9);
    }
}
