//! How a row holder answers its peers, written once for the native node, the browser node and
//! the simulation: [`route`] decides what a request means and answers what it can at once;
//! the shell runs the rest (a coded step, an update, its part in a chain, a piece of its shard)
//! with the executors here, where its own threads or tasks allow.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;

use web_time::{Duration, Instant};

use super::{Link, ShardState, answer_chain, chunk_of, shard_to_blob};
use crate::chain::{ChainError, ChainPart, Running, Turn};
use crate::code::Generator;
use crate::mesh::{MAX_CHUNK_BYTES, MeshRequest, MeshResponse, MeshView, ShardVersion, Usage};
use crate::model::LlamaConfig;
use crate::protocol::{self, StepRequest};

/// Updates one peer may hand over per minute.
pub const LEARN_PER_MINUTE: usize = 120;

/// Most peers whose hand-overs a holder counts within a minute; past that, a new peer's is
/// refused until the minute's oldest ages out.
pub const LIMITED_PEERS: usize = 4096;

/// What a holder must do to answer a request.
#[derive(Debug)]
pub enum Route<P> {
    /// Send this answer.
    Answer(MeshResponse),
    /// A question about the mesh, answered from the node's view ([`answer_view`]).
    View(ViewQuery),
    /// Compute a coded step ([`step`] or [`step_async`]): the version is checked with the same
    /// read of the shard that computes it.
    Step {
        /// The version the leader's group decodes at.
        version: [u8; 32],
        /// The step.
        request: StepRequest,
    },
    /// Check, keep and apply a learning update, then send its receipt ([`receipt`]).
    Learn(Vec<u8>),
    /// Take part in a chain ([`chain`]).
    Chain(ChainPart),
    /// Pull an update that is spreading and pass its notice on ([`super::spread`]); the
    /// notice is checked.
    Spread(super::Opened<P>),
    /// Send a piece of this row's shard blob at its current version ([`Snapshot::piece`]).
    ShardPiece {
        /// First byte.
        offset: u64,
        /// Bytes wanted (already at most [`MAX_CHUNK_BYTES`]).
        len: u32,
    },
    /// Hand text to this node's trainer (token ids, checked against the model), if it trains.
    Teach(Vec<u32>),
    /// Send a piece of a kept update's payload.
    UpdatePiece {
        /// The update.
        id: u64,
        /// First byte.
        offset: u64,
        /// Bytes wanted (already at most [`MAX_CHUNK_BYTES`]).
        len: u32,
    },
}

/// A request about the mesh rather than the row.
#[derive(Debug)]
pub enum ViewQuery {
    /// The node's view of the mesh.
    Info,
    /// A row for the asking node, which measured these round trips (at most
    /// [`crate::mesh::regions::MAX_SAMPLES`]).
    Join(Vec<(String, Duration)>),
    /// A leader the mesh admits to report caught a holder answering against the code.
    Report {
        /// The report, checked ([`super::open_report`]).
        report: Box<super::Report>,
        /// Its signed bytes, to pass on.
        bytes: Vec<u8>,
        /// Holders to pass the report on to, as sent ([`ViewQuery::onward`]).
        to: Vec<String>,
    },
    /// A leader finished a request.
    Served(Usage),
}

impl ViewQuery {
    /// A report to pass on after answering this query: its signed bytes and the holders to
    /// tell.
    pub fn onward(&self) -> Option<(Vec<u8>, Vec<String>)> {
        match self {
            ViewQuery::Report { bytes, to, .. } if !to.is_empty() => {
                Some((bytes.clone(), to.clone()))
            }
            _ => None,
        }
    }
}

/// The row a holder answers for, as its shell keeps it.
#[derive(Debug)]
pub struct Held<'a> {
    /// The row it announces.
    pub row: u32,
    /// Its shard now.
    pub state: &'a ShardState,
    /// The mesh's manifest, serialized.
    pub manifest: &'a [u8],
    /// Genesis blobs this node still hands out (the seeding node only), by row.
    pub genesis: &'a BTreeMap<u32, Arc<Vec<u8>>>,
    /// What updates and reports must satisfy on this mesh.
    pub rules: &'a super::Rules,
    /// The node's wall clock, in unix milliseconds (certificates expire, updates and reports
    /// go out of turn).
    pub wall_ms: u64,
    /// Live holders in the node's view: how many peers a notice or a report may name.
    pub live: usize,
}

/// How many updates each peer handed over in the last minute.
#[derive(Debug)]
pub struct LearnLimit<P> {
    times: HashMap<P, VecDeque<Instant>>,
}

impl<P> Default for LearnLimit<P> {
    fn default() -> Self {
        Self {
            times: HashMap::new(),
        }
    }
}

impl<P: Hash + Eq + Clone> LearnLimit<P> {
    /// Counts a hand-over from `peer`: false past [`LEARN_PER_MINUTE`], or when
    /// [`LIMITED_PEERS`] other peers handed something over within the minute (PeerIds are
    /// free: the count of them is bounded too).
    pub fn allow(&mut self, peer: &P, now: Instant) -> bool {
        let minute = Duration::from_secs(60);
        if !self.times.contains_key(peer) && self.times.len() >= LIMITED_PEERS {
            self.times
                .retain(|_, t| t.back().is_some_and(|b| now.duration_since(*b) <= minute));
            if self.times.len() >= LIMITED_PEERS {
                return false;
            }
        }
        let times = self.times.entry(peer.clone()).or_default();
        while times
            .front()
            .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60))
        {
            times.pop_front();
        }
        if times.len() >= LEARN_PER_MINUTE {
            return false;
        }
        times.push_back(now);
        true
    }
}

/// Whether `tokens` can be taught to a model of `cfg`: at least two, at most its context, each
/// in its vocabulary.
fn teachable(tokens: &[u32], cfg: &LlamaConfig) -> Result<(), String> {
    if tokens.len() < 2 || tokens.len() > cfg.max_seq {
        return Err(format!(
            "text of {} tokens to teach: 2 to {} are taught",
            tokens.len(),
            cfg.max_seq
        ));
    }
    match tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
        Some(t) => Err(format!("token {t} outside the vocabulary of {}", cfg.vocab)),
        None => Ok(()),
    }
}

/// Decides what `request` from `peer` means for the row `held`, answering at once what needs
/// no work.
pub fn route<P: Hash + Eq + Clone + std::str::FromStr>(
    held: &Held<'_>,
    limit: &mut LearnLimit<P>,
    peer: &P,
    now: Instant,
    request: MeshRequest,
) -> Route<P> {
    let answer = Route::Answer;
    let error = |e: String| Route::Answer(MeshResponse::Error(e));
    match request {
        MeshRequest::Info => Route::View(ViewQuery::Info),
        MeshRequest::Join => Route::View(ViewQuery::Join(Vec::new())),
        MeshRequest::JoinNear { peers, rtt_us } => {
            let samples = peers
                .iter()
                .zip(rtt_us)
                .take(crate::mesh::regions::MAX_SAMPLES)
                .map(|(p, us)| (p.clone(), Duration::from_micros(us.into())))
                .collect();
            Route::View(ViewQuery::Join(samples))
        }
        MeshRequest::Report { .. } if !limit.allow(peer, now) => error(format!(
            "rate limit: at most {LEARN_PER_MINUTE} updates and reports a minute from one peer"
        )),
        MeshRequest::Report { to, .. } if to.len() > super::spread::named_bound(held.live) => {
            error(format!(
                "a report naming {} holders, over the {} this node knows",
                to.len(),
                super::spread::named_bound(held.live)
            ))
        }
        MeshRequest::Report { report, to } => {
            match super::open_report(&report, held.rules, held.wall_ms) {
                Ok(r) => Route::View(ViewQuery::Report {
                    report: Box::new(r),
                    bytes: report,
                    to,
                }),
                Err(e) => error(e.to_string()),
            }
        }
        MeshRequest::Teach(_) if !limit.allow(peer, now) => error(format!(
            "rate limit: at most {LEARN_PER_MINUTE} texts to teach a minute from one peer"
        )),
        MeshRequest::Teach(tokens) => match teachable(&tokens, &held.rules.cfg) {
            Ok(()) => Route::Teach(tokens),
            Err(e) => error(e),
        },
        MeshRequest::Served(usage) => Route::View(ViewQuery::Served(usage)),
        MeshRequest::Manifest => answer(MeshResponse::Manifest(held.manifest.to_vec())),
        MeshRequest::Norms => answer(MeshResponse::Norms {
            version: held.state.version.digest(),
            norms: held.state.norms.clone(),
        }),
        MeshRequest::Versions => answer(MeshResponse::Versions(held.state.version.clone())),
        MeshRequest::Chunk { row, offset, len } => {
            let len = len.min(MAX_CHUNK_BYTES);
            match held.genesis.get(&row) {
                Some(blob) => answer(chunk_of(
                    blob,
                    ShardVersion::default().digest(),
                    offset,
                    len,
                )),
                None if row == held.row => Route::ShardPiece { offset, len },
                None => error(format!("this node does not hold row {row}")),
            }
        }
        MeshRequest::UpdateChunk { id, offset, len } => {
            if held.state.version.keeps(id) {
                let len = len.min(MAX_CHUNK_BYTES);
                Route::UpdatePiece { id, offset, len }
            } else if held.state.version.contains(id) {
                error(format!(
                    "update {id:016x} is folded into this node's snapshot: its payload is no longer kept"
                ))
            } else {
                error(format!("update {id:016x} is not applied here"))
            }
        }
        MeshRequest::Learn(_) if !limit.allow(peer, now) => error(format!(
            "rate limit: at most {LEARN_PER_MINUTE} updates a minute from one peer"
        )),
        MeshRequest::Learn(bytes) => Route::Learn(bytes),
        MeshRequest::Spread(_) if !limit.allow(peer, now) => error(format!(
            "rate limit: at most {LEARN_PER_MINUTE} updates a minute from one peer"
        )),
        MeshRequest::Spread(notice) => match notice.open(
            held.rules,
            held.wall_ms,
            super::spread::named_bound(held.live),
        ) {
            Ok(opened) => Route::Spread(opened),
            Err(e) => error(format!("an update's notice: {e}")),
        },
        MeshRequest::Step { version, bytes } => match protocol::decode::<StepRequest>(&bytes) {
            Ok(request) => Route::Step { version, request },
            Err(e) => error(format!("a step request: {e}")),
        },
        MeshRequest::Chain(part) => Route::Chain(part),
    }
}

/// Answers a question about the mesh from `view`; `peer` asked it.
pub fn answer_view<P>(
    view: &mut MeshView<P>,
    peer: &P,
    query: ViewQuery,
    now: Instant,
) -> MeshResponse
where
    P: Clone + Ord + std::fmt::Display + std::str::FromStr,
    P::Err: std::fmt::Display,
{
    match query {
        ViewQuery::Info => MeshResponse::Info(view.info(now)),
        ViewQuery::Join(samples) => {
            let samples: Vec<(P, Duration)> = (samples.into_iter())
                .filter_map(|(p, rtt)| Some((p.parse().ok()?, rtt)))
                .collect();
            let offer = view.offer_row_near(now, peer.clone(), &samples);
            tracing::info!(%peer, ?offer, measured = samples.len(), "join");
            MeshResponse::Join(offer)
        }
        ViewQuery::Report { report, .. } => {
            let text = format!(
                "{}; reported by {} ({}), whom the mesh admits to report",
                report.evidence, report.reporter, report.name
            );
            match report.accused.to_string().parse::<P>() {
                Ok(p) => {
                    if p == *view.me() {
                        tracing::warn!("this node was caught answering against the code: {text}");
                    }
                    tracing::info!(%peer, "a report: {text}");
                    view.report_caught(p, text);
                    MeshResponse::Reported
                }
                Err(e) => MeshResponse::Error(format!("peer id {}: {e}", report.accused)),
            }
        }
        ViewQuery::Served(usage) => {
            // Counts for the dashboards only: nothing is decided on them.
            view.add_usage(&usage);
            MeshResponse::Reported
        }
    }
}

/// A coded step on `state` at the leader's `version`; the answer carries the compute time.
pub fn step(state: &ShardState, version: &[u8; 32], request: &StepRequest) -> MeshResponse {
    let started = Instant::now();
    if let Some(stale) = state.stale(version) {
        return stale;
    }
    let answer = state.member.handle(request);
    step_answer(&answer, started)
}

/// [`step`] for callers that cannot block (the browser, on WebGPU).
pub async fn step_async(
    state: &ShardState,
    version: &[u8; 32],
    request: &StepRequest,
) -> MeshResponse {
    let started = Instant::now();
    if let Some(stale) = state.stale(version) {
        return stale;
    }
    let answer = state.member.handle_async(request).await;
    step_answer(&answer, started)
}

fn step_answer(answer: &protocol::StepResponse, started: Instant) -> MeshResponse {
    let compute_us = started.elapsed().as_micros() as u64;
    match protocol::encode(answer) {
        Ok(bytes) => MeshResponse::Step { bytes, compute_us },
        Err(e) => MeshResponse::Error(e.to_string()),
    }
}

/// The receipt of a learning update: its id and the shard's update count after it, or why it
/// was refused.
pub fn receipt(
    applied: Result<u64, impl std::fmt::Display>,
    version: &ShardVersion,
) -> MeshResponse {
    match applied {
        Ok(id) => MeshResponse::Learned {
            id,
            version_count: version.count(),
        },
        Err(e) => MeshResponse::Error(e.to_string()),
    }
}

/// This holder's turn in a chain: the running sum of the sources before it (asked through
/// `link`), plus its own term, which `contribute` adds (where the shell lets heavy work run).
pub async fn chain<L, F, Fut>(
    link: &L,
    part: ChainPart,
    g: &Generator,
    cfg: &LlamaConfig,
    contribute: F,
) -> MeshResponse
where
    L: Link,
    F: FnOnce(ChainPart, Option<Running>) -> Fut,
    Fut: Future<Output = Result<Turn, ChainError>>,
{
    let before = match answer_chain(link, &part, g, cfg).await {
        Ok(before) => before,
        Err(e) => return MeshResponse::Error(e.to_string()),
    };
    match contribute(part, before).await {
        Ok(turn) => turn.into(),
        Err(e) => MeshResponse::Error(e.to_string()),
    }
}

/// Adds the term of the row `state` holds to a chain's running sum (the last source of a
/// compact chain finishes the piece).
pub fn contribute(
    state: &ShardState,
    part: &ChainPart,
    before: Option<Running>,
) -> Result<Turn, ChainError> {
    part.contribute(state.member.shards(), &state.version.digest(), before)
}

/// The row's shard as a blob at one version, made when a peer starts downloading it and kept
/// while the row stays at that version.
#[derive(Debug, Default)]
pub struct Snapshot {
    at: Option<([u8; 32], Arc<Vec<u8>>)>,
}

impl Snapshot {
    /// A piece of the blob of `state`'s shard at its current version.
    pub fn piece(&mut self, state: &ShardState, offset: u64, len: u32) -> MeshResponse {
        let digest = state.version.digest();
        let fresh = self.at.as_ref().is_some_and(|(d, _)| *d == digest);
        if !fresh {
            if offset != 0 {
                return MeshResponse::Error(
                    "the shard changed version during the transfer; start again".into(),
                );
            }
            match shard_to_blob(state.member.shards()) {
                Ok(blob) => self.at = Some((digest, Arc::new(blob))),
                Err(e) => return MeshResponse::Error(e.to_string()),
            }
        }
        match &self.at {
            Some((d, blob)) => chunk_of(blob, *d, offset, len),
            None => MeshResponse::Error("no snapshot".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::coded::{Member, ShardSet};
    use crate::holder::Download;

    fn state() -> ShardState {
        let cfg = crate::model::LlamaConfig::small();
        let w = crate::model::ModelWeights::synthetic(cfg, 1).unwrap();
        let g = crate::code::Generator::cauchy(5, 3).unwrap();
        let shard = ShardSet::encode(&w, &g, 1, Default::default(), &mut |_, _| {}).unwrap();
        ShardState {
            member: Member::new(shard),
            version: ShardVersion::default(),
            norms: crate::model::LeaderWeights::from_model(&w),
            skip_updates: 0,
        }
    }

    fn error_of(r: Route<u32>) -> String {
        match r {
            Route::Answer(MeshResponse::Error(e)) => e,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn requests_are_routed_by_what_they_need() {
        let s = state();
        let genesis = BTreeMap::from([(4u32, Arc::new(vec![9u8; 10]))]);
        let rules = super::super::Rules::of_test();
        let held = Held {
            row: 1,
            state: &s,
            manifest: b"manifest",
            genesis: &genesis,
            rules: &rules,
            wall_ms: 0,
            live: 4,
        };
        let mut limit = LearnLimit::default();
        let now = Instant::now();
        let mut go = |r| route(&held, &mut limit, &7u32, now, r);
        assert!(matches!(
            go(MeshRequest::Manifest),
            Route::Answer(MeshResponse::Manifest(m)) if m == b"manifest"
        ));
        let own = go(MeshRequest::Chunk {
            row: 1,
            offset: 3,
            len: u32::MAX,
        });
        assert!(
            matches!(own, Route::ShardPiece { offset: 3, len } if len == MAX_CHUNK_BYTES),
            "{own:?}"
        );
        let given = go(MeshRequest::Chunk {
            row: 4,
            offset: 8,
            len: 100,
        });
        assert!(
            matches!(given, Route::Answer(MeshResponse::Chunk { total: 10, ref bytes, .. }) if bytes.len() == 2),
            "{given:?}"
        );
        let e = error_of(go(MeshRequest::Chunk {
            row: 2,
            offset: 0,
            len: 1,
        }));
        assert!(e.contains("does not hold row 2"), "{e}");
        let e = error_of(go(MeshRequest::UpdateChunk {
            id: 5,
            offset: 0,
            len: 1,
        }));
        assert!(e.contains("not applied here"), "{e}");
        let e = error_of(go(MeshRequest::Step {
            version: [0; 32],
            bytes: vec![0xff; 3],
        }));
        assert!(e.contains("a step request"), "{e}");
        assert!(matches!(
            go(MeshRequest::Join),
            Route::View(ViewQuery::Join(s)) if s.is_empty()
        ));
        // A joiner's round trips: at most MAX_SAMPLES kept, a bad peer id dropped.
        let mut peers = vec!["not a peer".to_string()];
        peers.extend((0..20).map(|i: u32| i.to_string()));
        let rtt_us = vec![1_000; peers.len()];
        match go(MeshRequest::JoinNear { peers, rtt_us }) {
            Route::View(ViewQuery::Join(s)) => {
                assert_eq!(s.len(), crate::mesh::regions::MAX_SAMPLES);
                assert_eq!(s[0].0, "not a peer", "parsed where the view answers");
                assert!(s.iter().all(|(_, rtt)| *rtt == Duration::from_millis(1)));
            }
            _ => panic!("a join with round trips is a join"),
        }
        // Text to teach: within the context and the vocabulary.
        assert!(matches!(
            go(MeshRequest::Teach(vec![1, 2, 3])),
            Route::Teach(_)
        ));
        let e = error_of(go(MeshRequest::Teach(vec![1, u32::MAX])));
        assert!(e.contains("outside the vocabulary"), "{e}");
        let e = error_of(go(MeshRequest::Teach(vec![1; 100_000])));
        assert!(e.contains("to teach"), "{e}");
        // A report by a peer the mesh does not admit changes nothing.
        let stranger =
            crate::learn::Signer::unadmitted(libp2p::identity::Keypair::generate_ed25519());
        let accused = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let evidence = crate::coded::Caught {
            node: 2,
            step: "lm head".into(),
            residual: 1.0,
            threshold: 0.1,
            witnesses: vec![0, 1],
            missing_update: None,
        };
        let report = super::super::sign_report(&stranger, accused, &evidence, 0).unwrap();
        let e = error_of(go(MeshRequest::Report {
            report: report.clone(),
            to: Vec::new(),
        }));
        assert!(e.contains("report"), "{e}");
        let e = error_of(go(MeshRequest::Report {
            report,
            to: vec!["x".into(); 100_000],
        }));
        assert!(e.contains("naming 100000 holders"), "{e}");
    }

    #[test]
    fn a_peer_handing_over_too_many_updates_is_refused_for_a_minute() {
        let s = state();
        let genesis = BTreeMap::new();
        let rules = super::super::Rules::of_test();
        let held = Held {
            row: 1,
            state: &s,
            manifest: &[],
            genesis: &genesis,
            rules: &rules,
            wall_ms: 0,
            live: 4,
        };
        let mut limit = LearnLimit::default();
        let t0 = Instant::now();
        for _ in 0..LEARN_PER_MINUTE {
            let r = route(&held, &mut limit, &1u32, t0, MeshRequest::Learn(vec![1]));
            assert!(matches!(r, Route::Learn(_)));
        }
        let e = error_of(route(
            &held,
            &mut limit,
            &1u32,
            t0,
            MeshRequest::Learn(vec![1]),
        ));
        assert!(e.contains("rate limit"), "{e}");
        // Another peer is not held back; the first is again a minute later.
        let r = route(&held, &mut limit, &2u32, t0, MeshRequest::Learn(vec![1]));
        assert!(matches!(r, Route::Learn(_)));
        let later = t0 + Duration::from_secs(61);
        let r = route(&held, &mut limit, &1u32, later, MeshRequest::Learn(vec![1]));
        assert!(matches!(r, Route::Learn(_)));
        // Fresh peer ids are free, but only so many are counted a minute.
        let mut limit = LearnLimit::default();
        for p in 0..LIMITED_PEERS as u32 {
            assert!(limit.allow(&p, t0));
        }
        assert!(
            !limit.allow(&u32::MAX, t0),
            "one peer too many within the minute"
        );
        assert!(limit.allow(&u32::MAX, later), "the minute's peers aged out");
    }

    #[test]
    fn a_step_is_computed_only_at_the_leaders_version_and_a_snapshot_downloads_whole() {
        let s = state();
        let at = s.version.digest();
        let cfg = &s.member.shards().cfg;
        let request = StepRequest::Matmul {
            stage: crate::model::Stage::Qkv(0),
            t: 1,
            x: vec![0.5; cfg.hidden],
        };
        assert!(matches!(step(&s, &at, &request), MeshResponse::Step { .. }));
        match step(&s, &[1; 32], &request) {
            MeshResponse::Stale {
                have,
                updates,
                want,
            } => {
                assert_eq!((have, updates, want), (at, s.version.count(), [1; 32]));
            }
            other => panic!("{other:?}"),
        }
        let mut snap = Snapshot::default();
        let mut d = Download::new(u64::MAX);
        while !d.accept(snap.piece(&s, d.offset(), 1 << 12)).unwrap() {}
        let (blob, version) = d.finish();
        assert_eq!(version, at);
        assert_eq!(blob, shard_to_blob(s.member.shards()).unwrap());
        match snap.piece(&s, 0, 10) {
            MeshResponse::Chunk { bytes, .. } => assert_eq!(bytes, blob[..10]),
            other => panic!("{other:?}"),
        }
    }
}
