//! What becomes of an update a leader's learning made, settled once for every leader (the
//! API's trainer, `generate --bootstrap`, the browser's prompt box): the canary gate judges it
//! on the leader's group, a passed one is handed out by the leader's [`Publisher`], and one
//! refused, unjudged or lost is forgotten by the learner, so it steers no later update.

use std::future::Future;

use crate::learn::{GateClaim, Judged, Published, Teacher, Verdict};
use crate::model::{LinearExec, Llama};

/// Where a leader's updates go once the canary gate passed them: each shell's networking.
pub trait Publisher {
    /// What handing an update out reports.
    type Sent;

    /// Hands `p` out with the gate's `verdict` on it (none without a gate): what that did,
    /// and the version the mesh moved to when this leader knows it; why not, when it could
    /// not be handed out.
    fn publish(
        &mut self,
        p: Published,
        verdict: Option<GateClaim>,
    ) -> impl Future<Output = Result<(Self::Sent, Option<[u8; 32]>), String>>;
}

/// What became of an update that fell due.
#[derive(Debug, Clone)]
pub enum Settled<S> {
    /// Handed out: what that reported, with the gate's verdict (none without a gate).
    Published {
        /// What the publisher reported.
        sent: S,
        /// The canary gate's verdict.
        verdict: Option<Verdict>,
        /// Requests folded into the update.
        requests: u32,
    },
    /// The gate refused it (why, and its verdict); the learner forgot it.
    Refused(String, Verdict),
    /// The gate could not measure it (its group failed); the learner forgot it.
    Unjudged(String),
    /// It could not be handed out; the learner forgot it.
    Lost(String),
}

/// Settles `due`, the update `teacher`'s learner just made: judged on `llama` over `exec` (a
/// group at `version`), handed to `publisher` if the gate passes it. When the publisher
/// knows the version the mesh moved to, the gate follows the mesh there.
pub async fn settle<E: LinearExec, P: Publisher>(
    teacher: &mut Teacher,
    llama: &Llama,
    exec: &mut E,
    version: [u8; 32],
    due: Published,
    publisher: &mut P,
) -> Settled<P::Sent> {
    match teacher.judge(llama, exec, version, due).await {
        Err(e) => Settled::Unjudged(e.to_string()),
        Ok(Judged::Refused(why, verdict)) => Settled::Refused(why, verdict),
        Ok(Judged::Publish(p, verdict)) => {
            let requests = p.requests;
            match publisher
                .publish(*p, verdict.as_ref().map(Verdict::claim))
                .await
            {
                Ok((sent, moved)) => {
                    teacher.keep_last();
                    if let Some(v) = moved {
                        teacher.published(v, verdict.as_ref());
                    }
                    Settled::Published {
                        sent,
                        verdict,
                        requests,
                    }
                }
                Err(why) => {
                    teacher.drop_last();
                    Settled::Lost(why)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use futures::executor::block_on;

    use super::*;
    use crate::learn::CanaryGate;
    use crate::learn::fixtures::{canary, setup, teacher};

    /// Takes every update and says the mesh moved to `moved`, or refuses every one.
    struct Shelf {
        taken: Vec<Published>,
        moved: Option<[u8; 32]>,
        refuse: bool,
    }

    impl Publisher for Shelf {
        type Sent = usize;

        async fn publish(
            &mut self,
            p: Published,
            _: Option<GateClaim>,
        ) -> Result<(usize, Option<[u8; 32]>), String> {
            if self.refuse {
                return Err("no holder took it".into());
            }
            self.taken.push(p);
            Ok((self.taken.len(), self.moved))
        }
    }

    fn shelf(refuse: bool) -> Shelf {
        Shelf {
            taken: Vec::new(),
            moved: Some([1; 32]),
            refuse,
        }
    }

    fn gate(bound: f64) -> CanaryGate {
        CanaryGate::new(canary(), None).with_bounds(bound, bound)
    }

    #[test]
    fn a_passed_update_is_published_and_the_gate_follows_the_mesh() {
        let (llama, mut group, [g1, g2]) = setup();
        let mut t = teacher(Some(gate(f64::INFINITY)));
        let due = t.fold(g1).unwrap().unwrap();
        let mut out = shelf(false);
        let settled = block_on(settle(
            &mut t,
            &llama,
            &mut group,
            [0; 32],
            due.clone(),
            &mut out,
        ));
        let Settled::Published {
            sent,
            verdict,
            requests,
        } = settled
        else {
            panic!("a gate that passes everything did not publish: {settled:?}");
        };
        assert_eq!((sent, requests), (1, due.requests));
        assert!(out.taken == [due], "the publisher got another update");
        let first = verdict.unwrap();
        assert!(first.pass && first.before != first.after);
        // At the version the mesh moved to, the gate starts from the loss it measured after
        // the first update (the group here never took it: only the gate can know it).
        let next = t.fold(g2).unwrap().unwrap();
        let Judged::Publish(_, Some(second)) =
            block_on(t.judge(&llama, &mut group, [1; 32], next)).unwrap()
        else {
            panic!("a gate that passes everything refused");
        };
        assert_eq!(second.before, first.after);
    }

    #[test]
    fn a_refused_or_lost_update_reaches_no_one_and_steers_no_later_one() {
        let (llama, mut group, [g1, g2]) = setup();
        let alone = teacher(None).fold(g2.clone()).unwrap().unwrap();
        // Refused by the gate: nothing is handed out.
        let mut shut = teacher(Some(gate(f64::NEG_INFINITY)));
        let due = shut.fold(g1.clone()).unwrap().unwrap();
        let mut out = shelf(false);
        let settled = block_on(settle(
            &mut shut, &llama, &mut group, [0; 32], due, &mut out,
        ));
        assert!(
            matches!(settled, Settled::Refused(_, ref v) if !v.pass),
            "{settled:?}"
        );
        assert!(out.taken.is_empty());
        assert!(
            shut.fold(g2.clone()).unwrap().unwrap() == alone,
            "a refused update steered"
        );
        // Passed but not handed out: forgotten as well.
        let mut open = teacher(None);
        let due = open.fold(g1).unwrap().unwrap();
        let mut refusing = shelf(true);
        let settled = block_on(settle(
            &mut open,
            &llama,
            &mut group,
            [0; 32],
            due,
            &mut refusing,
        ));
        assert!(
            matches!(settled, Settled::Lost(ref why) if why.contains("no holder")),
            "{settled:?}"
        );
        assert!(
            open.fold(g2).unwrap().unwrap() == alone,
            "a lost update steered"
        );
    }
}
