//! Leading a request from the page: a coded group over the mesh's live rows, each round sent
//! through this node's libp2p swarm, node-core's generation loop, then the request's learning
//! update, signed with this node's identity and handed to every row's holder.

use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::task::Poll;

use futures::FutureExt;
use futures::future::LocalBoxFuture;
use libp2p::Multiaddr;
use libp2p::PeerId;
use node_core::code::Generator;
use node_core::holder::HolderError;
use node_core::lead::{
    Failure, Formed, GroupOptions, LeadLink, LeadShell, Leader, Looking, Measured, OwnRow,
    generate_regrouping,
};
use node_core::mesh::rounds::{Asks, MemberAnswer, Rounds};
use node_core::mesh::{
    BrowserBootstrap, MeshRequest, MeshResponse, ModelManifest, RoundConfig, Usage,
};
use node_core::model::{ChatMessage, GenerateOptions, ModelError, SamplingParams, Tokenizer};
use node_core::net::asks::SessionAsks;
use node_core::net::session;
use serde::{Deserialize, Serialize};
use web_time::Instant;

use super::{BrowserNode, Command, WebError};

/// Rows asked beyond the checked ones, to outrun a straggler.
const SPARES: usize = 1;

/// A request to lead from the page.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Prompt {
    /// The user's text.
    pub text: String,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Wrap the text in the model's chat template.
    pub chat: bool,
    /// Answers beyond k that check every round (0: unchecked).
    pub check: usize,
    /// Train on the request afterwards, as every leader does.
    pub learn: bool,
}

impl Default for Prompt {
    fn default() -> Self {
        Self {
            text: String::new(),
            max_tokens: 32,
            temperature: 0.0,
            chat: true,
            check: 1,
            learn: true,
        }
    }
}

/// What a request led from the page did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    /// The generated text.
    pub text: String,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Why generation stopped.
    pub stop: String,
    /// The group's rows, the decoding k first.
    pub group: Vec<usize>,
    /// Rows this page could reach when the group formed.
    pub live_rows: usize,
    /// Prompt tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tokens_per_s: f64,
    /// Coded rounds run (generation and learning).
    pub rounds: u64,
    /// Rounds checked with answers beyond k.
    pub checked_rounds: u64,
    /// Rounds decoded from k answers only while checking was asked for.
    pub unchecked_rounds: u64,
    /// Session streams opened to the members, and the asks written on them.
    pub sessions: (usize, u64),
    /// Members caught answering against the code (reported to every holder).
    pub caught: Vec<String>,
    /// Next-token loss of the request before learning from it.
    pub loss: Option<f64>,
    /// The learning update handed out, if one was due: id, bytes and holders that took it.
    pub update: Option<String>,
}

/// The model as a leader needs it, fetched once per page.
#[derive(Debug)]
pub(crate) struct LeaderModel {
    manifest: ModelManifest,
    tokenizer: Tokenizer,
}

/// What a page's leader keeps between requests.
#[derive(Debug, Default)]
pub(crate) struct Lead {
    model: Option<Rc<LeaderModel>>,
}

fn mesh_err(e: impl std::fmt::Display) -> WebError {
    WebError::Mesh(e.to_string())
}

impl BrowserNode {
    /// Leads `prompt` on the mesh from this page: forms a coded group over the live rows,
    /// generates (each piece of text goes to `on_text` as it completes), and hands the text the
    /// user sent to the page's native node to teach: a page is not admitted to write the
    /// model, so the node's trainer trains on it under its budget and gate.
    pub async fn generate(
        &self,
        prompt: &Prompt,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Completion, WebError> {
        let began = Instant::now();
        let model = self.leader_model().await?;
        let (manifest, tokenizer) = (&model.manifest, &model.tokenizer);
        let text = match prompt.chat {
            true => tokenizer.chat_prompt(&[ChatMessage {
                role: "user".into(),
                content: prompt.text.clone(),
            }]),
            false => prompt.text.clone(),
        };
        let ids = tokenizer.encode(&text).map_err(mesh_err)?;
        if ids.is_empty() {
            return Err(WebError::Mesh("the prompt encodes to no tokens".into()));
        }
        let opts = GroupOptions {
            // A page forms a group per request: fetching updates to probe with would cost
            // more than the request.
            probe: false,
            ..GroupOptions::new(prompt.check, SPARES)
        };
        let mut lead = PageLead::new(self, manifest, opts);
        node_core::lead::ready(&mut lead).await.map_err(mesh_err)?;
        if let Some(f) = &lead.formed {
            tracing::info!(group = ?f.group.nodes(), "leading a request from the page");
        }

        let opts = GenerateOptions {
            max_tokens: prompt.max_tokens,
            sampling: SamplingParams {
                temperature: prompt.temperature,
                top_p: 1.0,
                seed: (js_sys::Math::random() * u32::MAX as f64) as u64,
                ..SamplingParams::default()
            },
            stop_ids: tokenizer.eos_ids().to_vec(),
            draft: node_core::model::speculate::DEFAULT_DRAFT,
        };
        let mut stream = tokenizer.stream();
        let mut text = String::new();
        let out = generate_regrouping(&mut lead, &ids, &opts, &mut |id| {
            if let Some(piece) = stream.push(id) {
                on_text(&piece);
                text.push_str(&piece);
            }
            true
        })
        .await;
        let caught = lead.report().await;
        let out = out.map_err(mesh_err)?;
        let Some(Formed {
            group, live_rows, ..
        }) = lead.formed
        else {
            return Err(mesh_err("the group went with the request's last pass"));
        };
        let members = group.nodes().to_vec();

        let update = match prompt.learn && manifest.learning.enabled && ids.len() >= 2 {
            true => Some(self.teach(manifest, &ids).await),
            false => None,
        };
        let usage = Usage::of_request(out.prompt_tokens, out.tokens.len(), began.elapsed(), None);
        if let Err(e) = self.ask_bootstrap(MeshRequest::Served(usage)).await {
            tracing::warn!("the request was not counted in the mesh's usage: {e}");
        }
        let stats = group.stats();
        Ok(Completion {
            text,
            prompt_tokens: out.prompt_tokens,
            tokens: out.tokens.len(),
            stop: format!("{:?}", out.stop),
            group: members,
            live_rows,
            prefill_tokens_per_s: out.prefill_tokens_per_s(),
            decode_tokens_per_s: out.decode_tokens_per_s(),
            rounds: stats.rounds,
            checked_rounds: stats.verified_rounds,
            unchecked_rounds: stats.unverified_rounds,
            sessions: group.transport().asks.counts(),
            caught,
            loss: None,
            update,
        })
    }

    /// The manifest and tokenizer, fetched from the native node once.
    async fn leader_model(&self) -> Result<Rc<LeaderModel>, WebError> {
        if let Some(m) = self.lead.borrow().model.clone() {
            return Ok(m);
        }
        let MeshResponse::Manifest(bytes) = self.ask_bootstrap(MeshRequest::Manifest).await? else {
            return Err(mesh_err("asked for the manifest, got something else"));
        };
        let manifest = ModelManifest::from_bytes(&bytes).map_err(mesh_err)?;
        let tokenizer = Tokenizer::from_data(&manifest.tokenizer).map_err(mesh_err)?;
        let model = Rc::new(LeaderModel {
            manifest,
            tokenizer,
        });
        self.lead.borrow_mut().model = Some(model.clone());
        Ok(model)
    }

    /// Hands the text of the user's request (its last positions a trainer takes) to the
    /// page's native node, whose trainer trains on it: what became of it, for the page.
    async fn teach(&self, manifest: &ModelManifest, prompt: &[u32]) -> String {
        let window = node_core::learn::training_window(&manifest.learning, &manifest.cfg);
        let tokens = node_core::learn::taught(prompt, window).to_vec();
        let n = tokens.len();
        match self.ask_bootstrap(MeshRequest::Teach(tokens)).await {
            Ok(MeshResponse::Taught) => {
                format!("taught: {n} tokens went to the native node's trainer")
            }
            Ok(MeshResponse::Error(e)) => format!("not taught: {e}"),
            Ok(_) => "not taught: the native node answered something else".into(),
            Err(e) => format!("not taught: {e}"),
        }
    }
}

/// The prompt box's leader for one request: its group, formed (again) over the mesh's view from
/// the native node the page joined through, as every leader's [`Steer`] rules.
struct PageLead<'a> {
    node: &'a BrowserNode,
    manifest: &'a ModelManifest,
    opts: GroupOptions,
    leader: Leader<()>,
    formed: Option<Formed<WebTransport>>,
    /// What the groups it let go caught, reported.
    caught: Vec<String>,
}

impl<'a> PageLead<'a> {
    fn new(node: &'a BrowserNode, manifest: &'a ModelManifest, opts: GroupOptions) -> Self {
        let (cfg, k) = (&manifest.cfg, manifest.generator.k());
        let limits = node_core::lead::one_at_a_time(cfg);
        let leader = Leader::new(cfg, limits, k, opts.verify, opts.spares);
        Self {
            node,
            manifest,
            opts,
            leader,
            formed: None,
            caught: Vec::new(),
        }
    }

    /// The mesh's view from the native node.
    async fn info(&self) -> Result<node_core::mesh::MeshInfo, WebError> {
        match self.node.ask_bootstrap(MeshRequest::Info).await? {
            MeshResponse::Info(info) => Ok(info),
            _ => Err(mesh_err("asked for the mesh's view, got something else")),
        }
    }

    /// Reports what the group caught (once: when it goes, or at the request's end) to every
    /// holder (a page is not admitted to report, so
    /// holders act on it only with their own evidence); what it caught, for the page.
    async fn report(&mut self) -> Vec<String> {
        if let Some(f) = &mut self.formed {
            let signer = node_core::lead::Signer::unadmitted(self.node.key.clone());
            let now = node_core::holder::wall_ms();
            let caught = &f.group.stats().caught;
            let reported = node_core::lead::report_caught(
                self.node, &signer, now, caught, &f.rows, &f.holders,
            )
            .await;
            let rows = reported.caught.iter();
            self.caught
                .extend(rows.map(|(row, _, c)| format!("row {row}: {c}")));
        }
        self.caught.clone()
    }
}

/// The page's leader as its rules drive it.
impl LeadShell<()> for PageLead<'_> {
    fn leader(&mut self) -> &mut Leader<()> {
        &mut self.leader
    }

    fn rows(&self) -> Vec<usize> {
        (self.formed.as_ref()).map_or_else(Vec::new, |f| f.group.nodes().to_vec())
    }

    async fn wait_until(&mut self, until: Instant) {
        futures_timer::Delay::new(until.saturating_duration_since(Instant::now())).await
    }

    /// Forms a group from the mesh's view now, after reporting what the one it lets go caught.
    async fn form(&mut self, checks: usize) -> Result<bool, String> {
        self.report().await;
        self.formed = None;
        let info = self.info().await.map_err(|e| e.to_string())?;
        let mut opts = self.opts.clone();
        opts.verify = checks;
        let formed = node_core::lead::form(self.node, self.manifest, &info, &opts).await;
        self.formed = Some(formed.map_err(|e| mesh_err(e).to_string())?);
        // A page's members are reached through its swarm; its passes go over rounds.
        Ok(false)
    }

    async fn look(&mut self, looking: &Looking) -> Option<usize> {
        let f = self.formed.as_ref()?;
        let (version, left) = (f.version, f.left(&looking.rows));
        let info = self.info().await.ok()?;
        looking.in_view(&info, &version, &BTreeSet::<PeerId>::new(), &left)
    }

    fn regroup(&mut self, row: usize, _: &Looking) {
        tracing::info!(row, "a row came back: forming the group again");
    }

    async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        let Some(f) = self.formed.as_mut() else {
            return Err(ModelError::NoGroup("no group".into()));
        };
        let mut items = self.leader.batch_mut().rounds_items();
        f.llama.forward_batch(&mut f.group, &mut items).await
    }

    fn measured(&mut self) -> Option<Measured> {
        let unlocated = self.formed.as_ref()?.group.stats().unlocated > 0;
        Some(Measured {
            unlocated,
            ..Measured::default()
        })
    }

    fn failed(&mut self, why: &ModelError) -> Option<Failure> {
        // The failed pass's last round: whether a member was at another version.
        let moved = (self.formed.as_ref()).is_some_and(|f| f.group.transport().notes().stale);
        if moved {
            tracing::info!("members are at another version (the mesh moved on): forming again");
        } else {
            tracing::warn!("a pass failed ({why}): forming the group again");
        }
        Some(Failure { moved, hop: false })
    }
}

/// The page's networking for the leader's role written once in node-core.
impl LeadLink for BrowserNode {
    type Net = WebTransport;

    fn own_row(&self) -> Option<OwnRow> {
        // A node cannot ask itself: the page's own row is left to its other holders.
        Some(OwnRow {
            peer: self.key.public().to_peer_id(),
            norms: None,
        })
    }

    async fn reach(&self, peer: PeerId, addrs: &[String]) -> Result<Vec<Multiaddr>, HolderError> {
        // WebSocket only (a browser holder's is its relayed one): request-response spreads
        // requests over a peer's connections, and WebRTC-direct's buffers are small.
        let addrs: Vec<Multiaddr> = BrowserBootstrap::from_addrs(peer.to_string(), addrs)
            .addrs
            .into_iter()
            .filter(|a| !a.contains("/webrtc-direct/"))
            .filter_map(|a| a.parse().ok())
            .collect();
        self.send(Command::AddAddrs {
            peer,
            addrs: addrs.clone(),
        })
        .await
        .map_err(|e| HolderError::Link(format!("{peer}: {e}")))?;
        Ok(addrs)
    }

    fn transport(
        &self,
        version: [u8; 32],
        rows: &BTreeMap<usize, PeerId>,
        members: &[usize],
        generator: &Generator,
        round: RoundConfig,
    ) -> WebTransport {
        let asks = WebAsks::new(self.streams.clone(), version, rows.clone());
        Rounds::new(
            asks,
            generator.clone(),
            rows.keys().copied(),
            members,
            round,
        )
    }
}

/// Coded steps from the page: each round goes to every member on its session, a long-lived
/// stream opened when the group forms ([`node_core::net::session`]), as a native leader's do;
/// the first answers win, failed members are replaced from the free rows, stragglers outrun
/// ([`node_core::mesh::rounds`]).
pub type WebTransport = Rounds<WebAsks>;

/// The sessions a [`WebTransport`]'s rounds ask through ([`node_core::net::asks`]), with the
/// page's timer.
#[derive(Debug)]
pub struct WebAsks(WebSessions);

/// The page's sessions with its group's members.
type WebSessions = SessionAsks<libp2p::Stream, Opening, (), Box<dyn FnMut(PeerId) -> Opening>>;

/// A session's stream being opened.
type Opening = LocalBoxFuture<'static, Result<(libp2p::Stream, ()), String>>;

impl WebAsks {
    /// The transport's asks to the holders of `peers` (row → peer), opening sessions through
    /// `streams` as rows are first asked.
    fn new(
        streams: libp2p_stream::Control,
        version: [u8; 32],
        peers: BTreeMap<usize, PeerId>,
    ) -> Self {
        let open = move |peer: PeerId| -> Opening {
            let mut control = streams.clone();
            async move {
                let opened = session::open_accepted(&mut control, peer, session::protocol(), |d| {
                    futures_timer::Delay::new(d)
                })
                .await;
                opened.map(|s| (s, ())).map_err(|e| format!("{peer}: {e}"))
            }
            .boxed_local()
        };
        Self(SessionAsks::new(version, peers, Box::new(open)))
    }

    /// Sessions opened, and asks handed to them.
    pub fn counts(&self) -> (usize, u64) {
        self.0.counts()
    }
}

impl Asks for WebAsks {
    fn version(&self) -> [u8; 32] {
        self.0.version()
    }

    fn ask(&mut self, round: u64, asks: &[(usize, &[u8])]) {
        for &(row, request) in asks {
            self.0.ask(round, row, request.to_vec());
        }
    }

    async fn next(&mut self, until: Instant) -> Option<MemberAnswer> {
        let mut timer = futures_timer::Delay::new(until.saturating_duration_since(Instant::now()));
        futures::future::poll_fn(|cx| {
            if let Some(answer) = self.0.poll_answer(cx, Instant::now()) {
                return Poll::Ready(Some(answer));
            }
            match timer.poll_unpin(cx) {
                Poll::Ready(()) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    fn try_next(&mut self) -> Option<MemberAnswer> {
        self.0.try_answer()
    }
}
