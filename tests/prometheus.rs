//! `deploy/` against the real thing: `promtool check rules` and `promtool test rules` on the
//! rules, then a real Prometheus (Debian's `prometheus` package) scraping a running
//! `tokentap demo` under load every second, with the rules loaded: every recording rule and
//! every query of the Grafana dashboard must return data, and every rule must evaluate
//! without error. `promtool check metrics` reads a scrape too.
//!
//! Needs `prometheus` and `promtool` (`apt-get install prometheus`); without them the test
//! says so and passes, except in CI (`CI=true`), where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::process::Scratch;
use common::{free_addr, send};
use serde_json::Value;

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(file)
}

fn found(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn promtool(args: &[&str], input: Option<&[u8]>) -> String {
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(input) = input {
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(input).unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

/// Every query of the Grafana dashboard, with its panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let dash: Value =
        serde_json::from_slice(&std::fs::read(deploy("grafana/tokentap.json")).unwrap()).unwrap();
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                p["title"].as_str().unwrap().to_owned(),
                t["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// A dashboard query as Grafana would send it here: its variables filled in for a 1 s
/// scrape.
fn fill(expr: &str) -> String {
    expr.replace("$__rate_interval", "10s")
        .replace("$__range", "10m")
        .replace("$upstream", ".*")
}

fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

async fn query(prometheus: SocketAddr, expr: &str) -> Value {
    let path = format!("/api/v1/query?query={}", encode(expr));
    match send(prometheus, "GET", &path, b"", &[]).await {
        Ok(r) => serde_json::from_slice(&r.body).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_and_the_dashboard_against_a_real_prometheus() {
    // A demo at 128 clients and a Prometheus: the whole machine.
    let _machine = common::whole_machine().await;
    if !found("promtool") || !found("prometheus") {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI needs prometheus and promtool: apt-get install prometheus"
        );
        eprintln!("skipped: no prometheus or promtool (apt-get install prometheus)");
        return;
    }
    let rules = deploy("prometheus/rules.yml");
    promtool(&["check", "rules", rules.to_str().unwrap()], None);
    promtool(
        &[
            "test",
            "rules",
            deploy("prometheus/rules_test.yml").to_str().unwrap(),
        ],
        None,
    );

    let (proxy, admin, web) = (free_addr(), free_addr(), free_addr());
    let _demo = Killed(
        Command::new(env!("CARGO_BIN_EXE_tokentap"))
            .args(["demo", "--duration", "150", "--levels", "16,128"])
            .args(["--phase-secs", "8"])
            .args([
                "--listen",
                &proxy.to_string(),
                "--admin",
                &admin.to_string(),
            ])
            .env_remove("RUST_LOG")
            .env_remove("TOKENTAP_ADMIN_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The rules as shipped, evaluated every 2 s instead of 15 s so the test is short.
    let dir = Scratch::new("prometheus");
    let text = std::fs::read_to_string(&rules).unwrap();
    assert!(text.contains("interval: 15s"));
    std::fs::write(
        dir.path("rules.yml"),
        text.replace("interval: 15s", "interval: 2s"),
    )
    .unwrap();
    std::fs::write(
        dir.path("prometheus.yml"),
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 2s}}\n\
             rule_files: [{}]\n\
             scrape_configs:\n  - job_name: tokentap\n    static_configs: [{{targets: ['{admin}']}}]\n",
            dir.path("rules.yml").display()
        ),
    )
    .unwrap();
    let _prometheus = Killed(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let scrape = loop {
        if let Ok(r) = send(admin, "GET", "/metrics", b"", &[]).await {
            if r.status == 200 {
                break r.body;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    promtool(&["check", "metrics"], Some(&scrape));

    let recorded: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(str::to_owned)
        .collect();
    assert!(recorded.len() >= 10, "{recorded:?}");
    let mut pending: Vec<(String, String)> = recorded
        .iter()
        .map(|r| (format!("recording rule {r}"), r.clone()))
        .chain(
            dashboard_queries()
                .into_iter()
                .map(|(title, expr)| (format!("panel \"{title}\""), fill(&expr))),
        )
        .collect();
    let total = pending.len();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !pending.is_empty() {
        let mut still = Vec::new();
        for (what, expr) in pending {
            let v = query(web, &expr).await;
            if v["status"] == "error" {
                panic!("{what}: {expr}: {}", v["error"]);
            }
            // Data: a series with a number (a quantile of nothing is NaN, which is not).
            let finite = v["data"]["result"].as_array().is_some_and(|r| {
                r.iter().any(|s| {
                    s["value"][1]
                        .as_str()
                        .and_then(|x| x.parse::<f64>().ok())
                        .is_some_and(f64::is_finite)
                })
            });
            if !finite {
                still.push((what, expr));
            }
        }
        pending = still;
        if pending.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {total} queries returned no data in 90 s: {pending:#?}",
            pending.len()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // Every rule, alerts included, evaluates cleanly.
    let rules = send(web, "GET", "/api/v1/rules", b"", &[]).await.unwrap();
    let rules: Value = serde_json::from_slice(&rules.body).unwrap();
    let mut checked = 0;
    for g in rules["data"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "{r}");
            checked += 1;
        }
    }
    assert!(checked >= 19, "{checked} rules loaded: {rules}");
    eprintln!("{total} queries returned data; {checked} rules healthy");

    // The KEDA overlay's query, for each of the demo's upstreams: the replicas KEDA would
    // set are tokentap's own endpoints_needed (or, without one, the endpoints taking
    // requests now), through the real Prometheus.
    let (expr, threshold, min, max) = scaled_object();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = send(admin, "GET", "/stats", b"", &[]).await.unwrap();
        let stats: Value = serde_json::from_slice(&stats.body).unwrap();
        let upstreams = stats["upstreams"].as_array().unwrap();
        let mut agreed = 0;
        for u in upstreams {
            let name = u["name"].as_str().unwrap();
            let want = u["capacity"]["endpoints_needed"].as_f64().or_else(|| {
                u["endpoints"]
                    .as_array()
                    .map(|e| e.iter().filter(|e| e["healthy"] == true).count() as f64)
            });
            let v = query(
                web,
                &expr.replace("upstream=\"vllm\"", &format!("upstream=\"{name}\"")),
            )
            .await;
            assert_ne!(v["status"], "error", "{expr}: {v}");
            let got = v["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|x| x.parse::<f64>().ok());
            if let Some(got) = got.filter(|&g| Some(g) == want) {
                let replicas = (got / threshold).ceil().clamp(min, max);
                eprintln!(
                    "KEDA would set {name} to {replicas} replicas (endpoints_needed {:?})",
                    u["capacity"]["endpoints_needed"]
                );
                agreed += 1;
            }
        }
        if agreed == upstreams.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the ScaledObject's query never matched /stats: {expr}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The KEDA overlay's Prometheus trigger: its query, threshold, and the replica bounds.
fn scaled_object() -> (String, f64, f64, f64) {
    let text =
        std::fs::read_to_string(deploy("kubernetes/overlays/keda/scaledobject.yaml")).unwrap();
    let field = |key: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap();
        line.split_once(':')
            .unwrap()
            .1
            .trim()
            .trim_matches('"')
            .parse()
            .unwrap()
    };
    // `query: >-`: the folded lines under it, joined by spaces.
    let mut lines = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("query: >-"));
    let indent = |l: &str| l.len() - l.trim_start().len();
    let head = indent(lines.next().unwrap());
    let expr: Vec<&str> = lines
        .take_while(|l| indent(l) > head)
        .map(str::trim)
        .collect();
    let expr = expr.join(" ");
    assert!(
        expr.contains("tokentap_capacity_endpoints_needed"),
        "{expr}"
    );
    (
        expr,
        field("threshold:"),
        field("minReplicaCount:"),
        field("maxReplicaCount:"),
    )
}

/// `metrics.semconv`: the OpenTelemetry GenAI histograms, which `promtool check metrics`
/// accepts, agree with tokentap's own bucket for bucket (the same edges, the same requests),
/// and their output tokens add up to tokentap's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gen_ai_histograms_agree_with_tokentaps_own() {
    use tokentap::load::{self, LoadArgs, Mode};
    use tokentap::sim::{Sim, SimArgs};
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:2".parse().unwrap(),
        ttft_ms: 3.0,
        max_tokens: 16,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let tap = common::proxy(&[("sim", sim.addr)], "[metrics]\nsemconv = true\n").await;
    let proxy = common::proxy_addr(&tap);
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let target = LoadArgs {
            max_tokens: 16,
            include_usage: true,
            path: Some(path.into()),
            ..LoadArgs::for_url(format!("http://{proxy}"))
        }
        .target()
        .unwrap();
        let r = load::phase(
            &target,
            Mode::Closed { concurrency: 4 },
            Duration::ZERO,
            Duration::from_secs(1),
            false,
        )
        .await;
        assert!(r.errors.is_empty(), "{:?}", r.errors);
    }
    common::stats_when(&tap, |u| u["in_flight"] == 0).await;
    let admin = tap.shared().config.listen.admin;
    let text =
        String::from_utf8(send(admin, "GET", "/metrics", b"", &[]).await.unwrap().body).unwrap();
    if found("promtool") {
        promtool(&["check", "metrics"], Some(text.as_bytes()));
    } else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI needs promtool"
        );
    }
    // Σ over the gen_ai label sets of `family{…}` lines, by `le` (or "" for _sum/_count).
    let summed = |family: &str, only: &str| -> std::collections::BTreeMap<String, f64> {
        let mut out = std::collections::BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| l.starts_with(family) && l.contains(only))
        {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let le = series
                .split("le=\"")
                .nth(1)
                .map_or("", |r| r.split('"').next().unwrap());
            let name = series.split('{').next().unwrap();
            *out.entry(format!("{name} {le}")).or_insert(0.0) += value.parse::<f64>().unwrap();
        }
        out
    };
    for (ours, theirs) in [
        (
            "tokentap_ttft_seconds",
            "gen_ai_server_time_to_first_token_seconds",
        ),
        (
            "tokentap_tpot_seconds",
            "gen_ai_server_time_per_output_token_seconds",
        ),
        (
            "tokentap_e2e_seconds",
            "gen_ai_server_request_duration_seconds",
        ),
    ] {
        let a = summed(&format!("{ours}_"), "upstream=\"sim\"");
        let b = summed(&format!("{theirs}_"), "server_address=\"sim\"");
        assert!(a.len() > 10, "{ours}: {a:?}");
        for (key, v) in &a {
            let k = key.replacen(ours, theirs, 1);
            let w = b.get(&k).copied().unwrap_or(f64::NAN);
            if key.ends_with("_sum ") {
                assert!((v - w).abs() < 1e-6 * v.max(1.0), "{key}: {v} vs {w}");
            } else {
                assert_eq!(*v, w, "{key} against {k}");
            }
        }
    }
    for op in ["chat", "text_completion"] {
        assert!(
            text.contains(&format!("gen_ai_operation_name=\"{op}\"")),
            "no {op} series"
        );
    }
    let output = summed(
        "gen_ai_client_token_usage_sum",
        "gen_ai_token_type=\"output\"",
    );
    let total: f64 = output.values().sum();
    let ours = text
        .lines()
        .find(|l| l.starts_with("tokentap_output_tokens_total{upstream=\"sim\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert_eq!(total, ours);
    assert!(text.contains("gen_ai_provider_name=\"openai\""));
    assert!(
        text.contains("gen_ai_request_model=\"tokentap-sim\"")
            || text.contains("gen_ai_request_model=\"m\""),
        "model label"
    );
}
