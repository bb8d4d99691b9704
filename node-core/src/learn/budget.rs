//! Learning budgets: how many tokens each caller (an API key, or the anonymous user) may have
//! the mesh train on. A token bucket per caller, with time passed in (no clock inside).

use std::collections::HashMap;
use std::time::Duration;

/// Tokens a caller may have trained on at once (a full bucket).
pub const BUDGET_TOKENS: f64 = 32_768.0;

/// Tokens a caller's bucket refills each second.
pub const BUDGET_REFILL_PER_S: f64 = 64.0;

/// Most callers remembered; past that, the fullest buckets (those that would be full again
/// anyway) are forgotten first.
const MAX_CALLERS: usize = 4096;

/// One caller's budget: a full bucket, and its refill a second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Tokens (or requests) at once.
    pub capacity: f64,
    /// Refill a second.
    pub refill_per_s: f64,
}

/// Every caller's bucket.
#[derive(Debug, Clone)]
pub struct Budgets {
    capacity: f64,
    refill_per_s: f64,
    /// Per caller: tokens left and when that was computed.
    buckets: HashMap<String, (f64, Duration)>,
    /// Callers with budgets of their own (an API key's), instead of the default.
    own: HashMap<String, Budget>,
}

impl Default for Budgets {
    fn default() -> Self {
        Self::new(BUDGET_TOKENS, BUDGET_REFILL_PER_S)
    }
}

impl Budgets {
    /// Buckets of `capacity` tokens that refill `refill_per_s` a second.
    pub fn new(capacity: f64, refill_per_s: f64) -> Self {
        Self {
            capacity,
            refill_per_s,
            buckets: HashMap::new(),
            own: HashMap::new(),
        }
    }

    /// Gives `caller` a budget of its own.
    pub fn set(&mut self, caller: &str, budget: Budget) {
        self.own.insert(caller.to_owned(), budget);
    }

    /// `caller`'s capacity and refill.
    fn limits(&self, caller: &str) -> (f64, f64) {
        self.own
            .get(caller)
            .map_or((self.capacity, self.refill_per_s), |b| {
                (b.capacity, b.refill_per_s)
            })
    }

    /// Takes `tokens` from `caller`'s bucket at `now` (time since any fixed start) if it holds
    /// that many; false, leaving the bucket as it was, when it does not.
    pub fn take(&mut self, caller: &str, tokens: usize, now: Duration) -> bool {
        let (capacity, refill) = self.limits(caller);
        if !self.buckets.contains_key(caller) && self.buckets.len() >= MAX_CALLERS {
            self.forget_fullest(now);
        }
        let (left, at) = self
            .buckets
            .entry(caller.to_owned())
            .or_insert((capacity, now));
        let refilled = (*left + refill * now.saturating_sub(*at).as_secs_f64()).min(capacity);
        *at = now.max(*at);
        let want = tokens as f64;
        if refilled >= want {
            *left = refilled - want;
            true
        } else {
            *left = refilled;
            false
        }
    }

    /// Tokens `caller` may have trained on at `now`.
    pub fn left(&self, caller: &str, now: Duration) -> f64 {
        let (capacity, refill) = self.limits(caller);
        self.buckets.get(caller).map_or(capacity, |(left, at)| {
            (left + refill * now.saturating_sub(*at).as_secs_f64()).min(capacity)
        })
    }

    fn forget_fullest(&mut self, now: Duration) {
        let fullest = self
            .buckets
            .keys()
            .map(|k| (k.clone(), self.left(k, now)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(k, _)| k);
        if let Some(k) = fullest {
            self.buckets.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_past_its_budget_waits_for_the_refill_and_others_are_not_touched() {
        let mut b = Budgets::new(100.0, 10.0);
        let s = Duration::from_secs;
        assert!(b.take("a", 60, s(0)));
        assert!(!b.take("a", 60, s(0)), "40 left");
        assert!(b.take("b", 100, s(0)), "b has its own bucket");
        assert!(!b.take("a", 60, s(1)), "50 left after a second");
        assert!(b.take("a", 60, s(2)), "60 left after two");
        assert!((b.left("a", s(2)) - 0.0).abs() < 1e-9);
        assert!(
            (b.left("a", s(100)) - 100.0).abs() < 1e-9,
            "never past full"
        );
        // Time that goes backwards refills nothing.
        assert!(!b.take("a", 1, s(1)));
        // A caller with a budget of its own.
        b.set(
            "key",
            Budget {
                capacity: 10.0,
                refill_per_s: 1.0,
            },
        );
        assert!(!b.take("key", 11, s(0)));
        assert!(b.take("key", 10, s(0)));
        assert!(b.take("key", 5, s(5)));
    }
}
