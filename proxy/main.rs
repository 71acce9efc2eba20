//! The `tokentap` command: parse the command line, load the config, run. No logic here.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pingora::server::RunArgs;

use tokentap::config::Config;

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
    /// figures printed every second. Needs no config and no GPU.
    Demo(tokentap::demo::DemoArgs),
    /// Run the proxy.
    Run {
        /// The TOML config file (see config/ for commented examples).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a config file: exit 0, or print every problem with its location and exit 1.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// A simulated continuously batching backend, OpenAI-compatible.
    Sim(tokentap::sim::SimArgs),
    /// A load generator that reports client-side TTFT, TPOT, single-stream and system T/s.
    Load(tokentap::load::LoadArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => tokentap::demo::run(args),
        Command::Run { config } => run(config),
        Command::Check { config } => return check(config),
        Command::Sim(args) => tokentap::sim::run_blocking(args),
        Command::Load(args) => tokentap::load::run_blocking(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokentap: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&path)?;
    eprintln!(
        "tokentap: proxy on http://{}, admin on http://{} (/stats, /metrics, /healthz)",
        config.listen.proxy, config.listen.admin
    );
    let (server, _shared, _transport) = tokentap::server::build(config);
    // SIGTERM: graceful (streams get the grace period), SIGINT: fast. SIGQUIT (pingora's
    // upgrade) shuts down gracefully too: tokentap hands no listening socket over.
    server.run(RunArgs::default());
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
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprint!("{e}");
            ExitCode::FAILURE
        }
    }
}
