//! What a node shows of the mesh's learning: the latest updates it applied or refused (who
//! trained each, the canary verdict it carried, what became of it), and how many of its API's
//! requests each key had trained on. Plain data and a bounded list, no clock inside: the
//! shells date each record and serve the list as JSON (`/api/updates`), the dashboard reads it.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::rules::{Checked, Refused};
use crate::learn::{GateClaim, MAX_CANARY_DRIFT, MAX_CANARY_STEP};

/// Updates a node remembers: the newest this many, whoever sends more.
pub const UPDATES_SEEN: usize = 32;

/// Most characters of a record's text fields (a refusal's reason, a trainer's name): what a
/// peer puts there cannot grow the list.
pub const MAX_SEEN_TEXT: usize = 240;

/// Most keys [`LearningStatus::keys`] lists: those with the most requests.
pub const MAX_KEYS_SHOWN: usize = 32;

/// One update a node saw, as the dashboard lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateSeen {
    /// The update's id (the hash of its payload, hex); empty when it did not open.
    pub id: String,
    /// The row's update count once it was applied; `None` when it was not.
    pub version: Option<u64>,
    /// The trainer's peer id (the signer, once the signature held); empty when unknown.
    pub trainer: String,
    /// The trainer's name in the certificate by which the mesh admits it, where it has one.
    pub trainer_name: String,
    /// The canary verdict the trainer attached (the loss before and after, the reference).
    pub gate: Option<GateClaim>,
    /// Whether this node applied it.
    pub applied: bool,
    /// Why it was refused (a reason as `/metrics` labels it, then the detail).
    pub why: Option<String>,
    /// Its signed bytes (0 for one refused before it was sealed).
    pub bytes: u64,
    /// When the trainer signed it, in unix milliseconds (0 when unknown).
    pub issued_ms: u64,
    /// When this node applied or refused it, in unix milliseconds.
    pub seen_ms: u64,
}

impl UpdateSeen {
    /// An update that passed the mesh's rules, `bytes` long, seen at `now_ms`; applied until
    /// the caller says otherwise (its `version` is the caller's to fill in).
    pub fn checked(c: &Checked, bytes: usize, now_ms: u64) -> Self {
        Self {
            id: format!("{:016x}", c.id),
            version: None,
            trainer: c.signer.to_string(),
            trainer_name: c.trainer.clone(),
            gate: c.header.verdict,
            applied: true,
            why: None,
            bytes: bytes as u64,
            issued_ms: c.header.issued_ms,
            seen_ms: now_ms,
        }
        .bounded()
    }

    /// An update the mesh's rules refused (`why`), seen at `now_ms`: its signer, id and
    /// verdict where its signature held (as the rules found them).
    pub fn refused(bytes: &[u8], why: &Refused, now_ms: u64) -> Self {
        let sender = why.sender.as_deref();
        Self {
            id: sender.map_or_else(String::new, |s| format!("{:016x}", s.id)),
            version: None,
            trainer: sender.map_or_else(String::new, |s| s.signer.to_string()),
            trainer_name: String::new(),
            gate: sender.and_then(|s| s.header.verdict),
            applied: false,
            why: Some(format!("{}: {}", why.why.label(), why.detail)),
            bytes: bytes.len() as u64,
            issued_ms: sender.map_or(0, |s| s.header.issued_ms),
            seen_ms: now_ms,
        }
        .bounded()
    }

    /// An update with its text fields cut to [`MAX_SEEN_TEXT`] characters.
    pub fn bounded(mut self) -> Self {
        for s in [&mut self.id, &mut self.trainer, &mut self.trainer_name] {
            cut(s);
        }
        if let Some(why) = &mut self.why {
            cut(why);
        }
        self
    }
}

/// Cuts `s` to [`MAX_SEEN_TEXT`] characters.
fn cut(s: &mut String) {
    if let Some((i, _)) = s.char_indices().nth(MAX_SEEN_TEXT) {
        s.truncate(i);
        s.push('…');
    }
}

/// The latest [`UPDATES_SEEN`] updates, oldest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateLog {
    seen: VecDeque<UpdateSeen>,
}

impl UpdateLog {
    /// Records an update, forgetting the oldest past [`UPDATES_SEEN`].
    pub fn push(&mut self, seen: UpdateSeen) {
        if self.seen.len() >= UPDATES_SEEN {
            self.seen.pop_front();
        }
        self.seen.push_back(seen.bounded());
    }

    /// The updates remembered, newest first.
    pub fn newest_first(&self) -> Vec<UpdateSeen> {
        self.seen.iter().rev().cloned().collect()
    }

    /// How many are remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// One API key's requests on this node, and how many of them it had trained on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyShare {
    /// The key's name (never the key); `anonymous` for callers without one.
    pub key: String,
    /// Requests of it this node's API finished.
    pub requests: u64,
    /// Those handed to training (this node's trainer, or a trainer elsewhere).
    pub trained: u64,
}

impl KeyShare {
    /// The share of its requests trained on (0 before any).
    pub fn share(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            (self.trained as f64 / self.requests as f64).min(1.0)
        }
    }
}

/// What `/api/updates` answers: the latest updates this node saw, the mesh's canary bounds
/// they were held to, and its API's requests trained on by key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LearningStatus {
    /// The latest updates, newest first (at most [`UPDATES_SEEN`]).
    pub updates: Vec<UpdateSeen>,
    /// Most an update may raise the canary loss, in nats a token.
    pub max_step: f64,
    /// Most the canary loss may drift above the mesh's reference, in nats a token.
    pub max_drift: f64,
    /// This node's API's requests by key, most requests first (at most [`MAX_KEYS_SHOWN`]).
    pub keys: Vec<KeyShare>,
}

impl LearningStatus {
    /// The status of `log` and `keys` under the mesh's canary bounds.
    pub fn new(log: &UpdateLog, mut keys: Vec<KeyShare>) -> Self {
        keys.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.key.cmp(&b.key)));
        keys.truncate(MAX_KEYS_SHOWN);
        Self {
            updates: log.newest_first(),
            max_step: MAX_CANARY_STEP,
            max_drift: MAX_CANARY_DRIFT,
            keys,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(i: u64) -> UpdateSeen {
        UpdateSeen {
            id: format!("{i:016x}"),
            version: Some(i),
            trainer: "12D3KooWtrainer".into(),
            trainer_name: "t".into(),
            gate: None,
            applied: true,
            why: None,
            bytes: 100,
            issued_ms: i,
            seen_ms: i,
        }
    }

    #[test]
    fn the_log_keeps_the_newest_and_cuts_what_a_peer_says() {
        let mut log = UpdateLog::default();
        assert!(log.is_empty());
        for i in 0..1000 {
            log.push(seen(i));
        }
        assert_eq!(log.len(), UPDATES_SEEN);
        let listed = log.newest_first();
        assert_eq!(listed[0].version, Some(999));
        assert_eq!(
            listed[UPDATES_SEEN - 1].version,
            Some(1000 - UPDATES_SEEN as u64)
        );
        let mut hostile = seen(1000);
        hostile.why = Some("é".repeat(100_000));
        hostile.trainer_name = "x".repeat(100_000);
        log.push(hostile);
        let first = &log.newest_first()[0];
        assert_eq!(
            first.why.as_deref().map(|w| w.chars().count()),
            Some(MAX_SEEN_TEXT + 1)
        );
        assert_eq!(first.trainer_name.chars().count(), MAX_SEEN_TEXT + 1);
        assert_eq!(log.len(), UPDATES_SEEN);
    }

    #[test]
    fn the_status_lists_the_busiest_keys_and_their_shares() {
        let keys = (0..100)
            .map(|i| KeyShare {
                key: format!("k{i}"),
                requests: i,
                trained: i / 2,
            })
            .collect();
        let s = LearningStatus::new(&UpdateLog::default(), keys);
        assert_eq!(s.keys.len(), MAX_KEYS_SHOWN);
        assert_eq!(s.keys[0].key, "k99");
        assert_eq!(s.keys[0].share(), 49.0 / 99.0);
        assert_eq!(
            (s.max_step, s.max_drift),
            (MAX_CANARY_STEP, MAX_CANARY_DRIFT)
        );
        let none = KeyShare {
            key: "anonymous".into(),
            requests: 0,
            trained: 0,
        };
        assert_eq!(none.share(), 0.0);
        let json = serde_json::to_string(&s).unwrap_or_default();
        assert_eq!(serde_json::from_str::<LearningStatus>(&json).ok(), Some(s));
    }
}
