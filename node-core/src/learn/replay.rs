//! What a trainer teaches again: a reservoir of the lessons it trained on, a few mixed into
//! every minibatch, so what users told the mesh early is taught again while later chats move
//! the adapters (docs/coding.md, "Facts and rehearsal"). Every lesson seen has the same chance
//! to be kept (Vitter's algorithm R), so a caller's share of what is taught again is its share
//! of what was trained, which its learning budget already bounds.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

/// Lessons a trainer keeps to teach again.
pub const REPLAY_LESSONS: usize = 256;

/// Positions of earlier lessons a minibatch takes.
pub const REPLAY_TOKENS: usize = 64;

/// Fewest positions worth teaching again (a shorter tail is left out).
const MIN_POSITIONS: usize = 8;

/// A reservoir of lessons already trained on.
#[derive(Debug, Clone)]
pub struct Replay {
    kept: Vec<Vec<u32>>,
    /// Most lessons kept.
    most: usize,
    /// Positions a minibatch takes.
    positions: usize,
    /// Lessons offered so far.
    seen: u64,
    rng: ChaCha8Rng,
}

impl Replay {
    /// A reservoir of at most `most` lessons, `positions` of them taught again a minibatch,
    /// drawn deterministically from `seed`.
    pub fn new(most: usize, positions: usize, seed: u64) -> Self {
        Self {
            kept: Vec::new(),
            most,
            positions,
            seen: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Positions a minibatch takes.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// Lessons kept now.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether nothing is kept yet.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// Earlier lessons for the next minibatch: distinct ones drawn at random until
    /// [`Self::positions`] are taken, the last cut to its tail where it would overflow.
    pub fn draw(&mut self) -> Vec<Vec<u32>> {
        let mut order: Vec<usize> = (0..self.kept.len()).collect();
        let mut out = Vec::new();
        let mut room = self.positions;
        while room >= MIN_POSITIONS && !order.is_empty() {
            let at = (self.rng.next_u64() % order.len() as u64) as usize;
            let lesson = &self.kept[order.swap_remove(at)];
            let take = lesson.len().min(room);
            if take >= MIN_POSITIONS.min(lesson.len()).max(2) {
                out.push(lesson[lesson.len() - take..].to_vec());
                room -= take;
            }
        }
        out
    }

    /// Offers lessons just trained on: each is kept with the chance every lesson seen has
    /// (each at most [`Self::positions`] long, its tail kept).
    pub fn offer(&mut self, lessons: &[&[u32]]) {
        if self.most == 0 || self.positions < 2 {
            return;
        }
        for lesson in lessons.iter().filter(|l| l.len() >= 2) {
            self.seen += 1;
            let tail = lesson[lesson.len().saturating_sub(self.positions)..].to_vec();
            if self.kept.len() < self.most {
                self.kept.push(tail);
                continue;
            }
            let at = self.rng.next_u64() % self.seen;
            if let Some(slot) = usize::try_from(at).ok().and_then(|i| self.kept.get_mut(i)) {
                *slot = tail;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lesson(i: u32, len: u32) -> Vec<u32> {
        (0..len).map(|j| i * 1000 + j).collect()
    }

    #[test]
    fn the_reservoir_keeps_a_fair_sample_of_every_lesson_within_its_bounds() {
        let mut r = Replay::new(64, 32, 7);
        let lessons: Vec<Vec<u32>> = (0..1000).map(|i| lesson(i, 5 + i % 90)).collect();
        for chunk in lessons.chunks(8) {
            let refs: Vec<&[u32]> = chunk.iter().map(Vec::as_slice).collect();
            r.offer(&refs);
        }
        assert_eq!(r.len(), 64);
        // Each kept lesson is a lesson's tail, no longer than a minibatch's share.
        let mut early = 0;
        for k in &r.kept {
            let i = k[0] / 1000;
            let whole = &lessons[i as usize];
            assert!(k.len() <= 32 && whole.ends_with(k), "{k:?}");
            early += usize::from(i < 500);
        }
        // Half the lessons came in the first 500: about half of those kept did (a biased
        // reservoir would keep the newest).
        assert!(
            (20..=44).contains(&early),
            "{early} of 64 from the first half"
        );
    }

    #[test]
    fn a_draw_takes_distinct_earlier_lessons_up_to_its_positions() {
        let mut r = Replay::new(16, 20, 1);
        assert!(r.draw().is_empty(), "nothing kept, nothing drawn");
        let lessons: Vec<Vec<u32>> = (0..16).map(|i| lesson(i, 9)).collect();
        let refs: Vec<&[u32]> = lessons.iter().map(Vec::as_slice).collect();
        r.offer(&refs);
        for _ in 0..50 {
            let drawn = r.draw();
            let positions: usize = drawn.iter().map(Vec::len).sum();
            assert!((9..=20).contains(&positions), "{positions}");
            let mut firsts: Vec<u32> = drawn.iter().map(|d| d[d.len() - 1] / 1000).collect();
            firsts.sort_unstable();
            firsts.dedup();
            assert_eq!(firsts.len(), drawn.len(), "distinct lessons");
        }
    }

    #[test]
    fn an_empty_reservoir_or_one_of_no_room_keeps_nothing() {
        let mut none = Replay::new(0, 64, 1);
        none.offer(&[&[1, 2, 3]]);
        assert!(none.is_empty());
        let mut narrow = Replay::new(8, 1, 1);
        narrow.offer(&[&[1, 2, 3]]);
        assert!(narrow.is_empty());
        let mut one = Replay::new(8, 64, 1);
        one.offer(&[&[1], &[]]);
        assert!(one.is_empty(), "a lesson of one token predicts nothing");
    }
}
