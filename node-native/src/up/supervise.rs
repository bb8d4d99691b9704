//! Keeping nodes running (PCP's supervisor): a node runs as a child process and is started
//! again when it crashes, after a wait that doubles with each crash in a row and resets once
//! it has run a while. A child that exits cleanly (it was asked to stop) is not restarted.
//! `codedmesh node --supervise` supervises one node; `codedmesh up` supervises its mesh.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

/// How long to wait before each restart.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// The first wait.
    pub first: Duration,
    /// The longest wait.
    pub max: Duration,
    /// A run this long counts as healthy: the next crash waits `first` again.
    pub healthy_after: Duration,
    /// Crashes in a row, each before `healthy_after`, that make the supervisor give up.
    pub give_up_after: u32,
    next: Duration,
    quick_crashes: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
            give_up_after: 8,
            next: Duration::from_secs(1),
            quick_crashes: 0,
        }
    }
}

impl Backoff {
    /// The wait after a crash of a run that lasted `ran`; `None` when it is time to give up.
    pub fn after_crash(&mut self, ran: Duration) -> Option<Duration> {
        if ran >= self.healthy_after {
            self.next = self.first;
            self.quick_crashes = 0;
        }
        self.quick_crashes += 1;
        if self.quick_crashes > self.give_up_after {
            return None;
        }
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        Some(wait)
    }
}

/// How one supervised process is started.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    /// A name for messages (`node 2`).
    pub name: String,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Where its output goes (appended); `None` inherits this process's.
    pub log: Option<PathBuf>,
    /// Environment variables set for it, beside this process's.
    pub env: Vec<(OsString, OsString)>,
}

/// The variables that size a node's thread pools: its kernels' and its tasks' (tokio's
/// workers).
pub const THREAD_VARS: [&str; 2] = [node_core::compute::par::THREADS_VAR, "TOKIO_WORKER_THREADS"];

/// The cores this process may run on (1 where the system does not say).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |c| c.get())
}

/// How long the local sessions of a mesh on this machine poll before they sleep, where each
/// of the `busy` processes a stream keeps computing has a core of its own (where they share
/// cores, a process that polls takes the core another needs); `None` where they do not, or
/// where the user set [`crate::hold::session::local::SPIN_VAR`], which then stands.
pub fn mesh_spin(busy: usize) -> Option<std::time::Duration> {
    let user_set = std::env::var_os(crate::hold::session::local::SPIN_VAR).is_some();
    (!user_set && cores() >= busy)
        .then(|| std::time::Duration::from_micros(crate::hold::session::local::SPIN_US))
}

/// The environment of each node of a local mesh of `nodes` processes, k a stream: its share
/// of the cores ([`threads_env`]), and sessions that poll before they sleep where the k
/// processes a stream keeps computing (the API's node among them) have a core each
/// ([`mesh_spin`]). `up` and the bench start their nodes with it.
pub fn mesh_env(k: usize, nodes: usize) -> Vec<(OsString, OsString)> {
    let spin = mesh_spin(k).map(|spin| {
        let us = spin.as_micros().to_string();
        (crate::hold::session::local::SPIN_VAR.into(), us.into())
    });
    threads_env(nodes).into_iter().chain(spin).collect()
}

/// The arguments that have a node check and spare the groups it leads (its API's) as
/// `group` says: `up` and the bench give them to every node they start.
pub fn group_args(group: &node_core::lead::GroupOptions) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "--check".into(),
        group.verify.to_string().into(),
        "--spares".into(),
        group.spares.to_string().into(),
    ];
    if !group.project {
        args.push("--check-answers".into());
    }
    args
}

/// The environment that gives each of `nodes` processes on this machine its share of the cores
/// (at least one) for its kernels and for its tasks: with every process on every core, two
/// cores ran ten kernel threads, and the threads spinning and waking each other cost a mesh
/// over loopback ~12% of its tokens/s; with two task workers a node, a round's answer woke
/// another worker of the leader's node (one worker: +9% through the API, docs/perf.md). A
/// variable the user set stands.
pub fn threads_env(nodes: usize) -> Vec<(OsString, OsString)> {
    let share = (cores() / nodes.max(1)).max(1);
    THREAD_VARS
        .iter()
        .filter(|var| std::env::var_os(var).is_none())
        .map(|var| (var.into(), share.to_string().into()))
        .collect()
}

impl ChildSpec {
    /// Starts the process in a process group of its own, so a terminal's Ctrl-C reaches only
    /// the supervisor, which then stops it.
    pub fn spawn(&self) -> Result<Child> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.env.clone())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        #[cfg(unix)]
        cmd.process_group(0);
        if let Some(log) = &self.log {
            let open = || {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .with_context(|| format!("opening {}", log.display()))
            };
            cmd.stdout(open()?).stderr(open()?);
        }
        cmd.spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.program.display()))
    }
}

/// Asks a child to stop (SIGTERM), and kills it if it has not within `grace`.
pub async fn stop_child(child: &mut Child, grace: Duration) {
    #[cfg(unix)]
    if let Some(pid) = child.id() {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        if let Ok(pid) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if tokio::time::timeout(grace, child.wait()).await.is_ok() {
            return;
        }
    }
    let _ = child.kill().await;
}

/// Runs `spec` until it exits cleanly or `stop` turns true (then the child is stopped too),
/// restarting it after each crash.
pub async fn supervise(
    spec: ChildSpec,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let mut backoff = Backoff::default();
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        let started = Instant::now();
        let mut child = spec.spawn()?;
        eprintln!(
            "supervisor: started {} (pid {})",
            spec.name,
            child.id().unwrap_or(0)
        );
        let mut again = stop.clone();
        tokio::select! {
            status = child.wait() => {
                let status = status.with_context(|| format!("waiting for {}", spec.name))?;
                if status.success() {
                    eprintln!("supervisor: {} exited", spec.name);
                    return Ok(());
                }
                let said = spec
                    .log
                    .as_deref()
                    .and_then(last_error)
                    .map_or_else(String::new, |e| format!(": {e}"));
                let Some(wait) = backoff.after_crash(started.elapsed()) else {
                    bail!(
                        "{} crashed {} times in a row ({status}){said}; giving up",
                        spec.name,
                        backoff.give_up_after + 1
                    );
                };
                eprintln!(
                    "supervisor: {} crashed ({status}) after {:.1} s{said}; restarting in {:.0} s",
                    spec.name,
                    started.elapsed().as_secs_f64(),
                    wait.as_secs_f64()
                );
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stopped(&mut again) => return Ok(()),
                }
            }
            _ = stopped(&mut stop) => {
                stop_child(&mut child, STOP_GRACE).await;
                eprintln!("supervisor: stopped {}", spec.name);
                return Ok(());
            }
        }
    }
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A stop switch that turns on when this process is asked to stop (Ctrl-C or SIGTERM).
pub fn on_stop_signal() -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        crate::node::stop_signal().await;
        let _ = tx.send(true);
    });
    rx
}

/// `codedmesh node --supervise`: this same command without the switch, supervised.
pub async fn supervise_self(flag: &str, name: &str) -> Result<()> {
    let spec = ChildSpec {
        name: name.to_string(),
        program: this_program()?,
        args: args_without(flag),
        log: None,
        env: Vec::new(),
    };
    supervise(spec, on_stop_signal()).await
}

/// How long a child gets to stop cleanly before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// This program's arguments without `flag` (the supervisor's own switch), for the child.
pub fn args_without(flag: &str) -> Vec<OsString> {
    std::env::args_os()
        .skip(1)
        .filter(|a| a.as_os_str() != flag)
        .collect()
}

/// This program's path.
pub fn this_program() -> Result<PathBuf> {
    std::env::current_exe().context("locating this program")
}

/// The last `lines` lines of a log file, for an error message.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The error a crashed child's log ends with, on one line: its last `Error:` (an `anyhow`
/// error from `main`) and the causes under it, else its last line; `None` for an empty log.
fn last_error(log: &Path) -> Option<String> {
    let tail = log_tail(log, 40);
    let lines: Vec<&str> = tail
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let from = lines.iter().rposition(|l| l.starts_with("Error:"));
    let said: Vec<&str> = match from {
        Some(i) => lines[i..]
            .iter()
            .filter(|l| **l != "Caused by:")
            .map(|l| {
                l.split_once(": ")
                    .filter(|(n, _)| n.parse::<u32>().is_ok())
                    .map_or(*l, |(_, c)| c)
            })
            .collect(),
        None => lines.last().into_iter().copied().collect(),
    };
    let said = said.join(": ");
    (!said.is_empty()).then(|| said.chars().take(400).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_reset_after_a_healthy_run() {
        let mut b = Backoff::default();
        let quick = Duration::from_secs(2);
        let waits: Vec<u64> = (0..6)
            .map(|_| b.after_crash(quick).map_or(0, |d| d.as_secs()))
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30]);
        assert_eq!(
            b.after_crash(Duration::from_secs(120)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(b.after_crash(quick), Some(Duration::from_secs(2)));
    }

    #[test]
    fn a_crash_is_told_with_the_error_its_log_ends_with() {
        let log = std::env::temp_dir().join(format!("codedmesh-crash-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&log);
        assert_eq!(last_error(&log), None, "no log");
        std::fs::write(&log, "started\nlistening\n").unwrap();
        assert_eq!(last_error(&log).as_deref(), Some("listening"));
        std::fs::write(
            &log,
            "started\nError: listening on /ip4/127.0.0.1/tcp/10006\n\nCaused by:\n    0: Other(Custom)\n    1: Address already in use (os error 98)\n",
        )
        .unwrap();
        assert_eq!(
            last_error(&log).as_deref(),
            Some(
                "Error: listening on /ip4/127.0.0.1/tcp/10006: Other(Custom): Address already in use (os error 98)"
            )
        );
        std::fs::remove_file(&log).unwrap();
    }

    #[test]
    fn gives_up_after_too_many_quick_crashes() {
        let mut b = Backoff::default();
        let quick = Duration::from_millis(100);
        for _ in 0..b.give_up_after {
            assert!(b.after_crash(quick).is_some());
        }
        assert_eq!(b.after_crash(quick), None);
    }
}
