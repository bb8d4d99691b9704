//! The one place where native and wasm differ for parallel loops.

#[cfg(native)]
mod imp {
    use rayon::prelude::*;

    /// Number of threads the kernels use.
    pub fn threads() -> usize {
        rayon::current_num_threads()
    }

    /// Runs `f` on one of the kernels' worker threads: the parallel kernels it calls then start
    /// their work on the thread they run on, instead of handing it to the pool and sleeping
    /// until it is done (a round trip through the scheduler for every product).
    pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        rayon::scope(|_| f())
    }

    /// `f` applied to every item, in parallel, results in order.
    pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
        items.par_iter().map(f).collect()
    }

    /// Runs `f(chunk_index, chunk)` over `chunk`-sized pieces of `data`, in parallel.
    pub fn for_each_chunk(data: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        data.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

#[cfg(wasm_browser)]
mod imp {
    /// Number of threads the kernels use.
    pub fn threads() -> usize {
        1
    }

    /// Runs `f` (there is one thread).
    pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        f()
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
