//! One hop per stage on a native node ([`node_core::net::hop`]): a member runs its part of a hop
//! group (its shard's steps, the other members' parts in, the decode, the check and the model's
//! non-linear part), and a leader feeds passes and reads the LM head's parts.
//!
//! Streams: the leader opens one to each member (`Join`, then `Feed`s, answered with `Fed`s);
//! each member opens one to each other member it sends parts to. A part is taken only from the
//! peer that holds its row in the group. With the bench's one-way delay set, every frame is held
//! back by it before it leaves, by its sender.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures::{AsyncReadExt, StreamExt};
use libp2p::{Multiaddr, PeerId};
use node_core::code::Generator;
use node_core::holder::ShardState;
use node_core::model::{Llama, LlamaConfig};
use node_core::net::hop::{
    self, Fed, Feed, FeedLink, Heard, HopError, HopFrame, HopLeader, HopLink, HopMember, Join, Part,
};
use node_core::net::session;
use node_core::protocol::StepRequest;
use tokio::sync::mpsc;

use crate::hold::learning::read;
use crate::net::swarm::Client;
use crate::net::swarm::open_accepted;

/// Hop streams a node serves at once (a leader's and one per other member, per group).
const MAX_STREAMS: usize = 1024;

/// Groups whose parts arrived before their leader's `Join`, kept this long at most.
const UNJOINED_FOR: Duration = Duration::from_secs(30);

/// Parts queued for one group before more are dropped (a round has one per member).
const PARTS_QUEUED: usize = 4096;

/// Groups whose parts arrived before any leader joined them, kept at once at most.
const MAX_UNJOINED: usize = 16;

/// Where a node's incoming parts go: to the group's member task, or held until it joins.
#[derive(Debug, Default)]
struct Router {
    groups: Mutex<HashMap<u64, Slot>>,
}

#[derive(Debug)]
struct Slot {
    tx: mpsc::Sender<(PeerId, Option<Part>)>,
    rx: Option<mpsc::Receiver<(PeerId, Option<Part>)>>,
    since: Instant,
}

impl Router {
    /// `group`'s slot (made if new; a part, `joining` false, makes one only while fewer than
    /// [`MAX_UNJOINED`] groups wait for their leader).
    fn slot<R>(&self, group: u64, joining: bool, f: impl FnOnce(&mut Slot) -> R) -> Option<R> {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if !groups.contains_key(&group) {
            groups.retain(|_, s| s.rx.is_none() || s.since.elapsed() < UNJOINED_FOR);
            // Any peer can name a group: those no leader joined yet are few.
            if !joining && groups.values().filter(|s| s.rx.is_some()).count() >= MAX_UNJOINED {
                return None;
            }
        }
        let slot = groups.entry(group).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(PARTS_QUEUED);
            Slot {
                tx,
                rx: Some(rx),
                since: Instant::now(),
            }
        });
        Some(f(slot))
    }

    fn route(&self, from: PeerId, part: Part) {
        match self.slot(part.group, false, |s| s.tx.clone()) {
            Some(tx) => {
                let _ = tx.try_send((from, Some(part)));
            }
            None => {
                tracing::debug!(%from, "a part for a group no leader joined, past {MAX_UNJOINED} such groups: dropped")
            }
        }
    }

    /// A member's stream of parts for `group` ended: it left (or the group is over).
    fn gone(&self, from: PeerId, group: u64) {
        let groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = groups.get(&group) {
            let _ = slot.tx.try_send((from, None));
        }
    }

    fn join(&self, group: u64) -> Option<mpsc::Receiver<(PeerId, Option<Part>)>> {
        self.slot(group, true, |s| s.rx.take()).flatten()
    }

    fn leave(&self, group: u64) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.remove(&group);
    }
}

/// Serves the hop groups leaders form with this node, on `state`.
pub fn serve(client: &Client, state: Arc<RwLock<ShardState>>) -> anyhow::Result<()> {
    let mut incoming = client
        .control()
        .accept(hop::protocol())
        .map_err(|e| anyhow::anyhow!("accepting hop streams: {e}"))?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS));
    let router = Arc::new(Router::default());
    let client = client.clone();
    tokio::spawn(async move {
        while let Some((peer, stream)) = incoming.next().await {
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::warn!(%peer, "refusing a hop stream: {MAX_STREAMS} are open");
                continue;
            };
            let (state, router, client) = (state.clone(), router.clone(), client.clone());
            tokio::spawn(async move {
                let (mut reader, mut writer) = stream.split();
                if let Err(e) = session::accepted(&mut writer).await {
                    tracing::debug!(%peer, "hop stream ended: {e}");
                    return;
                }
                let mut buf = session::FrameReader::default();
                let result = match session::read_frame::<HopFrame, _>(&mut reader, &mut buf).await {
                    Ok(Some(HopFrame::Join(join))) => {
                        let group = join.group;
                        let rx = router.join(group);
                        let done = member(client, state, join, rx, reader, writer).await;
                        router.leave(group);
                        done
                    }
                    Ok(Some(HopFrame::Part(part))) => {
                        let group = part.group;
                        router.route(peer, part);
                        let ended = parts(&router, peer, group, reader).await;
                        if ended.is_ok() {
                            // Closed by the sender: it left the group. (A failed connection
                            // says nothing: a live sender opens another stream.)
                            router.gone(peer, group);
                        }
                        ended
                    }
                    Ok(Some(HopFrame::Feed(_))) => Err("a pass before the group was formed".into()),
                    Ok(None) => Ok(()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = result {
                    tracing::warn!(%peer, "hop stream ended: {e}");
                }
                drop(slot);
            });
        }
    });
    Ok(())
}

/// Routes the parts another member sends on its stream (one group's).
async fn parts(
    router: &Router,
    peer: PeerId,
    group: u64,
    mut reader: futures::io::ReadHalf<libp2p::Stream>,
) -> Result<(), String> {
    let mut buf = session::FrameReader::default();
    loop {
        match session::read_frame::<HopFrame, _>(&mut reader, &mut buf).await {
            Ok(Some(HopFrame::Part(part))) if part.group == group => router.route(peer, part),
            Ok(Some(_)) => return Err("a member's stream carries only parts".into()),
            Ok(None) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// A frame's bytes, held back until `at` (the bench's delay) and written in order.
type Outgoing = mpsc::UnboundedSender<(Instant, Vec<u8>)>;

/// Writes frames in order on `writer`, each once its time has come.
async fn write_frames<W: futures::AsyncWrite + Unpin>(
    writer: &mut W,
    frames: &mut mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
) -> std::io::Result<()> {
    while let Some((at, frame)) = frames.recv().await {
        hold_until(at).await;
        session::write_frame(writer, &frame).await?;
    }
    Ok(())
}

/// Waits until `at` if it is still ahead (the bench's delay); without a delay, not at all:
/// tokio's timer would round even a past deadline up to its next millisecond.
async fn hold_until(at: Instant) {
    if at > Instant::now() {
        tokio::time::sleep_until(at.into()).await;
    }
}

/// Runs a member's side of a group on the leader's stream until the leader closes it.
async fn member(
    client: Client,
    state: Arc<RwLock<ShardState>>,
    join: Join,
    parts: Option<mpsc::Receiver<(PeerId, Option<Part>)>>,
    mut reader: futures::io::ReadHalf<libp2p::Stream>,
    mut writer: futures::io::WriteHalf<libp2p::Stream>,
) -> Result<(), String> {
    let delay = crate::net::swarm::one_way_delay();
    let parts = parts.ok_or("the group was joined twice")?;
    let (llama, generator) = {
        let s = read(&state);
        if s.version.digest() != join.version {
            return Err("the group's version is not this node's".into());
        }
        if s.member.row() != join.row as usize {
            return Err(format!(
                "this node holds row {}, not {}",
                s.member.row(),
                join.row
            ));
        }
        let shards = s.member.shards();
        let llama = Llama::new(shards.cfg.clone(), s.norms.clone()).map_err(|e| e.to_string())?;
        (llama, shards.generator.clone())
    };
    let peers = peers_of(&join)?;
    // The other members may not have met yet: the leader says where each is.
    for (i, &row) in join.rows.iter().enumerate() {
        let (Some(&peer), Some(addrs)) = (peers.get(&(row as usize)), join.addrs.get(i)) else {
            continue;
        };
        let addrs: Vec<Multiaddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
        if !addrs.is_empty() && peer != client.peer_id() {
            client
                .add_addrs(peer, addrs)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    let link = NetHopLink {
        client,
        state,
        version: join.version,
        peers,
        out: HashMap::new(),
        parts,
        delay,
    };
    let mut hop = HopMember::new(llama, generator, &join, link).map_err(|e| e.to_string())?;
    let (answers, mut queued) = mpsc::unbounded_channel();
    let answering = async { write_frames(&mut writer, &mut queued).await };
    let feeding = async {
        let mut buf = session::FrameReader::default();
        while let Some(frame) = session::read_frame::<HopFrame, _>(&mut reader, &mut buf)
            .await
            .map_err(|e| e.to_string())?
        {
            let HopFrame::Feed(feed) = frame else {
                return Err("a leader's stream carries only passes after the join".to_string());
            };
            let result = hop.feed(&feed).await.map_err(|e: HopError| e.to_string());
            let fed = session::frame(&Fed {
                pass: feed.pass,
                result,
            })
            .map_err(|e| e.to_string())?;
            let _ = answers.send((Instant::now() + delay, fed));
        }
        let caught = &hop.stats().caught;
        if !caught.is_empty() {
            tracing::warn!(
                ?caught,
                "hop group members caught answering against the code"
            );
        }
        Ok(())
    };
    tokio::select! {
        fed = feeding => fed,
        written = answering => written.map_err(|e| e.to_string()),
    }
}

/// The members' peers, by row.
fn peers_of(join: &Join) -> Result<HashMap<usize, PeerId>, String> {
    if join.peers.len() != join.rows.len() {
        return Err("a join names as many peers as rows".into());
    }
    join.rows
        .iter()
        .zip(&join.peers)
        .map(|(&row, bytes)| {
            let peer = PeerId::from_bytes(bytes).map_err(|e| format!("row {row}'s peer: {e}"))?;
            Ok((row as usize, peer))
        })
        .collect()
}

/// A member's shard and streams to the other members of its group.
struct NetHopLink {
    client: Client,
    state: Arc<RwLock<ShardState>>,
    version: [u8; 32],
    peers: HashMap<usize, PeerId>,
    out: HashMap<usize, Outgoing>,
    parts: mpsc::Receiver<(PeerId, Option<Part>)>,
    delay: Duration,
}

impl std::fmt::Debug for NetHopLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetHopLink")
            .field("peers", &self.peers)
            .finish_non_exhaustive()
    }
}

impl HopLink for NetHopLink {
    async fn compute(&mut self, step: StepRequest) -> Result<Vec<u8>, String> {
        crate::hold::session::compute(self.state.clone(), self.version, step)
            .await
            .into_step()
            .map(|(bytes, _)| bytes)
            .map_err(|e| e.to_string())
    }

    fn send(&mut self, row: usize, part: &Part) {
        let Some(&peer) = self.peers.get(&row) else {
            return;
        };
        let client = &self.client;
        let out = self
            .out
            .entry(row)
            .or_insert_with(|| send_parts(client.clone(), peer));
        match session::frame(&HopFrame::Part(part.clone())) {
            Ok(frame) => {
                let _ = out.send((Instant::now() + self.delay, frame));
            }
            Err(e) => tracing::warn!("a part did not frame: {e}"),
        }
    }

    async fn next(&mut self, wait: Duration) -> Option<Heard> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let (from, part) = tokio::time::timeout_at(deadline, self.parts.recv())
                .await
                .ok()??;
            match part {
                // A part counts only from the peer holding its row in the group.
                Some(part) if self.peers.get(&(part.row as usize)) == Some(&from) => {
                    return Some(Heard::Part(part));
                }
                Some(_) => {}
                None => {
                    let row = self
                        .peers
                        .iter()
                        .find(|(_, p)| **p == from)
                        .map(|(r, _)| *r);
                    if let Some(row) = row {
                        return Some(Heard::Gone(row));
                    }
                }
            }
        }
    }
}

/// Streams opened to one member, one after another, before its parts are given up.
const PART_STREAMS: usize = 3;

/// Sends parts to `peer` in order on a stream of their own. A stream that fails is replaced
/// (a connection can close under it), the part it failed on sent again; when none can be
/// opened, the parts are lost and the member shows as silent to the others.
fn send_parts(client: Client, peer: PeerId) -> Outgoing {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(async move {
        let mut failed: Option<Vec<u8>> = None;
        for _ in 0..PART_STREAMS {
            let mut control = client.control();
            let why = match open_accepted(&mut control, peer, hop::protocol()).await {
                Ok(stream) => {
                    let (_, mut writer) = stream.split();
                    let sent = async {
                        if let Some(frame) = failed.take() {
                            session::write_frame(&mut writer, &frame)
                                .await
                                .map_err(|e| (e, Some(frame)))?;
                        }
                        while let Some((at, frame)) = rx.recv().await {
                            hold_until(at).await;
                            session::write_frame(&mut writer, &frame)
                                .await
                                .map_err(|e| (e, Some(frame)))?;
                        }
                        Ok::<_, (std::io::Error, Option<Vec<u8>>)>(())
                    };
                    match sent.await {
                        Ok(()) => return, // the group is over for this member
                        Err((e, frame)) => {
                            failed = frame;
                            e.to_string()
                        }
                    }
                }
                Err(e) => e.to_string(),
            };
            tracing::debug!(%peer, "a hop stream to a member failed: {why}");
        }
        tracing::warn!(%peer, "no hop stream to a member after {PART_STREAMS} tries: its parts are lost");
    });
    tx
}

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
    let (answered, answers) = mpsc::unbounded_channel();
    let delay = crate::net::swarm::one_way_delay();
    let mut to = HashMap::new();
    for &(row, peer, _) in members {
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
        let result = Err(why.clone());
        let _ = answered.send((row, Fed { pass, result }));
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

/// A hop group over `formed`'s members other than this node (`client`'s): k + `check` +
/// `spares` of them ([`node_core::lead::hop_members`]; at least k + `check`, spares where there
/// are rows for them), every round checked with those beyond k, formed on `runtime`.
pub fn lead_group(
    runtime: &tokio::runtime::Handle,
    client: &Client,
    manifest: &node_core::mesh::ModelManifest,
    formed: &crate::lead::remote::Formed,
    check: usize,
    spares: usize,
) -> anyhow::Result<HopLeader<NetFeedLink>> {
    let least = manifest.generator.k() + check;
    let nodes = formed.group.nodes();
    let members =
        node_core::lead::hop_members(nodes, &formed.rows, client.peer_id(), least, least + spares)
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .map(|(row, peer)| {
                (
                    row,
                    peer,
                    formed.addrs.get(&peer).cloned().unwrap_or_default(),
                )
            })
            .collect::<Vec<_>>();
    lead(
        runtime,
        client,
        manifest.cfg.clone(),
        manifest.generator.clone(),
        formed.version,
        &members,
        WAIT,
    )
}
