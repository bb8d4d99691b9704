use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, channel};

use futures::executor::block_on;

use super::*;
use crate::coded::{InProcess, Member, Misbehaviour, ShardFormat, ShardSet};
use crate::lead::{generate, generate_with};
use crate::model::{GenerateOptions, LeaderWeights, ModelWeights, Pass};

fn config() -> LlamaConfig {
    LlamaConfig::test_model()
}

struct MemberLink {
    member: Member,
    to: HashMap<usize, Sender<Heard>>,
    from: Receiver<Heard>,
    /// A part of this member's that is lost on its way: (to row, pass, round).
    lose: Option<(usize, u64, u32)>,
}

impl HopLink for MemberLink {
    async fn compute(&mut self, step: StepRequest) -> Result<Vec<u8>, String> {
        protocol::encode(&self.member.handle(&step)).map_err(|e| e.to_string())
    }

    fn send(&mut self, row: usize, part: &Part) {
        if self.lose == Some((row, part.pass, part.round)) {
            return;
        }
        if let Some(tx) = self.to.get(&row) {
            let _ = tx.send(Heard::Part(part.clone()));
        }
    }

    async fn next(&mut self, wait: Duration) -> Option<Heard> {
        self.from.recv_timeout(wait).ok()
    }
}

struct LeadLink {
    to: HashMap<usize, Sender<Feed>>,
    from: Receiver<(usize, Fed)>,
    /// Where a feed to a member that has gone is answered, as a failed stream would.
    failed: Sender<(usize, Fed)>,
}

impl FeedLink for LeadLink {
    fn feed(&mut self, row: usize, feed: &Feed) {
        if let Some(tx) = self.to.get(&row)
            && tx.send(feed.clone()).is_err()
        {
            let why = "the member's stream closed".to_string();
            let _ = self.failed.send((row, Fed::failed(feed.pass, why)));
        }
    }

    async fn next(&mut self, wait: Duration) -> Option<(usize, Fed)> {
        self.from.recv_timeout(wait).ok()
    }
}

/// How a test's hop group goes wrong.
#[derive(Clone, Copy, Default)]
struct Faults {
    /// This row answers with garbage.
    liar: Option<usize>,
    /// This row leaves after this many passes.
    quits: Option<(usize, u64)>,
    /// A part from the first row to the second is lost, in (pass, round).
    lose: Option<(usize, usize, u64, u32)>,
    /// How long a part is waited for (10 s where `None`).
    wait_ms: Option<u32>,
    /// This row, fed this pass, computes nothing and tells the leader it missed this other
    /// row's part, naming it this many times.
    blames: Option<(usize, u64, usize, usize)>,
}

/// What each member of a test's hop group saw: the rows it caught, and those it left out.
type Seen = (Vec<usize>, Vec<(usize, String)>);

/// A member's thread: what it saw once its leader is gone.
type MemberThread = std::thread::JoinHandle<Seen>;

/// A hop group of `rows` (k = 3 of 5, checked with the rows beyond k) on threads, and its
/// leader.
fn hop_group(
    weights: &ModelWeights,
    rows: &[usize],
    faults: Faults,
) -> (HopLeader<LeadLink>, Vec<MemberThread>) {
    let g = Generator::cauchy(5, 3).unwrap();
    let norms = LeaderWeights::from_model(weights);
    let join = Join {
        group: 7,
        version: [0; 32],
        rows: rows.iter().map(|&r| r as u32).collect(),
        peers: vec![Vec::new(); rows.len()],
        addrs: vec![Vec::new(); rows.len()],
        row: 0,
        wait_ms: faults.wait_ms.unwrap_or(10_000),
        extra: (rows.len() - 3) as u32,
        noise: crate::coded::DEFAULT_NOISE,
    };
    let mut part_tx = HashMap::new();
    let mut part_rx = HashMap::new();
    for &r in rows {
        let (tx, rx) = channel();
        part_tx.insert(r, tx);
        part_rx.insert(r, rx);
    }
    let (fed_tx, fed_rx) = channel();
    let mut feed_tx = HashMap::new();
    let mut threads = Vec::new();
    for &r in rows {
        let set = ShardSet::encode(weights, &g, r, ShardFormat::F32, &mut |_, _| {}).unwrap();
        let member = match faults.liar {
            Some(l) if l == r => Member::misbehaving(set, r, Misbehaviour::Garbage),
            _ => Member::new(set),
        };
        let quits = faults
            .quits
            .and_then(|(q, passes)| (q == r).then_some(passes));
        let blames = (faults.blames).and_then(|(liar, pass, accused, times)| {
            (liar == r).then_some((pass, vec![accused as u32; times]))
        });
        let others = part_tx.clone();
        let link = MemberLink {
            member,
            to: part_tx.clone(),
            from: part_rx.remove(&r).unwrap(),
            lose: (faults.lose)
                .and_then(|(from, to, pass, round)| (from == r).then_some((to, pass, round))),
        };
        let llama = Llama::new(weights.cfg.clone(), norms.clone()).unwrap();
        let mut hop = HopMember::new(
            llama,
            g.clone(),
            &Join {
                row: r as u32,
                ..join.clone()
            },
            link,
        )
        .unwrap();
        let (tx, rx) = channel::<Feed>();
        feed_tx.insert(r, tx);
        let fed = fed_tx.clone();
        threads.push(std::thread::spawn(move || {
            for feed in rx {
                if quits.is_some_and(|q| feed.pass > q) {
                    // Its streams close: the others hear it, and the leader's link answers
                    // the pass it was fed (and every later one) with the failure.
                    for tx in others.values() {
                        let _ = tx.send(Heard::Gone(r));
                    }
                    let why = "the member's stream closed".to_string();
                    let _ = fed.send((r, Fed::failed(feed.pass, why)));
                    break;
                }
                if let Some((pass, silent)) = blames.as_ref().filter(|(p, _)| *p == feed.pass) {
                    let result = Err("a part did not come (a lie)".to_string());
                    let silent = silent.clone();
                    let _ = fed.send((
                        r,
                        Fed {
                            pass: *pass,
                            result,
                            silent,
                        },
                    ));
                    continue;
                }
                let _ = fed.send((r, Fed::of(feed.pass, block_on(hop.feed(&feed)))));
            }
            let caught = hop.stats().caught.iter().map(|c| c.node).collect();
            (caught, hop.dropped().to_vec())
        }));
    }
    drop(part_tx);
    let link = LeadLink {
        to: feed_tx,
        from: fed_rx,
        failed: fed_tx,
    };
    let leader = HopLeader::new(weights.cfg.clone(), g, &join, link).unwrap();
    (leader, threads)
}

/// Greedy tokens of `prompt` through a hop group of `rows`, what each member saw, and the
/// leader's counters (its passes fed again in `reruns`).
fn hop_generate(
    weights: &ModelWeights,
    rows: &[usize],
    faults: Faults,
    draft: usize,
) -> (Vec<u32>, Vec<Seen>, ExecStats, u64) {
    let (mut leader, threads) = hop_group(weights, rows, faults);
    let opts = GenerateOptions {
        max_tokens: 12,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft,
    };
    let mut forward = |pass: Pass<'_>| block_on(leader.forward(pass));
    let out = generate_with(
        &mut forward,
        &weights.cfg,
        &[3, 17, 200, 42, 3, 17],
        &opts,
        &mut |_| true,
    )
    .unwrap();
    let (stats, reruns) = (leader.stats().clone(), leader.reruns());
    drop(leader);
    let caught = threads.into_iter().map(|t| t.join().unwrap()).collect();
    (out.tokens, caught, stats, reruns)
}

fn round_generate(weights: &ModelWeights, draft: usize) -> Vec<u32> {
    let g = Generator::cauchy(5, 3).unwrap();
    let mesh = InProcess::encode(weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(weights.cfg.clone(), g, &[0, 1, 2], mesh).unwrap();
    let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(weights)).unwrap();
    let opts = GenerateOptions {
        max_tokens: 12,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft,
    };
    generate(
        &llama,
        &mut group,
        &[3, 17, 200, 42, 3, 17],
        &opts,
        &mut |_| true,
    )
    .unwrap()
    .tokens
}

proptest::proptest! {
    #[test]
    fn any_bytes_on_a_hop_stream_are_a_frame_or_an_error(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let mut reader = futures::io::Cursor::new(bytes);
        let mut buf = crate::net::session::FrameReader::default();
        while let Ok(Some(_)) =
            block_on(crate::net::session::read_frame::<HopFrame, _>(&mut reader, &mut buf))
        {}
    }
}

#[test]
fn a_hop_group_generates_the_tokens_a_leader_does() {
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    for draft in [0, 4] {
        let want = round_generate(&weights, draft);
        let (tokens, seen, stats, reruns) =
            hop_generate(&weights, &[0, 1, 2, 3], Faults::default(), draft);
        assert_eq!(tokens, want, "drafts of {draft}");
        assert!(
            seen.iter().all(|(c, d)| c.is_empty() && d.is_empty()),
            "{seen:?}"
        );
        assert!(stats.verified_rounds > 0 && stats.unverified_rounds == 0);
        assert!(stats.caught.is_empty());
        assert_eq!(reruns, 0);
    }
}

#[test]
fn every_member_and_the_leader_catch_a_member_that_lies() {
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let want = round_generate(&weights, 0);
    let faults = Faults {
        liar: Some(2),
        ..Faults::default()
    };
    let (tokens, seen, stats, reruns) = hop_generate(&weights, &[0, 1, 2, 3, 4], faults, 0);
    assert_eq!(tokens, want);
    for (i, (caught, _)) in seen.iter().enumerate() {
        if i != 2 {
            assert_eq!(caught, &[2], "member {i} caught {caught:?}");
        }
    }
    assert_eq!(stats.caught.iter().map(|c| c.node).collect::<Vec<_>>(), [2]);
    assert_eq!(
        reruns, 0,
        "a liar is left out by all alike, within the pass"
    );
}

#[test]
fn a_member_that_leaves_is_left_out_at_once_and_the_rest_decode_from_k() {
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let want = round_generate(&weights, 0);
    let faults = Faults {
        quits: Some((3, 4)),
        ..Faults::default()
    };
    let (tokens, seen, stats, reruns) = hop_generate(&weights, &[0, 1, 2, 3], faults, 0);
    assert_eq!(tokens, want);
    for (caught, dropped) in &seen[..3] {
        assert!(caught.is_empty());
        // Heard leaving, not waited out (the wait is 10 s); left out from the pass fed again.
        assert_eq!(dropped, &[(3, "left the group".to_string())]);
    }
    assert!(stats.verified_rounds >= 4 && stats.unverified_rounds > 0);
    assert!(stats.caught.is_empty());
    assert_eq!(reruns, 1, "the pass it left in was fed again without it");
}

#[test]
fn a_spare_in_a_hop_group_takes_a_members_loss_and_every_round_stays_checked() {
    // k = 3 with a check and a spare: when a member leaves, the other four still decode from
    // k and check with the fourth, on every member and at the leader.
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let want = round_generate(&weights, 0);
    let faults = Faults {
        quits: Some((1, 3)),
        ..Faults::default()
    };
    let (tokens, seen, stats, reruns) = hop_generate(&weights, &[0, 1, 2, 3, 4], faults, 0);
    assert_eq!(tokens, want);
    for (i, (caught, dropped)) in seen.iter().enumerate().filter(|(i, _)| *i != 1) {
        assert!(caught.is_empty(), "member {i} caught {caught:?}");
        assert_eq!(dropped, &[(1, "left the group".to_string())], "member {i}");
    }
    assert!(stats.verified_rounds >= 12, "{stats:?}");
    assert_eq!(
        stats.unverified_rounds, 0,
        "a round went unchecked after the loss"
    );
    assert!(stats.caught.is_empty());
    assert_eq!(reruns, 1);
}

#[test]
fn a_part_lost_to_one_member_fails_its_pass_and_the_pass_is_fed_again_to_members_alike() {
    // Row 0's part of pass 3's third round never reaches row 1. Row 1 must not leave row 0 out
    // on its own (it would decode from other rows than the rest, and its parts drift off the
    // code): it fails the pass, naming row 0; the others then miss row 1's next part and name
    // it. The leader feeds the pass again without the member most named, and every member
    // left in leaves out the same row, at a pass's start.
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let want = round_generate(&weights, 0);
    let faults = Faults {
        lose: Some((0, 1, 3, 3)),
        wait_ms: Some(2_000),
        ..Faults::default()
    };
    let (tokens, seen, stats, reruns) = hop_generate(&weights, &[0, 1, 2, 3, 4], faults, 0);
    assert_eq!(tokens, want);
    assert_eq!(reruns, 1);
    assert_eq!(seen[1].1, [], "row 1 left no one out");
    for (i, (caught, dropped)) in seen.iter().enumerate() {
        assert!(caught.is_empty(), "member {i} caught {caught:?}");
        if i != 1 {
            assert_eq!(dropped, &[(1, "left the group".to_string())], "member {i}");
        }
    }
    assert!(
        stats.caught.is_empty() && stats.unverified_rounds == 0,
        "{stats:?}"
    );
}

#[test]
fn a_member_that_blames_an_honest_one_again_and_again_is_the_one_left_out() {
    // Row 4, fed pass 3, computes nothing and tells the leader it missed row 2's part, naming
    // row 2 twelve times. The others miss row 4's parts and name it once each: the leader
    // counts each member's blame of a row once, so row 4 is the most named and left out, and
    // row 2 stays.
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let want = round_generate(&weights, 0);
    let faults = Faults {
        blames: Some((4, 3, 2, 12)),
        wait_ms: Some(2_000),
        ..Faults::default()
    };
    let (tokens, seen, stats, reruns) = hop_generate(&weights, &[0, 1, 2, 3, 4], faults, 0);
    assert_eq!(tokens, want);
    assert_eq!(reruns, 1);
    for (i, (caught, dropped)) in seen.iter().enumerate().filter(|(i, _)| *i != 4) {
        assert!(caught.is_empty(), "member {i} caught {caught:?}");
        assert_eq!(
            dropped,
            &[(4, "left the group".to_string())],
            "member {i} left out the liar alone"
        );
    }
    assert!(stats.caught.is_empty(), "{stats:?}");
}

/// Greedy decoding of several prompts at once through `forward`, each sequence at its own
/// position (numbered from `first`); what each generated.
fn batch_decode(
    forward: &mut dyn FnMut(&[HopSeq<'_>]) -> Vec<Vec<f32>>,
    first: u64,
    prompts: &[&[u32]],
    tokens: usize,
    vocab: usize,
) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut held = vec![0usize; prompts.len()];
    let mut input: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    for _ in 0..tokens {
        let seqs: Vec<HopSeq<'_>> = input
            .iter()
            .enumerate()
            .map(|(i, t)| HopSeq {
                seq: first + i as u64,
                pass: Pass {
                    start: held[i],
                    tokens: t,
                    logits: 1,
                },
            })
            .collect();
        let logits = forward(&seqs);
        for (i, l) in logits.iter().enumerate() {
            assert_eq!(l.len(), vocab);
            held[i] += input[i].len();
            let next = crate::model::argmax(l);
            out[i].push(next);
            input[i] = vec![next];
        }
    }
    out
}

#[test]
fn a_batch_of_sequences_through_a_hop_group_decodes_each_as_alone() {
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let vocab = weights.cfg.vocab;
    let prompts: [&[u32]; 3] = [&[3, 17, 200, 42, 3, 17], &[9, 8, 7], &[100]];
    let (mut leader, threads) = hop_group(&weights, &[0, 1, 2, 3], Faults::default());
    let together = {
        let mut forward = |seqs: &[HopSeq<'_>]| block_on(leader.forward_batch(seqs)).unwrap();
        batch_decode(&mut forward, 10, &prompts, 6, vocab)
    };
    for seq in 10..13 {
        leader.forget(seq);
    }
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut forward = |seqs: &[HopSeq<'_>]| block_on(leader.forward_batch(seqs)).unwrap();
            batch_decode(&mut forward, 20 + i as u64, &[p], 6, vocab).remove(0)
        })
        .collect();
    assert_eq!(together, alone);
    // Sequence 10 was forgotten: it cannot go on where it was.
    let gone = block_on(leader.forward_batch(&[HopSeq {
        seq: 10,
        pass: Pass {
            start: 7,
            tokens: &[5],
            logits: 1,
        },
    }]));
    assert!(gone.is_err(), "a forgotten sequence starts again at 0");
    drop(leader);
    for t in threads {
        let (caught, _) = t.join().unwrap();
        assert!(caught.is_empty(), "{caught:?}");
    }
}

#[test]
fn a_pass_that_names_a_sequence_twice_fails() {
    let weights = ModelWeights::synthetic(config(), 5).unwrap();
    let (mut leader, threads) = hop_group(&weights, &[0, 1, 2, 3], Faults::default());
    let pass = Pass {
        start: 0,
        tokens: &[1, 2],
        logits: 1,
    };
    let twice = [HopSeq { seq: 1, pass }, HopSeq { seq: 1, pass }];
    assert!(block_on(leader.forward_batch(&twice)).is_err());
    drop(leader);
    for t in threads {
        t.join().unwrap();
    }
}

/// A member's link in a group of two whose other member's part comes `after` the round
/// starts: `next` hands it over when the wait it is given reaches that far, else nothing.
struct SlowLink {
    answer_len: usize,
    after: Duration,
    part: Option<Part>,
}

impl HopLink for SlowLink {
    async fn compute(&mut self, _step: StepRequest) -> Result<Vec<u8>, String> {
        Ok(vec![0; self.answer_len])
    }

    fn send(&mut self, _row: usize, part: &Part) {
        // The other member's part is as long as this one.
        self.part = Some(Part {
            row: 1,
            ..part.clone()
        });
    }

    async fn next(&mut self, wait: Duration) -> Option<Heard> {
        if wait < self.after {
            return None;
        }
        self.part.take().map(Heard::Part)
    }
}

/// Runs one round of a two-member exchange (a wait of 50 ms) whose parts are `len` bytes and
/// the other's comes `after`: the members answered, or why not.
fn slow_round(len: usize, after: Duration) -> Result<Vec<usize>, String> {
    let link = SlowLink {
        answer_len: len,
        after,
        part: None,
    };
    let join = Join {
        group: 1,
        version: [0; 32],
        rows: vec![0, 1],
        peers: vec![Vec::new(); 2],
        addrs: vec![Vec::new(); 2],
        row: 0,
        wait_ms: 50,
        extra: 0,
        noise: crate::coded::DEFAULT_NOISE,
    };
    let mut exchange = Exchange::new(&join, 0, link);
    exchange.pass = 1;
    let step = StepRequest::Matmul {
        stage: Stage::Down(0),
        t: 1,
        x: vec![0.0; 4],
    };
    let request = protocol::encode(&step).unwrap();
    let mut members = vec![0, 1];
    block_on(exchange.round(&mut members, &request, 2))
        .map(|answers| answers.into_iter().map(|(r, _)| r).collect())
        .map_err(|e| e.reason)
}

#[test]
fn a_members_part_is_waited_for_as_long_as_its_bytes_take_at_the_slowest_rate() {
    // 25 000-byte parts, one to each of two members: 0.4 s at 1 Mbit/s, beyond the 50 ms.
    assert_eq!(
        slow_round(25_000, Duration::from_millis(300)),
        Ok(vec![0, 1])
    );
    let late = slow_round(25_000, Duration::from_millis(600)).unwrap_err();
    assert!(late.contains("within 450ms"), "{late}");
    // A small part is waited for only the 50 ms.
    assert!(slow_round(10, Duration::from_millis(300)).is_err());
}
