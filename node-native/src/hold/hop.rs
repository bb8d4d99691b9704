//! A member's side of one hop per stage on a native node ([`node_core::net::hop`]): it runs
//! its part of a hop group (its shard's steps, the other members' parts in, the decode, the
//! check and the model's non-linear part). The leader's side, which feeds passes and reads the
//! LM head's parts, is [`crate::lead::hop`].
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
use node_core::holder::ShardState;
use node_core::model::Llama;
use node_core::net::hop::{self, Fed, Heard, HopFrame, HopLink, HopMember, Join, Part};
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
pub(crate) type Outgoing = mpsc::UnboundedSender<(Instant, Vec<u8>)>;

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
pub(crate) async fn hold_until(at: Instant) {
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
    let mut addrs_of = HashMap::new();
    for (i, &row) in join.rows.iter().enumerate() {
        let (Some(&peer), Some(addrs)) = (peers.get(&(row as usize)), join.addrs.get(i)) else {
            continue;
        };
        let addrs =
            node_core::net::reach::to_dial(addrs.iter().filter_map(|a| a.parse().ok()).collect());
        if !addrs.is_empty() && peer != client.peer_id() {
            addrs_of.insert(peer, addrs.clone());
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
        addrs: addrs_of,
        out: HashMap::new(),
        parts,
        delay,
    };
    let mut hop = HopMember::new(llama, generator, &join, link).map_err(|e| e.to_string())?;
    // Unbounded: one answer for each feed the leader sent, written as they come.
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
            let fed = Fed::of(feed.pass, hop.feed(&feed).await);
            if let Err(why) = &fed.result {
                tracing::debug!(pass = feed.pass, silent = ?fed.silent, "a hop pass failed here: {why}");
            }
            let fed = session::frame(&fed).map_err(|e| e.to_string())?;
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
    /// Where the leader said each member may be dialed, as [`node_core::net::reach::to_dial`]
    /// keeps them.
    addrs: HashMap<PeerId, Vec<Multiaddr>>,
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
        let (client, addrs) = (&self.client, self.addrs.get(&peer));
        let out = self.out.entry(row).or_insert_with(|| {
            send_parts(client.clone(), peer, addrs.cloned().unwrap_or_default())
        });
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

/// Sends parts to `peer` in order on a stream of their own, dialing it first at `addrs` (where
/// the leader said it is) when not connected: a stream opened on a peer id alone is dialed at
/// every address the node ever heard for it, a loopback one among them, which on the same port
/// reaches this node itself and fails the whole dial. A stream that fails is replaced (a
/// connection can close under it), the part it failed on sent again; when none can be opened,
/// the parts are lost and the member shows as silent to the others.
fn send_parts(client: Client, peer: PeerId, addrs: Vec<Multiaddr>) -> Outgoing {
    // Unbounded: one part a round for each member, and a round waits for the parts.
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(async move {
        let mut failed: Option<Vec<u8>> = None;
        for _ in 0..PART_STREAMS {
            if let Err(e) = client.dial_any(peer, &addrs).await {
                tracing::debug!(%peer, "dialing a member where its leader said: {e:#}");
            }
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
