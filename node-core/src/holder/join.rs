//! How a node obtains its row — a genesis shard, a row built along a chain of k holders, or a
//! replica copied from a holder — and a holder's part in someone else's chain; written once for
//! the native and the browser node, over the [`Link`] each of them implements.

use std::future::Future;

use futures::StreamExt;

use super::{
    Download, HolderError, MAX_BLOB_BYTES, check_shard, describe, shard_chunk_request,
    shard_from_blob, shard_to_blob, version_from_source,
};
use crate::chain::{Assembly, ChainPart, Running, Turn};
use crate::code::Generator;
use crate::coded::ShardSet;
use crate::mesh::{JoinOffer, MeshRequest, MeshResponse, ModelManifest, ShardVersion, SourceRow};
use crate::model::{LeaderWeights, LlamaConfig};

/// Chained pieces a joiner asks for at once: enough to keep every link of the chain busy.
const CHAIN_IN_FLIGHT: usize = 4;

/// What a holder needs of its node's networking.
pub trait Link {
    /// A peer this node can ask.
    type Peer: Clone + std::fmt::Display;

    /// Asks `peer` and waits for its answer (an `Error` answer is an answer).
    fn ask(
        &self,
        peer: &Self::Peer,
        request: MeshRequest,
    ) -> impl Future<Output = Result<MeshResponse, HolderError>>;

    /// Connects to the holder `src` names, at the addresses it gives.
    fn dial(&self, src: &SourceRow) -> impl Future<Output = Result<Self::Peer, HolderError>>;

    /// Runs CPU-heavy work where it does not hold up the node's networking.
    fn blocking<R: Send + 'static>(
        &self,
        work: impl FnOnce() -> R + Send + 'static,
    ) -> impl Future<Output = R>;

    /// Shows how far a long step is (`total` 0: not known yet).
    fn progress(&self, what: &str, done: u64, total: u64);

    /// The round trip to `peer` (connected), waiting briefly for a first measurement; `None`
    /// where this link measures none (the default, a browser's).
    fn round_trip(&self, peer: &Self::Peer) -> impl Future<Output = Option<web_time::Duration>> {
        let _ = peer;
        async { None }
    }
}

/// How long a joiner spends measuring its round trips to the mesh before it asks to join.
pub const MEASURE_WAIT: web_time::Duration = web_time::Duration::from_secs(5);

/// The peer id of the holder `src` names.
pub fn source_peer(src: &SourceRow) -> Result<libp2p::PeerId, HolderError> {
    src.peer
        .parse()
        .map_err(|e| source_error(src, format!("peer id: {e}")))
}

/// An error reaching the holder `src` names.
pub fn source_error(src: &SourceRow, e: impl std::fmt::Display) -> HolderError {
    HolderError::Link(format!("row {}'s holder {}: {e}", src.row, src.peer))
}

/// A row obtained from the mesh.
#[derive(Debug)]
pub struct Joined {
    /// The shard set.
    pub shard: ShardSet,
    /// The same as a blob, to store.
    pub blob: Vec<u8>,
    /// The updates it includes.
    pub version: ShardVersion,
    /// The norm gains at that version.
    pub norms: LeaderWeights,
    /// Where it came from, for people.
    pub how: String,
    /// Bytes of shard data this node received to obtain it.
    pub received: u64,
}

/// `link.ask`, with an `Error` answer as an error.
async fn ask_ok<L: Link>(
    link: &L,
    peer: &L::Peer,
    request: MeshRequest,
) -> Result<MeshResponse, HolderError> {
    match link.ask(peer, request).await? {
        MeshResponse::Error(e) => Err(HolderError::Link(format!("{peer} answered: {e}"))),
        other => Ok(other),
    }
}

/// Asks `bootstrap` for a row of the mesh `manifest` describes and obtains its shard.
pub async fn join<L: Link>(
    link: &L,
    bootstrap: &L::Peer,
    manifest: &ModelManifest,
) -> Result<Joined, HolderError> {
    let request = join_request(link, bootstrap).await;
    let offer = match ask_ok(link, bootstrap, request).await? {
        MeshResponse::Join(offer) => offer,
        other => {
            return Err(HolderError::Download(format!(
                "asked to join, got a {}",
                describe(&other)
            )));
        }
    };
    obtain(link, bootstrap, manifest, offer).await
}

/// The request to join: with the round trips to the bootstrap and to a few holders spread
/// over the mesh's coordinates ([`crate::mesh::regions`]), where the link measures them, so the
/// joiner is offered a row its region lacks; a plain [`MeshRequest::Join`] where it does not.
async fn join_request<L: Link>(link: &L, bootstrap: &L::Peer) -> MeshRequest {
    use futures::future::{Either, join_all, select};
    let Some(first) = link.round_trip(bootstrap).await else {
        return MeshRequest::Join;
    };
    let mut samples = vec![(bootstrap.to_string(), first)];
    if let Ok(MeshResponse::Info(info)) = link.ask(bootstrap, MeshRequest::Info).await {
        let others = spread_holders(&info, &samples[0].0, crate::mesh::regions::MAX_SAMPLES - 1);
        let measure = join_all(others.iter().map(|src| async move {
            let peer = link.dial(src).await.ok()?;
            Some((src.peer.clone(), link.round_trip(&peer).await?))
        }));
        let timer = futures_timer::Delay::new(MEASURE_WAIT);
        if let Either::Left((measured, _)) = select(Box::pin(measure), timer).await {
            samples.extend(measured.into_iter().flatten());
        }
    }
    tracing::info!(?samples, "round trips measured before joining");
    let (peers, rtt_us) = samples
        .into_iter()
        .map(|(p, rtt)| (p, u32::try_from(rtt.as_micros()).unwrap_or(u32::MAX)))
        .unzip();
    MeshRequest::JoinNear { peers, rtt_us }
}

/// Up to `count` healthy holders of `info` other than `bootstrap`, spread over the space of
/// their coordinates: each next the farthest from those taken (unplaced ones last).
fn spread_holders(info: &crate::mesh::MeshInfo, bootstrap: &str, count: usize) -> Vec<SourceRow> {
    let mut left: Vec<&crate::mesh::NodeStatus> = (info.nodes.iter())
        .filter(|n| {
            n.peer != bootstrap
                && n.health == crate::mesh::Health::Healthy
                && n.caught.is_none()
                && n.row.is_some()
                && !n.addrs.is_empty()
        })
        .collect();
    let mut taken: Vec<&crate::mesh::NodeStatus> = Vec::new();
    if let Some(boot) = info.nodes.iter().find(|n| n.peer == bootstrap) {
        taken.push(boot);
    }
    let skip = taken.len();
    while taken.len() < count + skip && !left.is_empty() {
        let far = |n: &&crate::mesh::NodeStatus| {
            let c = n.coord;
            if !c.is_placed() {
                return -1.0;
            }
            (taken.iter().map(|t| t.coord))
                .filter(crate::mesh::Coord::is_placed)
                .map(|t| t.rtt_ms(&c))
                .fold(f32::INFINITY, f32::min)
        };
        let i = (0..left.len())
            .max_by(|&a, &b| far(&left[a]).total_cmp(&far(&left[b])))
            .unwrap_or(0);
        taken.push(left.swap_remove(i));
    }
    taken[skip..]
        .iter()
        .map(|n| SourceRow {
            row: n.row.unwrap_or(0),
            peer: n.peer.clone(),
            addrs: n.addrs.clone(),
        })
        .collect()
}

/// Obtains the row `offer` names: a genesis shard from `bootstrap` (the node that offered
/// it), a row built along a chain, or a replica copied from one of its holders. A holder that
/// fell behind what its peers keep rebuilds its own row the same way
/// ([`crate::mesh::MeshView::rebuild_offer`]).
pub async fn obtain<L: Link>(
    link: &L,
    bootstrap: &L::Peer,
    manifest: &ModelManifest,
    offer: JoinOffer,
) -> Result<Joined, HolderError> {
    match offer {
        JoinOffer::Genesis { row } => {
            let what = format!("row {row} from {bootstrap}");
            let (blob, at) = download(link, bootstrap, &what, row).await?;
            if at != ShardVersion::default().digest() {
                return Err(HolderError::Download(
                    "the genesis shard is not at the genesis version".into(),
                ));
            }
            let received = blob.len() as u64;
            let (shard, blob) = decode(link, manifest, row, blob).await?;
            Ok(Joined {
                shard,
                blob,
                version: ShardVersion::default(),
                norms: manifest.leader.clone(),
                how: format!("a genesis shard from {bootstrap}"),
                received,
            })
        }
        JoinOffer::Reencode { row, sources } => build_row(link, manifest, row, &sources).await,
        JoinOffer::Replica { row, holders } => {
            let mut failures = Vec::new();
            for src in holders.iter().filter(|s| s.row == row) {
                match copy_row(link, manifest, src).await {
                    Ok(joined) => return Ok(joined),
                    Err(e) => {
                        tracing::warn!(peer = %src.peer, "could not copy row {row}: {e}");
                        failures.push(format!("{}: {e}", src.peer));
                    }
                }
            }
            Err(HolderError::Link(format!(
                "could not copy row {row} from any of its holders: {}",
                failures.join("; ")
            )))
        }
        JoinOffer::Full => Err(HolderError::Link(format!(
            "the mesh has fewer than k = {} live rows to build a row from: try again once it is available",
            manifest.generator.k()
        ))),
    }
}

/// Downloads row `row`'s shard blob from `peer`: the bytes and the version they are at.
async fn download<L: Link>(
    link: &L,
    peer: &L::Peer,
    what: &str,
    row: u32,
) -> Result<(Vec<u8>, [u8; 32]), HolderError> {
    fetch_pieces(link, peer, MAX_BLOB_BYTES, Some(what), |offset| {
        shard_chunk_request(row, offset)
    })
    .await
}

/// Fetches a blob of at most `limit` bytes from `peer` piece by piece (`request(offset)` asks
/// for the piece at `offset`), showing progress as `what` when given: the bytes and the version
/// they are at.
pub(super) async fn fetch_pieces<L: Link>(
    link: &L,
    peer: &L::Peer,
    limit: u64,
    what: Option<&str>,
    request: impl Fn(u64) -> MeshRequest,
) -> Result<(Vec<u8>, [u8; 32]), HolderError> {
    let mut d = Download::new(limit);
    loop {
        let done = d.accept(link.ask(peer, request(d.offset())).await?)?;
        if let Some(what) = what {
            link.progress(what, d.offset(), d.total().unwrap_or(0));
        }
        if done {
            return Ok(d.finish());
        }
    }
}

/// A downloaded blob as row `row`'s shard set of this mesh, with the blob.
async fn decode<L: Link>(
    link: &L,
    manifest: &ModelManifest,
    row: u32,
    blob: Vec<u8>,
) -> Result<(ShardSet, Vec<u8>), HolderError> {
    link.progress("checking the shard", 0, 0);
    let (shard, blob) = link
        .blocking(move || shard_from_blob(&blob).map(|s| (s, blob)))
        .await?;
    check_shard(&shard, manifest, row)?;
    Ok((shard, blob))
}

/// Which updates make version `at` on `from`, and its norm gains there.
async fn version_at<L: Link>(
    link: &L,
    from: &L::Peer,
    at: [u8; 32],
    cfg: &LlamaConfig,
) -> Result<(ShardVersion, LeaderWeights), HolderError> {
    let norms = link.ask(from, MeshRequest::Norms).await?;
    let versions = link.ask(from, MeshRequest::Versions).await?;
    version_from_source(at, norms, versions, cfg)
}

/// Copies one holder's shard of its row, at the version it is at.
async fn copy_row<L: Link>(
    link: &L,
    manifest: &ModelManifest,
    src: &SourceRow,
) -> Result<Joined, HolderError> {
    let from = link.dial(src).await?;
    let what = format!("copying row {} from {from}", src.row);
    let (blob, at) = download(link, &from, &what, src.row).await?;
    let received = blob.len() as u64;
    let (shard, blob) = decode(link, manifest, src.row, blob).await?;
    let (version, norms) = version_at(link, &from, at, &manifest.cfg).await?;
    Ok(Joined {
        shard,
        blob,
        version,
        norms,
        how: format!("a replica of row {}, copied from {from}", src.row),
        received,
    })
}

/// Builds row `target` along the chain `sources` ([`crate::chain`]): this node receives one
/// shard's worth from the last source (running sums, or a compact row's own bytes) and
/// nothing else.
async fn build_row<L: Link>(
    link: &L,
    manifest: &ModelManifest,
    target: u32,
    sources: &[SourceRow],
) -> Result<Joined, HolderError> {
    let rows: Vec<u32> = sources.iter().map(|s| s.row).collect();
    let last = sources
        .last()
        .ok_or_else(|| HolderError::Download("the join offer named no source rows".into()))?;
    let tail = &link.dial(last).await?;
    // The chain builds the row at the version its last source is at now; a source at another
    // version refuses its piece, and the join is tried again.
    let at = match ask_ok(link, tail, MeshRequest::Norms).await? {
        MeshResponse::Norms { version, .. } => version,
        other => {
            return Err(HolderError::Download(format!(
                "asked for the version, got a {}",
                describe(&other)
            )));
        }
    };
    let mut asm = Assembly::new(
        &manifest.cfg,
        &manifest.generator,
        target as usize,
        manifest.format,
    )?;
    let pieces = asm.pieces();
    let total = pieces.len() as u64;
    let part = |piece| ChainPart {
        target,
        chain: sources.to_vec(),
        at: (sources.len() - 1) as u32,
        version: at,
        piece,
    };
    let mut answers = futures::stream::iter(pieces.into_iter().map(|piece| {
        let request = MeshRequest::Chain(part(piece));
        async move { (piece, ask_ok(link, tail, request).await) }
    }))
    .buffered(CHAIN_IN_FLIGHT);
    let what = format!("row {target} from rows {rows:?} along a chain");
    let mut done = 0;
    while let Some((piece, answer)) = answers.next().await {
        match Turn::try_from(answer?) {
            Ok(turn) => asm.add(&piece, turn)?,
            Err(other) => {
                return Err(HolderError::Download(format!(
                    "asked for a piece of the row, got a {}",
                    describe(&other)
                )));
            }
        }
        done += 1;
        link.progress(&what, done, total);
    }
    let received = asm.received();
    link.progress("storing the row", 0, 0);
    let (shard, blob) = link
        .blocking(move || {
            let shard = asm.finish();
            shard_to_blob(&shard).map(|blob| (shard, blob))
        })
        .await?;
    let (version, norms) = version_at(link, tail, at, &manifest.cfg).await?;
    let how = if target as usize >= manifest.generator.genesis_rows() {
        "a new row, encoded"
    } else {
        "re-encoded"
    };
    Ok(Joined {
        shard,
        blob,
        version,
        norms,
        how: format!("{how} from rows {rows:?} along a chain"),
        received,
    })
}

/// A holder's part in a chain: the running sum of the sources before it (`None` for the first),
/// checked against the mesh's code `g` and model `cfg` before anything is asked. The holder then
/// adds its own term with [`ChainPart::contribute`].
pub async fn answer_chain<L: Link>(
    link: &L,
    part: &ChainPart,
    g: &Generator,
    cfg: &LlamaConfig,
) -> Result<Option<Running>, HolderError> {
    let (_, len) = part.check(g, cfg)?;
    let Some((src, before)) = part.before() else {
        return Ok(None);
    };
    let peer = link.dial(&src).await?;
    let short = |got: usize| {
        Err(HolderError::Download(format!(
            "row {}'s holder sent a running sum of {got} values where {len} were due",
            src.row
        )))
    };
    match ask_ok(link, &peer, MeshRequest::Chain(before)).await? {
        MeshResponse::Partial(sum) if sum.len() == len => Ok(Some(Running::Values(sum))),
        MeshResponse::IntPartial(sum) if sum.q.len() == len => Ok(Some(Running::Ints(sum))),
        MeshResponse::Partial(sum) => short(sum.len()),
        MeshResponse::IntPartial(sum) => short(sum.q.len()),
        other => Err(HolderError::Download(format!(
            "asked row {} for a running sum, got a {}",
            src.row,
            describe(&other)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{Coord, HealthConfig, Heartbeat, MeshView};

    /// A holder of `row` placed at `x` ms along one axis, with an address.
    fn holder(row: u32, x: f32) -> Heartbeat {
        Heartbeat {
            addrs: vec![format!("/ip4/10.0.0.{row}/tcp/4001")],
            coord: Coord {
                vec: [x, 0.0, 0.0, 0.0],
                height: 0.5,
                error: 0.1,
            },
            ..Heartbeat::for_test(Some(row))
        }
    }

    #[test]
    fn a_joiner_measures_holders_spread_over_the_regions_first() {
        // Seed (this view's node, unplaced) and three regions: 0 ms (peers 1-4), 100 ms
        // (5-7), 200 ms (8). Asked for three beyond the bootstrap (peer 1), a joiner measures
        // one holder of each of the other places before a second of any.
        let t0 = web_time::Instant::now();
        let mut v = MeshView::new(
            t0,
            0u32,
            HealthConfig::default(),
            2,
            (3, 3),
            "m".into(),
            holder(0, 0.0),
        )
        .unwrap();
        let places = [
            (1, 0.0),
            (2, 1.0),
            (3, 2.0),
            (4, 1.5),
            (5, 100.0),
            (6, 101.0),
            (7, 99.0),
            (8, 200.0),
        ];
        for (peer, x) in places {
            v.handle_heartbeat(t0, peer, holder(peer % 3, x));
        }
        let chosen = spread_holders(&v.info(t0), "1", 3);
        let peers: Vec<u32> = chosen.iter().map(|s| s.peer.parse().unwrap()).collect();
        assert_eq!(peers.len(), 3);
        assert!(peers.contains(&8), "{peers:?}");
        assert_eq!(
            peers.iter().filter(|p| (5..=7).contains(*p)).count(),
            1,
            "{peers:?}"
        );
        assert!(!peers.contains(&1), "the bootstrap is measured already");
        assert!(chosen.iter().all(|s| !s.addrs.is_empty()));
    }
}
