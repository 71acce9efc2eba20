//! The dashboard in a real browser: Debian's chromium driven through chromedriver (the
//! W3C WebDriver protocol, plain HTTP and JSON) against a running `tokentap demo` whose
//! admin API needs a token. The page must ask for the token, then hold data in every chart
//! within 10 s, show the figures of the snapshot it names exactly as `/stats/history` has
//! that second, and log no error. A screenshot is saved to `target/dashboard.png`.
//!
//! Needs `chromium` and `chromium-driver` (`apt-get install chromium chromium-driver`);
//! without them the test says so and passes, except in CI (`CI=true`), where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{free_addr, send};
use serde_json::{json, Value};

const TOKEN: &str = "dashboard-test-token";

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn browser() -> Option<(&'static str, &'static str)> {
    let found = |p: &str| std::path::Path::new(p).exists();
    let pair = ("/usr/bin/chromium", "/usr/bin/chromedriver");
    (found(pair.0) && found(pair.1)).then_some(pair)
}

/// One WebDriver command; the `value` of its answer.
async fn wd(driver: SocketAddr, method: &str, path: &str, body: Value) -> Value {
    let body = if method == "GET" {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    let resp = send(driver, method, path, &body, &[]).await.unwrap();
    let v: Value = serde_json::from_slice(&resp.body).unwrap_or(Value::Null);
    assert!(
        resp.status == 200,
        "WebDriver {method} {path}: {} {v}",
        resp.status
    );
    v["value"].clone()
}

/// Runs `script` in the page and returns what it returns.
async fn run(driver: SocketAddr, session: &str, script: &str) -> Value {
    wd(
        driver,
        "POST",
        &format!("/session/{session}/execute/sync"),
        json!({"script": script, "args": []}),
    )
    .await
}

/// What the page shows: its snapshot's time, each chart's points, every figure.
const READ_PAGE: &str = r#"
const t = window.tokentap;
if (!t) return null;
return {
  t: t.snap ? t.snap.t : null,
  login: !document.getElementById('login').hidden,
  charts: Object.fromEntries(Object.entries(t.charts).map(([k, c]) => [k, c.data[0].length])),
  curve_points: t.charts.curve ? t.charts.curve.data.slice(1).map(s => s.filter(v => v !== null).length) : [],
  figs: [...document.querySelectorAll('[data-fig]')].map(e => [e.dataset.up || '', e.dataset.fig, e.dataset.value]),
  endpoints: [...document.querySelectorAll('tr.ep')].map(e => [e.dataset.up, e.dataset.endpoint, e.dataset.state]),
  tenants: [...document.querySelectorAll('[data-tfig]')].map(e => [e.dataset.tenant, e.dataset.tfig, e.dataset.value]),
  snap_tenants: t.snap && t.snap.stats.tenants ? t.snap.stats.tenants.top : null,
  errors: t.errors,
};"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_a_real_browser() {
    // A demo at 16 clients and a browser: a core's share.
    let _load = common::load_slot().await;
    let Some((chromium, chromedriver)) = browser() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI needs chromium and chromedriver: apt-get install chromium chromium-driver"
        );
        eprintln!(
            "skipped: no /usr/bin/chromium or /usr/bin/chromedriver (apt-get install chromium chromium-driver)"
        );
        return;
    };
    let (proxy, admin, driver) = (free_addr(), free_addr(), free_addr());
    let _demo = Killed(
        Command::new(env!("CARGO_BIN_EXE_tokentap"))
            .args([
                "demo",
                "--duration",
                "90",
                "--levels",
                "4,16",
                "--phase-secs",
                "5",
            ])
            .args([
                "--listen",
                &proxy.to_string(),
                "--admin",
                &admin.to_string(),
            ])
            .env("TOKENTAP_ADMIN_TOKEN", TOKEN)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _driver = Killed(
        Command::new(chromedriver)
            .arg(format!("--port={}", driver.port()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    for addr in [admin, driver] {
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "{addr} did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let profile = std::env::temp_dir().join(format!("tokentap-chromium-{}", std::process::id()));
    let caps = json!({"capabilities": {"alwaysMatch": {
        "browserName": "chrome",
        "goog:loggingPrefs": {"browser": "ALL"},
        "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     "--window-size=1400,2000",
                     format!("--user-data-dir={}", profile.display())],
        },
    }}});
    let session = wd(driver, "POST", "/session", caps).await;
    let session = session["sessionId"].as_str().unwrap().to_owned();
    let page = format!("http://{admin}/");
    wd(
        driver,
        "POST",
        &format!("/session/{session}/url"),
        json!({ "url": page }),
    )
    .await;

    // The admin API has a token: the page asks for it.
    let asked = Instant::now() + Duration::from_secs(10);
    loop {
        let v = run(driver, &session, READ_PAGE).await;
        if v["login"] == true {
            break;
        }
        assert!(
            Instant::now() < asked,
            "the page did not ask for the token: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    run(
        driver,
        &session,
        &format!(
            "document.getElementById('token').value = '{TOKEN}'; document.getElementById('login').requestSubmit(); return true;"
        ),
    )
    .await;

    // Within 10 s every chart holds data, the curve included.
    let started = Instant::now();
    let shown = loop {
        let v = run(driver, &session, READ_PAGE).await;
        let charts_full = v["charts"]
            .as_object()
            .is_some_and(|c| c.len() == 6 && c.values().all(|n| n.as_u64() >= Some(3)));
        let curve_drawn = v["curve_points"]
            .as_array()
            .is_some_and(|p| p.iter().any(|n| n.as_u64() > Some(0)));
        if v["t"].is_u64() && charts_full && curve_drawn {
            break v;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the charts did not fill within 10 s: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(shown["errors"], json!([]), "page errors");
    // The demo's pool: big-batch's three replicas, each with its state.
    let endpoints = shown["endpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 3, "{endpoints:?}");
    for e in endpoints {
        assert_eq!(e[0], "big-batch", "{e}");
        assert!(
            e[1].as_str().unwrap().starts_with("http://127.0.0.1:"),
            "{e}"
        );
        assert_eq!(e[2], "healthy", "{e}");
    }

    // The figures shown are those of the second the page names, as /stats/history has it.
    let auth = format!("Bearer {TOKEN}");
    let history = send(
        admin,
        "GET",
        "/stats/history",
        b"",
        &[("authorization", &auth)],
    )
    .await
    .unwrap();
    assert_eq!(history.status, 200);
    let history: Value = serde_json::from_slice(&history.body).unwrap();
    let t = shown["t"].as_u64().unwrap();
    let point = history["points"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["t"].as_u64() == Some(t))
        .unwrap_or_else(|| panic!("no history point at {t}"));
    let mut compared = 0;
    for f in shown["figs"].as_array().unwrap() {
        let (up, name, value) = (
            f[0].as_str().unwrap(),
            f[1].as_str().unwrap(),
            f[2].as_str().unwrap(),
        );
        let Some(u) = point["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["name"] == up)
        else {
            continue;
        };
        let expected = match name.rsplit_once('_') {
            Some((metric, q)) if ["p50", "p90", "p99"].contains(&q) => u[metric][q].clone(),
            _ if name == "exact_share_pct" => u["estimated_tokens_share_pct"]
                .as_f64()
                .map_or(Value::Null, |e| json!(100.0 - e)),
            _ => u[name].clone(),
        };
        let expected = expected.as_f64();
        let shown_value = value.parse::<f64>().ok();
        match (expected, shown_value) {
            (Some(e), Some(s)) => assert!(
                (e - s).abs() <= 1e-9 * e.abs().max(1.0),
                "{up} {name}: shown {s}, /stats/history {e}"
            ),
            (None, None) => {}
            other => panic!("{up} {name}: shown {value:?}, /stats/history {other:?}"),
        }
        compared += 1;
    }
    assert!(compared >= 30, "only {compared} figures compared: {shown}");
    // And /stats now is no older than the page's second.
    let stats = send(admin, "GET", "/stats", b"", &[("authorization", &auth)])
        .await
        .unwrap();
    let stats: Value = serde_json::from_slice(&stats.body).unwrap();
    for u in stats["upstreams"].as_array().unwrap() {
        let then = point["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == u["name"])
            .unwrap();
        assert!(u["requests_total"].as_u64() >= then["requests_total"].as_u64());
    }

    // The demo's clients are one tenant (`[tenants]`, `x-tenant`): its row shows the
    // figures of the snapshot the page names, all of the output its own.
    let tenants = shown["snap_tenants"]
        .as_array()
        .expect("the demo's tenants");
    let demo = tenants
        .iter()
        .find(|t| t["tenant"] == "demo-clients")
        .unwrap_or_else(|| panic!("no demo-clients tenant: {tenants:?}"));
    assert_eq!(demo["output_share_pct"], 100.0, "{demo}");
    let mut tenant_figs = 0;
    for f in shown["tenants"].as_array().unwrap() {
        let (tenant, name, value) = (f[0].as_str().unwrap(), f[1].as_str().unwrap(), &f[2]);
        let row = tenants.iter().find(|t| t["tenant"] == tenant).unwrap();
        let expected = match name.rsplit_once('_') {
            Some((metric, q)) if ["p50", "p90"].contains(&q) => row[metric][q].clone(),
            _ => row[name].clone(),
        };
        let shown_value = value.as_str().unwrap().parse::<f64>().ok();
        match (expected.as_f64(), shown_value) {
            // The page's number as JavaScript prints it, to its last bit or so.
            (Some(e), Some(s)) => assert!(
                (e - s).abs() <= 1e-9 * e.abs().max(1.0),
                "tenant {tenant} {name}: shown {s}, the snapshot {e}"
            ),
            (e, s) => assert_eq!(e, s, "tenant {tenant} {name}"),
        }
        tenant_figs += 1;
    }
    assert!(tenant_figs >= 10, "{tenant_figs} tenant figures: {shown}");

    // No console errors, by the browser's own log.
    let log = wd(
        driver,
        "POST",
        &format!("/session/{session}/se/log"),
        json!({"type": "browser"}),
    )
    .await;
    let severe: Vec<&Value> = log
        .as_array()
        .map(|l| l.iter().filter(|e| e["level"] == "SEVERE").collect())
        .unwrap_or_default();
    assert!(severe.is_empty(), "console errors: {severe:?}");

    let shot = wd(
        driver,
        "GET",
        &format!("/session/{session}/screenshot"),
        Value::Null,
    )
    .await;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot.as_str().unwrap())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/dashboard.png");
    std::fs::write(&out, png).unwrap();
    eprintln!("screenshot: {}", out.display());
    let _ = send(driver, "DELETE", &format!("/session/{session}"), b"", &[]).await;
    let _ = std::fs::remove_dir_all(profile);
}
