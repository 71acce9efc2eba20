//! The decisions taken from the figures, against simulated backends through tokentap:
//! goodput as `vllm bench serve` defines it, cost per million tokens, the decode roofline,
//! the endpoints a pool needs at its SLO, and `tokentap load --plot`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::time::Duration;

use common::{fetch, proxy, proxy_addr, sim, stats, stats_when, stats_where, upstream_named};
use tokentap::load::{self, LoadArgs, Mode, Options, RequestRecord, Slo};

/// A load of `mode` through `url` for `secs`, `max_tokens` a request, `headers` sent.
async fn run(
    url: String,
    mode: Mode,
    secs: f64,
    max_tokens: u64,
    headers: &[&str],
    options: &Options,
) -> (load::PhaseReport, Vec<RequestRecord>) {
    let target = LoadArgs {
        max_tokens,
        include_usage: true,
        headers: headers.iter().map(|h| (*h).to_owned()).collect(),
        ..LoadArgs::for_url(url)
    }
    .target()
    .unwrap();
    load::phase_with(
        &target,
        mode,
        Duration::ZERO,
        Duration::from_secs_f64(secs),
        options,
    )
    .await
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs()
}

/// Short answers (10 tokens, ~100 ms) and long ones (40 tokens, ~400 ms) from the same
/// backend, judged against e2e ≤ 250 ms and TPOT ≤ 30 ms: tokentap's good requests are
/// those vLLM's `--goodput e2el:250 tpot:30` counts from the load's own per-request
/// records, within one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodput_is_vllm_s_on_the_same_requests() {
    let backend = sim("1:10").ttft(5.0).max_tokens(128).await;
    let tap = proxy(
        &[("b", backend.addr)],
        "[upstream.slo]\ne2e_ms = 250\ntpot_ms = 30\n",
    )
    .await;
    // Drained as vLLM's benchmark waits for every request it sent: each one the proxy
    // judged has its record.
    let options = Options {
        slo: Some("e2e:250,tpot:30".parse().unwrap()),
        records: true,
        progress: false,
        drain: Duration::from_secs(5),
    };
    let url = format!("http://{}", proxy_addr(&tap));
    let four = Mode::Closed { concurrency: 4 };
    let (short, long) = tokio::join!(
        run(url.clone(), four, 4.0, 10, &[], &options),
        run(url, four, 4.0, 40, &[], &options)
    );
    let records: Vec<RequestRecord> = short.1.into_iter().chain(long.1).collect();
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let u = &s["upstreams"][0];

    // vLLM's definition, from the client's records: every SLO holds, TPOT = (e2e − TTFT)
    // / (N − 1), 0 under two tokens.
    let vllm_good = records
        .iter()
        .filter(|r| r.error.is_none())
        .filter(|r| {
            let (ttft, e2e) = (r.ttft_ms.unwrap(), r.e2e_ms.unwrap());
            let tpot = if r.output_tokens > 1 {
                (e2e - ttft) / (r.output_tokens - 1) as f64
            } else {
                0.0
            };
            e2e <= 250.0 && tpot <= 30.0
        })
        .count() as i64;
    let completed = records.iter().filter(|r| r.error.is_none()).count() as i64;

    assert!(
        vllm_good > 10 && completed - vllm_good > 10,
        "a mix of good and late requests: {vllm_good} of {completed}"
    );
    let load_good: u64 = [&short.0, &long.0]
        .iter()
        .map(|r| r.goodput.map_or(0, |g| g.good))
        .sum();
    let in_window = records
        .iter()
        .filter(|r| !r.after_window && r.good == Some(true))
        .count();
    assert_eq!(load_good as usize, in_window, "the load's own count");
    let g = &u["goodput"];
    let tokentap_good = g["good_requests"].as_i64().unwrap();
    assert!(
        (tokentap_good - vllm_good).abs() <= 1,
        "tokentap {tokentap_good}, vLLM's definition {vllm_good}: {g:#}"
    );
    // Nothing was cut: tokentap judged exactly the requests the load recorded.
    assert_eq!(g["requests"].as_i64(), Some(completed), "{g:#}");
    let metrics = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8(metrics.body).unwrap();
    let counter = |result: &str| {
        let key = format!("tokentap_slo_requests_total{{upstream=\"b\",result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .map(|v| v.parse::<i64>().unwrap())
    };
    assert_eq!(counter("good"), Some(tokentap_good), "{text}");
    assert!(counter("e2e").unwrap() >= completed - vllm_good - 1);
    assert_eq!(counter("tpot"), Some(0));
    assert_eq!(counter("ttft"), Some(0));
}

/// Two priced upstreams with a model on an H100 SXM (70.6 GB: a 47.5 T/s roofline), one
/// decoding at 25 ms a token alone, one at 10: the first's MBU is 84%, the second is
/// reported as misconfigured; each one's cost per million tokens is the formula on its
/// own system T/s, now and at the SLO-bounded point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_and_roofline_follow_from_the_figures() {
    let (slow, fast) = (
        sim("1:25").ttft(5.0).max_tokens(128).await,
        sim("1:10").ttft(5.0).max_tokens(128).await,
    );
    let priced = "cost_per_hour = 2.5\ncost_currency = \"USD\"\ngpus = 1\n\
                  model = { weight_gb = 70.6 }\ngpu = \"h100-sxm\"\n\
                  [upstream.slo]\ntpot_ms = 30\n";
    let text = format!(
        "[[upstream]]\nname = \"slow\"\nurl = \"http://{}\"\n{priced}\
         [[upstream]]\nname = \"fast\"\nurl = \"http://{}\"\n{priced}\
         [[route]]\nheaders = {{ \"x-arm\" = \"fast\" }}\nsplit = {{ fast = 1 }}\n\
         [[route]]\nsplit = {{ slow = 1 }}\n",
        slow.addr, fast.addr
    );
    let tap = proxy(&[], &text).await;
    let url = format!("http://{}", proxy_addr(&tap));
    let one = Mode::Closed { concurrency: 1 };
    let options = Options::default();
    let (a, b) = tokio::join!(
        run(url.clone(), one, 3.5, 40, &[], &options),
        run(url, one, 3.5, 40, &["x-arm: fast"], &options)
    );
    assert!(a.0.errors.is_empty() && b.0.errors.is_empty());
    let s = stats_where(&tap, |s| {
        s["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .all(|u| u["roofline"]["mbu_at_concurrency"] == 1)
    })
    .await;
    let (slow, fast) = (upstream_named(&s, "slow"), upstream_named(&s, "fast"));

    let r = &slow["roofline"];
    assert!(
        close(
            r["single_stream_ceiling_tps"].as_f64().unwrap(),
            47.45,
            0.001
        ),
        "{r:#}"
    );
    let mbu = r["mbu_pct"].as_f64().unwrap();
    assert!((mbu - 84.3).abs() < 1.5, "MBU {mbu}: {r:#}");
    assert!(r["problem"].is_null());
    let r = &fast["roofline"];
    assert!(
        r["mbu_pct"].is_null() && r["mbu_pct_now"].is_null(),
        "{r:#}"
    );
    assert!(
        r["problem"]
            .as_str()
            .unwrap()
            .contains("model.weight_gb (70.6)"),
        "{r:#}"
    );

    for u in [&slow, &fast] {
        let c = &u["cost"];
        let tps = u["system_tps"].as_f64().unwrap();
        let want = 2.5 / (tps * 3600.0) * 1e6;
        let got = c["per_million_output_tokens"].as_f64().unwrap();
        assert!(close(got, want, 0.01), "{got} ≠ {want}: {c:#}");
        assert!(close(c["system_tps_per_gpu"].as_f64().unwrap(), tps, 1e-9));
        // The pool's bound: one endpoint's × its one endpoint here.
        let bounded = c["pool_slo_bounded_system_tps"].as_f64().unwrap();
        let one = u["slo"]["slo_bounded_system_tps"].as_f64().unwrap();
        assert!(close(bounded, one, 1e-9), "{u:#}");
        let want = 2.5 / (bounded * 3600.0) * 1e6;
        let got = c["per_million_at_slo_bounded"].as_f64().unwrap();
        assert!(close(got, want, 0.01), "{got} ≠ {want}: {u:#}");
        assert_eq!(c["currency"], "USD");
    }
    // 25 ms a token alone is 40 T/s: $17.36 per million at the SLO-bounded point.
    let bounded = slow["cost"]["per_million_at_slo_bounded"].as_f64().unwrap();
    assert!((bounded - 17.36).abs() < 0.5, "{bounded}");
}

/// A pool of two endpoints, each capped at its SLO-bounded 4 in flight (333 T/s), asked
/// for ~1000 T/s by an open loop: 4 endpoints needed with 20% headroom ("add 2"); with a
/// third and fourth found by discovery, the queue drains and the advice reads "enough".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_says_how_many_endpoints_the_demand_needs() {
    // An open loop whose rate is what it measures: alone on the machine (two at once on
    // two cores fall behind their schedules and catch up).
    let _machine = common::whole_machine().await;
    // Saturated from 2 in flight: 333 T/s at 2, 3 and 4 (TPOT 6, 9, 12 ms).
    let curve = "1:5,2:6,4:12,8:24";
    let mut sims = Vec::new();
    for _ in 0..4 {
        sims.push(sim(curve).ttft(5.0).max_tokens(128).await);
    }
    let dir = std::env::temp_dir().join(format!("tokentap-capacity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("endpoints.txt");
    let list = |n: usize| {
        sims[..n]
            .iter()
            .map(|s| format!("http://{}\n", s.addr))
            .collect::<String>()
    };
    std::fs::write(&file, list(2)).unwrap();
    let config = format!(
        "[[upstream]]\nname = \"pool\"\ndiscover = {{ file = \"{}\", every_secs = 1 }}\n\
         max_concurrency = 4\nmax_queue = 10000\nqueue_timeout_ms = 60000\n\
         [upstream.slo]\ntpot_ms = 14\nmin_concurrency = 4\n",
        file.display()
    );
    let tap = proxy(&[], &config).await;
    stats_when(&tap, |u| u["endpoints"].as_array().unwrap().len() == 2).await;
    let url = format!("http://{}", proxy_addr(&tap));
    // 30 tokens a request at 33.3 a second: 1000 T/s asked of a pool that serves 666.
    // For 40 s: the window's arrivals take 10 s to ramp up and the held figure is the
    // median of the last 30 s, so the need (3.5–3.75) is past 3's margin (3.3) only some
    // 20 s in; 22 s of load left a moment to see it, and none where the curve read high.
    let load = tokio::spawn(async move {
        let open = Mode::Open { rate: 100.0 / 3.0 };
        run(url, open, 40.0, 30, &[], &Options::default()).await
    });
    // The held figure settles on 4 (a start that reads high is not held).
    let over = stats_when(&tap, |u| {
        u["capacity"]["endpoints_needed"] == 4 && u["requests_total"].as_u64().unwrap() > 150
    })
    .await;
    let c = &over["upstreams"][0]["capacity"];
    let per = c["slo_bounded_tps_per_endpoint"].as_f64().unwrap();
    assert!(close(per, 1000.0 / 3.0, 0.06), "{c:#}");
    let demand = c["demand_tps"].as_f64().unwrap();
    assert!(close(demand, 1000.0, 0.15), "{c:#}");
    assert_eq!(c["endpoints_now"], 2, "{c:#}");
    assert_eq!(c["endpoints_needed"], 4, "{c:#}");
    assert_eq!(c["advice"], "add 2", "{c:#}");
    assert!(over["upstreams"][0]["queued"].as_u64().unwrap() > 0);

    std::fs::write(&file, list(4)).unwrap();
    let after = stats_when(&tap, |u| {
        u["capacity"]["endpoints_now"] == 4 && u["queued"] == 0
    })
    .await;
    let c = &after["upstreams"][0]["capacity"];
    assert_eq!(c["endpoints_needed"], 4, "{c:#}");
    assert_eq!(c["advice"], "enough", "{c:#}");
    let (report, _) = load.await.unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let text = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"")
        .await
        .body;
    let text = String::from_utf8(text).unwrap();
    assert!(
        text.contains("tokentap_capacity_endpoints_needed{upstream=\"pool\"} 4"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The figure an autoscaler acts on must hold still under a steady load: an open loop
/// asking for about four endpoints' worth (each second alone reads 3.6 to 4.5, the need
/// hovering at a whole number), sampled every second for two of its median's spans (three
/// windows of 5 s), takes one value; the load doubled, it moves within a minute. The SLO is on the gaps' median: their p90 at
/// the SLO-bounded point (12 ms against 14) breaks it now and then on a busy machine, and
/// with no other point supported the figure's basis would come and go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_needed_holds_still_under_a_steady_load_and_follows_a_step() {
    // An open loop whose rate is what it measures: alone on the machine (two at once on
    // two cores fall behind their schedules and catch up).
    let _machine = common::whole_machine().await;
    let curve = "1:5,2:6,4:12,8:24";
    let (a, b) = (
        sim(curve).ttft(5.0).max_tokens(128).await,
        sim(curve).ttft(5.0).max_tokens(128).await,
    );
    // Capped at the SLO-bounded 4 in flight, a short queue: what the pool cannot take is
    // refused at once, and the arrivals still say what was asked.
    let config = format!(
        "[metrics]\nwindow_secs = 5\n[[upstream]]\nname = \"pool\"\n\
         endpoints = [\"http://{}\", \"http://{}\"]\n\
         max_concurrency = 8\nmax_queue = 8\nqueue_timeout_ms = 2000\n\
         [upstream.slo]\ntpot_ms = 14\npercentile = 50\nmin_concurrency = 4\n",
        a.addr, b.addr
    );
    let tap = proxy(&[], &config).await;
    let url = format!("http://{}", proxy_addr(&tap));
    // 30 tokens at 37 a second: 1,110 T/s, with 20% headroom 4.0 endpoints of 333 T/s.
    let open = |secs: f64| {
        let url = url.clone();
        tokio::spawn(async move {
            run(
                url,
                Mode::Open { rate: 37.0 },
                secs,
                30,
                &[],
                &Options::default(),
            )
            .await
        })
    };
    // It lasts past the step's minute (aborted once the figure moves).
    let first = open(200.0);
    // Past the figure's first seconds (it settles on 10 samples of a second).
    stats_when(&tap, |u| {
        u["capacity"]["need_now"].is_number() && u["requests_total"].as_u64().unwrap() > 400
    })
    .await;
    // And well past the 15 s its held value is the median of: the load's first seconds
    // (the sims and the loop warming up, a loop that fell behind its schedule catching up)
    // can read one endpoint more, which a median over them held for ~35 s once with the
    // suite's light tests beside it. What is awaited is time itself.
    tokio::time::sleep(Duration::from_secs(25)).await;
    let (mut held, mut now) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        let s = stats(&tap).await;
        let c = &s["upstreams"][0]["capacity"];
        held.push(c["endpoints_needed"].as_u64());
        now.push(c["need_now"].as_f64());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let whole: Vec<Option<u64>> = now
        .iter()
        .map(|n| n.map(|n| (n - 1e-9).ceil() as u64))
        .collect();
    eprintln!("held {held:?}\neach second alone {whole:?}");
    assert!(
        held.iter().all(|&n| n == held[0] && n.is_some()),
        "held {held:?}"
    );
    let before = held[0].unwrap();
    // The load doubled.
    let second = open(70.0);
    let stepped = std::time::Instant::now();
    let moved = loop {
        let s = stats(&tap).await;
        let n = s["upstreams"][0]["capacity"]["endpoints_needed"].as_u64();
        if n.is_some_and(|n| n >= before + 2) {
            break stepped.elapsed();
        }
        assert!(
            stepped.elapsed() < Duration::from_secs(60),
            "not moved in a minute: {n:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("from {before}: moved in {moved:?}");
    first.abort();
    second.abort();
}

/// `load --plot`: an SVG whose points are the load's table, the SLO-bounded phase marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plot_shows_the_load_s_table() {
    let backend = sim("1:10,4:12,16:30").ttft(5.0).max_tokens(128).await;
    let url = format!("http://{}", backend.addr);
    let slo: Slo = "tpot:20".parse().unwrap();
    let options = Options {
        slo: Some(slo),
        ..Options::default()
    };
    let mut reports = Vec::new();
    for c in [1, 4, 16] {
        let mode = Mode::Closed { concurrency: c };
        reports.push(run(url.clone(), mode, 1.0, 20, &[], &options).await.0);
    }
    let svg = load::plot_svg(&reports, Some(&slo));
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let points = |class: &str| -> Vec<(usize, f64)> {
        doc.descendants()
            .filter(|n| n.has_tag_name("circle") && n.attribute("class") == Some(class))
            .map(|n| {
                (
                    n.attribute("data-concurrency").unwrap().parse().unwrap(),
                    n.attribute("data-tps").unwrap().parse().unwrap(),
                )
            })
            .collect()
    };
    let table = |f: fn(&load::PhaseReport) -> Option<f64>| -> Vec<(usize, f64)> {
        reports
            .iter()
            .map(|r| (r.concurrency.unwrap(), f(r).unwrap()))
            .collect()
    };
    assert_eq!(points("single"), table(|r| r.single_stream_tps));
    assert_eq!(points("system"), table(|r| r.system_tps));
    // TPOT 30 ms at 16 breaks 20 ms: the SLO-bounded phase is 4's.
    let marked = points("slo-bounded");
    assert_eq!(marked.len(), 1, "{svg}");
    assert_eq!(marked[0].0, 4);
    assert_eq!(Some(marked[0].1), reports[1].system_tps);
}

/// Clients that stop are not SLO misses: a backend inside both SLOs (26 ms a token, TTFT
/// 40 ms; SLOs 30 and 500 ms) under 16 closed-loop clients that stop mid-answer at the
/// window's end (each one's last request cut): every finished request is good, the cut
/// ones are counted as cancelled, and attainment is 100%. A client that leaves after
/// waiting past the TTFT SLO for its first token had already missed it: judged late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_stop_are_not_slo_misses() {
    let backend = sim("1:26").ttft(40.0).max_tokens(128).await;
    let tap = proxy(
        &[("b", backend.addr)],
        // tpot_ms steers an adaptive cap: from 16, so that no client waits for a slot.
        "[upstream.slo]\ntpot_ms = 30\nttft_ms = 500\nmin_concurrency = 16\n",
    )
    .await;
    let url = format!("http://{}", proxy_addr(&tap));
    let options = Options {
        slo: None,
        records: false,
        progress: false,
        drain: Duration::ZERO, // cut at the window's end, as a user stops
    };
    let (r, _) = run(
        url,
        Mode::Closed { concurrency: 16 },
        4.0,
        64,
        &[],
        &options,
    )
    .await;
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let g = &upstream_named(&s, "b")["goodput"];
    assert!(r.requests >= 16, "{}", r.requests);
    assert!(g["cancelled"].as_u64().unwrap() >= 8, "{g:#}");
    assert_eq!(g["requests"], g["good_requests"], "{g:#}");
    assert_eq!(g["attainment_pct"], 100.0, "{g:#}");

    // A backend whose first token takes a second: a client that gives up after 700 ms
    // had waited past the TTFT SLO (500 ms) already.
    let late = sim("1:26").ttft(1000.0).max_tokens(128).await;
    let tap = proxy(
        &[("b", late.addr)],
        "[upstream.slo]\ntpot_ms = 30\nttft_ms = 500\nmin_concurrency = 16\n",
    )
    .await;
    let admin = tap.shared().config.listen.admin;
    let body =
        r#"{"model":"m","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut client = tokio::net::TcpStream::connect(proxy_addr(&tap))
        .await
        .unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut client, req.as_bytes())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    drop(client); // gave up
    let s = stats_where(&tap, |s| {
        let g = &upstream_named(s, "b")["goodput"];
        g["requests"].as_u64() > g["good_requests"].as_u64()
    })
    .await;
    let g = &upstream_named(&s, "b")["goodput"];
    assert_eq!(
        (&g["requests"], &g["cancelled"]),
        (&1.into(), &0.into()),
        "{g:#}"
    );
    let metrics = String::from_utf8(fetch(admin, "GET", "/metrics", b"").await.body).unwrap();
    assert!(
        metrics.contains("tokentap_slo_requests_total{upstream=\"b\",result=\"ttft\"} 1"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("slo_requests"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
