//! The mesh at scale, in virtual time: many holders join a grown code through a leader's
//! [`MeshView`] (`offer_row`: new rows up to `n_max`, then replicas of the thinnest row) and
//! leave again (churn), while the leader serves back-to-back requests with many coded groups
//! of disjoint holders ([`pick_nearest`] and [`plan_group_near`], as `form` does; picking by
//! PeerId, they know no distances: the first free holder of each row, the best-conditioned rows).
//!
//! What is modelled, and what is not: a round of a group sends its request to its k + 1
//! members through the leader's uplink, each member answers after its compute time plus a
//! round trip over its own link (one-way latency drawn per holder), the answers come in
//! through the leader's downlink, and the leader decodes on one of its cores. Every group's
//! rounds share the leader's uplink, downlink and cores (each a queue, served in the order
//! rounds reach it), with the request and answer sizes of the real protocol for the model's
//! stages. A member may die during a round (at the churn rate) as well as between rounds: one
//! that does answers never, and the group goes on without it while k remain, else the token's
//! pass fails. Each group's rules are the real leader's ([`Steer`]: forming, backing off after a
//! failed pass, a short group looking for a row that came back, a whole one for a much closer
//! group, [`closer_row`]), polled before each token as every leader's shell does; a group is
//! formed with holders nobody else uses. Heartbeats reach the leader every second from every live holder
//! (their latency is ignored at this time scale). Not modelled: the download a joiner makes,
//! members' own bandwidth, and learning.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::{Duration, Instant};

use node_core::code::Generator;
use node_core::lead::{Action, Looking, Steer, closer_row};
use node_core::mesh::{
    Coord, HealthConfig, Heartbeat, JoinOffer, MeshError, MeshView, Vivaldi, pick_nearest,
    plan_group_near,
};
use node_core::model::{LlamaConfig, Stage};
use node_core::protocol::{self, StepRequest, StepResponse};

use crate::sim::{SIM_MODEL, SimRng, VirtualClock};
use crate::world::{Place, World};

/// How a leader picks its group's holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Picking {
    /// Each row's first holder in PeerId order, the best-conditioned rows (before issue 80).
    PeerId,
    /// Each row's nearest holder as the leader's view knows it (pings and the holders' network
    /// coordinates), and the nearest rows that decode well ([`plan_group_near`]).
    Latency,
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct ScaleConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Rows needed to decode.
    pub k: usize,
    /// Rows encoded at genesis (the leader holds row 0, one node each of the others).
    pub genesis: usize,
    /// Holders that join after genesis, and the population churn keeps.
    pub holders: usize,
    /// Groups the leader serves with side by side.
    pub groups: usize,
    /// Fraction of the holders that leave (and as many that join) per simulated minute.
    pub churn_per_minute: f64,
    /// Simulated serving time, after every holder joined.
    pub duration: Duration,
    /// Tokens each request generates.
    pub tokens_per_request: u32,
    /// Coded rounds per token (4 per layer, the embedding and the LM head: 122 for SmolLM2).
    pub rounds_per_token: u32,
    /// A member's compute time per round, drawn uniformly from this range each round.
    pub compute: (Duration, Duration),
    /// A holder's one-way link latency, drawn once per holder from this range.
    pub latency: (Duration, Duration),
    /// The leader's decode and non-linear work per round, on one core.
    pub leader_per_round: Duration,
    /// The leader's cores.
    pub leader_cores: usize,
    /// The leader's uplink and downlink, bytes a second.
    pub leader_link: (f64, f64),
    /// Bytes of a round's request to one member and of its answer, on average over a token's
    /// rounds ([`round_bytes`]).
    pub round_bytes: (usize, usize),
    /// A world of regions: each holder's latency to the leader comes from where both are (the
    /// leader in a datacentre in the first region), and `latency` is not used; every holder
    /// measures a round trip to a random other each second and announces its coordinate.
    pub world: Option<World>,
    /// How the leader picks holders.
    pub picking: Picking,
}

/// The bytes of a round's request to one member and of a member's answer, on the wire, on
/// average over a token's rounds of a model of `cfg` coded with `g` (one token a pass).
pub fn round_bytes(cfg: &LlamaConfig, g: &Generator) -> (usize, usize) {
    let stages = Stage::all(cfg);
    let (mut request, mut answer) = (0, 0);
    for stage in &stages {
        let shapes = stage.shapes(cfg);
        let inp = shapes.first().map_or(0, |&(_, i)| i);
        let x = vec![0.0; inp];
        let req = StepRequest::Matmul {
            stage: *stage,
            t: 1,
            x,
        };
        let values = shapes
            .iter()
            .map(|&(out, _)| g.block_len(out) * g.sub_blocks())
            .sum::<usize>();
        let ans = StepResponse::Partial {
            node: 0,
            values: vec![0.0; values],
        };
        request += protocol::encode(&req).map_or(0, |b| b.len());
        answer += protocol::encode(&ans).map_or(0, |b| b.len());
    }
    let rounds = stages.len().max(1);
    (request / rounds, answer / rounds)
}

impl Default for ScaleConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            k: 3,
            genesis: 5,
            holders: 1000,
            groups: 1,
            churn_per_minute: 0.10,
            duration: Duration::from_secs(120),
            tokens_per_request: 32,
            rounds_per_token: 122,
            compute: (Duration::from_micros(300), Duration::from_micros(700)),
            latency: (Duration::from_millis(2), Duration::from_millis(4)),
            leader_per_round: Duration::from_micros(100),
            leader_cores: 8,
            leader_link: (125e6, 125e6),
            round_bytes: round_bytes(
                &LlamaConfig::smollm2_135m(),
                &Generator::cauchy(5, 3).expect("a k = 3 of 5 code"),
            ),
            world: None,
            picking: Picking::PeerId,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleReport {
    /// Groups the leader ran.
    pub groups: usize,
    /// Rows of the grown code at the end, and its room.
    pub rows: (usize, usize),
    /// Tokens generated in the serving time.
    pub tokens: u64,
    /// Tokens per simulated second.
    pub tokens_per_s: f64,
    /// Requests finished.
    pub requests: u64,
    /// Requests that failed (no group could be formed for them).
    pub failed: u64,
    /// Passes that failed because fewer than k members answered (run again on a group
    /// formed again).
    pub failed_passes: u64,
    /// Groups formed again after a member left (a pass failed, or a short group found a row
    /// that came back).
    pub replaced: u64,
    /// Holders that left and joined during the serving time.
    pub churned: (u64, u64),
    /// Joiners the mesh turned away.
    pub turned_away: u64,
    /// Seconds at which some existing row had no live holder while fewer than k rows had one
    /// (the row could not have been re-encoded).
    pub unrecoverable_seconds: u64,
    /// The fewest live holders any row had at a one-second check while serving.
    pub min_holders: usize,
    /// Members that died during a round.
    pub died_mid_round: u64,
    /// Share of the serving time the leader's uplink, downlink and busiest core were busy.
    pub leader_busy: (f64, f64, f64),
    /// Milliseconds each token took, from its first round's start to its last round's end.
    pub token_ms: Vec<f64>,
    /// Groups formed again because a much closer one could be ([`closer_row`]).
    pub reformed: u64,
}

impl ScaleReport {
    /// The `p` quantile of the tokens' times, milliseconds (`None` without tokens).
    pub fn token_ms_at(&self, p: f64) -> Option<f64> {
        let mut v = self.token_ms.clone();
        v.sort_by(f64::total_cmp);
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        v.get(i).copied()
    }
}

impl ScaleConfig {
    /// Tokens a second the leader's limits allow, whatever the groups: its uplink, downlink
    /// and cores over a token's rounds.
    pub fn leader_bound(&self) -> f64 {
        let members = (self.k + 1) as f64;
        let rounds = f64::from(self.rounds_per_token);
        let up = self.leader_link.0 / (members * self.round_bytes.0 as f64 * rounds);
        let down = self.leader_link.1 / (members * self.round_bytes.1 as f64 * rounds);
        let cpu = self.leader_cores as f64 / (self.leader_per_round.as_secs_f64() * rounds);
        up.min(down).min(cpu)
    }
}

#[derive(Debug)]
struct Holder {
    row: u32,
    latency: Duration,
    alive: bool,
    incarnation: u64,
    seq: u64,
    /// Where it is, in a world.
    place: Option<Place>,
    /// Its network coordinate, in a world.
    coords: Option<Vivaldi<u32>>,
}

#[derive(Debug)]
struct Group {
    /// (row, holder) of the k + 1 members, less those the leader saw leave.
    members: Vec<(usize, u32)>,
    /// Tokens done of the request in progress.
    done: u32,
    /// Rounds done of the token in progress.
    rounds: u32,
    /// When the token in progress began.
    token_began: Option<Duration>,
    /// The leader's rules for this group.
    steer: Steer,
    /// Why it is to be formed again: a much closer group (true), a member lost (false).
    again: Option<bool>,
}

impl Group {
    /// A group not formed yet, to have `wanted` members.
    fn new(wanted: usize) -> Self {
        Self {
            members: Vec::new(),
            done: 0,
            rounds: 0,
            token_began: None,
            steer: Steer::new(wanted),
            again: None,
        }
    }
}

/// The simulation state.
#[derive(Debug)]
struct Scale {
    cfg: ScaleConfig,
    g: Generator,
    rng: SimRng,
    clock: VirtualClock,
    view: MeshView<u32>,
    holders: BTreeMap<u32, Holder>,
    next_id: u32,
    /// Holders the leader saw fail to answer.
    known_gone: BTreeSet<u32>,
    /// The leader's uplink, downlink and cores.
    up: Queue,
    down: Queue,
    cores: Vec<Queue>,
    report: ScaleReport,
    /// Where the leader is, in a world.
    leader: Option<Place>,
}

/// One of the leader's resources, serving one piece of work at a time in the order it comes.
#[derive(Debug, Clone, Copy, Default)]
struct Queue {
    /// When it is next free.
    free: Duration,
    /// How long it has worked.
    busy: Duration,
}

impl Queue {
    /// Work of `took` that can start at `ready`: when it is done.
    fn take(&mut self, ready: Duration, took: Duration) -> Duration {
        self.free = self.free.max(ready) + took;
        self.busy += took;
        self.free
    }
}

fn heartbeat(row: u32, incarnation: u64, seq: u64, coord: Coord) -> Heartbeat {
    Heartbeat {
        model: SIM_MODEL,
        row: Some(row),
        version_count: 0,
        version_digest: [0; 32],
        addrs: Vec::new(),
        offers: Vec::new(),
        incarnation,
        seq,
        // One heartbeat a simulated second.
        uptime_ms: seq * 1000,
        device: "sim".into(),
        usage: Default::default(),
        reach: Default::default(),
        trains: false,
        coord,
    }
}

impl Scale {
    fn new(cfg: ScaleConfig) -> Result<Self, MeshError> {
        let g = Generator::growing(cfg.genesis, cfg.k, None)
            .map_err(|e| MeshError::Config(e.to_string()))?;
        let clock = VirtualClock::new();
        let view = MeshView::new(
            clock.now(),
            0,
            HealthConfig::default(),
            cfg.k as u32,
            (cfg.genesis as u32, g.n() as u32),
            "scale".into(),
            heartbeat(0, 1, 0, Coord::ORIGIN),
        )?;
        let report = ScaleReport {
            groups: cfg.groups,
            rows: (0, g.n()),
            tokens: 0,
            tokens_per_s: 0.0,
            requests: 0,
            failed: 0,
            failed_passes: 0,
            replaced: 0,
            churned: (0, 0),
            turned_away: 0,
            unrecoverable_seconds: 0,
            min_holders: usize::MAX,
            died_mid_round: 0,
            leader_busy: (0.0, 0.0, 0.0),
            token_ms: Vec::new(),
            reformed: 0,
        };
        let cores = cfg.leader_cores.max(1);
        let mut rng = SimRng::new(cfg.seed);
        let leader = cfg.world.map(|w| w.place_in(0, true, &mut rng));
        let mut s = Self {
            rng,
            leader,
            cfg,
            g,
            clock,
            view,
            holders: BTreeMap::new(),
            next_id: 1,
            known_gone: BTreeSet::new(),
            up: Queue::default(),
            down: Queue::default(),
            cores: vec![Queue::default(); cores],
            report,
        };
        for row in 1..s.cfg.genesis as u32 {
            s.add_holder(row);
        }
        Ok(s)
    }

    fn add_holder(&mut self, row: u32) {
        let id = self.next_id;
        self.next_id += 1;
        let (place, latency) = match (self.cfg.world, self.leader) {
            (Some(w), Some(leader)) => {
                let place = w.place(&mut self.rng);
                (Some(place), w.one_way(&leader, &place))
            }
            _ => (
                None,
                self.rng.duration(self.cfg.latency.0, self.cfg.latency.1),
            ),
        };
        let coords = place.map(|_| Vivaldi::new(u64::from(id)));
        let incarnation = 1 + u64::from(id);
        let hb = heartbeat(row, incarnation, 0, Coord::ORIGIN);
        self.view.handle_heartbeat(self.clock.now(), id, hb);
        self.holders.insert(
            id,
            Holder {
                row,
                latency,
                alive: true,
                incarnation,
                seq: 0,
                place,
                coords,
            },
        );
    }

    /// In a world, every live holder measures a round trip to a random other (its pings) and
    /// the leader to a few (its connections), each within 10 % of the true one.
    fn ping(&mut self) {
        let (Some(w), Some(leader)) = (self.cfg.world, self.leader) else {
            return;
        };
        let alive: Vec<u32> = (self.holders.iter())
            .filter(|(_, h)| h.alive)
            .map(|(&id, _)| id)
            .collect();
        if alive.len() < 2 {
            return;
        }
        let coord = |h: &Holder| h.coords.as_ref().map_or(Coord::ORIGIN, Vivaldi::coord);
        for &id in &alive {
            let other = alive[(self.rng.next_u64() % alive.len() as u64) as usize];
            if other == id {
                continue;
            }
            let (Some(a), Some(b)) = (self.holders.get(&id), self.holders.get(&other)) else {
                continue;
            };
            let (Some(pa), Some(pb)) = (a.place, b.place) else {
                continue;
            };
            let rtt = (w.one_way(&pa, &pb) * 2).mul_f64(1.0 + 0.1 * self.rng.unit());
            let theirs = coord(b);
            if let Some(v) = self.holders.get_mut(&id).and_then(|h| h.coords.as_mut()) {
                let _ = v.observe(&other, &theirs, rtt);
            }
        }
        for _ in 0..8 {
            let id = alive[(self.rng.next_u64() % alive.len() as u64) as usize];
            if let Some(p) = self.holders.get(&id).and_then(|h| h.place) {
                let rtt = (w.one_way(&leader, &p) * 2).mul_f64(1.0 + 0.1 * self.rng.unit());
                self.view.observe_rtt(&id, rtt);
            }
        }
    }

    /// A newcomer asks the leader for a row and takes what it is offered.
    fn join(&mut self) {
        let joiner = self.next_id;
        match self.view.offer_row(self.clock.now(), joiner) {
            JoinOffer::Genesis { row }
            | JoinOffer::Reencode { row, .. }
            | JoinOffer::Replica { row, .. } => self.add_holder(row),
            JoinOffer::Full => {
                self.next_id += 1;
                self.report.turned_away += 1;
            }
        }
    }

    /// One second passes for the mesh: heartbeats, health, churn, and the row check.
    fn tick(&mut self, churn: bool) {
        let now = self.clock.now();
        for (&id, h) in self.holders.iter_mut().filter(|(_, h)| h.alive) {
            h.seq += 1;
            let coord = h.coords.as_ref().map_or(Coord::ORIGIN, Vivaldi::coord);
            self.view
                .handle_heartbeat(now, id, heartbeat(h.row, h.incarnation, h.seq, coord));
        }
        self.ping();
        self.view.handle_timeout(now);
        while self.view.poll_transmit().is_some() {}
        while self.view.poll_event().is_some() {}
        if churn {
            let p = self.cfg.churn_per_minute / 60.0;
            let alive: Vec<u32> = self
                .holders
                .iter()
                .filter(|(_, h)| h.alive)
                .map(|(&id, _)| id)
                .collect();
            let mut left = 0;
            for id in alive {
                if self.rng.chance(p)
                    && let Some(h) = self.holders.get_mut(&id)
                {
                    h.alive = false;
                    left += 1;
                }
            }
            for _ in 0..left {
                self.join();
            }
            self.report.churned.0 += left;
            self.report.churned.1 += left;
        }
        // Every row that exists is held by a live node, or can be re-encoded from k that are.
        let mut live: BTreeMap<u32, usize> = BTreeMap::new();
        for h in self.holders.values().filter(|h| h.alive) {
            *live.entry(h.row).or_default() += 1;
        }
        *live.entry(0).or_default() += 1; // the leader
        let mut rows: BTreeSet<u32> = self.holders.values().map(|h| h.row).collect();
        rows.insert(0);
        let missing = rows.iter().filter(|r| !live.contains_key(r)).count();
        if missing > 0 && live.len() < self.cfg.k {
            self.report.unrecoverable_seconds += 1;
        }
        let fewest = rows
            .iter()
            .map(|r| live.get(r).copied().unwrap_or(0))
            .min()
            .unwrap_or(0);
        if churn {
            self.report.min_holders = self.report.min_holders.min(fewest);
        }
        self.report.rows.0 = rows.len().max(self.cfg.genesis);
    }

    /// The holders group `i` may not take: other groups' and those the leader saw fail.
    fn avoid(&self, groups: &[Group], i: usize) -> BTreeSet<u32> {
        let mut avoid: BTreeSet<u32> = self.known_gone.clone();
        for (j, other) in groups.iter().enumerate() {
            if j != i {
                avoid.extend(other.members.iter().map(|&(_, id)| id));
            }
        }
        // The leader's own row computes in process: only the first group uses it.
        if i > 0 {
            avoid.insert(0);
        }
        avoid
    }

    /// Plans group `i` over holders no other group uses and the leader did not see fail.
    fn plan(&self, groups: &[Group], i: usize) -> Option<Vec<(usize, u32)>> {
        let info = self.view.info(self.clock.now());
        let (_, live) = info.live_holders()?;
        let by_row: BTreeMap<usize, Vec<u32>> = live
            .into_iter()
            .map(|(row, nodes)| {
                let ids = nodes.iter().filter_map(|n| n.peer.parse().ok()).collect();
                (row, ids)
            })
            .collect();
        let avoid = self.avoid(groups, i);
        // Picking by PeerId knows no distances: the first free holder, the best-conditioned rows.
        let peers = pick_nearest(&by_row, &avoid, |id| self.rtt_ms(id));
        let rows: Vec<usize> = peers.keys().copied().collect();
        let plan = plan_group_near(&self.g, &rows, 1, |r| self.rtt_ms(peers.get(&r)?)).ok()?;
        if plan.members.len() < self.cfg.k + 1 {
            return None;
        }
        Some(
            plan.members
                .iter()
                .filter_map(|r| Some((*r, *peers.get(r)?)))
                .collect(),
        )
    }

    /// One round of group `group` that starts at `at`: when it ends, and whether k members
    /// answered. Its request leaves through the leader's uplink, the answers come in through
    /// its downlink, and the decode takes a core: each waits for the rounds of other groups
    /// ahead of it.
    fn round(&mut self, group: &Group, at: Duration) -> (Duration, bool) {
        let members = group.members.len();
        let secs = |bytes: f64, rate: f64| Duration::from_secs_f64(bytes / rate.max(1.0));
        let (req, ans) = (self.cfg.round_bytes.0 as f64, self.cfg.round_bytes.1 as f64);
        let send = secs(req * members as f64, self.cfg.leader_link.0);
        let sent = self.up.take(at, send);
        // A member dies during a round at the churn rate, over the round's likely length.
        let die = self.cfg.churn_per_minute / 60.0 * (send.as_secs_f64() + 0.01);
        let mut answers: Vec<Duration> = Vec::new();
        let mut slowest_wait = Duration::ZERO;
        let mut died = 0;
        for &(_, id) in &group.members {
            let compute = self.rng.duration(self.cfg.compute.0, self.cfg.compute.1);
            let dies = self.rng.chance(die);
            match self.holders.get_mut(&id) {
                Some(h) if h.alive && dies => {
                    h.alive = false;
                    died += 1;
                    self.report.died_mid_round += 1;
                    self.report.churned.0 += 1;
                    // Noticed when its connection drops, about a round trip later.
                    slowest_wait = slowest_wait.max(h.latency * 2);
                }
                Some(h) if h.alive => answers.push(compute + h.latency * 2),
                Some(h) => slowest_wait = slowest_wait.max(h.latency * 2),
                None => answers.push(compute), // the leader's own row
            }
        }
        answers.sort();
        let ok = answers.len() >= self.cfg.k;
        let heard = match answers.get(self.cfg.k - 1) {
            Some(&kth) => kth,
            None => slowest_wait.max(answers.last().copied().unwrap_or_default()),
        };
        let receive = secs(ans * answers.len() as f64, self.cfg.leader_link.1);
        let received = self.down.take(sent + heard, receive);
        // The decode goes to the core free first.
        let done = match self.cores.iter_mut().min_by_key(|c| c.free) {
            Some(core) => core.take(received, self.cfg.leader_per_round),
            None => received + self.cfg.leader_per_round,
        };
        // A joiner takes the place of each member that died: the population stays.
        for _ in 0..died {
            self.join();
            self.report.churned.1 += 1;
        }
        (done, ok)
    }

    /// The leader's round trip to holder `id` as its view knows it, milliseconds; none when
    /// it picks by PeerId.
    fn rtt_ms(&self, id: &u32) -> Option<f32> {
        let known = self
            .view
            .rtt_to(id)
            .filter(|_| self.cfg.picking == Picking::Latency);
        known.map(|d| d.as_secs_f32() * 1e3)
    }

    /// What group `i`'s [`Looking`] finds in the leader's view: for a whole group, a row of a
    /// much closer one ([`closer_row`]; a leader picking by PeerId never looked), for a short
    /// one, a row that came back ([`Looking::in_view`]).
    fn look(&self, groups: &[Group], i: usize, looking: &Looking) -> Option<usize> {
        let info = self.view.info(self.clock.now());
        let avoid = self.avoid(groups, i);
        if looking.rows.len() >= looking.wanted {
            if self.cfg.picking == Picking::PeerId {
                return None;
            }
            let rows: BTreeMap<usize, u32> = groups[i].members.iter().copied().collect();
            let extra = looking.wanted.saturating_sub(self.cfg.k);
            return closer_row(&info, &self.g, &rows, extra, &avoid, Some(0));
        }
        let (version, _) = info.live_holders()?;
        // The members the leader saw leave are in `avoid` for good.
        looking.in_view(&info, &version, &avoid, &BTreeSet::new())
    }

    /// Leaves out of `group` the members the leader saw leave (a request to one fails).
    fn drop_gone(&mut self, group: &mut Group) {
        let gone: Vec<u32> = (group.members.iter())
            .map(|&(_, id)| id)
            .filter(|id| self.holders.get(id).is_some_and(|h| !h.alive))
            .collect();
        group.members.retain(|(_, id)| !gone.contains(id));
        self.known_gone.extend(gone);
    }

    /// Does what group `i`'s rules say at `now` until its next token's pass may run: `None`,
    /// or the moment to poll again (a backoff, or no group can be formed).
    fn steer(&mut self, groups: &mut [Group], i: usize, now: Instant) -> Option<Instant> {
        loop {
            let rows: Vec<usize> = groups[i].members.iter().map(|&(r, _)| r).collect();
            match groups[i].steer.poll(now, &rows) {
                Action::Pass(_) => return None,
                Action::Wait(until) | Action::Unavailable { until, .. } => return Some(until),
                Action::Look(looking) => {
                    let row = self.look(groups, i, &looking);
                    if groups[i].steer.looked(now, row) {
                        groups[i].again = Some(looking.rows.len() >= looking.wanted);
                        groups[i].members.clear();
                    }
                }
                Action::Form => match self.plan(groups, i) {
                    Some(members) => {
                        let g = &mut groups[i];
                        match g.again.take() {
                            Some(true) => self.report.reformed += 1,
                            Some(false) => self.report.replaced += 1,
                            None => {}
                        }
                        g.members = members;
                        g.steer.formed();
                    }
                    None => {
                        // No group can be formed now: the request in progress fails.
                        let g = &mut groups[i];
                        if g.done > 0 || g.token_began.is_some() {
                            self.report.failed += 1;
                        }
                        (g.done, g.rounds, g.token_began) = (0, 0, None);
                        g.members.clear();
                        g.steer.form_failed(now, "no group can be formed".into());
                    }
                },
            }
        }
    }

    fn run(mut self) -> ScaleReport {
        // Genesis rows are held; everyone else joins, one every 10 ms, heartbeats each second.
        let mut joined = 0;
        while joined < self.cfg.holders {
            for _ in 0..100.min(self.cfg.holders - joined) {
                self.join();
                joined += 1;
            }
            let t = self.clock.now() + Duration::from_secs(1);
            self.clock.advance_to(t);
            self.tick(false);
        }
        let start = self.clock.elapsed();
        let end = start + self.cfg.duration;
        let wanted = self.cfg.k + 1;
        let mut groups: Vec<Group> = (0..self.cfg.groups).map(|_| Group::new(wanted)).collect();
        let base = self.clock.at(Duration::ZERO);
        // (when a group's next round ends, group)
        let mut queue: BinaryHeap<Reverse<(Duration, usize)>> = BinaryHeap::new();
        for i in 0..groups.len() {
            queue.push(Reverse((start, i)));
        }
        let mut next_tick = start + Duration::from_secs(1);
        while let Some(Reverse((at, i))) = queue.pop() {
            while next_tick <= at && next_tick <= end {
                self.clock.advance_to(self.clock.at(next_tick));
                self.tick(true);
                next_tick += Duration::from_secs(1);
            }
            if at >= end {
                continue;
            }
            self.clock.advance_to(self.clock.at(at));
            let now = self.clock.now();
            // A member that left: the group goes on without it while k remain.
            self.drop_gone(&mut groups[i]);
            // Before each token's pass, the leader's rules: form, back off, look.
            if groups[i].rounds == 0
                && let Some(until) = self.steer(&mut groups, i, now)
            {
                let again = until
                    .saturating_duration_since(base)
                    .max(at + Duration::from_millis(1));
                queue.push(Reverse((again, i)));
                continue;
            }
            groups[i].token_began.get_or_insert(at);
            let (done, ok) = self.round(&groups[i], at);
            if ok {
                let group = &mut groups[i];
                group.rounds += 1;
                if group.rounds == self.cfg.rounds_per_token {
                    group.rounds = 0;
                    group.done += 1;
                    self.report.tokens += 1;
                    if let Some(began) = group.token_began.take() {
                        let took = done.saturating_sub(began);
                        self.report.token_ms.push(took.as_secs_f64() * 1000.0);
                    }
                    if group.done == self.cfg.tokens_per_request {
                        group.done = 0;
                        self.report.requests += 1;
                    }
                    group.steer.passed();
                }
            } else {
                // The pass failed: the group is formed again (at once, then backing off) and
                // the token's pass runs again.
                self.report.failed_passes += 1;
                let group = &mut groups[i];
                group.steer.pass_failed(now, false);
                (group.rounds, group.again) = (0, Some(false));
                group.members.clear();
            }
            queue.push(Reverse((done, i)));
        }
        let serving = self.cfg.duration.as_secs_f64();
        self.report.tokens_per_s = self.report.tokens as f64 / serving;
        let share = |d: Duration| d.as_secs_f64() / serving;
        let core = self.cores.iter().map(|c| c.busy).max().unwrap_or_default();
        self.report.leader_busy = (share(self.up.busy), share(self.down.busy), share(core));
        self.report
    }
}

/// Runs one simulation.
pub fn run_scale(cfg: ScaleConfig) -> Result<ScaleReport, MeshError> {
    Ok(Scale::new(cfg)?.run())
}
