//! What the dashboard's learning section shows, from the node's `/api/updates`: each update it
//! applied or refused (who trained it, the canary verdict it carried, what became of it), and
//! the share of its API's requests trained on by key. Plain data, no DOM.

use node_core::holder::{KeyShare, LearningStatus, UpdateSeen};

use crate::model::short_peer;

/// One update, as the learning table shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateRow {
    /// How long ago this node saw it ("12 s ago").
    pub when: String,
    /// Its id's first 8 hex digits and the row's update count after it ("—" when unknown).
    pub update: String,
    /// Who trained it: the short peer id, with its certificate's name.
    pub trainer: String,
    /// The canary loss after it, as its trainer measured it ("—" without a verdict).
    pub canary_after: String,
    /// The canary verdict: the step and the drift from the mesh's reference, each against
    /// its bound.
    pub gate: String,
    /// Its signed size.
    pub bytes: String,
    /// Applied, or refused and why.
    pub outcome: String,
    /// Whether this node applied it.
    pub applied: bool,
}

/// Every update of `status`, newest first, as seen at `now_ms` (unix milliseconds).
pub fn update_rows(status: &LearningStatus, now_ms: u64) -> Vec<UpdateRow> {
    status
        .updates
        .iter()
        .map(|u| update_row(u, status, now_ms))
        .collect()
}

fn update_row(u: &UpdateSeen, status: &LearningStatus, now_ms: u64) -> UpdateRow {
    let id = u.id.get(..8).unwrap_or(&u.id);
    let update = match (id, u.version) {
        ("", _) => "—".to_string(),
        (id, Some(v)) => format!("{id} (#{v})"),
        (id, None) => id.to_string(),
    };
    let trainer = match (u.trainer.as_str(), u.trainer_name.as_str()) {
        ("", _) => "unknown".to_string(),
        (peer, "") => short_peer(peer),
        (peer, name) => format!("{} ({name})", short_peer(peer)),
    };
    let (canary_after, gate) = match &u.gate {
        Some(g) => (
            format!("{:.4}", g.after),
            format!(
                "{:.4} → {:.4}: {:+.4} (≤ +{}), {:+.4} over the reference {:.4} (≤ +{})",
                g.before,
                g.after,
                g.after - g.before,
                status.max_step,
                g.after - g.reference,
                g.reference,
                status.max_drift
            ),
        ),
        None => ("—".to_string(), "no verdict".to_string()),
    };
    let outcome = match (&u.why, u.applied) {
        (_, true) => "applied".to_string(),
        (Some(why), false) => format!("refused: {why}"),
        (None, false) => "refused".to_string(),
    };
    UpdateRow {
        when: ago(now_ms.saturating_sub(u.seen_ms)),
        update,
        trainer,
        canary_after,
        gate,
        bytes: if u.bytes == 0 {
            "—".into()
        } else {
            megabytes(u.bytes)
        },
        outcome,
        applied: u.applied,
    }
}

/// `ms` as a person reads an age: "4 s ago", "3 min ago", "2 h ago".
fn ago(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..120 => format!("{s} s ago"),
        120..7200 => format!("{} min ago", s / 60),
        _ => format!("{} h ago", s / 3600),
    }
}

/// Bytes as MB (or kB under one).
fn megabytes(b: u64) -> String {
    if b >= 1_000_000 {
        format!("{:.1} MB", b as f64 / 1e6)
    } else {
        format!("{:.1} kB", b as f64 / 1e3)
    }
}

/// One key's line: its name and "3 of 4 requests (75%)".
pub fn key_row(k: &KeyShare) -> (String, String) {
    (
        k.key.clone(),
        format!(
            "{} of {} requests ({:.0}%)",
            k.trained,
            k.requests,
            100.0 * k.share()
        ),
    )
}

/// The applied and refused updates of `status`.
pub fn counts(status: &LearningStatus) -> (usize, usize) {
    let applied = status.updates.iter().filter(|u| u.applied).count();
    (applied, status.updates.len() - applied)
}

#[cfg(test)]
mod tests {
    use node_core::learn::GateClaim;

    use super::*;

    fn seen(applied: bool) -> UpdateSeen {
        UpdateSeen {
            id: "00000000000000ab".into(),
            version: applied.then_some(4),
            trainer: "12D3KooWtrainer1".into(),
            trainer_name: "up-0".into(),
            gate: Some(GateClaim {
                before: 3.2,
                after: 3.205,
                reference: 3.19,
            }),
            applied,
            why: (!applied).then(|| "gate: the canary loss would go up".into()),
            bytes: 5_000_000,
            issued_ms: 1_000,
            seen_ms: 2_000,
        }
    }

    fn status(updates: Vec<UpdateSeen>, keys: Vec<KeyShare>) -> LearningStatus {
        let mut s = LearningStatus::new(&node_core::holder::UpdateLog::default(), keys);
        s.updates = updates;
        s
    }

    #[test]
    fn each_update_shows_its_trainer_verdict_canary_and_outcome() {
        let mut unknown = seen(false);
        unknown.trainer = String::new();
        unknown.id = String::new();
        unknown.gate = None;
        unknown.bytes = 0;
        unknown.why = None;
        let s = status(vec![seen(true), seen(false), unknown], vec![]);
        let rows = update_rows(&s, 14_000);
        assert_eq!(rows.len(), 3);
        let r = &rows[0];
        assert_eq!(r.when, "12 s ago");
        assert_eq!(r.update, "00000000 (#4)");
        assert_eq!(r.trainer, "…trainer1 (up-0)");
        assert_eq!(r.canary_after, "3.2050");
        assert_eq!(
            r.gate,
            "3.2000 → 3.2050: +0.0050 (≤ +0.01), +0.0150 over the reference 3.1900 (≤ +0.03)"
        );
        assert_eq!(
            (r.bytes.as_str(), r.outcome.as_str()),
            ("5.0 MB", "applied")
        );
        assert!(r.applied);
        assert_eq!(rows[1].update, "00000000");
        assert_eq!(
            rows[1].outcome,
            "refused: gate: the canary loss would go up"
        );
        assert_eq!(
            (
                rows[2].update.as_str(),
                rows[2].trainer.as_str(),
                rows[2].canary_after.as_str(),
                rows[2].gate.as_str(),
                rows[2].bytes.as_str(),
                rows[2].outcome.as_str()
            ),
            ("—", "unknown", "—", "no verdict", "—", "refused")
        );
        assert_eq!(counts(&s), (1, 2));
        assert_eq!(ago(600_000), "10 min ago");
        assert_eq!(ago(9_000_000), "2 h ago");
        assert_eq!(megabytes(2_500), "2.5 kB");
    }

    #[test]
    fn each_key_shows_the_share_of_its_requests_trained_on() {
        let keys = vec![
            KeyShare {
                key: "alice".into(),
                requests: 4,
                trained: 3,
            },
            KeyShare {
                key: "anonymous".into(),
                requests: 10,
                trained: 0,
            },
        ];
        let s = status(vec![], keys);
        let rows: Vec<_> = s.keys.iter().map(key_row).collect();
        assert_eq!(
            rows,
            vec![
                ("anonymous".to_string(), "0 of 10 requests (0%)".to_string()),
                ("alice".to_string(), "3 of 4 requests (75%)".to_string()),
            ]
        );
    }
}
