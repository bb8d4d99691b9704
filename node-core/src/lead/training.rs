//! The trainer's policy, for a leader that serves and learns at once: how much of the mesh's
//! time training may take while requests are served, and how finished requests share one
//! minibatch (each text once, each cut to its share of the positions). Time is passed in; the
//! shell's tasks wait as it says.

use std::collections::VecDeque;
use std::time::Duration;

use crate::learn::{Optimizer, bytes_per_position};
use crate::mesh::ModelManifest;
use crate::model::training_bytes;

/// The share of the time training may take while requests are being served (all of it while
/// none are): serving keeps at least `1 − TRAIN_SHARE` of the mesh, and training still moves.
pub const TRAIN_SHARE: f64 = 0.15;

/// Fewest positions a waiting request keeps when the minibatch is cut among many.
pub const MIN_SHARE: usize = 32;

/// Most tokens in one training minibatch, whatever the model.
pub const LEARN_TOKENS: usize = 1024;

/// How long training waits, while requests are served, before its next round after working
/// for `worked`: so that it keeps to [`TRAIN_SHARE`] of the time.
pub fn turn_wait(worked: Duration) -> Duration {
    worked.mul_f64((1.0 - TRAIN_SHARE) / TRAIN_SHARE)
}

/// Most tokens one training minibatch can carry on this mesh: the LM head's answers for all of
/// its rows (`rows × vocab / k` values per member) within a message's worth (the minibatches
/// learning was measured with; the head now runs [`crate::model::HEAD_BYTES`] at a time),
/// exact updates (rank 0) at most the training window, and the pass within [`TRAIN_BYTES`].
pub fn minibatch_tokens(manifest: &ModelManifest) -> usize {
    let per_row = 2 * 4 * manifest.cfg.vocab.div_ceil(manifest.generator.k().max(1));
    let by_message = crate::protocol::MAX_MESSAGE_BYTES / per_row.max(1);
    let window = crate::learn::training_window(&manifest.learning, &manifest.cfg);
    let limit = if manifest.learning.rank == 0 {
        window
    } else {
        LEARN_TOKENS
    };
    // The most positions whose training pass fits [`TRAIN_BYTES`] (SGD also keeps every
    // stage's factors until the pass ends).
    let (cfg, sgd) = (&manifest.cfg, manifest.learning.optimizer == Optimizer::Sgd);
    let fits = |p: usize| {
        let factors = if sgd { p * bytes_per_position(cfg) } else { 0 };
        training_bytes(cfg, p, window) + factors <= TRAIN_BYTES
    };
    let (mut lo, mut hi) = (2, limit.min(by_message).max(2));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Most bytes a leader's training pass may hold: its activations, a run of the LM head's
/// logits and (SGD) its factors, beside its row (docs/models.md, "Memory that follows 1/k").
pub const TRAIN_BYTES: usize = 128 << 20;

/// A finished request, as a minibatch sees it: the text it trains on.
pub trait Lesson {
    /// The tokens it trains on.
    fn tokens(&self) -> &[u32];
}

/// What one training pass takes: the requests it trains on, and their distinct token
/// sequences (requests that sent the same text train once, and count as many), each cut to its
/// share of the minibatch's positions.
#[derive(Debug)]
pub struct Minibatch<R> {
    /// The requests taken.
    pub requests: Vec<R>,
    /// Their distinct texts, cut to fit.
    pub seqs: Vec<Vec<u32>>,
}

/// Takes requests from the front of `waiting` while their distinct sequences fit `limit`
/// positions at [`MIN_SHARE`] each, and cuts each sequence to its share (its last positions):
/// the shortest keep all they have, the rest split what is left evenly.
pub fn share_out<R: Lesson>(waiting: &mut VecDeque<R>, limit: usize) -> Minibatch<R> {
    let most = (limit / MIN_SHARE).max(1);
    let (mut requests, mut seqs) = (Vec::new(), Vec::<Vec<u32>>::new());
    while let Some(r) = waiting.front() {
        let seen = seqs.iter().any(|s| s == r.tokens());
        if !seen && seqs.len() >= most {
            break;
        }
        if !seen {
            seqs.push(r.tokens().to_vec());
        }
        requests.extend(waiting.pop_front());
    }
    let total: usize = seqs.iter().map(Vec::len).sum();
    if total > limit {
        seqs.sort_by_key(Vec::len);
        let mut left = limit;
        let n = seqs.len();
        for (i, s) in seqs.iter_mut().enumerate() {
            let share = (left / (n - i)).max(2);
            let keep = s.len().min(share);
            s.drain(..s.len() - keep);
            left = left.saturating_sub(keep);
        }
    }
    Minibatch { requests, seqs }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Lesson for Vec<u32> {
        fn tokens(&self) -> &[u32] {
            self
        }
    }

    #[test]
    fn a_minibatch_takes_every_waiting_request_trains_each_text_once_and_cuts_them_to_fit() {
        // Ten requests: the same 100-token text six times, and four texts of 300, 40, 300 and
        // 300 tokens, with room for 512 positions (16 distinct texts at most).
        let same: Vec<u32> = (0..100).collect();
        let long = |seed: u32| -> Vec<u32> { (0..300).map(|i| i * 7 + seed).collect() };
        let mut waiting: VecDeque<Vec<u32>> = [
            same.clone(),
            long(1),
            same.clone(),
            (0..40).rev().collect(),
            same.clone(),
            long(2),
            same.clone(),
            long(3),
            same.clone(),
            same.clone(),
        ]
        .into_iter()
        .collect();
        let b = share_out(&mut waiting, 512);
        assert!(waiting.is_empty(), "every request is taken");
        assert_eq!(b.requests.len(), 10);
        assert_eq!(b.seqs.len(), 5, "the repeated text trains once");
        let total: usize = b.seqs.iter().map(Vec::len).sum();
        assert!(total <= 512, "{total} positions");
        // The short ones keep everything; the long ones split the rest, keeping their ends.
        let lens: Vec<usize> = b.seqs.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![40, 100, 124, 124, 124]);
        assert!(b.seqs.iter().any(|s| s.last() == Some(&(299 * 7 + 3))));
        // Past the most distinct texts a minibatch holds, the rest wait for the next one.
        let mut many: VecDeque<Vec<u32>> = (0..20u32).map(|i| vec![i, i + 1]).collect();
        let b = share_out(&mut many, 4 * MIN_SHARE);
        assert_eq!((b.seqs.len(), many.len()), (4, 16));
    }

    #[test]
    fn training_waits_so_it_keeps_its_share_of_the_time() {
        let worked = Duration::from_millis(150);
        let waited = turn_wait(worked);
        let share = worked.as_secs_f64() / (worked + waited).as_secs_f64();
        assert!((share - TRAIN_SHARE).abs() < 1e-9, "{share}");
        assert_eq!(turn_wait(Duration::ZERO), Duration::ZERO);
    }
}
