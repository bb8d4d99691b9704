//! Who runs beside whom. libtest runs a binary's tests on as many threads as there are cores
//! (two in CI). When each file was a binary of its own, a test only ever ran beside a test of
//! its own file; now any two may meet. Most tests take that: a mesh test ran beside another
//! five-node mesh before, and an in-process test has no clock to miss. The browser test does
//! not: its page computes on Chromium's CPU WebGPU (SwiftShader) while its mesh marks a row
//! Suspect after 0.8 s without a heartbeat (`tests::procs::HEALTH`), and it checks that only
//! the row it killed is down; it never had a neighbour. So each test holds a [`share`] of the
//! machine and the browser test holds it [`alone`], waiting for the running tests to end and
//! keeping the next ones waiting until it ends.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

static MACHINE: RwLock<()> = RwLock::new(());

/// A share of the machine, beside other tests, until dropped.
pub fn share() -> RwLockReadGuard<'static, ()> {
    // A test that failed while holding it poisons the lock; the next still gets its turn.
    MACHINE.read().unwrap_or_else(PoisonError::into_inner)
}

/// The machine alone, until dropped.
pub fn alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(PoisonError::into_inner)
}
