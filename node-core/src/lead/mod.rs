//! The leader's role, written once for the native and the browser node: forming a coded group
//! over the mesh's live rows (checked against learning updates of their version), settling
//! what learning makes ([`learning`]), spreading an update through the holders and reporting the
//! members a group caught ([`publish`]), choosing how a pass travels ([`route`]), and the
//! trainer's share of the time and of a minibatch ([`training`]). No I/O is inside: each shell
//! implements [`LeadLink`] over its own networking.

pub mod generate;
pub mod leader;
pub mod learning;
mod near;
pub mod publish;
pub mod route;
pub mod steer;
pub mod training;

pub use crate::learn::Signer;
pub use generate::{
    generate, generate_async, generate_on, generate_regrouping, generate_with, one_at_a_time,
};
pub use leader::{Failure, LeadShell, Leader, Measured, Stepped, ready, step, step_scored};
pub use learning::{Publisher, Settled, settle};
pub use near::{closer_hop_row, closer_row, places_of};
pub use publish::{Reported, Sealed, Sent, report_caught, seal_update, spread_out};
pub use route::{HOP_OVER, PassRoute, RouteMeasures, hop_cost, hop_members};
pub use steer::{Action, Looking, Route, Steer, returned_row};

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;

use libp2p::{Multiaddr, PeerId};

use crate::code::{CodeError, Generator};
use crate::coded::{CodedError, CodedGroup, Transport, UpdateProbe, VerifyConfig};
use crate::holder::{HolderError, Link, Rules, fetch_update, version_of};
use crate::learn::{Update, UpdateError};
use crate::mesh::{
    Coord, MeshInfo, MeshRequest, MeshResponse, ModelManifest, RoundConfig, hex, pick_nearest,
    plan_group_near, rows_at_version,
};
use crate::model::{LeaderWeights, Llama, ModelError};

/// Learning updates of a version a leader checks its members against: a random few.
pub const PROBE_UPDATES: usize = 4;

/// Most bytes of learning updates a leader holds for its probe, whatever the model: the
/// [`PROBE_UPDATES`] of SmolLM2 (10 MB each), one of Llama-3.2-1B's shape (24 MB), and never
/// fewer than one.
pub const PROBE_BYTES: usize = 40 << 20;

/// What a leader needs of its node's networking, beyond a holder's [`Link`].
pub trait LeadLink: Link<Peer = PeerId> {
    /// The transport a formed group computes over.
    type Net: Transport;

    /// This node's own row, if it holds one.
    fn own_row(&self) -> Option<OwnRow>;

    /// Makes `peer` reachable at the addresses the mesh lists for it; returns the ones it will
    /// be dialed at.
    fn reach(
        &self,
        peer: PeerId,
        addrs: &[String],
    ) -> impl Future<Output = Result<Vec<Multiaddr>, HolderError>>;

    /// The transport of a group at `version` over `rows`, asking `members` (the decoding k
    /// first) in every round.
    fn transport(
        &self,
        version: [u8; 32],
        rows: &BTreeMap<usize, PeerId>,
        members: &[usize],
        generator: &Generator,
        round: RoundConfig,
    ) -> Self::Net;
}

/// The leading node's own row.
#[derive(Debug, Clone)]
pub struct OwnRow {
    /// The node's peer id.
    pub peer: PeerId,
    /// Its version and norm gains, when the row computes in the group in process (`None`: the
    /// group does without it).
    pub norms: Option<([u8; 32], LeaderWeights)>,
}

/// Why a leader could not form a group or hand out an update.
#[derive(Debug, thiserror::Error)]
pub enum LeadError {
    /// Too few rows can be used now.
    #[error("{0}")]
    Unavailable(String),
    /// The rows are between versions: asking again shortly will do.
    #[error("{0}")]
    Moving(String),
    /// The mesh's view names a peer id that does not parse.
    #[error("peer id {0:?} in the mesh's view: {1}")]
    PeerId(String, String),
    /// Reaching a peer failed.
    #[error(transparent)]
    Link(#[from] HolderError),
    /// The generator cannot give a group.
    #[error(transparent)]
    Code(#[from] CodeError),
    /// The group could not be set up.
    #[error(transparent)]
    Coded(#[from] CodedError),
    /// The leader's side of the model could not be set up.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The update could not be signed.
    #[error(transparent)]
    Update(#[from] UpdateError),
}

/// How a leader's group is formed.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Answers checked beyond the k decoded in every forward round.
    pub verify: usize,
    /// Spare members asked beside the k (and the checked ones).
    pub spares: usize,
    /// Round timing.
    pub round: RoundConfig,
    /// Holders to leave out (another group of this leader computes with them), when the row
    /// has another holder or the group can do without the row.
    pub avoid: BTreeSet<PeerId>,
    /// Check members against a few learning updates of their version (when checked and the
    /// mesh learns); costs fetching those updates when the group forms.
    pub probe: bool,
    /// With `verify` 1, check rounds against secret projections of the check row instead of
    /// its answers ([`VerifyConfig::project`]).
    pub project: bool,
    /// The updates probed at each version, shared by every group formed with clones of these
    /// options.
    pub probed: ProbedUpdates,
}

/// The learning updates a leader probes its groups' members against: chosen once per version
/// (at random, unknown to the members) and shared by every group it forms at that version, so
/// that its memory holds one probe's updates however many groups it runs.
#[derive(Debug, Clone, Default)]
pub struct ProbedUpdates(Arc<std::sync::Mutex<Option<Probed>>>);

/// Updates probed at a version, as shards in the mesh's format take them.
type Probed = ([u8; 32], Vec<(u64, Arc<Update>)>);

impl ProbedUpdates {
    /// The updates probed at `version`: those chosen before, or a new choice from `holders`
    /// ([`probe_updates`]), projected as the mesh's shards take them.
    pub async fn at<L: Link<Peer = PeerId>>(
        &self,
        link: &L,
        holders: &[PeerId],
        version: [u8; 32],
        manifest: &ModelManifest,
    ) -> Result<Vec<(u64, Arc<Update>)>, HolderError> {
        if let Some(list) = chosen(&self.lock(), version) {
            return Ok(list);
        }
        let list: Vec<(u64, Arc<Update>)> =
            probe_updates(link, holders, version, &Rules::of(manifest), PROBE_BYTES)
                .await?
                .into_iter()
                // Compact shards learn each update's projection (docs/coding.md).
                .map(|(id, u)| {
                    (
                        id,
                        Arc::new(Arc::unwrap_or_clone(u).taken_by(manifest.format)),
                    )
                })
                .collect();
        let mut held = self.lock();
        // A group formed meanwhile may have chosen first: every group takes one choice.
        if let Some(first) = chosen(&held, version) {
            return Ok(first);
        }
        *held = Some((version, list.clone()));
        Ok(list)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Probed>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The updates `held` chose at `version`, if it chose at that version.
fn chosen(held: &Option<Probed>, version: [u8; 32]) -> Option<Vec<(u64, Arc<Update>)>> {
    held.as_ref()
        .filter(|(v, _)| *v == version)
        .map(|(_, list)| list.clone())
}

impl GroupOptions {
    /// `verify` checked answers and `spares` spares, default timing, members probed, checks
    /// projected.
    pub fn new(verify: usize, spares: usize) -> Self {
        Self {
            verify,
            spares,
            round: RoundConfig::default(),
            avoid: BTreeSet::new(),
            probe: true,
            project: true,
            probed: ProbedUpdates::default(),
        }
    }
}

/// A group formed for a leader, with what it needs to run the model on it.
#[derive(Debug)]
pub struct Formed<T: Transport> {
    /// The group.
    pub group: CodedGroup<T>,
    /// The leader's side of the model, with the norm gains at the group's version.
    pub llama: Llama,
    /// The version the group decodes at.
    pub version: [u8; 32],
    /// Every live holder at that version, replicas included, this node excluded (learning
    /// updates and reports go to all of them).
    pub holders: Vec<PeerId>,
    /// The holders the group computes with (k, the checked ones and the spares).
    pub members: Vec<PeerId>,
    /// The holder asked for each row that answered at the version.
    pub rows: BTreeMap<usize, PeerId>,
    /// Rows healthy at that version when the group was formed.
    pub live_rows: usize,
    /// Condition number of the decoding k.
    pub condition_number: f64,
    /// The addresses each asked holder is dialed at (each of `others`: the view's).
    pub addrs: BTreeMap<PeerId, Vec<Multiaddr>>,
    /// Each row's free holders at the version but this node, for a hop group ([`hop_members`]).
    pub others: BTreeMap<usize, Vec<PeerId>>,
    /// Where the view places each holder and this node (placed coordinates only).
    pub places: BTreeMap<PeerId, Coord>,
}

/// Forms a group over the rows `info` shows healthy: every row's holder is asked for its norm
/// gains at once (a slow first dial happens here, not inside a round's timeout, and rows that
/// cannot be reached or hold another version are left out), then the best-conditioned k plus
/// checks and spares are chosen.
pub async fn form<L: LeadLink>(
    link: &L,
    manifest: &ModelManifest,
    info: &MeshInfo,
    opts: &GroupOptions,
) -> Result<Formed<L::Net>, LeadError> {
    let Some((version, live)) = info.live_holders() else {
        return Err(LeadError::Unavailable(
            "no healthy row holder is known: the model is unavailable".into(),
        ));
    };
    let own = link.own_row();
    let own_peer = own.as_ref().map(|o| o.peer);
    // Every holder at the version gets the learning updates; the group takes one per row,
    // the first that no other group of this leader uses.
    let mut by_row: BTreeMap<usize, Vec<PeerId>> = BTreeMap::new();
    let mut addrs_of: BTreeMap<PeerId, &[String]> = BTreeMap::new();
    for (row, holders) in &live {
        for n in holders {
            let peer = n
                .peer
                .parse::<PeerId>()
                .map_err(|e| LeadError::PeerId(n.peer.clone(), e.to_string()))?;
            by_row.entry(*row).or_default().push(peer);
            addrs_of.insert(peer, n.addrs.as_slice());
        }
    }
    let holders: Vec<PeerId> = by_row
        .values()
        .flatten()
        .copied()
        .filter(|p| Some(*p) != own_peer)
        .collect();
    // A row this node holds but cannot compute in the group is left to its other holders.
    let mut avoid = opts.avoid.clone();
    if let Some(o) = own.as_ref().filter(|o| o.norms.is_none()) {
        avoid.insert(o.peer);
    }
    // Each row's nearest holder (this node's own row nearest of all; unknown last, in PeerId
    // order).
    let rtt = near::round_trips(info, own_peer);
    let peers = pick_nearest(&by_row, &avoid, |p| rtt.get(p).copied());
    // A further group of a leader needs its decoded and checked rows free: say so before
    // asking anyone anything.
    let needed = manifest.generator.k() + opts.verify;
    if !opts.avoid.is_empty() && peers.len() < needed {
        return Err(LeadError::Unavailable(format!(
            "{} rows have a holder no other group uses, fewer than the {needed} a further group needs",
            peers.len()
        )));
    }
    let mut dialed = BTreeMap::new();
    for &peer in peers.values().filter(|&&p| Some(p) != own_peer) {
        let at = addrs_of.get(&peer).copied().unwrap_or_default();
        dialed.insert(peer, link.reach(peer, at).await?);
    }
    let free = |p: &&PeerId| Some(**p) != own_peer && !avoid.contains(*p);
    let others: BTreeMap<usize, Vec<PeerId>> = (by_row.iter())
        .map(|(&row, holders)| (row, holders.iter().filter(free).copied().collect()))
        .collect();
    for &peer in others.values().flatten() {
        let view = addrs_of.get(&peer).copied().unwrap_or_default();
        let view = view.iter().filter_map(|a| a.parse().ok());
        dialed.entry(peer).or_insert_with(|| view.collect());
    }
    let places = near::places_of(info);
    let asks = peers.iter().map(|(&row, &peer)| {
        let own = own.as_ref().filter(|o| o.peer == peer);
        async move {
            let answer = match own.and_then(|o| o.norms.clone()) {
                Some((version, norms)) => Ok(MeshResponse::Norms { version, norms }),
                None => link.ask(&peer, MeshRequest::Norms).await,
            };
            (row, peer, answer)
        }
    });
    let answers = futures::future::join_all(asks).await;
    // Rows whose holders answered at another version: the mesh is between two.
    let moved = answers
        .iter()
        .filter(
            |(_, _, a)| matches!(a, Ok(MeshResponse::Norms { version: v, .. }) if *v != version),
        )
        .count();
    let (rows, norms) = rows_at_version(answers, version, &manifest.cfg);
    let Some(norms) = norms else {
        return Err(LeadError::Moving(format!(
            "no row holder could give the norm gains at version {}; the mesh is taking an update, try again",
            hex(&version[..8])
        )));
    };
    let g = manifest.generator.clone();
    let live: Vec<usize> = rows.keys().copied().collect();
    // Rows the view shows healthy at other versions, or whose holders answered at another.
    let elsewhere = info.healthy_row_count().saturating_sub(by_row.len()) + moved;
    if live.len() < g.k() && live.len() + elsewhere >= g.k() {
        // Rows at other versions would make k: an update is spreading, or a holder is
        // catching up from its peers. Asking again shortly forms the group at one version.
        return Err(LeadError::Moving(format!(
            "{} rows answer at version {}, {elsewhere} more are healthy at another: the mesh is taking an update, try again",
            live.len(),
            hex(&version[..8]),
        )));
    }
    if live.len() < g.k() {
        return Err(LeadError::Unavailable(format!(
            "the mesh has {} healthy rows at one version that this node can ask, fewer than k = {}: the model is unavailable",
            live.len(),
            g.k()
        )));
    }
    let row_rtt = |r: usize| rows.get(&r).and_then(|p| rtt.get(p)).copied();
    let plan = plan_group_near(&g, &live, opts.verify + opts.spares, row_rtt)?;
    let members: Vec<PeerId> = plan
        .members
        .iter()
        .filter_map(|r| rows.get(r).copied())
        .collect();
    // Members that claim updates they do not hold are caught by fitting the residuals
    // against a few updates of the version (docs/verification.md).
    let probe = match opts.probe && opts.verify > 0 && manifest.learning.enabled {
        true => match opts.probed.at(link, &holders, version, manifest).await {
            Ok(list) if list.is_empty() => None,
            Ok(list) => {
                tracing::info!(
                    updates = list.len(),
                    "checking members against learning updates of their version"
                );
                Some(UpdateProbe::new(list, g.n()))
            }
            Err(e) => {
                tracing::warn!("members are not checked against learning updates: {e}");
                None
            }
        },
        false => None,
    };
    let llama = Llama::new(manifest.cfg.clone(), norms)?;
    let transport = link.transport(version, &rows, &plan.members, &g, opts.round);
    let mut group = CodedGroup::new(manifest.cfg.clone(), g, &plan.members, transport)?;
    group.set_verify(VerifyConfig {
        extra: opts.verify,
        noise: manifest.verify_noise,
        project: opts.project,
    });
    group.set_probe(probe);
    Ok(Formed {
        group,
        llama,
        version,
        holders,
        members,
        rows,
        live_rows: live.len(),
        condition_number: plan.condition_number,
        addrs: dialed,
        others,
        places,
    })
}

/// A random few of the updates of `version` whose payloads a holder still keeps (at most
/// [`PROBE_UPDATES`], and as many as `budget` bytes hold, one at least), fetched and checked:
/// its version must have the group's digest, each payload hash to its id, and each must be
/// signed and fit the mesh's rules. (Payloads folded long ago are no longer kept anywhere, so
/// only the latest updates can be probed.)
pub async fn probe_updates<L: Link<Peer = PeerId>>(
    link: &L,
    holders: &[PeerId],
    version: [u8; 32],
    rules: &Rules,
    budget: usize,
) -> Result<Vec<(u64, Arc<Update>)>, HolderError> {
    use std::hash::BuildHasher;
    let mut last = HolderError::Link("no row holder to ask".into());
    for peer in holders {
        let listed = match version_of(link, peer).await {
            Ok(v) => v,
            Err(e) => {
                last = e;
                continue;
            }
        };
        if listed.digest() != version {
            last =
                HolderError::Mismatch(format!("{peer}'s update list is not the group's version"));
            continue;
        }
        // A random choice per leader (the hasher's keys are random), so no member can know
        // which updates will be checked.
        let order = std::collections::hash_map::RandomState::new();
        // Only updates whose payloads the holder still keeps can be probed.
        let mut ids: Vec<u64> = listed.served().collect();
        ids.sort_by_key(|&id| order.hash_one(id));
        ids.truncate(PROBE_UPDATES);
        let mut out: Vec<(u64, Arc<Update>)> = Vec::with_capacity(ids.len());
        let mut held = 0;
        for id in ids {
            // A version's updates have about one size: stop before one would pass the budget.
            if let Some((_, last)) = out.last()
                && held + last.held_bytes() > budget
            {
                break;
            }
            let bytes = fetch_update(link, peer, id).await?;
            // Updates a holder took before: their certificates may have expired since.
            let checked = rules.check(&bytes, None)?;
            if checked.id != id {
                return Err(HolderError::Mismatch(format!(
                    "{peer}'s update {id:016x} hashes to {:016x}",
                    checked.id
                )));
            }
            held += checked.update.held_bytes();
            out.push((id, Arc::new(checked.update)));
        }
        return Ok(out);
    }
    Err(last)
}

#[cfg(test)]
mod tests {
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

        async fn blocking<R: Send + 'static>(
            &self,
            work: impl FnOnce() -> R + Send + 'static,
        ) -> R {
            work()
        }

        fn progress(&self, _: &str, _: u64, _: u64) {}
    }

    impl LeadLink for Mesh {
        type Net = Unused;

        fn own_row(&self) -> Option<OwnRow> {
            self.own.clone()
        }

        async fn reach(
            &self,
            peer: PeerId,
            addrs: &[String],
        ) -> Result<Vec<Multiaddr>, HolderError> {
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
            returned_row(&back, &V, &[0, 1, 3, 4], 5, &none, 5.0),
            Some(2)
        );
        // A full group, a group at another version, or a row another group uses: none.
        assert_eq!(returned_row(&back, &V, &[0, 1, 3, 4], 4, &none, 5.0), None);
        assert_eq!(
            returned_row(&back, &[1; 32], &[0, 1, 3, 4], 5, &none, 5.0),
            None
        );
        let busy = BTreeSet::from([peers[2]]);
        assert_eq!(returned_row(&back, &V, &[0, 1, 3, 4], 5, &busy, 5.0), None);
        // Row 2 still gone, or not heard from since the group went short (a stalled member
        // still shows healthy for a while): nothing to take.
        let gone = view(&[all[0], all[1], all[3], all[4]]);
        assert_eq!(returned_row(&gone, &V, &[0, 1, 3, 4], 5, &none, 5.0), None);
        let mut stalled = view(&all);
        stalled.nodes[2].silent_for_s = 3.0;
        assert_eq!(
            returned_row(&stalled, &V, &[0, 1, 3, 4], 5, &none, 2.0),
            None
        );
        assert_eq!(
            returned_row(&stalled, &V, &[0, 1, 3, 4], 5, &none, 4.0),
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
}
