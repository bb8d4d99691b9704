//! A pass's embedding round where product rounds are checked by projection: decoded from the
//! first k answers at once, checked against the check row's answer before the LM head, so a
//! lie in it never reaches a token. The check row's answer comes with the round (in process)
//! or after it (as a network leader sees a session that slept).

use crate::common::max_rel_diff;
use crate::verification::{LastIsLate, calibrated, honest};

use node_core::code::Generator;
use node_core::coded::{
    CodedGroup, InProcess, Member, Misbehaviour, Transport, TransportError, VerifyConfig,
};
use node_core::model::{KvCache, LeaderWeights, Llama, ModelWeights};
use node_core::protocol::{StepRequest, decode};

const SEQ: [u32; 6] = [5, 41, 7, 19, 3, 28];

/// Honest weights, code and members, projected checks calibrated on them, and the logits of
/// [`SEQ`] decoded from rows 0, 1, 2 unchecked.
fn setup() -> (ModelWeights, Generator, Vec<Member>, VerifyConfig, Vec<f32>) {
    let (w, g, members) = honest();
    let check = VerifyConfig {
        project: true,
        ..calibrated(&w, &g, &members, 1)
    };
    let mesh = InProcess::new(members.clone()).unwrap();
    let mut plain = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2], mesh).unwrap();
    let want = forward(&w, &mut plain).unwrap();
    (w, g, members, check, want)
}

/// One forward pass of `group` on [`SEQ`]: its logits, or why it failed.
fn forward<T: Transport>(w: &ModelWeights, group: &mut CodedGroup<T>) -> Result<Vec<f32>, String> {
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    futures::executor::block_on(llama.forward(group, &SEQ, &mut KvCache::new(&w.cfg)))
        .map_err(|e| e.to_string())
}

/// Rows 0, 1, 2 answer, row 3 checks by projection, row 4 settles who is wrong; `bad` scales
/// its forward answers and embedding rows (its projections stay honest).
fn group<T: Transport>(
    w: &ModelWeights,
    g: &Generator,
    check: VerifyConfig,
    transport: T,
) -> CodedGroup<T> {
    let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], transport).unwrap();
    group.set_verify(check);
    group
}

/// Checks the case of `bad` on a group made by `make`: honest logits, or a pass that fails
/// at the embedding's check with `bad` dropped, then honest logits from the same group.
fn case<T: Transport>(
    w: &ModelWeights,
    want: &[f32],
    bad: Option<usize>,
    mut group: CodedGroup<T>,
    how: &str,
) {
    let Some(bad) = bad else {
        let got = forward(w, &mut group).unwrap();
        let s = group.stats();
        assert!(s.caught.is_empty(), "{how}: {:?}", s.caught);
        assert_eq!(s.unverified_rounds, 0, "{how}: a round went unchecked");
        assert!(max_rel_diff(&got, want) < 1e-4, "{how}: logits off");
        return;
    };
    let err = forward(w, &mut group).unwrap_err();
    assert!(err.contains("embedding"), "{how}, bad row {bad}: {err}");
    let caught = &group.stats().caught;
    assert!(
        !caught.is_empty() && caught.iter().all(|c| c.node == bad),
        "{how}, bad row {bad}: caught {caught:?}"
    );
    assert!(
        !group.nodes().contains(&bad),
        "{how}: row {bad} still a member"
    );
    // The leader runs the pass again: the same group, the liar gone.
    let got = forward(w, &mut group).unwrap();
    let diff = max_rel_diff(&got, want);
    assert!(
        diff < 1e-4,
        "{how}, bad row {bad}: logits off by {diff:.2e}"
    );
}

#[test]
fn a_lie_in_the_embedding_is_caught_before_the_head_and_the_pass_runs_again() {
    let (w, g, members, check, want) = setup();
    // Row 0 is among the k decoded; row 3 is the check row, whose answer checks them.
    for bad in [None, Some(0), Some(3)] {
        let mut members = members.clone();
        if let Some(bad) = bad {
            let shards = members[bad].shards().clone();
            members[bad] = Member::misbehaving(shards, bad, Misbehaviour::ForwardOnly);
        }
        let at_once = InProcess::new(members.clone()).unwrap();
        case(&w, &want, bad, group(&w, &g, check, at_once), "at once");
        let late = LastIsLate::new(members);
        case(&w, &want, bad, group(&w, &g, check, late), "late");
    }
}

/// In-process members whose row `cut` answers embedding lookups with half its bytes.
struct CutLookups {
    members: InProcess,
    cut: usize,
}

impl Transport for CutLookups {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        let mut answers = self.members.round(members, request, need).await?;
        if matches!(decode(request), Ok(StepRequest::EmbedRows { .. })) {
            for (row, bytes) in &mut answers {
                if *row == self.cut {
                    bytes.truncate(bytes.len() / 2);
                }
            }
        }
        Ok(answers)
    }

    fn asks_alone(&self) -> bool {
        true
    }
}

#[test]
fn an_unusable_answer_to_the_embedding_drops_its_member_and_another_checks_the_lookup() {
    let (w, g, members, check, want) = setup();
    // Row 3, the check row, answers beyond the k decoded: its cut answer checks the lookup.
    let transport = CutLookups {
        members: InProcess::new(members).unwrap(),
        cut: 3,
    };
    let mut group = group(&w, &g, check, transport);
    let got = forward(&w, &mut group).unwrap();
    let s = group.stats();
    assert_eq!(s.members_dropped, 1, "{s:?}");
    assert!(!group.nodes().contains(&3), "row 3 still a member");
    assert_eq!(s.unverified_rounds, 0, "the lookup went unchecked");
    let diff = max_rel_diff(&got, &want);
    assert!(diff < 1e-4, "logits off by {diff:.2e}");
}
