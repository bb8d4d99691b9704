//! Work a node does for itself that no request waits on (folding its updates into a new
//! snapshot): a thread of its own at the lowest scheduling priority, so that serving takes the
//! cores first and the work uses what serving leaves (docs/perf-history.md, "Folds that wait for idle
//! cores, and drafts through the API").

use anyhow::{Result, anyhow};

/// Runs `f` on a new thread named `name` at the lowest priority (nice 19 on Linux; the
/// default elsewhere) and returns what it returns.
pub async fn run<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            lower_priority();
            let _ = tx.send(f());
        })
        .map_err(|e| anyhow!("starting the {name} thread: {e}"))?;
    rx.await
        .map_err(|_| anyhow!("the {name} thread stopped before it finished"))
}

/// Lowers the calling thread's priority to nice 19. On Linux the nice value belongs to the
/// thread (`setpriority` with `who` 0 is the calling thread), so the node's other threads keep
/// theirs. An unprivileged thread cannot raise it again, hence a thread of its own.
#[cfg(target_os = "linux")]
fn lower_priority() {
    // SAFETY: setpriority reads only its three integer arguments and touches no memory of ours.
    let set = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
    if set != 0 {
        tracing::debug!(
            "could not lower a background thread's priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The calling thread's nice value.
    fn nice() -> i32 {
        // SAFETY: as above; errno is cleared first since -1 is also a valid result.
        unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, 0)
        }
    }

    #[tokio::test]
    async fn the_work_runs_at_the_lowest_priority_and_the_caller_keeps_its_own() {
        let before = nice();
        let (inside, name) = run("fold", || {
            (nice(), std::thread::current().name().map(String::from))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(inside, 19);
        assert_eq!(name.as_deref(), Some("fold"));
        assert_eq!(nice(), before, "the calling thread keeps its priority");
    }

    #[tokio::test]
    async fn a_panic_in_the_work_is_an_error_not_a_hang() {
        let got = run("fold", || -> u8 { panic!("a fold that fails") }).await;
        assert!(got.is_err());
    }
}
