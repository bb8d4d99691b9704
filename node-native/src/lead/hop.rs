//! A leader's side of one hop per stage on a native node ([`node_core::net::hop`]): it forms
//! a hop group over its members, feeds passes and reads the LM head's parts. The members' side
//! is [`crate::hold::hop`].

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::AsyncReadExt;
use libp2p::{Multiaddr, PeerId};
use node_core::code::Generator;
use node_core::model::LlamaConfig;
use node_core::net::hop::{self, Fed, Feed, FeedLink, HopFrame, HopLeader, Join};
use node_core::net::session;
use tokio::sync::mpsc;

use crate::hold::hop::{Outgoing, hold_until};
use crate::net::swarm::{Client, open_accepted};

/// A leader's streams to the members of its hop group.
#[derive(Debug)]
pub struct NetFeedLink {
    to: HashMap<usize, Outgoing>,
    answers: mpsc::UnboundedReceiver<(usize, Fed)>,
}

impl FeedLink for NetFeedLink {
    fn feed(&mut self, row: usize, feed: &Feed) {
        let Some(to) = self.to.get(&row) else {
            return;
        };
        match session::frame(&HopFrame::Feed(feed.clone())) {
            Ok(frame) => {
                let _ = to.send((Instant::now() + crate::net::swarm::one_way_delay(), frame));
            }
            Err(e) => tracing::warn!("a pass did not frame: {e}"),
        }
    }

    async fn next(&mut self, wait: Duration) -> Option<(usize, Fed)> {
        tokio::time::timeout(wait, self.answers.recv())
            .await
            .ok()
            .flatten()
    }
}

/// Forms a hop group of `members` (row, holder) on `runtime`: every member gets its join, and
/// the leader decodes and checks the logits with the members beyond the first `k`.
pub fn lead(
    runtime: &tokio::runtime::Handle,
    client: &Client,
    cfg: LlamaConfig,
    generator: Generator,
    version: [u8; 32],
    members: &[(usize, PeerId, Vec<Multiaddr>)],
    wait: Duration,
) -> anyhow::Result<HopLeader<NetFeedLink>> {
    let k = generator.k();
    anyhow::ensure!(
        members.len() >= k,
        "a hop group needs k = {k} members, {} given",
        members.len()
    );
    let join = Join {
        group: group_id(),
        version,
        rows: members.iter().map(|&(r, _, _)| r as u32).collect(),
        peers: members.iter().map(|(_, p, _)| p.to_bytes()).collect(),
        addrs: members
            .iter()
            .map(|(_, _, a)| a.iter().map(ToString::to_string).collect())
            .collect(),
        row: 0,
        wait_ms: u32::try_from(wait.as_millis()).unwrap_or(u32::MAX),
        extra: (members.len() - k) as u32,
        noise: node_core::coded::DEFAULT_NOISE,
    };
    // Unbounded: a member answers only the passes fed to it, and the leader waits on each.
    let (answered, answers) = mpsc::unbounded_channel();
    let delay = crate::net::swarm::one_way_delay();
    let mut to = HashMap::new();
    for &(row, peer, _) in members {
        // Unbounded: the leader feeds a pass and waits for its answer before the next.
        let (tx, rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let joined = session::frame(&HopFrame::Join(Join {
            row: row as u32,
            ..join.clone()
        }))?;
        let _ = tx.send((Instant::now() + delay, joined));
        to.insert(row, tx);
        runtime.spawn(feed_member(client.clone(), peer, row, rx, answered.clone()));
    }
    let link = NetFeedLink { to, answers };
    Ok(HopLeader::new(cfg, generator, &join, link)?)
}

/// A number for a new group no other leader is likely to use (the hasher's keys are random).
fn group_id() -> u64 {
    use std::hash::BuildHasher;
    static FORMED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = FORMED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::collections::hash_map::RandomState::new().hash_one(n)
}

/// A leader's stream to one member: the join and the feeds out, the answers in. When it fails,
/// every pass fed and not answered, and every later one, is answered with why.
async fn feed_member(
    client: Client,
    peer: PeerId,
    row: usize,
    mut frames: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    answered: mpsc::UnboundedSender<(usize, Fed)>,
) {
    let outstanding = Mutex::new(std::collections::VecDeque::new());
    let lock = || outstanding.lock().unwrap_or_else(PoisonError::into_inner);
    let mut control = client.control();
    let why = match open_accepted(&mut control, peer, hop::protocol()).await {
        Ok(stream) => {
            let (mut reader, mut writer) = stream.split();
            let writing = async {
                while let Some((at, frame)) = frames.recv().await {
                    hold_until(at).await;
                    if let Some(pass) = pass_of(&frame) {
                        lock().push_back(pass);
                    }
                    session::write_frame(&mut writer, &frame).await?;
                }
                Ok::<_, std::io::Error>(())
            };
            let reading = async {
                let mut buf = session::FrameReader::default();
                loop {
                    match session::read_frame::<Fed, _>(&mut reader, &mut buf).await {
                        Ok(Some(fed)) => {
                            lock().retain(|&p| p != fed.pass);
                            let _ = answered.send((row, fed));
                        }
                        Ok(None) => return "the member closed the group".to_string(),
                        Err(e) => return e.to_string(),
                    }
                }
            };
            tokio::select! {
                written = writing => match written {
                    Ok(()) => return, // the leader is done with the group
                    Err(e) => e.to_string(),
                },
                why = reading => why,
            }
        }
        Err(e) => e.to_string(),
    };
    tracing::debug!(%peer, "hop stream to a member failed: {why}");
    let fail = |pass| {
        let _ = answered.send((row, Fed::failed(pass, why.clone())));
    };
    let unanswered: Vec<u64> = lock().drain(..).collect();
    unanswered.into_iter().for_each(fail);
    while let Some((_, frame)) = frames.recv().await {
        if let Some(pass) = pass_of(&frame) {
            fail(pass);
        }
    }
}

/// The pass a framed feed carries.
fn pass_of(frame: &[u8]) -> Option<u64> {
    match node_core::protocol::decode::<HopFrame>(frame.get(4..)?).ok()? {
        HopFrame::Feed(feed) => Some(feed.pass),
        _ => None,
    }
}

/// How long a member or the leader waits for a part before it leaves its sender out.
pub const WAIT: Duration = Duration::from_secs(5);

/// A hop group's members: row and holder.
pub type Members = Vec<(usize, PeerId)>;

/// A hop group over `formed`'s rows other than this node's (`client`'s): k + `check` +
/// `spares` of them ([`node_core::lead::hop_members`]; at least k + `check`, spares where there
/// are rows for them, each row's holder the one nearest the others), every round checked with
/// those beyond k, formed on `runtime`; with its members (row and holder). None for a route
/// chosen by the delays (`chosen`) where it would cross more network a stage than the rounds
/// group ([`node_core::lead::hops_beat_rounds`]).
pub fn lead_group(
    runtime: &tokio::runtime::Handle,
    client: &Client,
    manifest: &node_core::mesh::ModelManifest,
    formed: &crate::lead::remote::Formed,
    check: usize,
    spares: usize,
    chosen: bool,
) -> anyhow::Result<(HopLeader<NetFeedLink>, Members)> {
    let least = manifest.generator.k() + check;
    let nodes = formed.group.nodes();
    let members = node_core::lead::hop_members(
        nodes,
        &formed.rows,
        &formed.others,
        &formed.places,
        client.peer_id(),
        least,
        least + spares,
    )
    .map_err(anyhow::Error::msg)?;
    let me = client.peer_id();
    let rounds: Vec<PeerId> = formed.holders_of(nodes).into_values().collect();
    anyhow::ensure!(
        !chosen || node_core::lead::hops_beat_rounds(&members, &rounds, &formed.places, me),
        "a hop group over {members:?} would cross more network a stage than the rounds group"
    );
    let reached: Vec<_> = (members.iter())
        .map(|&(row, peer)| {
            let addrs = formed.addrs.get(&peer).cloned().unwrap_or_default();
            (row, peer, addrs)
        })
        .collect();
    let leader = lead(
        runtime,
        client,
        manifest.cfg.clone(),
        manifest.generator.clone(),
        formed.version,
        &reached,
        WAIT,
    )?;
    Ok((leader, members))
}
