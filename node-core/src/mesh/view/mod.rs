//! One node's view of the mesh: who holds which row, at which version, and how healthy.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Display;

use web_time::{Duration, Instant};

use super::{
    Coord, Health, HealthConfig, Heartbeat, JoinOffer, MeshError, MeshInfo, NodeStatus, RowHolders,
    SourceRow, Usage, Vivaldi, hex,
};

/// How long a row offered to a joiner stays reserved for it.
const RESERVATION: Duration = Duration::from_secs(120);

/// Something a shell may want to act on or log.
#[derive(Debug, Clone, PartialEq)]
pub enum MeshEvent<P> {
    /// A peer was heard from for the first time.
    Discovered {
        /// The peer.
        peer: P,
        /// Its addresses.
        addrs: Vec<String>,
    },
    /// A peer's health changed.
    HealthChanged {
        /// The peer.
        peer: P,
        /// Its row.
        row: Option<u32>,
        /// The new state.
        health: Health,
    },
    /// A peer's heartbeat was refused.
    Refused {
        /// The peer.
        peer: P,
        /// Why.
        error: String,
    },
}

/// Most peers a view tracks (holders, leaders, browsers), alive or lately dead.
pub const MAX_PEERS: usize = 4096;

/// Most characters of the device a heartbeat names.
const MAX_DEVICE_CHARS: usize = 128;

/// How long a holder that stopped announcing itself still counts as one that may come back
/// behind ([`MeshView::lags`]).
pub const LAG_MEMORY: Duration = Duration::from_secs(120);

/// A row held for a joiner while it downloads: a free row it will create, or a replica.
#[derive(Debug, Clone)]
struct Reservation<P> {
    row: u32,
    joiner: P,
    until: Instant,
    replica: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    hb: Heartbeat,
    last_seen: Instant,
    health: Health,
    /// When the peer's incarnation started, as the last few heartbeats of it place it on this
    /// node's clock (arrival minus uptime): the earliest is the least delayed.
    started: VecDeque<Instant>,
}

/// Heartbeats of one incarnation whose timing a view keeps (a few intervals: clocks drift
/// apart too little in that time to matter).
const TIMING_WINDOW: usize = 16;

impl Entry {
    /// Whether `hb` (arriving `now`) left its sender more than `late` after it would have if
    /// it had come as fast as the recent ones: gossip hands a peer that missed a message the
    /// old message seconds later, and a late heartbeat says nothing about the sender now.
    fn is_late(&self, now: Instant, hb: &Heartbeat, late: Duration) -> bool {
        let (Some(started), Some(first)) = (started_at(now, hb), self.started.iter().min()) else {
            return false;
        };
        hb.incarnation == self.hb.incarnation && started.saturating_duration_since(*first) > late
    }

    /// Keeps the timing of an accepted heartbeat.
    fn note_timing(&mut self, now: Instant, hb: &Heartbeat) {
        if hb.incarnation != self.hb.incarnation {
            self.started.clear();
        }
        if let Some(s) = started_at(now, hb) {
            if self.started.len() == TIMING_WINDOW {
                self.started.pop_front();
            }
            self.started.push_back(s);
        }
    }
}

/// When `hb`'s sender started its incarnation, on this node's clock (`None` before the clock's
/// origin).
fn started_at(now: Instant, hb: &Heartbeat) -> Option<Instant> {
    now.checked_sub(Duration::from_millis(hb.uptime_ms))
}

/// A node's view of the mesh, driven by heartbeats and time.
#[derive(Debug)]
pub struct MeshView<P> {
    cfg: HealthConfig,
    k: u32,
    /// Rows the code has room for (a growing code adds rows up to this on demand).
    n: u32,
    /// Rows encoded at genesis.
    genesis: u32,
    model_name: String,
    /// This node's dashboard URL, when it serves HTTP.
    dashboard: Option<String>,
    me: P,
    local: Heartbeat,
    peers: BTreeMap<P, Entry>,
    reservations: Vec<Reservation<P>>,
    next_heartbeat: Instant,
    /// When the view was made (a time that is always past).
    created: Instant,
    events: VecDeque<MeshEvent<P>>,
    transmits: VecDeque<Heartbeat>,
    /// Nodes a leader caught answering against the code, with the evidence as text.
    caught: BTreeMap<P, String>,
    /// This node's place in the latency space, moved by the round trips it measures.
    coords: Vivaldi<P>,
}

impl<P: Ord + Clone + Display> MeshView<P> {
    /// A view for node `me` of a mesh needing `k` rows, whose code has room for `n` rows of
    /// which the first `genesis` were encoded at genesis, serving the model `local.model`.
    pub fn new(
        now: Instant,
        me: P,
        cfg: HealthConfig,
        k: u32,
        (genesis, n): (u32, u32),
        model_name: String,
        local: Heartbeat,
    ) -> Result<Self, MeshError> {
        cfg.validate()?;
        let mut local = local;
        local.addrs.truncate(crate::protocol::bounded::MAX_ADDRS);
        if k == 0 || genesis < k || n < genesis {
            return Err(MeshError::Config(format!(
                "need 1 ≤ k ≤ genesis rows ≤ n, got k = {k}, {genesis} genesis rows, n = {n}"
            )));
        }
        Ok(Self {
            cfg,
            k,
            n,
            genesis,
            model_name,
            dashboard: None,
            me,
            peers: BTreeMap::new(),
            reservations: Vec::new(),
            next_heartbeat: now,
            created: now,
            events: VecDeque::new(),
            transmits: VecDeque::new(),
            caught: BTreeMap::new(),
            coords: Vivaldi::new(local.incarnation),
            local,
        })
    }

    /// This node's id.
    pub fn me(&self) -> &P {
        &self.me
    }

    /// What this node announces.
    pub fn local(&self) -> &Heartbeat {
        &self.local
    }

    /// Changes what this node announces (row, version, addresses, offers); `incarnation`
    /// and `seq` are kept. A new version is announced at the next `handle_timeout`, without
    /// waiting for the heartbeat interval.
    pub fn set_local(&mut self, mut hb: Heartbeat) {
        // Peers read at most this many: the first are the best ways to reach this node.
        hb.addrs.truncate(crate::protocol::bounded::MAX_ADDRS);
        if hb.version_digest != self.local.version_digest {
            self.next_heartbeat = self.next_heartbeat.min(self.created);
        }
        let (incarnation, seq) = (self.local.incarnation, self.local.seq);
        self.local = Heartbeat {
            incarnation,
            seq,
            coord: self.coords.coord(),
            ..hb
        };
    }

    /// A round trip this node measured to `peer` (a ping): moves this node's coordinate by
    /// the peer's last announced one. A peer not heard from moves nothing.
    pub fn observe_rtt(&mut self, peer: &P, rtt: Duration) {
        let Some(theirs) = self.peers.get(peer).map(|e| e.hb.coord) else {
            return;
        };
        match self.coords.observe(peer, &theirs, rtt) {
            Ok(()) => self.local.coord = self.coords.coord(),
            Err(e) => tracing::debug!(%peer, "a round trip not taken: {e}"),
        }
    }

    /// The round trip from this node to `peer`: as measured lately, else as the coordinates
    /// estimate it once both are placed; `None` when neither is known.
    pub fn rtt_to(&self, peer: &P) -> Option<Duration> {
        if *peer == self.me {
            return Some(Duration::ZERO);
        }
        if let Some(ms) = self.coords.measured_ms(peer) {
            return Some(Duration::from_secs_f64(f64::from(ms) / 1000.0));
        }
        let theirs = self.peers.get(peer)?.hb.coord;
        let mine = self.coords.coord();
        (mine.is_placed() && theirs.is_placed()).then(|| mine.rtt(&theirs))
    }

    /// This node's coordinate.
    pub fn coord(&self) -> Coord {
        self.coords.coord()
    }

    /// Adds a finished request to the usage this node announces.
    pub fn add_usage(&mut self, usage: &Usage) {
        self.local.usage.add(usage);
    }

    /// Sets the dashboard URL [`Self::info`] reports for this node.
    pub fn set_dashboard(&mut self, url: Option<String>) {
        self.dashboard = url;
    }

    /// Health timing.
    pub fn config(&self) -> &HealthConfig {
        &self.cfg
    }

    /// A heartbeat arrived from `from`.
    pub fn handle_heartbeat(&mut self, now: Instant, from: P, hb: Heartbeat) {
        if from == self.me {
            return;
        }
        if hb.model != self.local.model {
            self.events.push_back(MeshEvent::Refused {
                peer: from.clone(),
                error: MeshError::OtherModel {
                    peer: from.to_string(),
                    ours: hex(&self.local.model),
                    theirs: hex(&hb.model),
                }
                .to_string(),
            });
            return;
        }
        if hb.offers.len() > self.n as usize || hb.device.len() > MAX_DEVICE_CHARS {
            self.events.push_back(MeshEvent::Refused {
                peer: from.clone(),
                error: MeshError::BadMessage {
                    peer: from.to_string(),
                    reason: "a heartbeat out of shape (its offers or device)".into(),
                }
                .to_string(),
            });
            return;
        }
        if let Err(reason) = hb.coord.check() {
            self.events.push_back(MeshEvent::Refused {
                peer: from.clone(),
                error: MeshError::BadMessage {
                    peer: from.to_string(),
                    reason,
                }
                .to_string(),
            });
            return;
        }
        if !self.peers.contains_key(&from) && !self.room_for_a_peer(now) {
            self.events.push_back(MeshEvent::Refused {
                peer: from.clone(),
                error: format!(
                    "a heartbeat from a new peer while this node tracks {MAX_PEERS} live ones already"
                ),
            });
            return;
        }
        if let Some(row) = hb.row.filter(|&r| r >= self.n) {
            self.events.push_back(MeshEvent::Refused {
                peer: from.clone(),
                error: MeshError::BadMessage {
                    peer: from.to_string(),
                    reason: format!("row {row} outside n = {}", self.n),
                }
                .to_string(),
            });
            return;
        }
        if let Some(row) = hb.row {
            self.reservations
                .retain(|r| !(r.row == row && r.joiner == from));
        }
        match self.peers.get_mut(&from) {
            Some(e) => {
                // Reordered: an older heartbeat of this incarnation, or one of an earlier
                // incarnation that gossip delivers late (a peer that just subscribed asks for the
                // recent messages it missed). An earlier incarnation counts again only once this
                // one is dead (a restart with a clock set back).
                let older = (hb.incarnation, hb.seq) < (e.hb.incarnation, e.hb.seq);
                if older && (hb.incarnation == e.hb.incarnation || e.health != Health::Dead) {
                    return;
                }
                if e.is_late(now, &hb, self.cfg.suspect_after) {
                    return;
                }
                e.note_timing(now, &hb);
                e.hb = hb;
                e.last_seen = now;
                if e.health != Health::Healthy {
                    e.health = Health::Healthy;
                    self.events.push_back(MeshEvent::HealthChanged {
                        peer: from,
                        row: e.hb.row,
                        health: Health::Healthy,
                    });
                }
            }
            None => {
                self.events.push_back(MeshEvent::Discovered {
                    peer: from.clone(),
                    addrs: hb.addrs.clone(),
                });
                let started = started_at(now, &hb).into_iter().collect();
                self.peers.insert(
                    from,
                    Entry {
                        hb,
                        last_seen: now,
                        health: Health::Healthy,
                        started,
                    },
                );
            }
        }
    }

    /// Whether a new peer's heartbeat has room in the view: past [`MAX_PEERS`], peers dead for
    /// longer than [`LAG_MEMORY`] are forgotten first (PeerIds are free: the view's size is
    /// bounded, not per peer).
    fn room_for_a_peer(&mut self, now: Instant) -> bool {
        if self.peers.len() < MAX_PEERS {
            return true;
        }
        self.peers.retain(|_, e| {
            e.health != Health::Dead || now.saturating_duration_since(e.last_seen) < LAG_MEMORY
        });
        self.peers.len() < MAX_PEERS
    }

    /// Advances time: health transitions, and this node's own heartbeat when due.
    pub fn handle_timeout(&mut self, now: Instant) {
        for (peer, e) in &mut self.peers {
            let h = self.cfg.health(now.saturating_duration_since(e.last_seen));
            if h != e.health {
                e.health = h;
                self.events.push_back(MeshEvent::HealthChanged {
                    peer: peer.clone(),
                    row: e.hb.row,
                    health: h,
                });
            }
        }
        self.reservations.retain(|r| r.until > now);
        if now >= self.next_heartbeat {
            self.local.seq += 1;
            self.local.uptime_ms = now.saturating_duration_since(self.created).as_millis() as u64;
            self.transmits.push_back(self.local.clone());
            self.next_heartbeat = now + self.cfg.heartbeat_interval;
        }
    }

    /// When `handle_timeout` should next be called.
    pub fn poll_timeout(&self) -> Instant {
        let mut t = self.next_heartbeat;
        for e in self.peers.values() {
            let next = match e.health {
                Health::Healthy => e.last_seen + self.cfg.suspect_after,
                Health::Suspect => e.last_seen + self.cfg.dead_after,
                Health::Dead => continue,
            };
            t = t.min(next);
        }
        t
    }

    /// The next event for the shell.
    pub fn poll_event(&mut self) -> Option<MeshEvent<P>> {
        self.events.pop_front()
    }

    /// The next heartbeat to publish.
    pub fn poll_transmit(&mut self) -> Option<Heartbeat> {
        self.transmits.pop_front()
    }

    /// Health of a peer, if known.
    pub fn health(&self, peer: &P) -> Option<Health> {
        self.peers.get(peer).map(|e| e.health)
    }

    /// Addresses a peer announced.
    pub fn addrs(&self, peer: &P) -> Option<&[String]> {
        self.peers.get(peer).map(|e| e.hb.addrs.as_slice())
    }

    /// Every node (this one first) with its heartbeat and health.
    fn all(&self) -> impl Iterator<Item = (&P, &Heartbeat, Health)> {
        std::iter::once((&self.me, &self.local, Health::Healthy))
            .chain(self.peers.iter().map(|(p, e)| (p, &e.hb, e.health)))
    }

    /// Records that a leader caught `peer` answering against the code: it leaves groups and
    /// its row is free to re-create.
    pub fn report_caught(&mut self, peer: P, evidence: String) {
        tracing::warn!(%peer, %evidence, "a node was caught answering against the code");
        self.caught.insert(peer, evidence);
    }

    /// Healthy and not caught.
    fn usable(&self, p: &P, h: Health) -> bool {
        h == Health::Healthy && !self.caught.contains_key(p)
    }

    /// The version digest most healthy row holders share.
    fn majority_version(&self) -> Option<[u8; 32]> {
        let mut counts: BTreeMap<[u8; 32], usize> = BTreeMap::new();
        for (p, hb, h) in self.all() {
            if self.usable(p, h) && hb.row.is_some() {
                *counts.entry(hb.version_digest).or_default() += 1;
            }
        }
        counts.into_iter().max_by_key(|&(_, c)| c).map(|(d, _)| d)
    }

    /// Holders this node knows to be alive (not dead, holding a row), itself included: what a
    /// peer's list of holders is bounded by.
    pub fn live_holders(&self) -> usize {
        1 + self
            .peers
            .values()
            .filter(|e| e.health != Health::Dead && e.hb.row.is_some())
            .count()
    }

    /// How many of this node's newest updates each holder may lack, from the versions their
    /// heartbeats announce: `mine − theirs` updates for a holder behind, one for a holder at
    /// this count with another set, none for one at this version or ahead. Holders alive, or
    /// heard from within [`LAG_MEMORY`] (a crashed node restarts in seconds), count. A holder
    /// keeps those payloads for them ([`crate::mesh::ShardVersion::to_release`]) so that they
    /// catch up by replaying rather than by rebuilding their rows. A peer can claim to lag to
    /// make holders keep more, which the lag budget bounds.
    pub fn lags(&self, now: Instant) -> Vec<u64> {
        let (count, digest) = (self.local.version_count, self.local.version_digest);
        self.peers
            .values()
            .filter(|e| e.hb.row.is_some())
            .filter(|e| {
                e.health != Health::Dead || now.saturating_duration_since(e.last_seen) < LAG_MEMORY
            })
            .filter(|e| e.hb.version_digest != digest && e.hb.version_count <= count)
            .map(|e| (count - e.hb.version_count).max(1))
            .collect()
    }

    /// Healthy rows at the majority version, one holder each (the lowest peer id), by row.
    pub fn live_rows(&self) -> Vec<(u32, P)> {
        self.holders_at_majority()
            .into_iter()
            .filter_map(|(row, peers)| peers.into_iter().next().map(|p| (row, p)))
            .collect()
    }

    /// Offers a row to a joining peer and reserves it: a genesis row this node holds back,
    /// else the lowest row no live node holds (a dead node's row, or a new row of a growing
    /// code), re-encoded from k live rows; once the code has no room left, a replica of the
    /// row with the fewest live holders. A new row's contents follow from its index alone
    /// (its generator row), so two nodes that offer the same new row to two joiners at once
    /// make two holders of one row, never two different rows under one index.
    pub fn offer_row(&mut self, now: Instant, joiner: P) -> JoinOffer {
        self.offer_row_near(now, joiner, &[])
    }

    /// [`Self::offer_row`] for a joiner that measured `samples` (round trips to some nodes): a
    /// replica is of a row no holder within [`super::NEAR_MS`] of it holds, where its region
    /// lacks one, so a region with k holders near each other serves alone. Samples to peers
    /// this node does not know are ignored.
    pub fn offer_row_near(
        &mut self,
        now: Instant,
        joiner: P,
        samples: &[(P, Duration)],
    ) -> JoinOffer {
        self.reservations.retain(|r| r.until > now);
        // Rows held by a node that is not dead (a holder may have come back since).
        let held: Vec<u32> = self
            .all()
            .filter(|(p, _, h)| {
                *h != Health::Dead && **p != joiner && !self.caught.contains_key(*p)
            })
            .filter_map(|(_, hb, _)| hb.row)
            .collect();
        self.reservations
            .retain(|r| r.joiner != joiner || r.replica || !held.contains(&r.row));
        if let Some(r) = self
            .reservations
            .iter_mut()
            .find(|r| r.joiner == joiner && !r.replica)
        {
            r.until = now + RESERVATION;
            let row = r.row;
            return self.offer_for(row);
        }
        let taken: Vec<u32> = held
            .iter()
            .copied()
            .chain(self.reservations.iter().map(|r| r.row))
            .collect();
        let free = |r: &u32| !taken.contains(r);
        let free_row = self
            .local
            .offers
            .iter()
            .copied()
            .find(free)
            .or_else(|| (0..self.n).find(free));
        if let Some(row) = free_row {
            // A free row beats a replica this joiner was offered before.
            self.reservations.retain(|r| r.joiner != joiner);
            let offer = self.offer_for(row);
            return self.reserve(offer, joiner, now);
        }
        if let Some(r) = self.reservations.iter_mut().find(|r| r.joiner == joiner) {
            r.until = now + RESERVATION;
            let row = r.row;
            return self.replica_of(row);
        }
        let Some(row) = self.row_to_complete(samples) else {
            return JoinOffer::Full;
        };
        let offer = self.replica_of(row);
        self.reserve(offer, joiner, now)
    }

    /// The coordinate `p` announced (this node's own for itself).
    fn coord_of(&self, p: &P) -> Option<Coord> {
        if *p == self.me {
            return Some(self.coords.coord());
        }
        self.peers.get(p).map(|e| e.hb.coord)
    }

    /// The row a joiner that measured `samples` is best given a replica of: the thinnest of
    /// the rows all of whose holders are known to be far from it (measured, or estimated from
    /// the place its samples give it; a holder not placed may be near), else the thinnest of
    /// all.
    fn row_to_complete(&self, samples: &[(P, Duration)]) -> Option<u32> {
        let samples = &samples[..samples.len().min(super::regions::MAX_SAMPLES)];
        let placed: Vec<(Coord, Duration)> = samples
            .iter()
            .filter_map(|(p, rtt)| Some((self.coord_of(p)?, *rtt)))
            .collect();
        let at = super::regions::place(&placed);
        let far = |p: &P| {
            let measured = samples.iter().find(|(s, _)| s == p).map(|(_, rtt)| *rtt);
            match (measured, &at, self.coord_of(p)) {
                (Some(rtt), _, _) => rtt.as_secs_f32() * 1000.0 > super::NEAR_MS,
                (None, Some(at), Some(theirs)) => {
                    at.is_placed() && theirs.is_placed() && !super::regions::near(at, &theirs)
                }
                _ => false,
            }
        };
        let holders = self.holders_at_majority();
        let thinnest = |lacking: bool| {
            holders
                .iter()
                .filter(|(_, peers)| !lacking || peers.iter().all(far))
                .map(|(row, peers)| {
                    let reserved = self.reservations.iter().filter(|r| r.row == *row).count();
                    (peers.len() + reserved, *row)
                })
                .min()
                .map(|(_, row)| row)
        };
        // Without samples no holder is known to be far: the thinnest of all.
        thinnest(true).or_else(|| thinnest(false))
    }

    /// How this node can rebuild its own row at `version` (a peer's, which it fell behind):
    /// a copy from another usable holder of the row at that version, else a chain of k other
    /// rows at it; [`JoinOffer::Full`] while neither exists.
    pub fn rebuild_offer(&self, version: [u8; 32]) -> JoinOffer {
        let Some(row) = self.local.row else {
            return JoinOffer::Full;
        };
        let mut rows: BTreeMap<u32, Vec<P>> = BTreeMap::new();
        for (p, hb, h) in self.all() {
            if let (true, Some(r), true) = (
                self.usable(p, h) && *p != self.me,
                hb.row,
                hb.version_digest == version,
            ) {
                rows.entry(r).or_default().push(p.clone());
            }
        }
        rows.values_mut().for_each(|peers| peers.sort());
        if let Some(peers) = rows.remove(&row) {
            return JoinOffer::Replica {
                row,
                holders: peers.iter().map(|p| self.source(row, p)).collect(),
            };
        }
        if rows.len() < self.k as usize {
            return JoinOffer::Full;
        }
        let sources = rows
            .iter()
            .take(self.k as usize)
            .filter_map(|(r, peers)| Some(self.source(*r, peers.first()?)))
            .collect();
        JoinOffer::Reencode { row, sources }
    }

    /// Holds the row of `offer` for `joiner` (nothing for [`JoinOffer::Full`]); the offer.
    fn reserve(&mut self, offer: JoinOffer, joiner: P, now: Instant) -> JoinOffer {
        let (row, replica) = match &offer {
            JoinOffer::Genesis { row } | JoinOffer::Reencode { row, .. } => (*row, false),
            JoinOffer::Replica { row, .. } => (*row, true),
            JoinOffer::Full => return offer,
        };
        self.reservations.push(Reservation {
            row,
            joiner,
            until: now + RESERVATION,
            replica,
        });
        offer
    }

    /// Usable holders of every row at the majority version, each row's lowest peer first.
    fn holders_at_majority(&self) -> BTreeMap<u32, Vec<P>> {
        let mut rows: BTreeMap<u32, Vec<P>> = BTreeMap::new();
        let Some(version) = self.majority_version() else {
            return rows;
        };
        for (p, hb, h) in self.all() {
            if let (true, Some(row), true) =
                (self.usable(p, h), hb.row, hb.version_digest == version)
            {
                rows.entry(row).or_default().push(p.clone());
            }
        }
        rows.values_mut().for_each(|peers| peers.sort());
        rows
    }

    fn source(&self, row: u32, p: &P) -> SourceRow {
        SourceRow {
            row,
            addrs: if *p == self.me {
                self.local.addrs.clone()
            } else {
                self.addrs(p).map(<[String]>::to_vec).unwrap_or_default()
            },
            peer: p.to_string(),
        }
    }

    fn replica_of(&self, row: u32) -> JoinOffer {
        match self.holders_at_majority().remove(&row) {
            Some(peers) if !peers.is_empty() => JoinOffer::Replica {
                row,
                holders: peers.iter().map(|p| self.source(row, p)).collect(),
            },
            _ => JoinOffer::Full,
        }
    }

    fn offer_for(&self, row: u32) -> JoinOffer {
        if self.local.offers.contains(&row) {
            return JoinOffer::Genesis { row };
        }
        let live = self.live_rows();
        if live.len() < self.k as usize {
            return JoinOffer::Full;
        }
        let sources = live
            .iter()
            .take(self.k as usize)
            .map(|(r, p)| self.source(*r, p))
            .collect();
        JoinOffer::Reencode { row, sources }
    }

    /// The mesh as this node sees it, for `status` and the dashboard.
    pub fn info(&self, now: Instant) -> MeshInfo {
        let live = self.live_rows();
        let healthy = live.len() as u32;
        let version = self.majority_version().unwrap_or(self.local.version_digest);
        let version_count = self
            .all()
            .find(|(_, hb, _)| hb.version_digest == version)
            .map_or(0, |(_, hb, _)| hb.version_count);
        let nodes = self
            .all()
            .map(|(p, hb, h)| NodeStatus {
                peer: p.to_string(),
                row: hb.row,
                health: h,
                version_count: hb.version_count,
                version_digest: hex(&hb.version_digest),
                addrs: hb.addrs.clone(),
                lag: if hb.version_digest == version {
                    0
                } else {
                    version_count.saturating_sub(hb.version_count).max(1)
                },
                caught: self.caught.get(p).cloned(),
                device: hb.device.clone(),
                usage: hb.usage,
                reach: hb.reach.label().into(),
                trains: hb.trains,
                coord: hb.coord,
                rtt_ms: self.rtt_to(p).map(|d| d.as_secs_f32() * 1000.0),
                silent_for_s: if *p == self.me {
                    0.0
                } else {
                    self.peers.get(p).map_or(0.0, |e| {
                        now.saturating_duration_since(e.last_seen).as_secs_f64()
                    })
                },
            })
            .collect::<Vec<NodeStatus>>();
        let mut usage = Usage::default();
        nodes.iter().for_each(|n| usage.add(&n.usage));
        let mut rows: BTreeMap<u32, RowHolders> = (0..self.genesis)
            .map(|row| (row, RowHolders::new(row)))
            .collect();
        for node in &nodes {
            if let Some(row) = node.row {
                let r = rows.entry(row).or_insert_with(|| RowHolders::new(row));
                r.holders.push(node.peer.clone());
                if node.health == Health::Healthy && node.caught.is_none() {
                    r.healthy += 1;
                }
            }
        }
        MeshInfo {
            k: self.k,
            n: rows.len() as u32,
            n_max: self.n,
            rows: rows.into_values().collect(),
            health: self.cfg,
            model: hex(&self.local.model),
            model_name: self.model_name.clone(),
            available: healthy >= self.k,
            healthy_rows: healthy,
            tolerates: healthy.saturating_sub(self.k),
            version_count,
            version_digest: hex(&version),
            nodes,
            dashboard: self.dashboard.clone(),
            usage,
        }
    }
}

#[cfg(test)]
mod tests;
