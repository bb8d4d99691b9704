//! A leader on the mesh: connect through one node, learn the rows and the model, and run coded
//! steps over a group of k + s members with the first k answers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use libp2p::{Multiaddr, PeerId};
use node_core::coded::{Transport, TransportError};
use node_core::learn::{Learner, Published};
use node_core::mesh::{
    Health, MemberPool, MeshInfo, MeshRequest, MeshResponse, ModelManifest, RoundConfig,
    RoundDriver, Usage,
};
use node_core::net::session::Ask;

use crate::link::pick_addr;
use crate::row::LocalRow;
use crate::rpc::{ask, fetch_manifest, fetch_update};
use crate::swarm::{self, Client, NetConfig};

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
    /// Starts an ephemeral node (no listening, no row) and dials `bootstrap`.
    pub async fn connect(bootstrap: Multiaddr) -> Result<Self> {
        let key = libp2p::identity::Keypair::generate_ed25519();
        let swarm = swarm::build(NetConfig {
            key: key.clone(),
            webrtc: None,
            listen: Vec::new(),
            mdns: false,
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

/// Learning updates of a version a leader checks its members against: a random few.
pub const PROBE_UPDATES: usize = 4;

/// A random few of the updates that make `version`, fetched from a holder and checked: the
/// list of ids must hash to the version's digest, each payload to its id, and each must be
/// signed and fit the mesh's rules.
async fn probe_updates(
    client: &Client,
    holders: &[PeerId],
    version: [u8; 32],
    rules: &crate::learning::Rules,
) -> Result<Vec<(u64, std::sync::Arc<node_core::learn::Update>)>> {
    use std::hash::BuildHasher;
    let mut last = anyhow!("no row holder to ask");
    for &peer in holders {
        let ids = match ask(client, peer, MeshRequest::Versions).await {
            Ok(MeshResponse::Versions { ids }) => ids,
            Ok(_) => {
                last = anyhow!("{peer} answered the version list with something else");
                continue;
            }
            Err(e) => {
                last = e;
                continue;
            }
        };
        let mut listed = node_core::mesh::ShardVersion::default();
        ids.iter().for_each(|&id| {
            listed.insert(id);
        });
        if listed.digest() != version {
            last = anyhow!("{peer}'s update list is not the group's version");
            continue;
        }
        // A random choice per leader (the hasher's keys are random), so no member can know
        // which updates will be checked.
        let order = std::collections::hash_map::RandomState::new();
        let mut ids = ids;
        ids.sort_by_key(|&id| order.hash_one(id));
        ids.truncate(PROBE_UPDATES);
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let bytes = fetch_update(client, peer, id).await?;
            let checked = rules.check(&bytes)?;
            if checked.id != id {
                bail!("{peer}'s update {id:016x} hashes to {:016x}", checked.id);
            }
            out.push((id, std::sync::Arc::new(checked.update)));
        }
        return Ok(out);
    }
    Err(last)
}

/// How a leader's group is formed and run.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Answers checked beyond the k decoded in every forward round.
    pub verify: usize,
    /// Spare members asked beside the k (and the checked ones).
    pub spares: usize,
    /// Round timing.
    pub round: RoundConfig,
    /// Where every coded step is written, if anywhere (`--trace-steps`).
    pub trace: Option<crate::steplog::StepLog>,
    /// Holders to leave out (another group of this leader computes with them), when the row
    /// has another holder or the group can do without the row.
    pub avoid: BTreeSet<PeerId>,
}

impl GroupOptions {
    /// `verify` checked answers and `spares` spares, default timing, no step trace.
    pub fn new(verify: usize, spares: usize) -> Self {
        Self {
            verify,
            spares,
            round: RoundConfig::default(),
            trace: None,
            avoid: BTreeSet::new(),
        }
    }
}

/// A group formed for a leader, with what it needs to run the model on it.
#[derive(Debug)]
pub struct Formed {
    /// The group, over the network.
    pub group: node_core::coded::CodedGroup<NetTransport>,
    /// The leader's side of the model, with the norm gains at the group's version.
    pub llama: node_core::model::Llama,
    /// The version the group decodes at.
    pub version: [u8; 32],
    /// Every live holder at that version, replicas included, this node excluded (learning
    /// updates go to all of them).
    pub holders: Vec<PeerId>,
    /// The holders the group computes with (k, the checked ones and the spares).
    pub members: Vec<PeerId>,
    /// Rows healthy at that version when the group was formed.
    pub live_rows: usize,
    /// Condition number of the decoding k.
    pub condition_number: f64,
    /// The address each chosen holder is dialed at.
    pub addrs: BTreeMap<PeerId, Vec<Multiaddr>>,
}

/// Forms a group over the rows `info` shows healthy: every row's holder is asked for its norm
/// gains at once (a slow first dial happens here, not inside a round's timeout, and rows that
/// cannot be reached or hold another version are left out), then the best-conditioned k plus
/// checks and spares are chosen. `local` is the calling node's own row, computed in process.
pub async fn form_group(
    client: &Client,
    manifest: &ModelManifest,
    info: &MeshInfo,
    local: Option<&LocalRow>,
    opts: &GroupOptions,
) -> Result<Formed> {
    let Some((version, live)) = info.live_holders() else {
        bail!("no healthy row holder is known: the model is unavailable");
    };
    // Every holder at the version gets the learning updates; the group takes one per row,
    // the first that no other group of this leader uses.
    let mut by_row: BTreeMap<usize, Vec<PeerId>> = BTreeMap::new();
    let mut addrs_of: BTreeMap<PeerId, &[String]> = BTreeMap::new();
    for (row, holders) in &live {
        for n in holders {
            let peer: PeerId = n
                .peer
                .parse()
                .map_err(|e| anyhow!("peer id {:?}: {e}", n.peer))?;
            by_row.entry(*row).or_default().push(peer);
            addrs_of.insert(peer, n.addrs.as_slice());
        }
    }
    let everyone: Vec<PeerId> = by_row.values().flatten().copied().collect();
    let peers = node_core::mesh::pick_holders(&by_row, &opts.avoid);
    // A further group of a leader needs its decoded and checked rows free: say so before
    // asking anyone anything.
    let needed = manifest.generator.k() + opts.verify;
    if !opts.avoid.is_empty() && peers.len() < needed {
        bail!(
            "{} rows have a holder no other group uses, fewer than the {needed} a further group needs",
            peers.len()
        );
    }
    let mut dialed = BTreeMap::new();
    for peer in peers.values() {
        if local.is_none_or(|l| l.peer != *peer) {
            let addrs: Vec<Multiaddr> = addrs_of
                .get(peer)
                .map(|a| a.iter().filter_map(|a| a.parse().ok()).collect())
                .unwrap_or_default();
            let picked: Vec<Multiaddr> = pick_addr(&addrs).into_iter().collect();
            client.add_addrs(*peer, picked.clone()).await?;
            dialed.insert(*peer, picked);
        }
    }
    let asks = peers.iter().map(|(&row, &peer)| async move {
        let answer = match local.filter(|l| l.peer == peer) {
            Some(l) => {
                let (version, norms) = l.norms();
                Ok(MeshResponse::Norms { version, norms })
            }
            None => ask(client, peer, MeshRequest::Norms)
                .await
                .map_err(|e| format!("{e:#}")),
        };
        (row, peer, answer)
    });
    let answers = futures::future::join_all(asks).await;
    let (rows, norms) = node_core::mesh::rows_at_version(answers, version, &manifest.cfg);
    let Some(norms) = norms else {
        bail!(
            "no row holder could give the norm gains at version {}; the mesh is taking an update, try again",
            node_core::mesh::hex(&version[..8])
        );
    };
    let g = manifest.generator.clone();
    let live: Vec<usize> = rows.keys().copied().collect();
    if live.len() < g.k() {
        bail!(
            "the mesh has {} healthy rows at one version, fewer than k = {}: the model is unavailable",
            live.len(),
            g.k()
        );
    }
    let plan = node_core::mesh::plan_group(&g, &live, opts.verify + opts.spares)?;
    let members: Vec<PeerId> = plan
        .members
        .iter()
        .filter_map(|r| rows.get(r).copied())
        .collect();
    let holders: Vec<PeerId> = everyone
        .into_iter()
        .filter(|p| local.is_none_or(|l| l.peer != *p))
        .collect();
    // Members that claim updates they do not hold are caught by fitting the residuals
    // against a few updates of the version (docs/verification.md).
    let probe = if opts.verify > 0 && manifest.learning.enabled {
        let rules = crate::learning::Rules {
            cfg: manifest.cfg.clone(),
            learning: manifest.learning,
        };
        match probe_updates(client, &holders, version, &rules).await {
            Ok(list) if list.is_empty() => None,
            Ok(list) => {
                tracing::info!(
                    updates = list.len(),
                    "checking members against learning updates of their version"
                );
                Some(node_core::coded::UpdateProbe::new(list, g.n()))
            }
            Err(e) => {
                tracing::warn!("members are not checked against learning updates: {e:#}");
                None
            }
        }
    } else {
        None
    };
    let llama = node_core::model::Llama::new(manifest.cfg.clone(), norms)?;
    let mut transport = NetTransport::new(
        client.clone(),
        version,
        rows,
        &plan.members,
        g.clone(),
        opts.round,
    );
    transport.local = local.cloned();
    transport.trace = opts.trace.clone();
    let mut group =
        node_core::coded::CodedGroup::new(manifest.cfg.clone(), g, &plan.members, transport)?;
    group.set_verify(node_core::coded::VerifyConfig {
        extra: opts.verify,
        noise: manifest.verify_noise,
    });
    group.set_probe(probe);
    Ok(Formed {
        group,
        llama,
        version,
        holders,
        members,
        live_rows: live.len(),
        condition_number: plan.condition_number,
        addrs: dialed,
    })
}

/// Everything a leader needs to run requests on the mesh.
#[derive(Debug)]
pub struct Leader {
    /// The model's manifest.
    pub manifest: ModelManifest,
    /// Its tokenizer.
    pub tokenizer: node_core::model::Tokenizer,
    /// The leader's side of the model.
    pub llama: node_core::model::Llama,
    /// The group, over the network.
    pub group: node_core::coded::CodedGroup<NetTransport>,
    /// Rows healthy when the group was formed.
    pub live_rows: usize,
    /// Condition number of the decoding k.
    pub condition_number: f64,
    /// The version the group decodes at.
    pub version: [u8; 32],
    /// Every live row's holder (learning updates go to all of them).
    pub holders: Vec<PeerId>,
    /// The network client.
    pub client: Client,
    /// The node this leader connected through.
    pub bootstrap: PeerId,
    /// The address each member is dialed at.
    pub addrs: BTreeMap<PeerId, Vec<Multiaddr>>,
    /// The leader's identity: it signs the updates.
    key: libp2p::identity::Keypair,
}

impl Leader {
    /// Connects through `bootstrap`, fetches the manifest and forms a group of k + `verify` +
    /// `spares`; every forward round is checked with `verify` answers beyond the k decoded.
    pub fn connect(
        rt: &tokio::runtime::Runtime,
        bootstrap: Multiaddr,
        verify: usize,
        spares: usize,
    ) -> Result<Self> {
        Self::connect_with(rt, bootstrap, &GroupOptions::new(verify, spares))
    }

    /// [`Leader::connect`] with every option of the group.
    pub fn connect_with(
        rt: &tokio::runtime::Runtime,
        bootstrap: Multiaddr,
        opts: &GroupOptions,
    ) -> Result<Self> {
        let (session, manifest, formed) = rt.block_on(async {
            let session = Session::connect(bootstrap).await?;
            let manifest = session.manifest().await?;
            let info = settled_info(|| session.info()).await?;
            let formed = form_group(&session.client, &manifest, &info, None, opts).await?;
            anyhow::Ok((session, manifest, formed))
        })?;
        let tokenizer = node_core::model::Tokenizer::from_data(&manifest.tokenizer)?;
        Ok(Self {
            manifest,
            tokenizer,
            llama: formed.llama,
            group: formed.group,
            live_rows: formed.live_rows,
            condition_number: formed.condition_number,
            version: formed.version,
            holders: formed.holders,
            client: session.client,
            bootstrap: session.bootstrap,
            addrs: formed.addrs,
            key: session.key,
        })
    }

    /// Trains on `tokens` if the mesh learns: the gradient through the group, folded into
    /// `learner`; when an update is due it is handed to every live row's holder (the rest catch
    /// up from them). Returns the loss before the update and what was published, if anything.
    pub fn learn(
        &mut self,
        rt: &tokio::runtime::Runtime,
        tokens: &[u32],
        learner: &mut Learner,
    ) -> Result<Option<Learned>> {
        let cfg = self.manifest.learning;
        if !cfg.enabled || tokens.len() < 2 {
            return Ok(None);
        }
        let max = node_core::learn::training_window(&cfg, &self.manifest.cfg);
        let tokens = &tokens[tokens.len().saturating_sub(max)..];
        let grads = self.llama.gradients(&mut self.group, tokens)?;
        let loss = grads.loss;
        let published = match learner.push(grads)? {
            Some(p) => Some(self.publish(rt, p)?),
            None => None,
        };
        Ok(Some(Learned {
            loss,
            positions: tokens.len(),
            published,
        }))
    }

    /// Tells every live row's holder about the members this leader caught; returns how many
    /// nodes took the reports.
    pub fn report_caught(&self, rt: &tokio::runtime::Runtime) -> Result<usize> {
        let caught = self.group.stats().caught.clone();
        if caught.is_empty() {
            return Ok(0);
        }
        let reports: Vec<(String, node_core::coded::Caught)> = caught
            .into_iter()
            .filter_map(|c| {
                let peer = self.group.transport().peer_of(c.node)?;
                Some((peer.to_string(), c))
            })
            .collect();
        let client = self.client.clone();
        let holders = self.holders.clone();
        let taken = rt.block_on(async move {
            let sends = holders.into_iter().map(|to| {
                let (client, reports) = (client.clone(), reports.clone());
                async move {
                    for (peer, evidence) in reports {
                        ask(&client, to, MeshRequest::Report { peer, evidence }).await?;
                    }
                    anyhow::Ok(())
                }
            });
            futures::future::join_all(sends).await
        });
        Ok(taken.iter().filter(|r| r.is_ok()).count())
    }

    /// Tells the node this leader connected through what a request did; the mesh's usage
    /// (tokens/s, latency, loss on the dashboards) counts it.
    pub fn report_served(&self, rt: &tokio::runtime::Runtime, usage: Usage) -> Result<()> {
        rt.block_on(ask(
            &self.client,
            self.bootstrap,
            MeshRequest::Served(usage),
        ))?;
        Ok(())
    }

    /// Hands an update to every live row's holder.
    pub fn publish(&self, rt: &tokio::runtime::Runtime, p: Published) -> Result<Sent> {
        let payload = p.update.encode();
        let id = node_core::learn::Update::id_of(&payload);
        let bytes = node_core::learn::seal(payload, &self.key)?;
        let size = bytes.len();
        let client = self.client.clone();
        let holders = self.holders.clone();
        let applied = rt.block_on(async move {
            let sends = holders.into_iter().map(|peer| {
                let client = client.clone();
                let req = MeshRequest::Learn(bytes.clone());
                async move { ask(&client, peer, req).await }
            });
            futures::future::join_all(sends).await
        });
        let ok = applied.iter().filter(|r| r.is_ok()).count();
        for e in applied.iter().filter_map(|r| r.as_ref().err()) {
            tracing::warn!("a node refused the update: {e:#}");
        }
        Ok(Sent {
            id,
            bytes: size,
            applied_by: ok,
            requests: p.requests,
            kept: p.kept,
        })
    }
}

/// What one learning step did.
#[derive(Debug, Clone, Copy)]
pub struct Learned {
    /// Mean next-token loss on the request's tokens before the update.
    pub loss: f64,
    /// Positions trained on.
    pub positions: usize,
    /// The update published after this request, if one was due.
    pub published: Option<Sent>,
}

/// An update handed to the mesh.
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    /// The update's id.
    pub id: u64,
    /// Its size on the wire.
    pub bytes: usize,
    /// Nodes that took it directly.
    pub applied_by: usize,
    /// Requests folded into it.
    pub requests: u32,
    /// Share of the gradient's energy the compression kept.
    pub kept: f64,
}

/// Time the members spent computing, as they reported it.
#[derive(Debug, Clone, Default)]
pub struct NetStats {
    /// Per round, the slowest used answer's compute time, summed.
    pub compute: Duration,
}

type Answer = (u64, usize, Result<(Vec<u8>, u64), String>);

/// Coded steps over the network: each round goes to every member, the first k answers win,
/// failed members are replaced from the free rows, stragglers are outrun and swapped out.
/// A leader inside a node computes its own row's steps in process.
#[derive(Debug)]
pub struct NetTransport {
    client: Client,
    version: [u8; 32],
    peers: BTreeMap<usize, PeerId>,
    pool: MemberPool,
    tx: std_mpsc::SyncSender<Answer>,
    rx: std_mpsc::Receiver<Answer>,
    round: u64,
    stats: NetStats,
    local: Option<LocalRow>,
    trace: Option<crate::steplog::StepLog>,
    /// The step the rounds belong to.
    label: String,
    /// What the rounds are for (the requests of a batch), for the step trace.
    context: String,
    /// When each member of the current round was asked, and with how many bytes.
    asked: BTreeMap<usize, (Instant, usize)>,
    /// The session with each row asked so far (opened when the group forms, or when a row is
    /// first asked as a replacement).
    links: BTreeMap<usize, crate::session::Link>,
    /// The runtime the sessions run on (rounds are driven from a thread outside it).
    runtime: tokio::runtime::Handle,
}

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
        let free = peers
            .keys()
            .copied()
            .filter(|r| !members.contains(r))
            .collect();
        let (tx, rx) = std_mpsc::sync_channel(4096);
        let mut transport = Self {
            client,
            version,
            peers,
            pool: MemberPool::new(generator, free, cfg),
            tx,
            rx,
            round: 0,
            stats: NetStats::default(),
            local: None,
            trace: None,
            label: String::new(),
            context: String::new(),
            asked: BTreeMap::new(),
            links: BTreeMap::new(),
            runtime: tokio::runtime::Handle::current(),
        };
        // This node's own row (a leader inside a node) is computed here, not over a session.
        let me = transport.client.peer_id();
        for &row in members {
            if transport.peers.get(&row) != Some(&me) {
                transport.link(row);
            }
        }
        transport
    }

    /// The session with a row's holder, opened now if there is none yet.
    fn link(&mut self, row: usize) -> Option<&crate::session::Link> {
        let peer = *self.peers.get(&row)?;
        let (client, tx, runtime) = (&self.client, &self.tx, &self.runtime);
        Some(self.links.entry(row).or_insert_with(|| {
            let tx = tx.clone();
            let deliver: crate::session::Deliver = Arc::new(move |round, result| {
                let _ = tx.try_send((round, row, result));
            });
            let delay = crate::swarm::one_way_delay();
            crate::session::Link::open(runtime, client, peer, deliver, delay)
        }))
    }

    /// The peer holding a row, as this transport knows it.
    pub fn peer_of(&self, row: usize) -> Option<PeerId> {
        self.peers.get(&row).copied()
    }

    /// Compute time reported by members.
    pub fn stats(&self) -> &NetStats {
        &self.stats
    }

    /// The version the members are asked at.
    pub fn version(&self) -> [u8; 32] {
        self.version
    }

    /// Asks the members at another version from now on (after this leader's own update,
    /// which every member has applied).
    pub fn set_version(&mut self, version: [u8; 32]) {
        self.version = version;
    }

    /// What the next rounds are for (written with each step in the step trace).
    pub fn set_context(&mut self, context: String) {
        self.context = context;
    }

    fn is_local(&self, row: usize) -> bool {
        self.local.as_ref().is_some_and(|l| l.row == row)
    }

    fn send(&mut self, row: usize, request: &[u8]) {
        self.asked.insert(row, (Instant::now(), request.len()));
        let ask = Ask {
            id: self.round,
            version: self.version,
            step: request.to_vec(),
        };
        let sent = match self.link(row) {
            Some(link) => link.ask(ask),
            None => Err(format!("no peer holds row {row}")),
        };
        if let Err(e) = sent {
            let _ = self.tx.try_send((self.round, row, Err(e)));
        }
    }

    /// Computes this node's own row's answer here (while the others compute theirs).
    fn answer_locally(&mut self, row: usize, request: &[u8]) {
        self.asked.insert(row, (Instant::now(), request.len()));
        let result = match &self.local {
            Some(l) => l.step(&self.version, request).into_step(),
            None => Err("no local row".into()),
        };
        let _ = self.tx.try_send((self.round, row, result));
    }

    /// Sends `request` to each of `rows`, computing the local one last.
    fn send_all(&mut self, rows: impl IntoIterator<Item = (usize, Vec<u8>)>) {
        let mut local = None;
        for (row, request) in rows {
            if self.is_local(row) {
                local = Some((row, request));
            } else {
                self.send(row, &request);
            }
        }
        if let Some((row, request)) = local {
            self.answer_locally(row, &request);
        }
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
        trace.record(&crate::steplog::StepRecord {
            unix_ms: crate::steplog::unix_ms(),
            context: &self.context,
            step: &self.label,
            round: self.round,
            member: row,
            peer: self
                .peers
                .get(&row)
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

    /// Ends a round in the step trace: members still unanswered were not needed.
    fn trace_round_end(&mut self) {
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
        self.round += 1;
        // Late answers to earlier rounds show who is slow but alive.
        while let Ok((_, row, result)) = self.rx.try_recv() {
            match result {
                Ok(_) => self.pool.note_answer(row),
                Err(_) => self.pool.note_failure(row),
            }
        }
        let mut driver = RoundDriver::start(Instant::now(), members, need, &mut self.pool);
        let mut compute: BTreeMap<usize, u64> = BTreeMap::new();
        loop {
            let mut due = Vec::new();
            while let Some(row) = driver.poll_transmit() {
                due.push((row, request.to_vec()));
            }
            self.send_all(due);
            if driver.is_done() || driver.is_failed() {
                break;
            }
            let wait = driver.poll_timeout().map_or(Duration::from_secs(1), |t| {
                t.saturating_duration_since(Instant::now())
            });
            match self.rx.recv_timeout(wait) {
                Ok((round, row, result)) if round == self.round => {
                    self.trace_answer(
                        row,
                        result
                            .as_ref()
                            .map(|(b, us)| (b.len(), *us))
                            .map_err(String::as_str),
                    );
                    let result = result.map(|(bytes, us)| {
                        compute.insert(row, us);
                        bytes
                    });
                    driver.handle_answer(Instant::now(), row, result, &mut self.pool);
                }
                Ok((_, row, result)) => match result {
                    // An answer to an earlier round, already decided: the member is alive.
                    Ok(_) => self.pool.note_answer(row),
                    Err(_) => self.pool.note_failure(row),
                },
                Err(std_mpsc::RecvTimeoutError::Timeout) => {
                    driver.handle_timeout(Instant::now(), &mut self.pool)
                }
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(TransportError {
                        node: usize::MAX,
                        reason: "the answer channel closed".into(),
                    });
                }
            }
        }
        self.trace_round_end();
        *members = driver.members().to_vec();
        let answers = driver.finish(&mut self.pool).map_err(|e| TransportError {
            node: usize::MAX,
            reason: e.to_string(),
        })?;
        let slowest = answers
            .iter()
            .filter_map(|(r, _)| compute.get(r))
            .max()
            .copied()
            .unwrap_or(0);
        self.stats.compute += Duration::from_micros(slowest);
        Ok(answers)
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        // Backward steps: every member gets its own input and every answer is needed.
        self.round += 1;
        let round = self.round;
        let rows: Vec<usize> = requests.iter().map(|(r, _)| *r).collect();
        self.send_all(requests);
        let deadline = Instant::now() + RoundConfig::default().member_timeout;
        let mut answers = Vec::with_capacity(rows.len());
        let result = loop {
            if answers.len() == rows.len() {
                break Ok(answers);
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(wait) {
                Ok((r, row, result)) if r == round => match result {
                    Ok((bytes, us)) => {
                        self.trace_answer(row, Ok((bytes.len(), us)));
                        answers.push((row, bytes));
                    }
                    Err(reason) => {
                        self.trace_answer(row, Err(&reason));
                        self.pool.note_failure(row);
                        break Err(TransportError { node: row, reason });
                    }
                },
                Ok(_) => {}
                Err(_) => {
                    let missing = rows
                        .iter()
                        .copied()
                        .find(|r| answers.iter().all(|(a, _)| a != r))
                        .unwrap_or(usize::MAX);
                    break Err(TransportError {
                        node: missing,
                        reason: "timed out".into(),
                    });
                }
            }
        };
        self.trace_round_end();
        result
    }

    fn label(&mut self, what: &str) {
        what.clone_into(&mut self.label);
    }
}
