//! `lab`: starts and stops the network lab (tests/src/lab) that scripts/lab.sh runs.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use tests::lab::{Lab, Topology, link};

/// The network lab: nodes in network namespaces, sites behind NAT, links with delay, rate and
/// loss in user space. Needs root on Linux.
#[derive(Debug, Parser)]
#[command(name = "lab")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Starts the topology a TOML file describes and leaves it running.
    Up {
        /// The topology (for example tests/lab/three-sites.toml).
        file: PathBuf,
    },
    /// Tears down a running lab: its processes, links and namespaces.
    Down {
        /// The lab's name, or its topology file.
        lab: String,
    },
    /// Changes a site's link while the lab runs (connections and NAT mappings stay).
    Shape {
        /// The lab's name.
        lab: String,
        /// The site.
        site: String,
        /// One-way delay, each way, in milliseconds.
        #[arg(long)]
        delay_ms: f64,
        /// Rate each way in Mbit/s; 0 is unlimited.
        #[arg(long)]
        rate_mbit: f64,
        /// Frames lost each way, in percent.
        #[arg(long, default_value_t = 0.0)]
        loss_percent: f64,
    },
    /// Measures the mesh between sites: SmolLM2 served across a leader site and two member
    /// sites at each link setting (docs/perf.md, "Across sites").
    Bench(tests::lab::bench::Options),
    /// Carries frames between two TAP devices it creates (each NAMESPACE:INTERFACE); `up`
    /// starts one per site.
    Link {
        /// One end.
        a: String,
        /// The other end.
        b: String,
        /// One-way delay, each way, in milliseconds.
        #[arg(long, default_value_t = 0.0)]
        delay_ms: f64,
        /// Rate each way in Mbit/s; 0 is unlimited.
        #[arg(long, default_value_t = 0.0)]
        rate_mbit: f64,
        /// Frames lost each way, in percent.
        #[arg(long, default_value_t = 0.0)]
        loss_percent: f64,
        /// Seed of the losses.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// A file to follow while running: `delay_ms rate_mbit loss_percent` (`lab shape`).
        #[arg(long)]
        shape_file: Option<PathBuf>,
    },
}

fn end(s: &str) -> Result<(&str, &str)> {
    s.split_once(':')
        .with_context(|| format!("{s:?}: want NAMESPACE:INTERFACE"))
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Up { file } => {
            let topo = Topology::load(&file)?;
            let me = std::env::current_exe()?;
            let lab = Lab::up(&topo, &me)?;
            let described = lab.describe();
            let state = lab.detach()?;
            // The lab is up whether or not anyone reads this.
            let mut out = std::io::stdout();
            let _ = writeln!(
                out,
                "{described}lab {} is up (recorded in {}); scripts/lab.sh down {0} tears it down",
                topo.name,
                state.display()
            );
        }
        Cmd::Down { lab } => {
            let name = if lab.ends_with(".toml") {
                Topology::load(std::path::Path::new(&lab))?.name
            } else {
                lab
            };
            Lab::down(&name)?;
            println!("lab {name} is down");
        }
        Cmd::Shape {
            lab,
            site,
            delay_ms,
            rate_mbit,
            loss_percent,
        } => {
            let mut topo = Lab::running(&lab)?;
            tests::lab::reshape(&mut topo, &site, delay_ms, rate_mbit, loss_percent)?;
            println!(
                "site {site} of lab {lab}: {delay_ms} ms, {rate_mbit} Mbit/s, {loss_percent} % loss"
            );
        }
        Cmd::Bench(opts) => {
            let me = std::env::current_exe()?;
            tests::lab::bench::run(&opts, &me)?;
        }
        Cmd::Link {
            a,
            b,
            delay_ms,
            rate_mbit,
            loss_percent,
            seed,
            shape_file,
        } => {
            anyhow::ensure!(
                delay_ms.is_finite() && delay_ms >= 0.0,
                "--delay-ms must be 0 or more"
            );
            let shape = link::Shape {
                delay: Duration::from_secs_f64(delay_ms / 1e3),
                rate_bps: rate_mbit * 1e6,
                loss: loss_percent / 100.0,
                queue: tests::lab::QUEUE,
            };
            link::run(end(&a)?, end(&b)?, shape, seed, shape_file, || {
                println!("ready")
            })?;
        }
    }
    Ok(())
}
