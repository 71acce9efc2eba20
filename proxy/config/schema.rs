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
    /// One table (`name = { … }`) or a list of them: made a list.
    TableOrTables(&'static [Field]),
    /// A table of any keys, each holding this.
    Map(&'static Kind),
    /// A list of texts (`["a", "b"]`).
    Texts,
    /// A list of numbers (`[10, 50, 100]`).
    Numbers(&'static str),
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
            ("endpoint_labels", COUNT),
            ("tenant_labels", COUNT),
            ("semconv", Kind::Bool),
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
            ("watch_config", Kind::Bool),
        ]),
    ),
    ("compare", Kind::Table(&[("window_secs", SECS)])),
    (
        "cluster",
        Kind::Table(&[("redis_url", Kind::Text), ("lease_secs", SECS)]),
    ),
    (
        "tenants",
        Kind::Table(&[
            ("key", Kind::Text),
            ("priority", Kind::Text),
            ("weight", Kind::Number("a number")),
            ("output_tokens_per_minute", COUNT),
            ("ageing_ms", MS),
            (
                "override",
                Kind::Tables(&[
                    ("tenant", Kind::Text),
                    ("weight", Kind::Number("a number")),
                    ("priority", Kind::Text),
                    ("output_tokens_per_minute", COUNT),
                ]),
            ),
        ]),
    ),
    ("rollouts", Kind::Table(&[("state_file", Kind::Text)])),
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
            ("endpoints", Kind::Texts),
            (
                "discover",
                Kind::Table(&[
                    ("dns", Kind::Text),
                    ("port", COUNT),
                    ("nameserver", Kind::Text),
                    ("file", Kind::Text),
                    ("every_secs", SECS),
                ]),
            ),
            (
                "health",
                Kind::Table(&[
                    ("path", Kind::Text),
                    ("every_secs", SECS),
                    ("timeout_ms", MS),
                    ("unhealthy_after", COUNT),
                    ("healthy_after", COUNT),
                ]),
            ),
            ("eject_after", COUNT),
            ("eject_secs", SECS),
            ("balance", Kind::Text),
            ("max_concurrency_total", COUNT),
            ("backend_metrics_path", Kind::Text),
            ("max_concurrency", COUNT),
            ("max_queue", COUNT),
            ("queue_timeout_ms", MS),
            ("inject_usage", Kind::Bool),
            ("estimate", Kind::Text),
            (
                "slo",
                Kind::Table(&[
                    ("tpot_ms", Kind::Number("a number of milliseconds")),
                    ("ttft_ms", Kind::Number("a number of milliseconds")),
                    ("e2e_ms", Kind::Number("a number of milliseconds")),
                    ("attainment_pct", Kind::Number("a percentage")),
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
            ("cost_per_hour", Kind::Number("a price per hour")),
            ("cost_currency", Kind::Text),
            ("gpus", COUNT),
            (
                "model",
                Kind::Table(&[
                    ("weight_gb", Kind::Number("a size in GB")),
                    ("params_b", Kind::Number("billions of parameters")),
                    ("bytes_per_param", Kind::Number("a number of bytes")),
                ]),
            ),
            ("gpu", Kind::Text),
            ("hbm_tb_per_s", Kind::Number("a bandwidth in TB/s")),
            ("tensor_parallel", COUNT),
            (
                "capacity",
                Kind::Table(&[("headroom_pct", Kind::Number("a percentage"))]),
            ),
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
            (
                "mirror",
                Kind::TableOrTables(&[
                    ("upstream", Kind::Text),
                    ("percent", Kind::Number("a percentage")),
                    ("max_in_flight", COUNT),
                    ("set_headers", Kind::Map(&Kind::Text)),
                    ("cancel_with_client", Kind::Bool),
                    ("sticky", Kind::Text),
                ]),
            ),
            (
                "rollout",
                Kind::Table(&[
                    ("from", Kind::Text),
                    ("to", Kind::Text),
                    ("steps", Kind::Numbers("percentages")),
                    ("every_secs", SECS),
                    ("max_tpot_ratio", Kind::Number("a ratio")),
                    ("max_ttft_ratio", Kind::Number("a ratio")),
                    ("max_error_pct", Kind::Number("a percentage")),
                    ("min_requests", COUNT),
                ]),
            ),
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
        (Kind::Texts, Value::Array(items)) => items.iter().all(Value::is_str),
        (Kind::Numbers(_), Value::Array(items)) => {
            (items.iter()).all(|v| v.is_integer() || v.is_float())
        }
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
        (Kind::TableOrTables(fields), Value::Table(t)) => {
            table(t, fields, path, p, out);
            let one = std::mem::take(t);
            *v = Value::Array(vec![Value::Table(one)]);
            true
        }
        (Kind::TableOrTables(fields), Value::Array(items)) if items.iter().all(Value::is_table) => {
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
        Kind::TableOrTables(_) => "a table, or a list of them".into(),
        Kind::Map(_) => "a table such as { name = value }".into(),
        Kind::Texts => "a list of texts in quotes".into(),
        Kind::Numbers(what) => format!("a list of numbers ({what})"),
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
            Kind::Texts => Value::Array(vec![Value::String("x".into())]),
            Kind::Numbers(_) => Value::Array(vec![Value::Integer(100)]),
            Kind::Text => Value::String("x".into()),
            Kind::Count(_) => Value::Integer(1),
            Kind::Number(_) => Value::Float(1.5),
            Kind::Bool => Value::Boolean(true),
            Kind::Table(fields) => Value::Table(sample_table(fields)),
            Kind::Tables(fields) | Kind::TableOrTables(fields) => {
                Value::Array(vec![Value::Table(sample_table(fields))])
            }
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

    /// Every key the shape knows, as docs/configuration.md names it (`upstream[].slo.tpot_ms`), with
    /// the name of the struct that reads it.
    fn keys(fields: &[Field], at: &str, strukt: &str, out: &mut Vec<(String, String)>) {
        for (key, kind) in fields {
            let path = join(at, key);
            let sub = |name: &str| format!("{}File", name[..1].to_uppercase() + &name[1..]);
            match kind {
                Kind::Table(inner) => keys(inner, &path, &sub(key), out),
                Kind::Tables(inner) | Kind::TableOrTables(inner) => {
                    keys(inner, &format!("{path}[]"), &sub(key), out)
                }
                _ => out.push((path, strukt.to_owned())),
            }
        }
    }

    /// The first word of a default as written: `30`, `none`, `true`, `"events"`…
    fn first_word(text: &str) -> String {
        let text = text.trim().trim_start_matches(':').trim();
        let word = text.split([' ', ',', '(']).next().unwrap_or("");
        word.trim_matches(['`', '"', '.', ';', ':']).to_lowercase()
    }

    /// The `Default …` a field's doc comment gives, if any.
    fn doc_default(file: &str, strukt: &str, field: &str) -> Option<String> {
        let body = file.split(&format!("pub struct {strukt} {{")).nth(1)?;
        let body = &body[..body.find("\n}")?];
        let mut doc = String::new();
        for line in body.lines().map(str::trim) {
            if let Some(d) = line.strip_prefix("///") {
                doc.push_str(d);
                doc.push(' ');
            } else if line.starts_with(&format!("pub {field}:")) {
                let at = doc.find("Default")?;
                return Some(first_word(&doc[at + "Default".len()..]));
            } else if line.starts_with("pub ") {
                doc.clear();
            }
        }
        None
    }

    /// The config file's structs, every section's file.
    fn sources() -> String {
        [
            include_str!("file/mod.rs"),
            include_str!("file/server.rs"),
            include_str!("file/metrics.rs"),
            include_str!("file/cluster.rs"),
            include_str!("file/tenants.rs"),
            include_str!("file/upstream/mod.rs"),
            include_str!("file/upstream/slo.rs"),
            include_str!("file/upstream/economics.rs"),
            include_str!("file/upstream/pool.rs"),
            include_str!("file/route.rs"),
            include_str!("file/rollout.rs"),
        ]
        .concat()
    }

    /// Every (struct, key) of the shape, tables included.
    fn shape_fields(fields: &[Field], strukt: &str, out: &mut Vec<(String, String)>) {
        for (key, kind) in fields {
            out.push((strukt.to_owned(), (*key).to_owned()));
            let sub = format!("{}File", key[..1].to_uppercase() + &key[1..]);
            if let Kind::Table(inner) | Kind::Tables(inner) | Kind::TableOrTables(inner) = kind {
                shape_fields(inner, &sub, out);
            }
        }
    }

    /// A key is written twice, as a field of its section's struct and in the shape above
    /// (which `check` reads first): neither may have one the other lacks.
    #[test]
    fn every_field_is_in_the_shape_and_every_key_a_field() {
        let file = sources();
        let mut shape = Vec::new();
        shape_fields(FILE, "FileConfig", &mut shape);
        let mut structs: Vec<(String, String)> = Vec::new();
        for part in file.split("pub struct ").skip(1) {
            let Some((name, rest)) = part.split_once(" {") else {
                continue;
            };
            let body = &rest[..rest.find("\n}").unwrap_or(rest.len())];
            for line in body.lines().map(str::trim) {
                if let Some((field, _)) = line.strip_prefix("pub ").and_then(|l| l.split_once(':'))
                {
                    let field = field.trim_start_matches("r#");
                    structs.push((name.to_owned(), field.to_owned()));
                }
            }
        }
        let mut problems = Vec::new();
        for (strukt, field) in &structs {
            if !shape.contains(&(strukt.clone(), field.clone())) {
                problems.push(format!("{strukt}.{field}: a field schema.rs does not know"));
            }
        }
        for (strukt, key) in &shape {
            if !structs.contains(&(strukt.clone(), key.clone())) {
                problems.push(format!(
                    "{strukt}.{key}: in schema.rs, not a field of {strukt}"
                ));
            }
        }
        assert!(structs.len() > 80, "{} fields read", structs.len());
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    /// The documented config table (docs/configuration.md): key → its default, as written.
    fn readme_defaults() -> HashMap<String, String> {
        let readme = include_str!("../../docs/configuration.md");
        let mut rows = HashMap::new();
        for line in readme.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = line.split(" | ").collect();
            let [names, default, ..] = cells[..] else {
                continue;
            };
            for name in names.trim_start_matches("| ").split(", ") {
                rows.insert(name.trim_matches('`').to_owned(), default.to_owned());
            }
        }
        rows
    }

    /// A key's name, default and doc are written in three places a user reads or the
    /// code runs: the documented table, the field's doc comment (what `check` and the
    /// example configs say) and the value the runtime takes when the key is absent. Every
    /// key the shape knows must be in docs/configuration.md, and where two of them give a default,
    /// they must agree.
    #[test]
    fn every_key_is_documented_once_with_one_default() {
        let mut all = Vec::new();
        keys(FILE, "", "FileConfig", &mut all);
        let readme = readme_defaults();
        let file = sources();
        let file = file.as_str();
        let mut problems = Vec::new();
        for (key, strukt) in &all {
            let Some(written) = readme.get(key) else {
                problems.push(format!("{key}: not in the documented config table"));
                continue;
            };
            let field = key.rsplit('.').next().unwrap_or(key);
            if let Some(doc) = doc_default(file, strukt, field) {
                if doc != first_word(written) {
                    problems.push(format!(
                        "{key}: the documented default is `{written}`, {strukt}'s doc says `{doc}`"
                    ));
                }
            }
        }
        // The runtime's value for each key left out, against the documented.
        let c = crate::config::Config::parse(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n[upstream.slo]\ntpot_ms = 30\n",
            "defaults",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let u = &c.upstreams[0];
        let slo = u.slo.as_ref().unwrap_or_else(|| unreachable!());
        let secs = |d: std::time::Duration| d.as_secs().to_string();
        let ms = |d: std::time::Duration| d.as_millis().to_string();
        let runtime: Vec<(&str, String)> = vec![
            ("listen.proxy", c.listen.proxy.to_string()),
            ("listen.admin", c.listen.admin.to_string()),
            ("metrics.window_secs", secs(c.window)),
            ("metrics.curve_window_secs", secs(c.curve_window)),
            ("metrics.model_label", c.model_label.to_string()),
            ("metrics.endpoint_labels", c.endpoint_labels.to_string()),
            ("metrics.tenant_labels", c.tenant_labels.to_string()),
            ("tenants.weight", c.tenants.default.weight.to_string()),
            ("tenants.ageing_ms", ms(c.tenants.ageing)),
            ("metrics.semconv", c.semconv.to_string()),
            ("upstream[].eject_after", u.eject_after.to_string()),
            ("upstream[].eject_secs", secs(u.eject)),
            ("compare.window_secs", secs(c.compare_window)),
            ("server.grace_period_secs", secs(c.grace_period)),
            (
                "server.upstream_keepalive_pool_size",
                c.keepalive_pool.to_string(),
            ),
            ("server.work_stealing", c.work_stealing.to_string()),
            (
                "server.request_id_upstream",
                c.request_id_upstream.to_string(),
            ),
            ("server.watch_config", c.watch_config.to_string()),
            (
                "server.client_write_timeout_secs",
                secs(c.limits.client_write_timeout),
            ),
            (
                "server.request_head_timeout_secs",
                secs(c.limits.request_head_timeout),
            ),
            (
                "server.request_body_timeout_secs",
                secs(c.limits.request_body_timeout),
            ),
            (
                "server.keepalive_timeout_secs",
                secs(c.limits.keepalive_timeout),
            ),
            (
                "server.max_request_head_bytes",
                c.limits.max_request_head_bytes.to_string(),
            ),
            (
                "server.max_request_body_bytes",
                c.limits.max_request_body_bytes.to_string(),
            ),
            ("admin.metrics_public", c.admin.metrics_public.to_string()),
            ("upstream[].read_timeout_secs", secs(u.read_timeout)),
            ("upstream[].connect_timeout_ms", ms(u.connect_timeout)),
            ("upstream[].write_timeout_secs", secs(u.write_timeout)),
            ("upstream[].idle_timeout_secs", secs(u.idle_timeout)),
            ("upstream[].tls_verify", u.tls_verify.to_string()),
            ("upstream[].backend_scrape_ms", ms(u.backend_scrape)),
            ("upstream[].inject_usage", u.inject_usage.to_string()),
            ("upstream[].max_queue", u.max_queue.to_string()),
            ("upstream[].queue_timeout_ms", ms(u.queue_timeout)),
            ("upstream[].slo.percentile", slo.percentile.to_string()),
            (
                "upstream[].slo.attainment_pct",
                u.attainment_pct.to_string(),
            ),
            (
                "upstream[].capacity.headroom_pct",
                u.economics.headroom_pct.to_string(),
            ),
            (
                "upstream[].slo.min_concurrency",
                slo.min_concurrency.to_string(),
            ),
            ("route[].path_prefix", c.routes[0].path_prefix.clone()),
            ("route[].spill", c.routes[0].spill.to_string()),
        ];
        // The keys of tables left out above, each given bare.
        let c = crate::config::Config::parse(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n\
             [upstream.health]\n\
             [[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:2\"\n\
             [[route]]\nsplit = { a = 1 }\nmirror = { upstream = \"b\" }\n",
            "defaults",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let h = c.upstreams[0]
            .health
            .as_ref()
            .unwrap_or_else(|| unreachable!());
        let m = &c.routes[0].mirrors[0];
        let runtime = runtime.into_iter().chain([
            ("upstream[].health.every_secs", secs(h.every)),
            ("upstream[].health.timeout_ms", ms(h.timeout)),
            (
                "upstream[].health.unhealthy_after",
                h.unhealthy_after.to_string(),
            ),
            (
                "upstream[].health.healthy_after",
                h.healthy_after.to_string(),
            ),
            ("upstream[].health.path", format!("\"{}\"", h.path)),
            ("route[].mirror[].percent", m.percent.to_string()),
            (
                "route[].mirror[].max_in_flight",
                m.max_in_flight.to_string(),
            ),
        ]);
        for (key, value) in runtime {
            let written = readme.get(key).map_or("", String::as_str);
            if first_word(written) != first_word(&value) {
                problems.push(format!(
                    "{key}: the documented default is `{written}`, the runtime takes `{value}`"
                ));
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}
