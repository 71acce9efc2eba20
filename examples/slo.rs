//! The adaptive cap against `tokentap sim` (the reference curve) under 128 closed-loop
//! clients with `tpot_ms = 30, percentile = 90`: prints the cap, the p90 of per-token gaps
//! and system T/s every 5 s; after `SWITCH` seconds the backend slows down 1.5× at every
//! batch size and the cap re-converges.
//!
//! Run: `cargo run --release --example slo` (about 4 minutes; `-- 60 60` for shorter phases)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tokentap::config::Config;
use tokentap::load::{self, LoadArgs, Mode};
use tokentap::server::Running;
use tokentap::sim::{Curve, Sim, SimArgs};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>());
    let before = args.next().transpose()?.unwrap_or(120);
    let after = args.next().transpose()?.unwrap_or(120);
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse()?,
        ..SimArgs::defaults()
    })
    .await?;
    let free = || std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
    let (proxy, admin) = (free()?, free()?);
    let config = Config::parse(
        &format!(
            "[listen]\nproxy = \"{proxy}\"\nadmin = \"{admin}\"\n[metrics]\nwindow_secs = 10\n\
             [[upstream]]\nname = \"sim\"\nurl = \"http://{}\"\nmax_queue = 1000\nqueue_timeout_ms = 120000\n\
             [upstream.slo]\ntpot_ms = 30\npercentile = 90\n",
            sim.addr
        ),
        "slo example",
    )?;
    let running = Running::start(config);
    running.wait_ready(Duration::from_secs(10)).await?;
    println!(
        "sim http://{}  proxy http://{proxy}  admin http://{admin}/stats",
        sim.addr
    );
    println!(
        "128 clients, SLO p90 TPOT ≤ 30 ms; the reference curve meets 30 ms at ~90 in flight\n"
    );
    let target = LoadArgs {
        duration: (before + after) as f64,
        warmup: 0.0,
        max_tokens: 128,
        include_usage: true,
        model: "m".into(),
        prompt: "p".into(),
        ..LoadArgs::for_url(format!("http://{proxy}"))
    }
    .target()?;
    let total = Duration::from_secs(before + after);
    let phase = tokio::spawn(async move {
        load::phase(
            &target,
            Mode::Closed { concurrency: 128 },
            Duration::ZERO,
            total,
            false,
        )
        .await
    });

    let mut limits: Vec<(u64, u64)> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    println!(
        "{:>5} {:>6} {:>10} {:>10} {:>12}",
        "t (s)", "cap", "p90 ms", "in flight", "system T/s"
    );
    for t in 0..before + after {
        tick.tick().await;
        if t == before {
            sim.engine.set_curve(Curve::reference().scaled(1.5));
            println!("-- the backend slows down 1.5× at every batch size --");
        }
        let s = tokentap::admin::stats(&running.shared(), &running.transport)
            .upstreams
            .remove(0);
        let cap = s.limit.unwrap_or(0);
        limits.push((t, cap));
        if t % 5 == 0 {
            let slo = s.slo.as_ref();
            let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
            println!(
                "{t:>5} {cap:>6} {:>10} {:>10} {:>12}",
                f(slo.and_then(|s| s.current_tpot_ms)),
                s.meter.in_flight,
                f(s.meter.system_tps)
            );
        }
    }
    let s = tokentap::admin::stats(&running.shared(), &running.transport)
        .upstreams
        .remove(0);
    let _ = phase.await;

    let settle = |from: u64, to: u64, band: std::ops::RangeInclusive<u64>| {
        limits
            .iter()
            .filter(|(t, _)| (from..to).contains(t))
            .find(|(_, l)| band.contains(l))
            .map(|(t, _)| t - from)
    };
    let window = |from: u64, to: u64| -> Vec<f64> {
        limits
            .iter()
            .filter(|(t, _)| (from..to).contains(t))
            .map(|&(_, l)| l as f64)
            .collect()
    };
    let cv = |v: &[f64]| {
        let m = v.iter().sum::<f64>() / v.len() as f64;
        (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt() / m
    };
    let last30 = window(before.saturating_sub(30), before);
    println!(
        "\nbefore the slowdown: cap in 72..=96 after {:?} s; last 30 s: mean cap {:.1}, CV {:.1}%",
        settle(0, before, 72..=96),
        last30.iter().sum::<f64>() / last30.len() as f64,
        100.0 * cv(&last30)
    );
    let tail = window(before + after - 30, before + after);
    println!("after the slowdown (new crossing: 1 in flight): cap ≤ 2 after {:?} s; last 30 s: mean cap {:.1}",
        settle(before, before + after, 1..=2), tail.iter().sum::<f64>() / tail.len() as f64);
    let analytic = 89.6 * 1000.0 / 30.0;
    if let Some(slo) = &s.slo {
        println!(
            "slo_bounded_system_tps {:.0} (analytic, the curve's system T/s at its 30 ms crossing ≈ 89.6 in flight: {analytic:.0})",
            slo.slo_bounded_system_tps.unwrap_or(f64::NAN)
        );
    }
    tokio::task::spawn_blocking(move || running.stop()).await?;
    Ok(())
}
