//! The `tokentap` command: parse the command line, load the config, run. No logic here.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pingora::server::RunArgs;

use std::sync::Arc;

use tokentap::config::{Config, LogFormat};
use tokentap::server::Signals;
use tokentap::state::Live;

/// The static (musl) build's allocator: musl's own costs a short request 40% more CPU
/// (docs/performance.md, the container image).
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormatArg {
    Text,
    Json,
}

impl From<LogFormatArg> for LogFormat {
    fn from(f: LogFormatArg) -> Self {
        match f {
            LogFormatArg::Text => LogFormat::Text,
            LogFormatArg::Json => LogFormat::Json,
        }
    }
}

/// A transparent reverse proxy that meters LLM token streams: single-stream T/s,
/// system T/s, TTFT, TPOT, ITL and the concurrency→TPOT curve, per upstream, live.
#[derive(Parser)]
#[command(name = "tokentap", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulated backends, the proxy and a load generator in one process, with the live
    /// figures (`top`'s view) and the dashboard; every result at the end. Needs no config
    /// and no GPU.
    Demo(tokentap::demo::DemoArgs),
    /// Run the proxy.
    Run {
        #[command(flatten)]
        config: ConfigPath,
        /// Log lines as human-readable text or as JSON objects (default: `[log] format`,
        /// else text). The filter is RUST_LOG, else `[log] filter`, else info.
        #[arg(long, value_enum)]
        log_format: Option<LogFormatArg>,
    },
    /// Validate a config file: exit 0, or print every problem with its location and exit 1.
    Check {
        #[command(flatten)]
        config: ConfigPath,
    },
    /// A simulated continuously batching backend that streams as one API does (--dialect:
    /// OpenAI, Responses, Anthropic, TGI, Ollama, llama.cpp).
    Sim(tokentap::sim::SimArgs),
    /// A load generator that reports client-side TTFT, TPOT, single-stream and system T/s.
    Load(tokentap::load::LoadArgs),
    /// The live figures of a running tokentap, from its admin API: redrawn in place on a
    /// terminal, one line a second otherwise.
    Top(tokentap::top::TopArgs),
}

/// The config file, as `--config FILE` or as the argument itself.
#[derive(clap::Args)]
struct ConfigPath {
    /// The TOML config file (see config/ for commented examples).
    #[arg(long, short, value_name = "FILE", conflicts_with = "file")]
    config: Option<PathBuf>,
    /// The same, given without `--config`.
    #[arg(value_name = "FILE", required_unless_present = "config")]
    file: Option<PathBuf>,
}

impl ConfigPath {
    fn path(self) -> PathBuf {
        self.config.or(self.file).unwrap_or_default()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => tokentap::demo::run(args),
        Command::Run { config, log_format } => run(config.path(), log_format.map(LogFormat::from)),
        Command::Check { config } => return check(config.path()),
        Command::Sim(args) => tokentap::sim::run_blocking(args),
        Command::Load(args) => tokentap::load::run_blocking(args),
        Command::Top(args) => tokentap::top::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("tokentap: {e:#}");
            if !format!("{e:#}").ends_with('\n') {
                eprintln!();
            }
            ExitCode::FAILURE
        }
    }
}

fn run(path: PathBuf, log_format: Option<LogFormat>) -> anyhow::Result<()> {
    let config = Config::load(&path)?;
    tokentap::logs::init(log_format.unwrap_or(config.log.format), &config.log);
    // Both addresses are tried before anything says it is up: a port in use is an error
    // now, not a line after "listening".
    for (key, addr) in [
        ("listen.proxy", config.listen.proxy),
        ("listen.admin", config.listen.admin),
    ] {
        tokentap::server::can_listen(addr)
            .map_err(|e| anyhow::anyhow!("cannot listen on {key} {addr}: {e}"))?;
    }
    tokentap::logs::started(&config);
    let live = Live::new(config, Some(path));
    let (server, transport) = tokentap::server::build(&live);
    let signals = Signals {
        live: Arc::clone(&live),
        transport,
    };
    server.run(RunArgs {
        shutdown_signal: Box::new(signals),
    });
    live.access.flush();
    Ok(())
}

fn check(path: PathBuf) -> ExitCode {
    match Config::load(&path) {
        Ok(config) => {
            println!(
                "{}: ok ({} upstream{}, {} route{})",
                path.display(),
                config.upstreams.len(),
                if config.upstreams.len() == 1 { "" } else { "s" },
                config.routes.len(),
                if config.routes.len() == 1 { "" } else { "s" },
            );
            // What each rollout will do, and its shadow (a mirror to its `to` is that).
            for (i, r) in config.routes.iter().enumerate() {
                let Some(ro) = &r.rollout else { continue };
                let name = |u: usize| config.upstreams[u].name.as_str();
                let shadow = r.mirrors.iter().position(|m| m.upstream == ro.to);
                println!(
                    "  route[{i}] ({}): rollout {} → {} at {:?}%, judged every {} s; while {} serves under half it also gets copies of {}'s requests (route[{i}].mirror[{}], at most {} in flight) so both run at the same load",
                    r.name,
                    name(ro.from),
                    name(ro.to),
                    ro.steps,
                    ro.every.as_secs(),
                    name(ro.to),
                    name(ro.from),
                    shadow.map_or(String::new(), |j| j.to_string()),
                    shadow.map_or(0, |j| r.mirrors[j].max_in_flight),
                );
                println!("    {}", tokentap::rollout::copies_cost(&config, r, ro));
                if r.spill {
                    println!(
                        "    spill: nothing spills into or out of {} and {} while the rollout holds a share, so each step's share holds",
                        name(ro.from),
                        name(ro.to),
                    );
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprint!("{e}");
            ExitCode::FAILURE
        }
    }
}
