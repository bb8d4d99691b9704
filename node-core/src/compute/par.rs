//! The one place where native and wasm differ for parallel loops.

/// The environment variable that sets how many threads a process's kernels use (the caller and
/// its helpers); unset or invalid, every core.
pub const THREADS_VAR: &str = "CODEDMESH_THREADS";

/// The kernel threads `value` of [`THREADS_VAR`] asks for: `cores` when it is unset or not a
/// positive count (with a warning).
#[cfg(native)]
fn threads_wanted(value: Option<String>, cores: usize) -> usize {
    let Some(v) = value else { return cores };
    match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => n,
        _ => {
            tracing::warn!("{THREADS_VAR}={v:?} is not a positive count; using {cores}");
            cores
        }
    }
}

#[cfg(native)]
mod imp {
    //! A panic in a parallel section would abort the process inside micropool; each item's
    //! work catches its own, and the caller panics with it after the section, as it would
    //! have without helpers (a holder's step then fails, its node stays up).
    use micropool::iter::*;
    use std::any::Any;
    use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
    use std::sync::{Mutex, OnceLock};

    /// How many times an idle helper polls for the next job (`pause` instructions, about a
    /// tenth of a millisecond) before it sleeps: a member's products come a round apart, and a
    /// helper that is still awake starts the next one without the scheduler's wake-up.
    const IDLE_SPIN: usize = 3000;

    /// Number of threads the kernels use: the calling thread and the pool's helpers.
    pub fn threads() -> usize {
        static THREADS: OnceLock<usize> = OnceLock::new();
        *THREADS.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            let threads = super::threads_wanted(std::env::var(super::THREADS_VAR).ok(), cores);
            if threads > 1 {
                micropool::ThreadPoolBuilder::default()
                    .num_threads(threads - 1)
                    .idle_spin_cycles(IDLE_SPIN)
                    .spawn_handler(|i, run| {
                        std::thread::Builder::new()
                            .name(format!("kernel-{i}"))
                            .spawn(run)
                            .expect("starting a kernel thread")
                    })
                    .build_global();
            }
            threads
        })
    }

    /// `f` applied to every item, in parallel, results in order.
    pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
        if threads() == 1 || items.len() < 2 {
            return items.iter().map(f).collect();
        }
        let mut out: Vec<Option<std::thread::Result<R>>> = items.iter().map(|_| None).collect();
        (out.par_iter_mut(), items.par_iter())
            .zip_eq()
            .with_thread_pool(micropool::split_per_item())
            .for_each(|(o, x)| *o = Some(catch_unwind(AssertUnwindSafe(|| f(x)))));
        let out: Vec<R> = out
            .into_iter()
            .flatten()
            .map(|r| r.unwrap_or_else(|panic| resume_unwind(panic)))
            .collect();
        debug_assert_eq!(out.len(), items.len(), "every item mapped");
        out
    }

    /// Runs `f(chunk_index, chunk)` over `chunk`-sized pieces of `data`, in parallel.
    pub fn for_each_chunk(data: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        if threads() == 1 || data.len() <= chunk {
            return data
                .chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i, c));
        }
        let mut chunks: Vec<&mut [f32]> = data.chunks_mut(chunk).collect();
        let panicked: Mutex<Option<Box<dyn Any + Send>>> = Mutex::new(None);
        chunks
            .par_iter_mut()
            .enumerate()
            .with_thread_pool(micropool::split_per_item())
            .for_each(|(i, c)| {
                if let Err(panic) = catch_unwind(AssertUnwindSafe(|| f(i, c))) {
                    let mut first = panicked.lock().unwrap_or_else(|e| e.into_inner());
                    first.get_or_insert(panic);
                }
            });
        if let Some(panic) = panicked.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(panic);
        }
    }
}

#[cfg(wasm_browser)]
mod imp {
    /// Number of threads the kernels use.
    pub fn threads() -> usize {
        1
    }

    /// `f` applied to every item, results in order.
    pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
        items.iter().map(f).collect()
    }

    /// Runs `f(chunk_index, chunk)` over `chunk`-sized pieces of `data`, one after another.
    pub fn for_each_chunk(data: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        data.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

pub use imp::*;

#[cfg(all(test, native))]
mod tests {
    use super::*;

    #[test]
    fn map_keeps_order_and_chunks_their_index_also_nested() {
        let items: Vec<u64> = (0..257).collect();
        let squares: Vec<u64> = items.iter().map(|&x| x * x).collect();
        assert_eq!(map(&items, |&x| x * x), squares);

        // As a coded group does: a parallel map whose items run parallel kernels.
        let sums = map(&[3usize, 10, 64], |&chunk| {
            let mut data = vec![0f32; 1003];
            for_each_chunk(&mut data, chunk, |i, c| {
                for (j, v) in c.iter_mut().enumerate() {
                    *v = (i * chunk + j) as f32;
                }
            });
            assert!(data.iter().enumerate().all(|(i, &v)| v == i as f32));
            data.iter().sum::<f32>()
        });
        assert_eq!(sums, vec![(1002.0 * 1003.0 / 2.0) as f32; 3]);
    }

    #[test]
    fn the_threads_variable_is_a_positive_count_or_every_core() {
        assert_eq!(threads_wanted(None, 16), 16);
        assert_eq!(threads_wanted(Some("3".into()), 16), 3);
        assert_eq!(threads_wanted(Some(" 4\n".into()), 16), 4);
        assert_eq!(threads_wanted(Some("0".into()), 16), 16);
        assert_eq!(threads_wanted(Some("-2".into()), 16), 16);
        assert_eq!(threads_wanted(Some("many".into()), 16), 16);
    }

    #[test]
    fn a_panic_in_a_parallel_section_reaches_the_caller_and_the_pool_goes_on() {
        let items: Vec<u32> = (0..64).collect();
        let mapped = std::panic::catch_unwind(|| map(&items, |&x| assert_ne!(x, 37)));
        assert!(mapped.is_err());
        let mut data = vec![0f32; 640];
        let chunked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for_each_chunk(&mut data, 10, |i, _| assert_ne!(i, 5))
        }));
        assert!(chunked.is_err());
        assert_eq!(map(&items, |&x| x + 1), (1..65).collect::<Vec<u32>>());
    }
}
