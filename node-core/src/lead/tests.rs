//! The leader's forming and probing, over an in-process link.

use super::*;
use crate::coded::{ShardFormat, TransportError};
use crate::mesh::{Health, LearningConfig, NodeStatus, Usage};
use crate::model::{LlamaConfig, TokenizerData};

/// A group's transport that is never asked: these tests only form groups.
#[derive(Debug)]
struct Unused;

impl Transport for Unused {
    async fn round(
        &mut self,
        _: &mut Vec<usize>,
        _: &[u8],
        _: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        unreachable!("a group formed in a test computes nothing")
    }

    async fn round_each(
        &mut self,
        _: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        unreachable!("a group formed in a test computes nothing")
    }
}

/// Holders that answer the norm gains at a version of their own (the peers reached and
/// asked are recorded), and the update list `kept` with the signed `payloads` it serves (the
/// pieces served are counted).
struct Mesh {
    cfg: LlamaConfig,
    at: BTreeMap<PeerId, [u8; 32]>,
    own: Option<OwnRow>,
    asked: std::cell::RefCell<Vec<PeerId>>,
    reached: std::cell::RefCell<Vec<PeerId>>,
    kept: crate::mesh::ShardVersion,
    payloads: BTreeMap<u64, Vec<u8>>,
    pieces: std::cell::Cell<usize>,
}

impl Link for Mesh {
    type Peer = PeerId;

    async fn ask(&self, peer: &PeerId, req: MeshRequest) -> Result<MeshResponse, HolderError> {
        match req {
            MeshRequest::Norms => {
                self.asked.borrow_mut().push(*peer);
                match self.at.get(peer) {
                    Some(&version) => Ok(MeshResponse::Norms {
                        version,
                        norms: norms(&self.cfg),
                    }),
                    None => Err(HolderError::Link(format!("{peer}: unreachable"))),
                }
            }
            MeshRequest::Versions => Ok(MeshResponse::Versions(self.kept.clone())),
            MeshRequest::UpdateChunk { id, offset, len } => {
                self.pieces.set(self.pieces.get() + 1);
                let payload = self
                    .payloads
                    .get(&id)
                    .ok_or_else(|| HolderError::Link(format!("no update {id:016x}")))?;
                Ok(crate::holder::chunk_of(payload, [0; 32], offset, len))
            }
            other => panic!("a leader asks for norms, versions and updates, not {other:?}"),
        }
    }

    async fn dial(&self, _: &crate::mesh::SourceRow) -> Result<PeerId, HolderError> {
        unreachable!("forming a group dials through reach")
    }

    async fn blocking<R: Send + 'static>(&self, work: impl FnOnce() -> R + Send + 'static) -> R {
        work()
    }

    fn progress(&self, _: &str, _: u64, _: u64) {}
}

impl LeadLink for Mesh {
    type Net = Unused;

    fn own_row(&self) -> Option<OwnRow> {
        self.own.clone()
    }

    async fn reach(&self, peer: PeerId, addrs: &[String]) -> Result<Vec<Multiaddr>, HolderError> {
        self.reached.borrow_mut().push(peer);
        Ok(addrs.iter().filter_map(|a| a.parse().ok()).collect())
    }

    fn transport(
        &self,
        _: [u8; 32],
        _: &BTreeMap<usize, PeerId>,
        _: &[usize],
        _: &Generator,
        _: RoundConfig,
    ) -> Unused {
        Unused
    }
}

fn norms(cfg: &LlamaConfig) -> LeaderWeights {
    LeaderWeights {
        attn_norm: vec![vec![1.0; cfg.hidden]; cfg.layers],
        ffn_norm: vec![vec![1.0; cfg.hidden]; cfg.layers],
        final_norm: vec![1.0; cfg.hidden],
        ..Default::default()
    }
}

fn manifest() -> ModelManifest {
    let cfg = crate::model::LlamaConfig::small();
    ModelManifest {
        name: "small".into(),
        leader: norms(&cfg),
        tokenizer: TokenizerData {
            json: String::new(),
            eos: Vec::new(),
            default_system: None,
            sampling: Default::default(),
        },
        generator: Generator::cauchy(5, 3).expect("a 3-of-5 code"),
        format: ShardFormat::F32,
        learning: LearningConfig::default(),
        verify_noise: 1e-3,
        mesh_key: crate::learn::MeshKey::of(&MESH_KEY).to_bytes(),
        canary_loss: None,
        cfg,
    }
}

/// The key of the tests' mesh.
static MESH_KEY: std::sync::LazyLock<libp2p::identity::Keypair> =
    std::sync::LazyLock::new(libp2p::identity::Keypair::generate_ed25519);

const V: [u8; 32] = [7; 32];

/// A compact mesh of the teacher fixtures' model, and a holder of two signed updates its
/// leader made (Adam on the adapters, as a mesh learns by default).
fn two_updates() -> (ModelManifest, Mesh) {
    let (llama, _, grads) = crate::learn::fixtures::setup();
    let cfg = llama.config().clone();
    let mut learner =
        crate::learn::Learner::new(LearningConfig::default(), cfg.clone(), ShardFormat::Q8);
    let key = libp2p::identity::Keypair::generate_ed25519();
    let cert = crate::learn::Certificate::issue(
        &MESH_KEY,
        key.public().to_peer_id(),
        "leader",
        1,
        u64::MAX,
        &[crate::learn::Power::Write],
    )
    .unwrap();
    let mut version = crate::mesh::ShardVersion::default();
    let mut payloads = BTreeMap::new();
    for g in grads {
        let update = learner.push(g).unwrap().unwrap().update;
        let payload = update.encode();
        let id = Update::id_of(&payload);
        let header = crate::learn::Header::default();
        payloads.insert(
            id,
            crate::learn::seal(payload, &key, Some(&cert), header).unwrap(),
        );
        version.insert(id);
    }
    let manifest = ModelManifest {
        leader: norms(&cfg),
        format: ShardFormat::Q8,
        cfg,
        ..manifest()
    };
    let holder = Mesh {
        kept: version,
        payloads,
        ..mesh(BTreeMap::new(), None)
    };
    (manifest, holder)
}

#[test]
fn a_short_group_takes_a_row_that_comes_back_at_its_version_and_free() {
    let peers: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
    let all: Vec<(PeerId, u32)> = peers.iter().zip(0..).map(|(&p, r)| (p, r)).collect();
    let none = BTreeSet::<PeerId>::new();
    // Rows 0, 1, 3 and 4 compute; row 2 is back. Wanting five, the group takes it.
    let back = view(&all);
    assert_eq!(
        returned_row(&back, &V, &[0, 1, 3, 4], 5, &none, &none, 5.0),
        Some(2)
    );
    // A full group, a group at another version, or a row another group uses: none.
    assert_eq!(
        returned_row(&back, &V, &[0, 1, 3, 4], 4, &none, &none, 5.0),
        None
    );
    assert_eq!(
        returned_row(&back, &[1; 32], &[0, 1, 3, 4], 5, &none, &none, 5.0),
        None
    );
    let busy = BTreeSet::from([peers[2]]);
    assert_eq!(
        returned_row(&back, &V, &[0, 1, 3, 4], 5, &busy, &none, 5.0),
        None
    );
    // Row 2 still gone, or not heard from since the group went short (a stalled member
    // still shows healthy for a while): nothing to take.
    let gone = view(&[all[0], all[1], all[3], all[4]]);
    assert_eq!(
        returned_row(&gone, &V, &[0, 1, 3, 4], 5, &none, &none, 5.0),
        None
    );
    let mut stalled = view(&all);
    stalled.nodes[2].silent_for_s = 3.0;
    assert_eq!(
        returned_row(&stalled, &V, &[0, 1, 3, 4], 5, &none, &none, 2.0),
        None
    );
    assert_eq!(
        returned_row(&stalled, &V, &[0, 1, 3, 4], 5, &none, &none, 4.0),
        Some(2)
    );
    // A holder heard from a heartbeat ago is taken at once, the moment the group goes short
    // (a stopped member's row rebuilt by a newcomer); a member that left the group, only once
    // heard from since.
    let mut fresh = view(&all);
    fresh.nodes[2].silent_for_s = 0.5;
    assert_eq!(
        returned_row(&fresh, &V, &[0, 1, 3, 4], 5, &none, &none, 0.0),
        Some(2)
    );
    let left = BTreeSet::from([peers[2]]);
    assert_eq!(
        returned_row(&fresh, &V, &[0, 1, 3, 4], 5, &none, &left, 0.0),
        None
    );
    assert_eq!(
        returned_row(&fresh, &V, &[0, 1, 3, 4], 5, &none, &left, 0.6),
        Some(2)
    );
}

#[test]
fn a_probe_takes_the_updates_its_budget_holds_and_every_group_at_a_version_shares_them() {
    let (manifest, holder) = two_updates();
    let (peer, version) = (PeerId::random(), holder.kept.digest());
    let rules = Rules::of(&manifest);
    let probe = |budget| {
        futures::executor::block_on(probe_updates(&holder, &[peer], version, &rules, budget))
            .unwrap()
    };
    let all = probe(usize::MAX);
    assert_eq!(all.len(), 2, "both updates fit an unbounded budget");
    let one = all[0].1.held_bytes();
    assert!(one > 0 && all[1].1.held_bytes() == one);
    assert_eq!(probe(one).len(), 1, "a budget of one update holds one");
    assert_eq!(
        probe(0).len(),
        1,
        "a probe takes one update whatever its budget"
    );
    // A leader's groups: the first at the version fetches, the others share what it took.
    let probed = ProbedUpdates::default();
    let at = |p: &ProbedUpdates, v| {
        futures::executor::block_on(p.at(&holder, &[peer], v, &manifest)).unwrap()
    };
    let before = holder.pieces.get();
    let first = at(&probed, version);
    let fetched = holder.pieces.get();
    assert!(fetched > before && !first.is_empty());
    let second = at(&probed.clone(), version);
    assert_eq!(
        holder.pieces.get(),
        fetched,
        "a second group fetches nothing"
    );
    assert_eq!(first.len(), second.len());
    for ((a, x), (b, y)) in first.iter().zip(&second) {
        assert!(a == b && Arc::ptr_eq(x, y), "the groups hold one copy");
        // What the shards of a compact mesh learn: the update's projection.
        let sent =
            Update::decode(&crate::learn::open(&holder.payloads[a]).unwrap().payload).unwrap();
        assert_eq!(**x, sent.projected());
    }
    // Another version is probed afresh, and not from a holder at another one.
    let moved = futures::executor::block_on(probed.at(&holder, &[peer], [1; 32], &manifest));
    assert!(matches!(moved, Err(HolderError::Mismatch(_))), "{moved:?}");
}

/// A mesh view: (peer, row) pairs, every one healthy at `V`.
pub(super) fn view(holders: &[(PeerId, u32)]) -> MeshInfo {
    let nodes = holders
        .iter()
        .map(|&(peer, row)| NodeStatus {
            peer: peer.to_string(),
            row: Some(row),
            health: Health::Healthy,
            version_count: 0,
            version_digest: hex(&V),
            addrs: vec!["/ip4/127.0.0.1/tcp/4001".into()],
            silent_for_s: 0.0,
            lag: 0,
            caught: None,
            device: "cpu".into(),
            usage: Usage::default(),
            reach: String::new(),
            trains: false,
            coord: Default::default(),
            rtt_ms: None,
        })
        .collect();
    MeshInfo {
        k: 3,
        n: 5,
        n_max: 5,
        rows: Vec::new(),
        health: Default::default(),
        model: String::new(),
        model_name: String::new(),
        available: true,
        healthy_rows: 5,
        tolerates: 2,
        version_count: 0,
        version_digest: hex(&V),
        nodes,
        dashboard: None,
        usage: Usage::default(),
    }
}

fn mesh(at: BTreeMap<PeerId, [u8; 32]>, own: Option<OwnRow>) -> Mesh {
    Mesh {
        cfg: crate::model::LlamaConfig::small(),
        at,
        own,
        asked: Default::default(),
        reached: Default::default(),
        kept: Default::default(),
        payloads: BTreeMap::new(),
        pieces: Default::default(),
    }
}

fn options(verify: usize) -> GroupOptions {
    GroupOptions {
        probe: false,
        ..GroupOptions::new(verify, 0)
    }
}

#[test]
fn a_row_this_node_cannot_ask_goes_to_its_other_holder_and_other_versions_are_left_out() {
    let peers: Vec<PeerId> = (0..6).map(|_| PeerId::random()).collect();
    let me = peers[5];
    // Row 1 is held by this node (which cannot ask itself) and by peers[1]; peers[4]
    // holds row 4 at another version than its heartbeat says.
    let info = view(&[
        (peers[0], 0),
        (me, 1),
        (peers[1], 1),
        (peers[2], 2),
        (peers[3], 3),
        (peers[4], 4),
    ]);
    let mut at: BTreeMap<PeerId, [u8; 32]> = peers[..4].iter().map(|&p| (p, V)).collect();
    at.insert(peers[4], [9; 32]);
    let link = mesh(
        at,
        Some(OwnRow {
            peer: me,
            norms: None,
        }),
    );
    let formed = futures::executor::block_on(form(&link, &manifest(), &info, &options(1)))
        .expect("four rows at the version are enough for k = 3 and a check");
    assert!(
        !link.asked.borrow().contains(&me),
        "a node never asks itself"
    );
    assert!(!link.reached.borrow().contains(&me));
    assert_eq!(formed.rows.get(&1), Some(&peers[1]));
    assert!(!formed.rows.contains_key(&4), "row 4 is at another version");
    assert_eq!(formed.live_rows, 4);
    assert_eq!(formed.group.nodes().len(), 4, "k = 3 and one check");
    assert_eq!(formed.version, V);
    assert!(
        !formed.holders.contains(&me),
        "updates are not sent to itself"
    );
    assert_eq!(formed.holders.len(), 5, "every other holder at the version");
}

#[test]
fn a_row_computed_in_process_joins_the_group_without_being_asked() {
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let me = PeerId::random();
    let info = view(&[(peers[0], 0), (peers[1], 1), (peers[2], 2), (me, 3)]);
    let link = mesh(
        peers.iter().map(|&p| (p, V)).collect(),
        Some(OwnRow {
            peer: me,
            norms: Some((V, norms(&crate::model::LlamaConfig::small()))),
        }),
    );
    let formed = futures::executor::block_on(form(&link, &manifest(), &info, &options(1)))
        .expect("four rows at the version");
    assert_eq!(formed.rows.get(&3), Some(&me));
    assert!(!link.asked.borrow().contains(&me));
    assert!(!formed.addrs.contains_key(&me), "its own row is not dialed");
    assert_eq!(formed.holders, peers, "updates go to the others");
}

#[test]
fn fewer_rows_than_k_at_one_version_is_unavailable_and_says_so() {
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let info = view(&[(peers[0], 0), (peers[1], 1), (peers[2], 2)]);
    // One of the three is unreachable.
    let link = mesh(peers[..2].iter().map(|&p| (p, V)).collect(), None);
    let err = futures::executor::block_on(form(&link, &manifest(), &info, &options(0)))
        .expect_err("two rows cannot decode k = 3");
    assert!(matches!(err, LeadError::Unavailable(_)), "{err}");
    assert!(err.to_string().contains("fewer than k = 3"), "{err}");
}

#[test]
fn rows_split_across_two_versions_are_a_moving_mesh() {
    // Two rows at the view's version V, the third's holder announces another: together
    // they would make k = 3 once the update reaches it.
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let mut info = view(&[(peers[0], 0), (peers[1], 1), (peers[2], 2)]);
    info.nodes[2].version_digest = hex(&[1; 32]);
    let link = mesh(peers.iter().map(|&p| (p, V)).collect(), None);
    let err = futures::executor::block_on(form(&link, &manifest(), &info, &options(0)))
        .expect_err("two rows at one version cannot decode k = 3");
    assert!(matches!(err, LeadError::Moving(_)), "{err}");
}

#[test]
fn rows_answering_at_another_version_only_is_a_moving_mesh() {
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let info = view(&[(peers[0], 0), (peers[1], 1), (peers[2], 2)]);
    let link = mesh(peers.iter().map(|&p| (p, [1; 32])).collect(), None);
    let err = futures::executor::block_on(form(&link, &manifest(), &info, &options(0)))
        .expect_err("no row is at the version the view shows");
    assert!(matches!(err, LeadError::Moving(_)), "{err}");
}
