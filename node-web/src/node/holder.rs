//! "Contribute this GPU": the browser node takes a row of the code, keeps its shard in
//! IndexedDB, and answers peers' requests for it (coded steps on WebGPU, the wasm CPU path
//! where there is none).

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use libp2p::PeerId;
use node_core::chain::ChainPart;
use node_core::coded::{Member, ShardSet};
use node_core::compute::gpu::Gpu;
use node_core::holder::{
    self, Held, HolderError, Joined, LearnLimit, Link, Route, Rules, ShardState, chunk_of,
};
use node_core::mesh::{
    BrowserBootstrap, CatchUp, MeshRequest, MeshResponse, ModelManifest, ShardVersion, SourceRow,
    hex,
};
use node_core::model::LeaderWeights;
use node_core::protocol::{self, StepRequest};
use serde::{Deserialize, Serialize};

use super::{BrowserNode, WebError};
use crate::store::ShardStore;

/// What the browser node does for the mesh.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Contribution {
    /// It only watches.
    Watching,
    /// It is obtaining a row: `done` of `total` (0 when unknown) of the current part.
    Preparing {
        /// What it is doing.
        what: String,
        /// Progress.
        done: u64,
        /// The total, when known.
        total: u64,
    },
    /// It holds a row and serves it.
    Serving {
        /// The row.
        row: u32,
        /// Where it computes: "browser WebGPU: adapter" or "browser wasm cpu".
        device: String,
        /// Where the shard came from.
        source: String,
        /// Coded steps answered.
        steps: u64,
        /// Of those, products computed on WebGPU.
        gpu_steps: u64,
        /// Their mean compute time, in milliseconds.
        step_ms: f64,
        /// Learning updates applied to the shard.
        version_count: u64,
        /// Bytes of the row kept in this browser's storage (0 when it keeps none).
        stored_bytes: u64,
    },
    /// Obtaining a row failed.
    Failed {
        /// Why.
        reason: String,
    },
}

/// Tokens of the prompt-sized product run once before serving, to compile the kernels.
const WARM_UP_TOKENS: u32 = 32;

/// What the page says while the shard goes to the GPU.
const GPU_STEP: &str = "opening WebGPU and compiling its kernels";

/// What is kept beside the shard blob in IndexedDB: the blob is the row's snapshot.
#[derive(Debug, Serialize, Deserialize)]
struct StoredRow {
    row: u32,
    /// The updates inside the blob (all folded).
    version: ShardVersion,
    /// The norm gains at that version.
    norms: LeaderWeights,
}

/// What a catch-up with a peer brought.
#[derive(Debug)]
pub(crate) enum CaughtUp {
    /// The payloads of the updates the peer keeps and this node lacks, in order.
    Updates(Vec<Vec<u8>>),
    /// The peer folded updates this node lacks: the row must be rebuilt at this version.
    Behind([u8; 32]),
}

/// A row this node holds and serves.
pub(crate) struct Holding {
    pub(crate) manifest_bytes: Rc<Vec<u8>>,
    /// The mesh's manifest (a rebuild obtains the row as a joiner would).
    pub(crate) manifest: Rc<ModelManifest>,
    pub(crate) rules: Rules,
    /// Shared with the steps in flight; updates wait until it is free again.
    pub(crate) state: Rc<ShardState>,
    pub(crate) row: u32,
    pub(crate) device: String,
    pub(crate) source: String,
    /// Payloads of the updates applied since the snapshot, for peers that missed them.
    pub(crate) updates: HashMap<u64, Rc<Vec<u8>>>,
    /// Where the snapshot is kept (IndexedDB under the manifest's key), if the browser allows.
    pub(crate) store: Option<(Rc<ShardStore>, String)>,
    /// Bytes of the latest snapshot kept there (0 until one is).
    pub(crate) stored: Rc<std::cell::Cell<u64>>,
    /// A rebuilt row waiting until no step uses the shard.
    pub(crate) rebuilt: Option<Joined>,
    /// The shard as a blob at one version, for peers that download it.
    pub(crate) snapshot: holder::Snapshot,
    /// Updates each peer handed over lately.
    pub(crate) limit: LearnLimit<PeerId>,
    pub(crate) steps: u64,
    /// Compute time of those steps, in microseconds.
    pub(crate) step_us: u64,
    /// Products sent to WebGPU.
    pub(crate) gpu_steps: u64,
    /// A catch-up with a peer is running.
    pub(crate) syncing: bool,
}

impl std::fmt::Debug for Holding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holding")
            .field("row", &self.row)
            .field("device", &self.device)
            .finish()
    }
}

fn mesh_err(e: impl std::fmt::Display) -> WebError {
    WebError::Mesh(e.to_string())
}

use node_core::holder::wall_ms;

impl Holding {
    /// The contribution as the page shows it.
    pub(crate) fn contribution(&self) -> Contribution {
        Contribution::Serving {
            row: self.row,
            device: self.device.clone(),
            source: self.source.clone(),
            steps: self.steps,
            gpu_steps: self.gpu_steps,
            step_ms: self.step_us as f64 / 1000.0 / self.steps.max(1) as f64,
            version_count: self.state.version.count(),
            stored_bytes: self.stored.get(),
        }
    }

    /// Counts an answered step.
    pub(crate) fn answered(&mut self, response: &MeshResponse) {
        if let MeshResponse::Step { compute_us, .. } = response {
            self.steps += 1;
            self.step_us += compute_us;
        }
    }

    /// What a peer's request for this row needs ([`holder::route`]); `live` is how many live
    /// holders the page's view knows.
    pub(crate) fn route(
        &mut self,
        peer: &PeerId,
        request: MeshRequest,
        live: usize,
    ) -> Route<PeerId> {
        let held = Held {
            row: self.row,
            state: &self.state,
            manifest: &self.manifest_bytes,
            // A browser hands out no genesis shards: it never seeds a mesh.
            genesis: &std::collections::BTreeMap::new(),
            rules: &self.rules,
            wall_ms: wall_ms(),
            live,
        };
        holder::route(
            &held,
            &mut self.limit,
            peer,
            web_time::Instant::now(),
            request,
        )
    }

    /// A coded step, computed on WebGPU where the product goes there.
    pub(crate) fn step(
        &mut self,
        version: [u8; 32],
        request: StepRequest,
    ) -> impl std::future::Future<Output = MeshResponse> + 'static {
        if self.state.member.on_gpu(&request) {
            self.gpu_steps += 1;
        }
        let state = self.state.clone();
        async move { holder::step_async(&state, &version, &request).await }
    }

    /// A piece of a kept update's payload.
    pub(crate) fn update_piece(&self, id: u64, offset: u64, len: u32) -> MeshResponse {
        match self.updates.get(&id) {
            Some(bytes) => chunk_of(bytes, [0; 32], offset, len),
            None => MeshResponse::Error(format!("update {id:016x} is not kept here")),
        }
    }

    /// Checks and applies an update: `Ok(None)` while a step still uses the shard (try again
    /// later), else its id and whether it was new.
    pub(crate) fn learn(&mut self, bytes: &[u8]) -> Result<Option<(u64, bool)>, WebError> {
        let checked = self.rules.check(bytes, Some(wall_ms())).map_err(mesh_err)?;
        if self.state.version.contains(checked.id) {
            return Ok(Some((checked.id, false)));
        }
        let Some(state) = Rc::get_mut(&mut self.state) else {
            return Ok(None);
        };
        let applied = state.apply(&checked.update, checked.id).map_err(mesh_err)?;
        self.updates.insert(checked.id, Rc::new(bytes.to_vec()));
        Ok(Some((checked.id, applied)))
    }
}

impl Holding {
    /// Folds the updates kept since the snapshot into a new one once they are due (while no
    /// step uses the shard): the shard as it is now goes to IndexedDB, their payloads are
    /// dropped, but for the newest ones that the live holders `lags` behind may lack
    /// ([`node_core::mesh::MeshView::lags`]). Returns the saving to run, if any.
    pub(crate) fn fold_if_due(
        &mut self,
        lags: &[u64],
    ) -> Option<impl std::future::Future<Output = ()> + 'static> {
        let size = |updates: &HashMap<u64, Rc<Vec<u8>>>, id| {
            updates.get(&id).map_or(0, |b| b.len() as u64)
        };
        let since: u64 = self
            .state
            .version
            .since()
            .map(|id| size(&self.updates, id))
            .sum();
        let shard_bytes = self.state.member.shards().bytes() as u64;
        if !self.state.version.fold_due(since, shard_bytes) {
            return None;
        }
        let state = Rc::get_mut(&mut self.state)?;
        let blob = match holder::shard_to_blob(state.member.shards()) {
            Ok(blob) => blob,
            Err(e) => {
                tracing::warn!("could not make a snapshot: {e}");
                return None;
            }
        };
        let folded: Vec<u64> = state.version.since().collect();
        state.version.fold(folded.iter().copied());
        // The latest folded payloads stay for peers a little behind, within the budget.
        for id in state
            .version
            .to_release(shard_bytes, 0, |id| size(&self.updates, id), lags)
        {
            state.version.release(id);
            self.updates.remove(&id);
        }
        tracing::info!(
            folded = folded.len(),
            "folded the kept updates into a snapshot"
        );
        let save = self.save(blob);
        Some(save)
    }

    /// Takes the rebuilt row in place of the shard, if one waits and no step uses the shard;
    /// returns the saving of its snapshot to run.
    pub(crate) fn take_rebuilt(
        &mut self,
    ) -> Option<impl std::future::Future<Output = ()> + 'static> {
        self.rebuilt.as_ref()?;
        let state = Rc::get_mut(&mut self.state)?;
        let joined = self.rebuilt.take()?;
        let mut version = joined.version;
        version.fold_all();
        if let Err(e) = state.replace(joined.shard, version, joined.norms) {
            tracing::warn!("could not take the rebuilt row: {e}");
            return None;
        }
        self.updates.clear();
        self.source = joined.how;
        tracing::info!(source = %self.source, "rebuilt the row");
        Some(self.save(joined.blob))
    }

    /// Saves `blob` (the shard at the state's version, every update in it) as the snapshot.
    fn save(&self, blob: Vec<u8>) -> impl std::future::Future<Output = ()> + 'static {
        let (store, stored) = (self.store.clone(), self.stored.clone());
        let meta = StoredRow {
            row: self.row,
            version: self.state.version.clone(),
            norms: self.state.norms.clone(),
        };
        async move {
            let Some((store, key)) = store else {
                return;
            };
            let saved = match protocol::encode(&meta) {
                Ok(meta) => (store.save(&key, &meta, &blob).await)
                    .map(|()| (meta.len() + blob.len()) as u64)
                    .map_err(mesh_err),
                Err(e) => Err(mesh_err(e)),
            };
            match saved {
                Ok(bytes) => stored.set(bytes),
                Err(e) => tracing::warn!("could not keep the snapshot in this browser: {e}"),
            }
        }
    }
}

impl BrowserNode {
    /// Takes a row of the code: from this browser's storage when it kept one for this model,
    /// else from the mesh (a genesis shard, or re-encoded from k rows), with progress in the
    /// snapshot's `contribution`; resolves once the row is obtained. The node then reserves a
    /// slot on the native node it dialed (relay v2), so peers can reach it, and announces the
    /// row and serves it (`contribution` turns to `Serving`).
    pub async fn contribute(&self) -> Result<(), WebError> {
        self.contribute_with(WebGpuUse::Auto).await
    }

    /// [`Self::contribute`], computing on WebGPU as `webgpu` says.
    pub async fn contribute_with(&self, webgpu: WebGpuUse) -> Result<(), WebError> {
        if matches!(
            self.snapshot().contribution,
            Contribution::Preparing { .. } | Contribution::Serving { .. }
        ) {
            return Err(WebError::Mesh("this node already contributes".into()));
        }
        self.progress("asking the mesh for a row", 0, 0);
        match self.obtain_row().await {
            Ok(mut holding) => {
                self.progress(GPU_STEP, 0, 0);
                holding.use_webgpu(webgpu).await;
                tracing::info!(row = holding.row, device = %holding.device, source = %holding.source, "serving a row");
                self.hold(holding).await
            }
            Err(e) => {
                let reason = e.to_string();
                tracing::error!("contributing: {reason}");
                self.set_contribution(Contribution::Failed { reason });
                Err(e)
            }
        }
    }

    fn progress(&self, what: &str, done: u64, total: u64) {
        self.set_contribution(Contribution::Preparing {
            what: what.to_string(),
            done,
            total,
        });
    }

    async fn obtain_row(&self) -> Result<Holding, WebError> {
        let MeshResponse::Manifest(bytes) = self.ask_bootstrap(MeshRequest::Manifest).await? else {
            return Err(mesh_err("asked for the manifest, got something else"));
        };
        let manifest = ModelManifest::from_bytes(&bytes).map_err(mesh_err)?;
        let key = hex(&manifest.digest().map_err(mesh_err)?);
        let store = match ShardStore::open().await {
            Ok(s) => Some(Rc::new(s)),
            Err(e) => {
                tracing::warn!("no browser storage, the shard will not survive a reload: {e}");
                None
            }
        };
        if let Some(store) = &store {
            match store.load(&key).await {
                Ok(Some(stored)) => {
                    self.progress("checking the stored shard", 0, 0);
                    match restore(&manifest, &stored.meta, &stored.blob) {
                        Ok((shard, version, norms)) => {
                            tracing::info!(
                                row = shard.node,
                                "the shard from this browser's storage"
                            );
                            let mut holding = Holding::open(
                                manifest,
                                bytes,
                                shard,
                                version,
                                norms,
                                "browser storage".into(),
                            );
                            holding.store = Some((store.clone(), key));
                            (holding.stored).set((stored.meta.len() + stored.blob.len()) as u64);
                            return Ok(holding);
                        }
                        Err(e) => {
                            tracing::warn!("the stored shard is unusable ({e}); downloading again")
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("the stored shard is unreadable ({e}); downloading again"),
            }
            let _ = store.remove(&key).await;
        }
        let bootstrap = self.bootstrap();
        let Joined {
            shard,
            blob,
            version,
            norms,
            how: source,
            ..
        } = holder::join(self, &bootstrap, &manifest)
            .await
            .map_err(mesh_err)?;
        let mut holding = Holding::open(manifest, bytes, shard, version, norms, source);
        holding.store = store.map(|s| (s, key));
        self.progress("saving the shard in this browser", 0, 0);
        holding.save(blob).await;
        Ok(holding)
    }

    /// A chained piece of someone else's row ([`node_core::chain`]): the running sum of the
    /// sources before this row's holder, plus this row's term.
    pub(crate) async fn chain_piece(&self, state: Rc<ShardState>, part: ChainPart) -> MeshResponse {
        let set = state.member.shards();
        holder::chain(self, part, &set.generator, &set.cfg, |part, before| {
            std::future::ready(holder::contribute(&state, &part, before))
        })
        .await
    }

    /// Takes an update's notice: pulls the update from the holders that told this node and
    /// passes the notice on, the next holders to pull from those too (a browser serves no
    /// pieces while it pulls); the task applies it.
    pub(crate) async fn take_spread(&self, notice: holder::Opened<PeerId>) {
        let sources: Vec<String> = notice.sources.iter().map(ToString::to_string).collect();
        // With no holder to pull from (a leader sent it whole), the next get it whole too.
        let inline = notice.inline.as_deref().filter(|_| sources.is_empty());
        let pass = holder::pass_on(self, &notice.list_bytes, &sources, &notice.to, inline);
        let got = async {
            match notice.inline.clone() {
                Some(bytes) => Ok(bytes),
                None => holder::pull(self, &notice.list, &notice.sources, |_, _| {})
                    .await
                    .map(|(bytes, _)| bytes)
                    .map_err(|e| e.to_string()),
            }
        };
        let (got, _) = futures::join!(got, pass);
        let _ = self.send(super::Command::Spread(got)).await;
    }

    /// What catching up with `peer` brings a holder at `have`: the payloads of the updates the
    /// peer keeps and it lacks, or the version to rebuild the row at when those cannot reach
    /// the peer's.
    pub(crate) async fn catch_up(
        &self,
        peer: PeerId,
        have: &ShardVersion,
    ) -> Result<CaughtUp, WebError> {
        let ids = match holder::plan_with(self, &peer, have)
            .await
            .map_err(mesh_err)?
        {
            (CatchUp::Nothing, _) => return Ok(CaughtUp::Updates(Vec::new())),
            (CatchUp::Rebuild, theirs) => return Ok(CaughtUp::Behind(theirs.digest())),
            (CatchUp::Replay(ids), _) => ids,
        };
        let mut out = Vec::new();
        for id in ids {
            out.push(
                holder::fetch_update(self, &peer, id)
                    .await
                    .map_err(mesh_err)?,
            );
        }
        Ok(CaughtUp::Updates(out))
    }
}

/// The shard, version and norm gains of a stored record (checksums already verified).
fn restore(
    manifest: &ModelManifest,
    meta: &[u8],
    blob: &[u8],
) -> Result<(ShardSet, ShardVersion, LeaderWeights), WebError> {
    let meta: StoredRow = protocol::decode(meta).map_err(mesh_err)?;
    let shard = holder::shard_from_blob(blob).map_err(mesh_err)?;
    holder::check_shard(&shard, manifest, meta.row).map_err(mesh_err)?;
    if !meta.norms.fits(&manifest.cfg) {
        return Err(mesh_err("the stored norm gains do not fit the model"));
    }
    // The payloads it kept were in this page's memory only.
    let mut version = meta.version;
    version.fold_all();
    Ok((shard, version, meta.norms))
}

/// Which products the browser node computes on WebGPU (`?webgpu=auto|all|off` on the page).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WebGpuUse {
    /// Products of at least [`BROWSER_GPU_MIN_WORK`] weight bytes × tokens; smaller ones are
    /// faster on the wasm CPU path (a WebGPU readback costs milliseconds).
    #[default]
    Auto,
    /// Every product.
    All,
    /// None: the wasm CPU path only.
    Off,
}

impl std::str::FromStr for WebGpuUse {
    type Err = WebError;

    fn from_str(s: &str) -> Result<Self, WebError> {
        match s {
            "auto" => Ok(Self::Auto),
            "all" => Ok(Self::All),
            "off" => Ok(Self::Off),
            other => Err(WebError::Mesh(format!(
                "webgpu={other:?}: expected auto, all or off"
            ))),
        }
    }
}

/// The work (weight bytes × tokens) from which `WebGpuUse::Auto` sends a product to WebGPU.
pub const BROWSER_GPU_MIN_WORK: usize = 4 << 20;

const CPU_DEVICE: &str = "browser wasm cpu";

impl Holding {
    /// Computes products on WebGPU as `choice` says, where the browser has it; compiles the
    /// kernels first. Without WebGPU (or with `Off`) the row stays on the wasm CPU path.
    async fn use_webgpu(&mut self, choice: WebGpuUse) {
        let Some(state) = Rc::get_mut(&mut self.state) else {
            return;
        };
        let min_work = match choice {
            WebGpuUse::Off => return,
            WebGpuUse::All => 0,
            WebGpuUse::Auto => BROWSER_GPU_MIN_WORK,
        };
        let gpu = match Gpu::open(false).await {
            Ok(gpu) => gpu,
            Err(e) => {
                tracing::info!("no WebGPU ({e}); computing on the wasm CPU path");
                return;
            }
        };
        let name = gpu.info().name.clone();
        let ready = match state.member.use_gpu(Arc::new(gpu), min_work) {
            Ok(()) => state.member.warm_up(WARM_UP_TOKENS).await,
            Err(e) => Err(e),
        };
        self.device = match ready {
            Ok(()) if name.is_empty() => "browser WebGPU".to_string(),
            Ok(()) => format!("browser WebGPU: {name}"),
            Err(e) => {
                tracing::warn!("WebGPU cannot serve the shard ({e}); computing on the CPU");
                state.member = Member::new(state.member.shards().clone());
                CPU_DEVICE.to_string()
            }
        };
    }

    /// A row ready to serve on the wasm CPU path.
    fn open(
        manifest: ModelManifest,
        manifest_bytes: Vec<u8>,
        shard: ShardSet,
        version: ShardVersion,
        norms: LeaderWeights,
        source: String,
    ) -> Self {
        let row = shard.node as u32;
        let member = Member::new(shard);
        let device = CPU_DEVICE.to_string();
        Self {
            rules: Rules::of(&manifest),
            manifest_bytes: Rc::new(manifest_bytes),
            manifest: Rc::new(manifest),
            state: Rc::new(ShardState {
                member,
                version,
                norms,
                skip_updates: 0,
            }),
            row,
            device,
            source,
            updates: HashMap::new(),
            store: None,
            stored: Rc::default(),
            rebuilt: None,
            snapshot: holder::Snapshot::default(),
            limit: LearnLimit::default(),
            steps: 0,
            step_us: 0,
            gpu_steps: 0,
            syncing: false,
        }
    }
}

/// The browser node's link for the holder logic of `node_core::holder`: requests through its
/// swarm task, progress on the page; the wasm page has one thread, so heavy work runs in place.
impl Link for BrowserNode {
    type Peer = PeerId;

    async fn ask(&self, peer: &PeerId, request: MeshRequest) -> Result<MeshResponse, HolderError> {
        self.request(*peer, request)
            .await
            .map_err(|e| HolderError::Link(format!("{peer}: {e}")))
    }

    async fn dial(&self, src: &SourceRow) -> Result<PeerId, HolderError> {
        let from = holder::source_peer(src)?;
        if from != self.bootstrap() {
            let addrs = BrowserBootstrap::from_addrs(src.peer.clone(), &src.addrs).addrs;
            self.dial_any(&addrs)
                .await
                .map_err(|e| holder::source_error(src, e))?;
        }
        Ok(from)
    }

    async fn blocking<R: Send + 'static>(&self, work: impl FnOnce() -> R + Send + 'static) -> R {
        work()
    }

    fn progress(&self, what: &str, done: u64, total: u64) {
        BrowserNode::progress(self, what, done, total);
    }
}

#[cfg(all(test, target_arch = "wasm32"))]
mod tests {
    use node_core::code::Generator;
    use node_core::coded::{InProcess, ShardFormat};
    use node_core::learn::{Precision, StageFactors, Update, seal};
    use node_core::mesh::{KEEP_SHARE, LearningConfig};
    use node_core::model::{ModelWeights, Stage, TokenizerData};
    use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

    use super::*;

    wasm_bindgen_test_configure!(run_in_browser);

    /// A signed exact (f32) update of `manifest`'s model with small seeded factors, by a
    /// trainer the mesh admits.
    fn update(manifest: &ModelManifest, seed: u32, signer: &node_core::lead::Signer) -> Vec<u8> {
        let cfg = &manifest.cfg;
        let value = |i: usize| ((i as u32 * 2654435761 + seed * 40503) % 1000) as f32 / 1e4 - 0.05;
        let stages = Stage::all(cfg)
            .into_iter()
            .map(|stage| {
                let shapes = stage.shapes(cfg);
                let inp = shapes.first().map_or(0, |s| s.1);
                StageFactors {
                    stage,
                    rows: 1,
                    x: (0..inp).map(value).collect(),
                    dy: shapes
                        .iter()
                        .map(|&(out, _)| (0..out).map(|i| value(i + 7)).collect())
                        .collect(),
                }
            })
            .collect();
        let zeros = |n: usize| vec![0.0; n];
        let update = Update {
            step: manifest.learning.lr,
            t: 1,
            stages,
            embed_tokens: vec![seed % cfg.vocab as u32],
            embed_dx: (0..cfg.hidden).map(value).collect(),
            norms: LeaderWeights {
                attn_norm: vec![zeros(cfg.hidden); cfg.layers],
                ffn_norm: vec![zeros(cfg.hidden); cfg.layers],
                final_norm: zeros(cfg.hidden),
                ..Default::default()
            },
            precision: Precision::F32,
        };
        let header = node_core::learn::Header {
            issued_ms: wall_ms(),
            verdict: None,
        };
        seal(update.encode(), &signer.key, signer.cert.as_ref(), header).expect("signed")
    }

    fn values(s: &ShardSet) -> Vec<u32> {
        s.blocks
            .iter()
            .flatten()
            .chain([&s.embed])
            .flat_map(|sh| {
                sh.values_f32()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[wasm_bindgen_test]
    async fn a_browser_holder_folds_its_updates_into_a_snapshot_that_a_reload_restores() {
        let cfg = node_core::model::LlamaConfig::small();
        let weights = ModelWeights::synthetic(cfg.clone(), 7).expect("a model");
        let generator = Generator::cauchy(5, 3).expect("a 3-of-5 code");
        let mesh =
            InProcess::encode(&weights, &generator, ShardFormat::F32, &|_, _| {}).expect("encoded");
        let shard = mesh.members()[2].shards().clone();
        let mesh_key = libp2p::identity::Keypair::generate_ed25519();
        let manifest = ModelManifest {
            name: "small".into(),
            leader: LeaderWeights::from_model(&weights),
            tokenizer: TokenizerData {
                json: String::new(),
                eos: Vec::new(),
                default_system: None,
                sampling: Default::default(),
            },
            generator,
            format: ShardFormat::F32,
            learning: LearningConfig {
                rank: 0,
                ..LearningConfig::of(
                    node_core::mesh::Optimizer::Sgd,
                    node_core::mesh::DEFAULT_SGD_LR,
                )
            },
            verify_noise: 1e-3,
            mesh_key: node_core::learn::MeshKey::of(&mesh_key).to_bytes(),
            canary_loss: None,
            cfg,
        };
        let bytes = protocol::encode(&manifest).expect("manifest");
        let norms = manifest.leader.clone();
        let mut holding = Holding::open(
            manifest.clone(),
            bytes,
            shard,
            ShardVersion::default(),
            norms,
            "a test".into(),
        );
        let store = Rc::new(ShardStore::open().await.expect("IndexedDB"));
        let key = "test-a-browser-holder-folds".to_string();
        holding.store = Some((store.clone(), key.clone()));
        let trainer = libp2p::identity::Keypair::generate_ed25519();
        let cert = node_core::learn::Certificate::issue(
            &mesh_key,
            trainer.public().to_peer_id(),
            "a test",
            1,
            u64::MAX,
            &[node_core::learn::Power::Write],
        )
        .expect("a certificate");
        let signer = node_core::lead::Signer {
            key: trainer,
            cert: Some(cert),
        };
        // Updates until one is due to fold (each is a few percent of this small shard).
        let mut save = None;
        for seed in 0..64 {
            let (_, applied) = holding
                .learn(&update(&manifest, seed, &signer))
                .expect("a valid update")
                .expect("no step holds the shard");
            assert!(applied);
            save = holding.fold_if_due(&[]);
            if save.is_some() {
                break;
            }
        }
        save.expect("the updates came due for a snapshot").await;
        assert_eq!(
            holding.state.version.since().len(),
            0,
            "every update folded"
        );
        let kept: usize = holding.updates.values().map(|b| b.len()).sum();
        let shard_bytes = holding.state.member.shards().bytes();
        assert!(
            kept as f64 <= KEEP_SHARE * shard_bytes as f64,
            "{kept} payload bytes kept beside a {shard_bytes}-byte shard"
        );
        // A reload finds the snapshot: the same values, at the same version.
        let stored = store.load(&key).await.expect("readable").expect("saved");
        let (shard, version, _) =
            restore(&manifest, &stored.meta, &stored.blob).expect("a usable snapshot");
        assert_eq!(version.digest(), holding.state.version.digest());
        assert_eq!(values(&shard), values(holding.state.member.shards()));
        store.remove(&key).await.expect("removed");
    }
}
