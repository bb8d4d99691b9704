//! A leader on the mesh: connect through one node, learn the rows and the model, and run coded
//! steps over a group of k + s members with the first k answers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use libp2p::{Multiaddr, PeerId};
use node_core::code::Generator;
use node_core::coded::{Transport, TransportError};
use node_core::holder::{HolderError, Link};
use node_core::lead::{LeadLink, OwnRow};
use node_core::mesh::rounds::{Asks, MemberAnswer, Rounds};
use node_core::mesh::{
    Health, MeshInfo, MeshRequest, MeshResponse, ModelManifest, RoundConfig, SourceRow, StepRefusal,
};
use tokio::sync::mpsc;

use crate::hold::link::{NativeLink, order_addrs};
use crate::hold::row::LocalRow;
use crate::net::rpc::{ask, fetch_manifest};
use crate::net::swarm::{self, Client, NetConfig};

/// The runtime a command-line leader (`generate --bootstrap`, `eval`, the mesh bench) runs on:
/// one thread runs the rounds, the connections under their streams and the timers, so an
/// answer wakes no other thread (a multi-thread runtime cost several task switches a round;
/// docs/perf.md).
pub fn leader_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// A connection to the mesh through one node.
#[derive(Debug)]
pub struct Session {
    /// The network client.
    pub client: Client,
    /// The node connected through.
    pub bootstrap: PeerId,
    /// This session's identity (it signs the updates it publishes).
    pub key: libp2p::identity::Keypair,
}

impl Session {
    /// Starts an ephemeral node (no listening, no row) with a fresh identity and dials
    /// `bootstrap`.
    pub async fn connect(bootstrap: Multiaddr) -> Result<Self> {
        Self::connect_as(bootstrap, libp2p::identity::Keypair::generate_ed25519()).await
    }

    /// [`Session::connect`] as the identity `key`.
    pub async fn connect_as(bootstrap: Multiaddr, key: libp2p::identity::Keypair) -> Result<Self> {
        let swarm = swarm::build(NetConfig {
            key: key.clone(),
            webrtc: None,
            listen: Vec::new(),
            mdns: false,
            probe: false,
        })
        .await?;
        let (client, mut inbound) = swarm::spawn(swarm);
        // A leader serves nothing: drain what arrives (heartbeats) so the network never blocks.
        tokio::spawn(async move { while inbound.recv().await.is_some() {} });
        let bootstrap = client.dial(bootstrap).await?;
        Ok(Self {
            client,
            bootstrap,
            key,
        })
    }

    /// The bootstrap node's view of the mesh.
    pub async fn info(&self) -> Result<MeshInfo> {
        match ask(&self.client, self.bootstrap, MeshRequest::Info).await? {
            MeshResponse::Info(info) => Ok(info),
            _ => bail!("asked for the mesh view, got something else"),
        }
    }

    /// The model manifest.
    pub async fn manifest(&self) -> Result<ModelManifest> {
        Ok(fetch_manifest(&self.client, self.bootstrap).await?.0)
    }
}

/// The mesh's view once it has settled: right after an update the view may still mix versions,
/// so heartbeats get a moment (up to 3 s) to bring every healthy node to one.
pub async fn settled_info<F: std::future::Future<Output = Result<MeshInfo>>>(
    mut info: impl FnMut() -> F,
) -> Result<MeshInfo> {
    let mut now = info().await?;
    for _ in 0..20 {
        if now
            .nodes
            .iter()
            .all(|n| n.health != Health::Healthy || n.lag == 0)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        now = info().await?;
    }
    Ok(now)
}

/// How a leader's group is formed and run, and where its steps are traced.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// What every leader's group takes ([`node_core::lead::GroupOptions`]).
    pub group: node_core::lead::GroupOptions,
    /// Where every coded step is written, if anywhere (`--trace-steps`).
    pub trace: Option<crate::lead::steplog::StepLog>,
}

impl GroupOptions {
    /// `verify` checked answers and `spares` spares, default timing, members probed, checks
    /// projected, no step trace.
    pub fn new(verify: usize, spares: usize) -> Self {
        Self {
            group: node_core::lead::GroupOptions::new(verify, spares),
            trace: None,
        }
    }
}

/// A group formed for a leader over the network, with what it needs to run the model on it.
pub type Formed = node_core::lead::Formed<NetTransport>;

/// Whether a member of the group is on another machine: its session is not on a local socket,
/// and no address it was reached at is this machine's.
pub fn far(formed: &Formed) -> bool {
    let own = crate::net::this_machine();
    formed.group.transport().over_libp2p().iter().any(|p| {
        formed
            .addrs
            .get(p)
            .is_some_and(|a| node_core::net::reach::off_this_machine(a, &own))
    })
}

/// How long a leader waits for the mesh's rows to come to one version (an update spreading, a
/// holder catching up from its peers) before it gives up forming a group.
pub const MOVING_PATIENCE: Duration = Duration::from_secs(30);

/// Forms a group over the rows the mesh's view (`info`, asked anew each try, once settled)
/// shows healthy ([`node_core::lead::form`]); `local` is the calling node's own row, computed
/// in process. While the rows are split across versions so that none has k of them, it asks
/// again with a growing wait, for up to [`MOVING_PATIENCE`].
pub async fn form_group<F: std::future::Future<Output = Result<MeshInfo>>>(
    client: &Client,
    manifest: &ModelManifest,
    mut info: impl FnMut() -> F,
    local: Option<&LocalRow>,
    opts: &GroupOptions,
) -> Result<Formed> {
    let link = NetLead {
        link: NativeLink::quiet(client.clone()),
        client,
        local,
        trace: opts.trace.clone(),
    };
    let began = std::time::Instant::now();
    let mut wait = Duration::from_millis(250);
    loop {
        let now = settled_info(&mut info).await?;
        match node_core::lead::form(&link, manifest, &now, &opts.group).await {
            Err(node_core::lead::LeadError::Moving(why)) if began.elapsed() < MOVING_PATIENCE => {
                tracing::info!("{why}; asking again in {} ms", wait.as_millis());
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            formed => return Ok(formed?),
        }
    }
}

/// A leader's networking through this node's swarm; its own row, if any, computes in process.
struct NetLead<'a> {
    link: NativeLink,
    client: &'a Client,
    local: Option<&'a LocalRow>,
    trace: Option<crate::lead::steplog::StepLog>,
}

impl Link for NetLead<'_> {
    type Peer = PeerId;

    async fn ask(&self, peer: &PeerId, request: MeshRequest) -> Result<MeshResponse, HolderError> {
        self.link.ask(peer, request).await
    }

    async fn dial(&self, src: &SourceRow) -> Result<PeerId, HolderError> {
        self.link.dial(src).await
    }

    async fn blocking<R: Send + 'static>(&self, work: impl FnOnce() -> R + Send + 'static) -> R {
        self.link.blocking(work).await
    }

    fn progress(&self, what: &str, done: u64, total: u64) {
        self.link.progress(what, done, total);
    }
}

impl LeadLink for NetLead<'_> {
    type Net = NetTransport;

    fn own_row(&self) -> Option<OwnRow> {
        self.local.map(|l| OwnRow {
            peer: l.peer,
            norms: Some(l.norms()),
        })
    }

    async fn reach(&self, peer: PeerId, addrs: &[String]) -> Result<Vec<Multiaddr>, HolderError> {
        let addrs: Vec<Multiaddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
        let picked = order_addrs(&addrs);
        // A circuit through a relay this node is not connected to yet fails when dialed (the
        // relay client cancels it while it dials the relay), and the request with it: a peer
        // reached only through relays (a browser) has its relays dialed first.
        if picked.iter().all(node_core::net::reach::is_relayed) {
            let relays: std::collections::BTreeSet<Multiaddr> = picked
                .iter()
                .filter_map(node_core::net::reach::relay_of)
                .collect();
            for relay in relays {
                if let Err(e) = self.client.dial(relay).await {
                    tracing::debug!(%peer, "dialing a relay of: {e:#}");
                }
            }
        }
        self.client
            .add_addrs(peer, picked.clone())
            .await
            .map_err(|e| HolderError::Link(format!("{peer}: {e:#}")))?;
        Ok(picked)
    }

    fn transport(
        &self,
        version: [u8; 32],
        rows: &BTreeMap<usize, PeerId>,
        members: &[usize],
        generator: &Generator,
        round: RoundConfig,
    ) -> NetTransport {
        let mut transport = NetTransport::new(
            self.client.clone(),
            version,
            rows.clone(),
            members,
            generator.clone(),
            round,
        );
        transport.rounds.asks.local = self.local.cloned();
        transport.rounds.asks.trace = self.trace.clone();
        transport
    }
}

/// Time the members spent computing, as they reported it.
#[derive(Debug, Clone, Default)]
pub struct NetStats {
    /// Per round, the slowest used answer's compute time, summed.
    pub compute: Duration,
}

/// Coded steps over the network: each round goes to every member on its session, the first k
/// answers win, failed members are replaced from the free rows, stragglers are outrun and
/// swapped out ([`node_core::mesh::rounds`]). A leader inside a node computes its own row's
/// steps in process.
#[derive(Debug)]
pub struct NetTransport {
    rounds: Rounds<NetAsks>,
    stats: NetStats,
    /// What every round waits for before it goes out, if anything (a trainer's group waits
    /// until serving is idle).
    gate: Option<Gate>,
}

/// The sessions a [`NetTransport`]'s rounds ask through ([`node_core::net::asks`]), the
/// leader's own row computed in process, and the step trace.
#[derive(Debug)]
struct NetAsks {
    sessions: crate::hold::session::Sessions,
    /// The leader's own row's answers, computed here (a prefill's on the blocking pool).
    tx: mpsc::UnboundedSender<MemberAnswer>,
    rx: mpsc::UnboundedReceiver<MemberAnswer>,
    local: Option<LocalRow>,
    trace: Option<crate::lead::steplog::StepLog>,
    /// The round last asked, for the step trace.
    round: u64,
    /// The step the rounds belong to.
    label: String,
    /// What the rounds are for (the requests of a batch), for the step trace.
    context: String,
    /// When each member of the current round was asked, and with how many bytes (kept only
    /// for the step trace).
    asked: BTreeMap<usize, (Instant, usize)>,
    /// The runtime the sessions open and the leader's own prefill steps compute on.
    runtime: tokio::runtime::Handle,
}

/// A wait a group's rounds make before they go out.
#[derive(Clone)]
pub struct Gate(pub Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>);

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gate(..)")
    }
}

/// Encoded steps up to this size (a decode step's activations) are computed for the leader's
/// own row on the round's task; larger ones (prefill) on the blocking pool.
const INLINE_LOCAL_BYTES: usize = 4 * crate::hold::session::INLINE_STEP_VALUES;

impl NetTransport {
    /// A transport to the holders of `peers` (row → peer); rows not in `members` are free.
    /// Called inside the runtime the members' sessions will run on.
    pub fn new(
        client: Client,
        version: [u8; 32],
        peers: BTreeMap<usize, PeerId>,
        members: &[usize],
        generator: node_core::code::Generator,
        cfg: RoundConfig,
    ) -> Self {
        // Unbounded: the leader's own row answers only what the leader asked it, a round's
        // ask at a time.
        let (tx, rx) = mpsc::unbounded_channel();
        let me = client.peer_id();
        let runtime = tokio::runtime::Handle::current();
        let rows: Vec<usize> = peers.keys().copied().collect();
        let mut sessions = crate::hold::session::sessions(runtime.clone(), client, version, peers)
            .with_delay(crate::net::swarm::one_way_delay());
        // This node's own row (a leader inside a node) is computed here, not over a session.
        for &row in members {
            if sessions.peer_of(row) != Some(me) {
                sessions.link(row);
            }
        }
        let asks = NetAsks {
            sessions,
            tx,
            rx,
            local: None,
            trace: None,
            round: 0,
            label: String::new(),
            context: String::new(),
            asked: BTreeMap::new(),
            runtime,
        };
        Self {
            rounds: Rounds::new(asks, generator, rows, members, cfg),
            stats: NetStats::default(),
            gate: None,
        }
    }

    /// The members whose sessions run over libp2p, not a local socket.
    pub fn over_libp2p(&self) -> Vec<PeerId> {
        let sessions = &self.rounds.asks.sessions;
        sessions
            .links()
            .filter(|(_, l)| crate::hold::session::over_libp2p(l))
            .filter_map(|(row, _)| sessions.peer_of(row))
            .collect()
    }

    /// The peer holding a row, as this transport knows it.
    pub fn peer_of(&self, row: usize) -> Option<PeerId> {
        self.rounds.asks.sessions.peer_of(row)
    }

    /// Compute time reported by members.
    pub fn stats(&self) -> &NetStats {
        &self.stats
    }

    /// The version the members are asked at.
    pub fn version(&self) -> [u8; 32] {
        self.rounds.asks.sessions.version()
    }

    /// Asks the members at another version from now on (after this leader's own update,
    /// which every member has applied).
    pub fn set_version(&mut self, version: [u8; 32]) {
        self.rounds.asks.sessions.set_version(version);
    }

    /// What the rounds are for, as the step trace writes it.
    pub fn context(&self) -> &str {
        &self.rounds.asks.context
    }

    /// What the next rounds are for (written with each step in the step trace).
    pub fn set_context(&mut self, context: String) {
        self.rounds.asks.context = context;
    }

    /// Makes every later round wait for `gate` first.
    pub fn set_gate(&mut self, gate: Gate) {
        self.gate = Some(gate);
    }

    /// Whether a member of the last round was at another version than the group's: the
    /// mesh moved on (or the member lags), and forming the group again at the mesh's
    /// settled version may help where asking again would not.
    pub fn met_another_version(&self) -> bool {
        self.rounds.notes().stale
    }

    async fn wait_gate(&self) {
        if let Some(Gate(wait)) = &self.gate {
            wait().await;
        }
    }
}

impl NetAsks {
    /// The next answer that is due, the leader's own row's included, after driving every
    /// session; registers `cx` for the rest.
    fn poll_answer(&mut self, cx: &mut std::task::Context<'_>) -> Option<MemberAnswer> {
        if let Poll::Ready(Some(answer)) = self.rx.poll_recv(cx) {
            return Some(answer);
        }
        self.sessions.poll_answer(cx, Instant::now())
    }

    /// Notes when a member was asked and with how many bytes, for the step trace (if any).
    fn note_asked(&mut self, row: usize, bytes: usize) {
        if self.trace.is_some() {
            self.asked.insert(row, (Instant::now(), bytes));
        }
    }

    fn is_local(&self, row: usize) -> bool {
        self.local.as_ref().is_some_and(|l| l.row == row)
    }

    fn send(&mut self, round: u64, row: usize, request: &[u8]) {
        self.note_asked(row, request.len());
        self.sessions.ask(round, row, request.to_vec());
    }

    /// Computes this node's own row's answer (while the others compute theirs): a decode
    /// step on this task, a larger one on the blocking pool, answered like any member.
    fn answer_locally(&mut self, round: u64, row: usize, request: &[u8]) {
        self.note_asked(row, request.len());
        let Some(local) = self.local.clone() else {
            let refusal = StepRefusal::Failed("no local row".into());
            let _ = self.tx.send((round, row, Err(refusal)));
            return;
        };
        let (version, tx) = (self.sessions.version(), self.tx.clone());
        if request.len() <= INLINE_LOCAL_BYTES {
            let _ = tx.send((round, row, local.step(&version, request).into_step()));
            return;
        }
        let request = request.to_vec();
        self.runtime.spawn_blocking(move || {
            let _ = tx.send((round, row, local.step(&version, &request).into_step()));
        });
    }

    /// Writes one member's part of the round to the step trace.
    fn trace_answer(&mut self, row: usize, result: Result<(usize, u64), &str>) {
        let Some(trace) = &self.trace else {
            return;
        };
        let Some((at, sent)) = self.asked.remove(&row) else {
            return;
        };
        let (received, compute_us, outcome) = match result {
            Ok((bytes, us)) => (bytes, us, "ok".to_string()),
            Err(e) => (0, 0, e.to_string()),
        };
        trace.record(&crate::lead::steplog::StepRecord {
            unix_ms: crate::lead::steplog::unix_ms(),
            context: &self.context,
            step: &self.label,
            round: self.round,
            member: row,
            peer: (self.sessions.peer_of(row))
                .map(|p| p.to_string())
                .unwrap_or_default(),
            local: self.is_local(row),
            bytes_sent: sent,
            bytes_received: received,
            ms: at.elapsed().as_secs_f64() * 1e3,
            compute_ms: compute_us as f64 / 1e3,
            outcome: &outcome,
        });
    }
}

impl Asks for NetAsks {
    fn version(&self) -> [u8; 32] {
        self.sessions.version()
    }

    /// Sends every remote ask first (written at once, as far as the streams take them), then
    /// computes the local one (if asked) meanwhile.
    fn ask(&mut self, round: u64, asks: &[(usize, &[u8])]) {
        self.round = round;
        // Each round starts its asks at another member: the member asked last (on a busy
        // machine, the one answering last, so outrun) is not always the same one.
        let start = (round as usize).checked_rem(asks.len()).unwrap_or(0);
        if let Some(&(row, _)) = asks.get(start) {
            self.sessions.begin_at(row);
        }
        let mut local = None;
        for &(row, request) in asks[start..].iter().chain(&asks[..start]) {
            if self.is_local(row) {
                local = Some((row, request));
            } else {
                self.send(round, row, request);
            }
        }
        self.sessions.flush();
        if let Some((row, request)) = local {
            self.answer_locally(round, row, request);
        }
    }

    async fn next(&mut self, until: Instant) -> Option<MemberAnswer> {
        let wake = tokio::time::sleep_until(until.into());
        tokio::pin!(wake);
        std::future::poll_fn(|cx| {
            use crate::hold::session::local;
            // Where sessions poll (every process of the stream on a core of its own), an answer
            // due within the poll is read without sleeping on the runtime's wake-up; the last
            // poll, before it sleeps, is not one it repeats (`local::polling`).
            if let Some(spin) = local::spin().filter(|_| self.sessions.delay().is_zero()) {
                let end = (Instant::now() + spin).min(until);
                loop {
                    if let Some(answer) = local::polling(|| self.poll_answer(cx)) {
                        return Poll::Ready(Some(answer));
                    }
                    if Instant::now() >= end {
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
            if let Some(answer) = self.poll_answer(cx) {
                return Poll::Ready(Some(answer));
            }
            let now = Instant::now();
            if now >= until {
                return Poll::Ready(None);
            }
            let at = (self.sessions.held_until(now)).map_or(until, |at| at.min(until));
            if wake.deadline() != at.into() {
                wake.as_mut().reset(at.into());
            }
            if wake.as_mut().poll(cx).is_ready() {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        })
        .await
    }

    /// Polls the sessions once without waiting (their writes progress too).
    fn try_next(&mut self) -> Option<MemberAnswer> {
        let waker = futures::task::noop_waker_ref();
        self.poll_answer(&mut std::task::Context::from_waker(waker))
    }

    fn seen(&mut self, row: usize, answer: Result<(usize, u64), &str>) {
        self.trace_answer(row, answer);
    }

    /// Members still unanswered were not needed: the trace says so.
    fn ended(&mut self) {
        let rows: Vec<usize> = self.asked.keys().copied().collect();
        for row in rows {
            self.trace_answer(row, Err("not needed (outrun)"));
        }
        self.asked.clear();
    }
}

impl Transport for NetTransport {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.wait_gate().await;
        let answers = self.rounds.round(members, request, need).await?;
        let slowest = self.rounds.notes().slowest_compute_us;
        self.stats.compute += Duration::from_micros(slowest);
        Ok(answers)
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.wait_gate().await;
        self.rounds.round_each(requests).await
    }

    fn label(&mut self, what: &str) {
        what.clone_into(&mut self.rounds.asks.label);
    }

    fn last_round(&self) -> Option<u64> {
        self.rounds.last_round()
    }

    fn late_answers(&mut self) -> Vec<(u64, usize, Vec<u8>)> {
        self.rounds.late_answers()
    }

    fn asks_alone(&self) -> bool {
        self.rounds.asks_alone()
    }
}
