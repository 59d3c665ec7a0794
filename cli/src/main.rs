//! `tensorwire`: the command line.
//!
//! - `tensorwire demo`: a disaggregated diffusion pipeline on this machine (real bytes through the
//!   engine, simulated compute), then the same requests colocated, side by side.
//! - `tensorwire simulate`: a discrete-event simulation of a cluster with the orchestrator's own
//!   scheduler (no bytes moved, no sleeping), with `--sweep` for sizing the decode pool.
//! - `tensorwire bench`: the bench harness for every backend, the store and the connector, and a
//!   report directory with tables and SVG plots.
//! - `tensorwire serve` / `tensorwire worker`: an engine with a store node and the orchestrator
//!   service, and stage workers in other processes or hosts.
//! - `tensorwire top --connect ADDR`: a live view of a running cluster from its metrics
//!   endpoints (`--metrics-listen` on `serve`, `worker` and `demo --processes`).
//! - `tensorwire secret new FILE`: a cluster secret for `--secret-file`.
//! - `tensorwire soak`: the worker-process pipeline under load and chaos for N minutes, sampling
//!   memory, descriptors and the store each minute; fails on growth without bound or a lost request.
//!
//! Library warnings and errors go to stderr (`RUST_LOG` sets the level; default info).

// The options' doc comments are their --help texts, where brackets write a syntax
// (`MODEL[=SHARE]`), not links.
#![allow(rustdoc::broken_intra_doc_links)]

mod bench;
mod cluster;
mod demo;
mod elastic;
mod observe;
mod plot;
mod report;
mod scale_report;
mod scenario;
mod secret;
mod serve;
mod simulate;
mod soak;
mod supervise;
mod switching;
mod top;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// tensorwire: tensor transport and orchestration for disaggregated diffusion serving.
#[derive(Debug, Parser)]
#[command(name = "tensorwire", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run a disaggregated pipeline on this machine and compare it with colocated serving.
    Demo(demo::DemoArgs),
    /// Simulate a cluster (capacity planning); no bytes move, nothing sleeps.
    Simulate(simulate::SimArgs),
    /// Measure every backend, the store and the connector; write report.md and SVG plots.
    Bench(bench::BenchArgs),
    /// Run an engine with a store node (and optionally the orchestrator service).
    Serve(serve::ServeArgs),
    /// Run a stage worker that joins an orchestrator service.
    Worker(serve::WorkerArgs),
    /// Run the pipeline of worker processes under load and chaos for N minutes, sampling memory,
    /// descriptors and the store; fails if anything grows without bound or a request is lost.
    Soak(soak::SoakArgs),
    /// A live view of a running cluster, from its metrics endpoints (q quits).
    Top(top::TopArgs),
    /// Make a cluster secret.
    #[command(subcommand)]
    Secret(secret::SecretCmd),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tensorwire: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = match cli.cmd {
        Cmd::Demo(a) if a.scenario == scenario::SHIFT => rt.block_on(async {
            tokio::spawn(demo::shift::run(a)).await.unwrap_or_else(|e| Err(e.into()))
        }),
        Cmd::Demo(a) => rt
            .block_on(async { tokio::spawn(demo::run(a)).await.unwrap_or_else(|e| Err(e.into())) }),
        Cmd::Simulate(a) if a.elastic => elastic::run(a),
        Cmd::Simulate(a) => simulate::run(a),
        Cmd::Bench(a) => rt.block_on(async {
            tokio::spawn(bench::run(a)).await.unwrap_or_else(|e| Err(e.into()))
        }),
        Cmd::Serve(a) => rt.block_on(async {
            tokio::spawn(serve::serve(a)).await.unwrap_or_else(|e| Err(e.into()))
        }),
        Cmd::Worker(a) => rt.block_on(async {
            tokio::spawn(serve::worker(a)).await.unwrap_or_else(|e| Err(e.into()))
        }),
        Cmd::Soak(a) => rt
            .block_on(async { tokio::spawn(soak::run(a)).await.unwrap_or_else(|e| Err(e.into())) }),
        Cmd::Secret(c) => secret::run(c),
        Cmd::Top(a) => rt.block_on(top::run(a)),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorwire: {e:#}");
            ExitCode::FAILURE
        }
    }
}
