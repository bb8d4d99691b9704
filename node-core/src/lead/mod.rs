//! The leader's role, written once for the native and the browser node: forming a coded group
//! over the mesh's live rows (checked against learning updates of their version), settling
//! what learning makes ([`learning`]), spreading an update through the holders and reporting the
//! members a group caught ([`publish`]), choosing how a pass travels ([`route`]), and the
//! trainer's share of the time and of a minibatch ([`training`]). No I/O is inside: each shell
//! implements [`LeadLink`] over its own networking.

pub mod choose;
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
pub use route::{HOP_OVER, PassRoute, RouteMeasures, hop_cost, hop_members, hops_beat_rounds};
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

impl<T: Transport> Formed<T> {
    /// The holder asked for each of `rows` (those it has one for).
    pub fn holders_of(&self, rows: &[usize]) -> BTreeMap<usize, PeerId> {
        (rows.iter())
            .filter_map(|r| Some((*r, *self.rows.get(r)?)))
            .collect()
    }

    /// The members it was formed with that hold none of `rows` (its rows now): those that
    /// left it.
    pub fn left(&self, rows: &[usize]) -> BTreeSet<PeerId> {
        let stay: BTreeSet<PeerId> = self.holders_of(rows).into_values().collect();
        (self.members.iter())
            .filter(|p| !stay.contains(p))
            .copied()
            .collect()
    }
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
mod tests;
