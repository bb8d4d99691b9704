//! A deterministic simulation of the mesh: `node-core`'s sans-IO state machines driven over a
//! simulated network in virtual time, with seeded randomness.
//!
//! Two halves, both without threads, sockets or sleeps:
//!
//! - [`SimMesh`]: nodes each running a [`MeshView`]. Heartbeats a node hands out through
//!   `poll_transmit` go to every other node it can reach (gossip approximated as a broadcast)
//!   after a random latency, unless dropped; `handle_timeout` runs exactly at each node's
//!   `poll_timeout`. Nodes can crash, restart with the same id and row, and be partitioned.
//! - [`SimTransport`]: a leader's [`Transport`] driven by a [`RoundDriver`] and a
//!   [`MemberPool`], as a network transport is: it sends each request to the members, delivers
//!   their answers after a random latency, runs `handle_timeout` at `poll_timeout`, and reports a
//!   crashed member's lost connection as an `Err` answer. The members are real [`Member`]s
//!   computing on real shards, so whole generations run through it; a member can be made to
//!   crash or stall after a given number of requests.
//!
//! Time is a base [`Instant`] captured once plus a virtual offset that only the simulation
//! moves. Randomness is a seeded SplitMix64 stream: a fixed seed replays the same history.
//! (`web_time::Instant` is `std::time::Instant` on native targets, and this crate depends on
//! neither `web-time` nor `rand_chacha`: hence `std::time` and a local generator.)

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use node_core::code::Generator;
use node_core::coded::{CodedError, CodedGroup, InProcess, Member, Transport, TransportError};
use node_core::mesh::{
    Health, HealthConfig, Heartbeat, JoinOffer, MemberPool, MeshError, MeshEvent, MeshRequest,
    MeshResponse, MeshView, RoundConfig, RoundDriver, plan_group,
};
use node_core::model::{LinearExec, LlamaConfig, ModelError, Stage};
use node_core::protocol::{self, StepRequest, StepResponse};

/// The model digest every simulated node announces.
mod leader;
mod members;
mod trainer;

pub use leader::*;
pub use members::*;
pub use trainer::*;

pub const SIM_MODEL: [u8; 32] = [7; 32];

/// A seeded pseudo-random stream (SplitMix64): small, fast and the same on every platform.
#[derive(Debug, Clone)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform in `[lo, hi]` (`lo` when `hi ≤ lo`).
    pub fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        lo + hi.saturating_sub(lo).mul_f64(self.unit())
    }
}

/// Virtual time: a base instant captured once plus an offset only the simulation advances.
#[derive(Debug, Clone, Copy)]
pub struct VirtualClock {
    base: Instant,
    offset: Duration,
}

impl Default for VirtualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl VirtualClock {
    /// A clock at virtual time zero.
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
            offset: Duration::ZERO,
        }
    }

    /// The virtual now.
    pub fn now(&self) -> Instant {
        self.base + self.offset
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.offset
    }

    /// The instant at virtual time `at`.
    pub fn at(&self, at: Duration) -> Instant {
        self.base + at
    }

    /// Moves time forward to `t`; never backwards.
    pub fn advance_to(&mut self, t: Instant) {
        let offset = t.saturating_duration_since(self.base);
        if offset > self.offset {
            self.offset = offset;
        }
    }
}

/// The simulated network's behaviour.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// Shortest one-way latency.
    pub min_latency: Duration,
    /// Longest one-way latency.
    pub max_latency: Duration,
    /// Probability that one message to one receiver is lost.
    pub drop: f64,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            min_latency: Duration::from_millis(5),
            max_latency: Duration::from_millis(80),
            drop: 0.0,
        }
    }
}

/// Message counters of a [`SimMesh`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Heartbeats published (once per sender, however many receivers).
    pub published: u64,
    /// Copies handed to a receiver.
    pub delivered: u64,
    /// Copies lost to the drop probability.
    pub dropped: u64,
    /// Copies lost to a partition or a crashed receiver.
    pub unreachable: u64,
}

/// An event a node's view emitted, with when and where.
#[derive(Debug, Clone, PartialEq)]
pub struct Logged {
    /// Virtual time of the event.
    pub at: Duration,
    /// The node whose view emitted it.
    pub node: u32,
    /// The event.
    pub event: MeshEvent<u32>,
}

#[derive(Debug)]
struct SimNode {
    view: MeshView<u32>,
    row: Option<u32>,
    up: bool,
}

#[derive(Debug)]
struct Packet {
    from: u32,
    to: u32,
    hb: Heartbeat,
}

/// A simulated mesh of [`MeshView`] nodes (ids are `u32`) in virtual time.
#[derive(Debug)]
pub struct SimMesh {
    clock: VirtualClock,
    rng: SimRng,
    net: NetConfig,
    health: HealthConfig,
    k: u32,
    n: u32,
    /// Rows the code has room for (`n` unless [`SimMesh::with_room`] says more).
    room: u32,
    nodes: BTreeMap<u32, SimNode>,
    wire: BTreeMap<(Instant, u64), Packet>,
    sent: u64,
    sides: Vec<BTreeSet<u32>>,
    events: Vec<Logged>,
    stats: NetStats,
}

impl SimMesh {
    /// An empty mesh of a `k`-of-`n` code; `seed` fixes every random choice.
    pub fn new(seed: u64, k: u32, n: u32, health: HealthConfig, net: NetConfig) -> Self {
        Self {
            clock: VirtualClock::new(),
            rng: SimRng::new(seed),
            net,
            health,
            k,
            n,
            room: n,
            nodes: BTreeMap::new(),
            wire: BTreeMap::new(),
            sent: 0,
            sides: Vec::new(),
            events: Vec::new(),
            stats: NetStats::default(),
        }
    }

    /// The same mesh with a growing code: `n` genesis rows and room for `rows`.
    pub fn with_room(mut self, rows: u32) -> Self {
        self.room = rows.max(self.n);
        self
    }

    /// What node `id` holding `row` announces in a process started at `incarnation`.
    fn heartbeat(id: u32, row: Option<u32>, incarnation: u64) -> Heartbeat {
        Heartbeat {
            model: SIM_MODEL,
            row,
            version_count: 0,
            version_digest: [0; 32],
            addrs: vec![format!("/sim/{id}")],
            offers: Vec::new(),
            incarnation,
            seq: 0,
            uptime_ms: 0,
            device: "cpu".into(),
            usage: Default::default(),
            reach: Default::default(),
            trains: false,
            coord: Default::default(),
        }
    }

    fn fresh_view(&self, id: u32, row: Option<u32>) -> Result<MeshView<u32>, MeshError> {
        MeshView::new(
            self.clock.now(),
            id,
            self.health,
            self.k,
            (self.n, self.room),
            "sim".into(),
            // The start time tells a restarted process from its earlier self.
            Self::heartbeat(id, row, self.clock.elapsed().as_nanos() as u64 + 1),
        )
    }

    /// Starts node `id` holding `row` now (it replaces a node of that id).
    pub fn add_node(&mut self, id: u32, row: Option<u32>) -> Result<(), MeshError> {
        let view = self.fresh_view(id, row)?;
        self.nodes.insert(
            id,
            SimNode {
                view,
                row,
                up: true,
            },
        );
        Ok(())
    }

    /// Crashes node `id`: it stops sending, receiving and keeping time. Messages it sent
    /// before are still on the wire.
    pub fn crash(&mut self, id: u32) {
        if let Some(node) = self.nodes.get_mut(&id) {
            node.up = false;
        }
    }

    /// Restarts a crashed node as a new process with the same id and row: its view starts
    /// empty and its heartbeat sequence starts again from zero.
    pub fn restart(&mut self, id: u32) -> Result<(), MeshError> {
        let row = self.nodes.get(&id).and_then(|n| n.row);
        self.add_node(id, row)
    }

    /// Splits the network: nodes in different sets cannot reach each other; nodes in no set
    /// form one more side together. Replaces any earlier partition.
    pub fn partition(&mut self, sides: &[&[u32]]) {
        self.sides = sides.iter().map(|s| s.iter().copied().collect()).collect();
    }

    /// Ends any partition.
    pub fn heal(&mut self) {
        self.sides.clear();
    }

    /// Changes latency and drops from now on.
    pub fn set_net(&mut self, net: NetConfig) {
        self.net = net;
    }

    /// The network's behaviour.
    pub fn net(&self) -> NetConfig {
        self.net
    }

    /// Health timing of every node.
    pub fn health_config(&self) -> HealthConfig {
        self.health
    }

    fn side(&self, id: u32) -> Option<usize> {
        self.sides.iter().position(|s| s.contains(&id))
    }

    /// Whether a message from `a` can reach `b` now (ignoring crashes and drops).
    pub fn reachable(&self, a: u32, b: u32) -> bool {
        self.sides.is_empty() || self.side(a) == self.side(b)
    }

    /// The virtual now.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.clock.elapsed()
    }

    /// Node `id`'s view (also of a crashed node: what it knew when it crashed).
    pub fn view(&self, id: u32) -> Option<&MeshView<u32>> {
        self.nodes.get(&id).map(|n| &n.view)
    }

    /// Node `id`'s view, to ask it something that changes it (`offer_row`).
    pub fn view_mut(&mut self, id: u32) -> Option<&mut MeshView<u32>> {
        self.nodes.get_mut(&id).map(|n| &mut n.view)
    }

    /// Asks node `observer` for a row for `joiner` now, as a join request would.
    pub fn offer_row(&mut self, observer: u32, joiner: u32) -> Option<JoinOffer> {
        let now = self.clock.now();
        self.view_mut(observer).map(|v| v.offer_row(now, joiner))
    }

    /// Whether node `id` runs.
    pub fn is_up(&self, id: u32) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.up)
    }

    /// Every node id, running or not.
    pub fn ids(&self) -> Vec<u32> {
        self.nodes.keys().copied().collect()
    }

    /// Ids of the running nodes.
    pub fn up_nodes(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.up)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The row node `id` holds.
    pub fn row_of(&self, id: u32) -> Option<u32> {
        self.nodes.get(&id).and_then(|n| n.row)
    }

    /// Every event so far, in order.
    pub fn events(&self) -> &[Logged] {
        &self.events
    }

    /// Message counters.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// The rows `observer` sees live, without their holders.
    pub fn live_rows_of(&self, observer: u32) -> BTreeSet<u32> {
        self.view(observer)
            .map(|v| v.live_rows().into_iter().map(|(r, _)| r).collect())
            .unwrap_or_default()
    }

    /// Whether `observer` sees every node of `group` (but itself) Healthy and exactly their
    /// rows live.
    pub fn sees_exactly(&self, observer: u32, group: &[u32]) -> bool {
        let Some(view) = self.view(observer) else {
            return false;
        };
        let rows: BTreeSet<u32> = group.iter().filter_map(|&id| self.row_of(id)).collect();
        self.live_rows_of(observer) == rows
            && group
                .iter()
                .filter(|&&id| id != observer)
                .all(|id| view.health(id) == Some(Health::Healthy))
    }

    /// Whether every running node sees every running node Healthy and their rows live.
    pub fn converged(&self) -> bool {
        let up = self.up_nodes();
        up.iter().all(|&id| self.sees_exactly(id, &up))
    }

    /// When the next thing happens: a message arrives or a running node's timer fires.
    fn next_instant(&self) -> Option<Instant> {
        let wire = self.wire.keys().next().map(|&(t, _)| t);
        let timers = self
            .nodes
            .values()
            .filter(|n| n.up)
            .map(|n| n.view.poll_timeout())
            .min();
        match (wire, timers) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs the next instant at which something happens, if it is not after `limit`;
    /// else moves time to `limit`. Returns whether something ran.
    fn step(&mut self, limit: Instant) -> bool {
        let next = match self.next_instant() {
            Some(t) if t <= limit => t,
            _ => {
                self.clock.advance_to(limit);
                return false;
            }
        };
        self.clock.advance_to(next);
        let now = self.clock.now();
        while let Some(entry) = self.wire.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let Packet { from, to, hb } = entry.remove();
            if !self.reachable(from, to) {
                self.stats.unreachable += 1;
                continue;
            }
            match self.nodes.get_mut(&to) {
                Some(node) if node.up => {
                    node.view.handle_heartbeat(now, from, hb);
                    self.stats.delivered += 1;
                }
                _ => self.stats.unreachable += 1,
            }
        }
        for node in self.nodes.values_mut() {
            if node.up && node.view.poll_timeout() <= now {
                node.view.handle_timeout(now);
            }
        }
        self.flush(now);
        true
    }

    /// Hands every running node's heartbeats to the wire and logs its events.
    fn flush(&mut self, now: Instant) {
        let ids = self.up_nodes();
        for &id in &ids {
            let mut out = Vec::new();
            if let Some(node) = self.nodes.get_mut(&id) {
                while let Some(hb) = node.view.poll_transmit() {
                    out.push(hb);
                }
                while let Some(event) = node.view.poll_event() {
                    self.events.push(Logged {
                        at: self.clock.elapsed(),
                        node: id,
                        event,
                    });
                }
            }
            for hb in out {
                self.stats.published += 1;
                for &to in self.nodes.keys().filter(|&&to| to != id) {
                    if !self.reachable(id, to) {
                        self.stats.unreachable += 1;
                        continue;
                    }
                    if self.rng.chance(self.net.drop) {
                        self.stats.dropped += 1;
                        continue;
                    }
                    let at = now
                        + self
                            .rng
                            .duration(self.net.min_latency, self.net.max_latency);
                    self.sent += 1;
                    self.wire.insert(
                        (at, self.sent),
                        Packet {
                            from: id,
                            to,
                            hb: hb.clone(),
                        },
                    );
                }
            }
        }
    }

    /// Runs `d` of virtual time.
    pub fn run_for(&mut self, d: Duration) {
        let limit = self.clock.now() + d;
        while self.step(limit) {}
    }

    /// Runs until `done` holds (checked after every instant at which something happens) or
    /// `within` has passed; returns the virtual time at which it held.
    pub fn run_until(
        &mut self,
        within: Duration,
        mut done: impl FnMut(&SimMesh) -> bool,
    ) -> Option<Duration> {
        let limit = self.clock.now() + within;
        loop {
            if done(self) {
                return Some(self.elapsed());
            }
            if !self.step(limit) {
                return done(self).then(|| self.elapsed());
            }
        }
    }

    /// The first time after `since` at which `observer` saw `peer` change to `health`.
    pub fn health_change(
        &self,
        observer: u32,
        peer: u32,
        health: Health,
        since: Duration,
    ) -> Option<Duration> {
        self.events.iter().find_map(|l| match &l.event {
            MeshEvent::HealthChanged {
                peer: p, health: h, ..
            } if l.at >= since && l.node == observer && *p == peer && *h == health => Some(l.at),
            _ => None,
        })
    }
}
