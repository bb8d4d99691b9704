//! The command line's arguments: one struct per command, apart from what the commands do
//! (main.rs).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Parser, Subcommand};
use node_core::coded::ShardFormat;
use node_core::mesh::HealthConfig;
use node_native::node;

/// Coded Mesh: a transformer served by Cauchy-coded shards, any k of n nodes.
#[derive(Debug, Parser)]
#[command(name = "codedmesh", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Generate a completion: on the mesh with --bootstrap, else through k of n coded shards in
    /// this process.
    Generate(GenerateArgs),
    /// Start a mesh: encode a model into n rows, keep row 0, hand the others to joining nodes.
    Seed(SeedArgs),
    /// Run a node: restart from its data dir, or join through --bootstrap and take a row.
    Node(NodeArgs),
    /// Show the mesh: rows, holders, health, versions.
    Status(StatusArgs),
    /// Perplexity of the mesh's model on a text file (forward only: it does not learn).
    Eval(EvalArgs),
    /// Fetch the default model into the cache (if needed) and print its path.
    FetchModel,
    /// Dial a peer as a mesh node would and tell how the connection ends up: direct, direct
    /// after hole punching, or relayed (behind NATs that do not allow hole punching).
    Reach(ReachArgs),
    /// Measure kernel bandwidth and model tokens/s, uncoded and coded; print a table.
    Bench(BenchArgs),
    /// Start a whole local mesh (n nodes on 127.0.0.1) and serve the OpenAI API and the
    /// dashboard: fetches and encodes the model the first time, then starts in seconds.
    Up(UpArgs),
    /// Admit a peer to write the model: a certificate signed by the mesh's key, by which
    /// holders take its learning updates and act on the members it reports.
    Admit(AdmitArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct AdmitArgs {
    /// The mesh's key (`mesh.key` in the data dir of the mesh's `seed`, or of `up`).
    #[arg(long)]
    pub(crate) mesh_key: PathBuf,
    /// The peer to admit, by its peer id.
    #[arg(
        long,
        conflicts_with = "identity",
        required_unless_present = "identity"
    )]
    pub(crate) peer: Option<libp2p::PeerId>,
    /// Admit the identity in this key file (made there if missing): a leader's `--identity`,
    /// or a node's `DATA/identity.key`.
    #[arg(long)]
    pub(crate) identity: Option<PathBuf>,
    /// A name for people (who runs it); shown with its updates.
    #[arg(long, default_value = "trainer")]
    pub(crate) name: String,
    /// Days the certificate admits the peer.
    #[arg(long, default_value_t = 30)]
    pub(crate) days: u64,
    /// Admit it to write only, not to report members (whose reports others act on).
    #[arg(long)]
    pub(crate) write_only: bool,
    /// Where to write the certificate: a node reads `trainer.cert` in its data dir, a leader
    /// takes `generate --cert FILE`.
    #[arg(long)]
    pub(crate) out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// Nodes to start, one coded row each (n); default: 5, or 4 for k = 2 (the compact code's
    /// rows), or the shape of the mesh already in --data.
    #[arg(long)]
    pub(crate) nodes: Option<usize>,
    /// Rows needed to compute (k ≤ nodes); default: 3, or 2 on a machine with fewer than 3
    /// cores (one stream works k nodes at once; docs/perf.md), or the k of the mesh already in
    /// --data.
    #[arg(long)]
    pub(crate) k: Option<usize>,
    /// Most rows the mesh may grow to as nodes join (then joiners become replicas); default:
    /// as many as keep every group of k within the numerics goal (docs/coding.md).
    #[arg(long)]
    pub(crate) max_rows: Option<usize>,
    /// A GGUF file or a Hugging Face directory; default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Where the mesh's rows and logs live; default: $CODEDMESH_DATA, else the user's data
    /// dir + codedmesh/up/<model>-k<k>-n<n>.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Port of the OpenAI API and the dashboard.
    #[arg(long, default_value_t = 8000)]
    pub(crate) port: u16,
    /// Address the API and the dashboard listen on (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) api_listen: std::net::IpAddr,
    /// The mesh does not learn: no request trains the model (as `seed --no-learning`).
    #[arg(long)]
    pub(crate) no_learning: bool,
    #[command(flatten)]
    pub(crate) diloco: DilocoArgs,
    /// Shard storage: f32 (exact to the code's error), f16 (does not learn), or q8 (compact: a
    /// quarter of the bytes on the integer code, learning in coded adapters; docs/coding.md,
    /// "Compact shards"); default: q8 where the integer code has a row for every node (k ≤ 5;
    /// 7 rows for k = 3), else f32; q4 (a 4-bit file's blocks, data rows only: n = k).
    #[arg(long)]
    pub(crate) shard_format: Option<ShardFormat>,
    /// The dashboard's built files (web-ui/dist).
    #[arg(long)]
    pub(crate) web_dir: Option<PathBuf>,
    /// Do not build the dashboard when it is missing.
    #[arg(long)]
    pub(crate) no_build_web: bool,
    /// How the API's node serves: keys, batch, queue, learning, groups, drafts, route, checks.
    #[command(flatten)]
    pub(crate) serve: ServeArgs,
    /// Silence before the nodes count a peer as Dead, ms (each node's `--dead-ms`; 10000).
    #[arg(long)]
    pub(crate) dead_ms: Option<u64>,
}

/// How a leader's groups are checked and how many spares they ask: every leader's (`up`,
/// `node`, `generate`, the bench).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct GroupArgs {
    /// Answers checked beyond the k decoded in every round: 1 detects a wrong member, 2 also
    /// locates it without asking anyone else; 0 turns checking off.
    #[arg(long, default_value_t = 1)]
    pub(crate) check: usize,
    /// With `--check 1`, ask the check row for its answer in every round instead of checking
    /// against its secret projections (docs/verification.md, "Projected checks"): a fourth
    /// product a round, as before projections.
    #[arg(long)]
    pub(crate) check_answers: bool,
    /// Spare members asked beside them: a straggler or a failure costs nothing, at the price
    /// of their compute. Default: 1, or 0 where every member shares this machine's cores
    /// (`up`, the bench): there a spare adds work (throughput -17%, docs/perf.md) and rarely
    /// beats a local straggler, and with `--check 1` a failed member still leaves k answers.
    #[arg(long)]
    pub(crate) spares: Option<usize>,
}

impl GroupArgs {
    /// The options a leader forms its groups with; `local`: its members share this machine.
    pub(crate) fn options(&self, local: bool) -> node_core::lead::GroupOptions {
        node_core::lead::GroupOptions {
            project: !self.check_answers,
            ..node_core::lead::GroupOptions::new(self.check, self.spares(local))
        }
    }

    /// Spare members asked; `local`: every member shares this machine.
    pub(crate) fn spares(&self, local: bool) -> usize {
        self.spares.unwrap_or(usize::from(!local))
    }
}

/// How a node serves the requests it leads (its OpenAI API): `node`'s and `up`'s.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Bearer key the API asks for (`Authorization: Bearer KEY`).
    #[arg(long, env = "CODEDMESH_API_KEY", conflicts_with = "api_keys")]
    pub(crate) api_key: Option<String>,
    /// A JSON file of API keys, each with a name, a learning budget, a request rate and
    /// whether it may teach (docs/security.md, "API keys").
    #[arg(long)]
    pub(crate) api_keys: Option<PathBuf>,
    /// Most requests generated together (one coded round per stage for all of them).
    #[arg(long, default_value_t = 16)]
    pub(crate) max_batch: usize,
    /// Most requests waiting beyond the batch before the API answers 429.
    #[arg(long, default_value_t = 64)]
    pub(crate) queue: usize,
    /// The requests this node leads do not train the mesh.
    #[arg(long)]
    pub(crate) no_learn: bool,
    /// Most coded groups this node serves with side by side, each over holders the others do
    /// not use; a further group forms only when the mesh has holders for it (with `up`, e.g.
    /// `--nodes 10`).
    #[arg(long, default_value_t = 4)]
    pub(crate) groups: usize,
    /// Most drafted tokens checked in one forward pass of a request (prompt lookup: tokens
    /// that followed the text's last words where they occurred before); 0 decodes a token a
    /// pass.
    #[arg(long, default_value_t = node_core::model::speculate::DEFAULT_DRAFT)]
    pub(crate) draft: usize,
    /// How this node runs the forward passes of the requests it leads: `rounds` (it decodes
    /// every stage), `hop` (the members pass their coded outputs to each other, one hop per
    /// stage), or `auto` (hop where a member is on another machine or the rounds wait on the
    /// network).
    #[arg(long, default_value_t)]
    pub(crate) pass: node_native::serve::engine::PassRoute,
    /// How its groups are checked, and their spares.
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    /// Write every coded step of the requests this node leads to this file (JSON lines:
    /// time, request, step, member, bytes, duration).
    #[arg(long)]
    pub(crate) trace_steps: Option<PathBuf>,
}

impl ServeArgs {
    /// The arguments that give a node of `up` these settings (the keys, learning and trace go
    /// to `up`'s API node by other means); `local`: the mesh is on this machine.
    pub(crate) fn node_args(&self, local: bool) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--max-batch".into(),
            self.max_batch.to_string().into(),
            "--queue".into(),
            self.queue.to_string().into(),
            "--groups".into(),
            self.groups.to_string().into(),
            "--draft".into(),
            self.draft.to_string().into(),
            "--pass".into(),
            self.pass.to_string().into(),
        ];
        if self.no_learn {
            args.push("--no-learn".into());
        }
        args.extend(node_native::up::supervise::group_args(
            &self.group.options(local),
        ));
        args
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// A GGUF file or a Hugging Face directory; default: SmolLM2-135M-Instruct.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Tokens to generate per measured run.
    #[arg(long, default_value_t = 32)]
    pub(crate) tokens: usize,
    /// Also start the mesh `up` starts on this machine (k = 3 of 5 nodes; 2 of 4 below 3
    /// cores) as processes and measure generation over loopback, by a leader of its own and
    /// by streams through the seed's OpenAI API, against in-process decode.
    #[arg(long)]
    pub(crate) mesh: bool,
    /// With --mesh: rows needed to compute; default: as `up` picks on this machine.
    #[arg(long)]
    pub(crate) k: Option<usize>,
    /// With --mesh: nodes to start, one coded row each; default: as `up` picks.
    #[arg(long)]
    pub(crate) nodes: Option<usize>,
    /// With --mesh: one-way delays in milliseconds to measure at (comma-separated; a fresh
    /// mesh for each). Every request and answer between the processes waits this long before
    /// it leaves: a bench-only model of a network, not a network.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub(crate) one_way_delay_ms: Vec<f64>,
    /// With --mesh: how the leader's group is checked, and its spares, as `up`'s. (Before
    /// 2026-11-28 the bench checked nothing and asked a spare: `--check 0 --spares 1`.)
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    /// Also measure drafted decoding (prompt lookup) on code, a summary and open chat.
    #[arg(long)]
    pub(crate) speculate: bool,
    /// Measure verification instead: false positives, detection and location of faults.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Trials per kind of fault (with --verify).
    #[arg(long, default_value_t = 1000)]
    pub(crate) trials: usize,
    /// Honest requests checked for false positives (with --verify).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) honest: usize,
    /// Shard storage the verification runs on (with --verify): f32, f16 or q8; default: what
    /// `up` and `seed` give a mesh of k = 3 of 5 (q8).
    #[arg(long)]
    pub(crate) shard_format: Option<ShardFormat>,
    /// Measure the GPU instead: WGSL kernels against the copy kernel, and tokens/s with the
    /// members on the GPU against the CPU.
    #[arg(long)]
    pub(crate) gpu: bool,
    /// Size of the large copy and GEMV buffers in MiB (with --gpu).
    #[arg(long, default_value_t = 1024)]
    pub(crate) gpu_mib: u64,
    /// Use random weights of SmolLM2-135M's shape instead of a model file (with --gpu; speed
    /// only).
    #[arg(long, requires = "gpu")]
    pub(crate) synthetic: bool,
    /// The shape of --synthetic's random weights. Past SmolLM2 only one member's rounds and the
    /// whole token on the GPU are measured (a group of members on the CPU would take minutes a
    /// token), and f32 shards only while the model's f32 weights fit in 16 GiB.
    #[arg(long, value_enum, default_value_t = SyntheticShape::Smollm2, requires = "synthetic")]
    pub(crate) shape: SyntheticShape,
    /// Measure what compact grids cost against the model as loaded (logit error, greedy
    /// tokens) instead of speed.
    #[arg(long)]
    pub(crate) grids: bool,
    /// Measure learning instead: a passage taught N times (its perplexity before and after),
    /// held-out perplexity of other text, the canary gate, a poisoner, update bytes.
    #[arg(long)]
    pub(crate) learning: bool,
    /// Times the passage is sent (with --learning).
    #[arg(long, default_value_t = 20)]
    pub(crate) exposures: usize,
    /// Times the poisoner sends its garbage (with --learning; 0 skips it).
    #[arg(long, default_value_t = 100)]
    pub(crate) poison: usize,
    /// With --learning: mention this many made-up facts (at most 5, texts/facts.json) in
    /// chats instead of teaching a passage, then ask each question greedily.
    #[arg(long, default_value_t = 0)]
    pub(crate) facts: usize,
    /// Chats that mention each fact (with --facts).
    #[arg(long, default_value_t = 20)]
    pub(crate) chats_per_fact: usize,
    /// With --learning: send this many chats on many topics from several clients instead,
    /// one made-up fact told in 20 of the first 100, and print the curve of held-out
    /// perplexity and the fact's answer (`bench::mixed`).
    #[arg(long, default_value_t = 0)]
    pub(crate) mixed: usize,
    /// Clients whose chats are interleaved (with --mixed).
    #[arg(long, default_value_t = 4)]
    pub(crate) clients: usize,
    /// Chats between two rows of the curve (with --mixed).
    #[arg(long, default_value_t = 100)]
    pub(crate) checkpoint_every: usize,
    /// Seed of the chats' generator (with --mixed).
    #[arg(long, default_value_t = 79)]
    pub(crate) seed: u64,
    /// Chats a trainer's minibatch holds (with --facts or --mixed; `up`'s trainer gathered
    /// about ten in the learning bench).
    #[arg(long, default_value_t = 10)]
    pub(crate) per_round: usize,
    /// Positions of general text the trainer rehearses a minibatch, as `up`'s does (with
    /// --learning; 0: none).
    #[arg(long, default_value_t = node_core::learn::REHEARSAL_TOKENS)]
    pub(crate) rehearse: usize,
    /// Distil the rehearsal (with --learning): teach each of its positions this share of the
    /// text's next token and the rest as the model's own distribution was when training
    /// began (0: all the model's, 1: the text alone); default: the text, as `up` does.
    #[arg(long, value_parser = share)]
    pub(crate) distil: Option<f32>,
    /// With --learning: leave untaught every next token the model already gives a loss
    /// below this many nats, as `up` does (0: teach every one).
    #[arg(long, default_value_t = node_core::learn::KNOWN_NATS)]
    pub(crate) floor: f64,
    /// With --learning: the adapters the trainer moves (head, attention, mlp), comma-separated;
    /// default: as `up`'s trainers.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [TrainedArg::Mlp])]
    pub(crate) train: Vec<TrainedArg>,
    /// With --learning: positions of earlier lessons taught again a minibatch (0: none).
    #[arg(long, default_value_t = 0)]
    pub(crate) replay: usize,
    /// With --learning: share of its updates' moves a trainer takes back a round (0: none).
    #[arg(long, value_parser = share, default_value_t = 0.0)]
    pub(crate) decay: f32,
    /// With --learning: published rounds over which the outer rate halves (0: kept).
    #[arg(long, default_value_t = 0)]
    pub(crate) anneal: u32,
    /// With --learning: an adapter entry's step goes out only where the trainer's last ten or
    /// so rounds agree on it, |Σβʲ·Δ| ≥ this share of Σβʲ·|Δ| (0: every entry).
    #[arg(long, value_parser = share, default_value_t = 0.0)]
    pub(crate) consensus: f32,
    /// With --learning: the gate's floor is the lowest canary of this many verdicts (0: ever).
    #[arg(long, default_value_t = 0)]
    pub(crate) gate_window: usize,
    /// Learning rate of the mesh measured (with --learning); default: the optimizer's.
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// Optimizer of the mesh measured (with --learning).
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adam)]
    pub(crate) optimizer: OptimizerArg,
    /// With --learning: measure without the canary gate (every update is taken).
    #[arg(long)]
    pub(crate) no_gate: bool,
    /// Shard storage with --learning; default: as `up` picks.
    #[arg(long)]
    pub(crate) learn_format: Option<ShardFormat>,
    #[command(flatten)]
    pub(crate) diloco: DilocoArgs,
}

/// DiLoCo's settings of a new mesh (docs/coding.md, "DiLoCo in the mesh"); unset, Adam's
/// defaults, and none with SGD.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub(crate) struct DilocoArgs {
    /// Adam steps a trainer takes over each minibatch before it publishes their sum (1: each
    /// step is an update); default 4 with Adam.
    #[arg(long)]
    pub(crate) inner_steps: Option<u32>,
    /// Outer learning rate of a trainer's rounds; default 1.
    #[arg(long)]
    pub(crate) outer_lr: Option<f32>,
    /// Outer Nesterov momentum of a trainer's rounds; default 0.5 with Adam.
    #[arg(long)]
    pub(crate) outer_momentum: Option<f32>,
}

impl DilocoArgs {
    /// `cfg` with the settings given here.
    pub(crate) fn apply(
        self,
        mut cfg: node_core::mesh::LearningConfig,
    ) -> node_core::mesh::LearningConfig {
        if let Some(h) = self.inner_steps {
            cfg.inner_steps = h;
        }
        if let Some(lr) = self.outer_lr {
            cfg.outer_lr = lr;
        }
        if let Some(mu) = self.outer_momentum {
            cfg.outer_momentum = mu;
        }
        cfg
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct NetArgs {
    /// Data directory (identity, manifest, shard).
    #[arg(long)]
    pub(crate) data: PathBuf,
    /// Address to listen on; QUIC, WebSocket and WebRTC-direct listen beside each TCP one.
    #[arg(long, default_value = "/ip4/127.0.0.1/tcp/0")]
    pub(crate) listen: Vec<libp2p::Multiaddr>,
    /// Listen on TCP only.
    #[arg(long)]
    pub(crate) tcp_only: bool,
    /// Discover peers on the local network with mDNS.
    #[arg(long)]
    pub(crate) mdns: bool,
    /// Heartbeat interval, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub(crate) heartbeat_ms: u64,
    /// Silence before a peer is Suspect, milliseconds.
    #[arg(long, default_value_t = 4000)]
    pub(crate) suspect_ms: u64,
    /// Silence before a peer is Dead, milliseconds.
    #[arg(long, default_value_t = 10000)]
    pub(crate) dead_ms: u64,
    /// Where to compute the shard products: cpu, gpu (any wgpu adapter; fails without one) or
    /// auto (a hardware GPU when there is one, else the CPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: node_core::compute::gpu::DeviceChoice,
    /// Where to serve HTTP: the OpenAI API at `/v1`, the dashboard at `/`, the status at
    /// `/api/status`, metrics at `/metrics` (port 0 picks a free one; the node prints the URL).
    #[arg(
        long = "api-listen",
        visible_alias = "http",
        default_value = "127.0.0.1:0"
    )]
    pub(crate) http: std::net::SocketAddr,
    /// Serve no HTTP.
    #[arg(long, conflicts_with = "http")]
    pub(crate) no_http: bool,
    /// The dashboard's built files (web-ui/dist); default: $CODEDMESH_WEB, else web-ui/dist
    /// of the checkout the binary was built in.
    #[arg(long)]
    pub(crate) web_dir: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) serve: ServeArgs,
}

impl NetArgs {
    pub(crate) fn options(
        &self,
        bootstrap: Option<libp2p::Multiaddr>,
    ) -> Result<node::NodeOptions> {
        let health = HealthConfig {
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms),
            suspect_after: Duration::from_millis(self.suspect_ms),
            dead_after: Duration::from_millis(self.dead_ms),
        };
        health.validate()?;
        Ok(node::NodeOptions {
            data: self.data.clone(),
            bootstrap,
            listen: self.listen.clone(),
            all_transports: !self.tcp_only,
            mdns: self.mdns,
            health,
            fault: None,
            device: self.device,
            http: (!self.no_http).then_some(self.http),
            web_dir: self.web_dir.clone(),
            serve: node_native::serve::engine::EngineConfig {
                max_batch: self.serve.max_batch,
                queue: self.serve.queue,
                learn: !self.serve.no_learn,
                verify: self.serve.group.check,
                project: !self.serve.group.check_answers,
                spares: self.serve.group.spares(false),
                trace_steps: self.serve.trace_steps.clone(),
                groups: self.serve.groups,
                draft: self.serve.draft,
                pass: self.serve.pass,
                ..Default::default()
            },
            api_key: self.serve.api_key.clone(),
            api_keys: self.serve.api_keys.clone(),
        })
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct SeedArgs {
    /// A GGUF file or a Hugging Face directory; default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Shards needed to compute (k).
    #[arg(long, default_value_t = 3)]
    pub(crate) k: usize,
    /// Rows of the code encoded at genesis (n ≥ k), one per node.
    #[arg(long, default_value_t = 5)]
    pub(crate) n: usize,
    /// Most rows the mesh may grow to as nodes join (then joiners become replicas); default:
    /// as many as keep every group of k within the numerics goal (docs/coding.md).
    #[arg(long)]
    pub(crate) max_rows: Option<usize>,
    /// Shard storage: f32, f16 (does not learn), or q8 (compact, on the integer code); default:
    /// q8 where the integer code has a row for every genesis node (k ≤ 5; 7 rows for k = 3),
    /// else f32; q4 (a 4-bit file's blocks, data rows only: n = k; issue 81).
    #[arg(long)]
    pub(crate) shard_format: Option<ShardFormat>,
    /// Requests do not train the model.
    #[arg(long)]
    pub(crate) no_learning: bool,
    /// How requests' gradients become updates: `adam` (Adam on the coded rank-16 adapters, the
    /// leader keeping the moments) or `sgd` (plain SGD on every weight).
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adam)]
    pub(crate) optimizer: OptimizerArg,
    /// Learning rate: the most an Adam step moves an adapter entry (in units of unit-length
    /// projection rows), or SGD's step; default: 5e-4 for Adam, 1e-4 for SGD.
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// Gradient clipping norm.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) clip: f32,
    /// Rank each update is compressed to, sent as f16; 0 sends exact f32 factors. Default: the
    /// adapters' rank (16) with `adam`, 8 with `sgd`.
    #[arg(long)]
    pub(crate) rank: Option<u32>,
    /// Requests a leader folds into one update (low-communication mode, needs rank > 0).
    #[arg(long, default_value_t = 1)]
    pub(crate) accumulate: u32,
    /// Linear outer momentum of a leader's updates (needs rank > 0).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) momentum: f32,
    #[command(flatten)]
    pub(crate) diloco: DilocoArgs,
    /// The mesh runs no canary gate: genesis measures no reference loss, and holders take an
    /// admitted trainer's updates without a verdict.
    #[arg(long)]
    pub(crate) no_canary_gate: bool,
    #[command(flatten)]
    pub(crate) net: NetArgs,
}

/// A model shape for random-weight benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SyntheticShape {
    /// SmolLM2-135M.
    Smollm2,
    /// Llama-3.2-1B (tied embeddings, llama3 rope scaling).
    #[value(name = "llama-3.2-1b")]
    Llama1b,
    /// Llama-3.1-8B.
    #[value(name = "llama-3.1-8b")]
    Llama8b,
}

impl SyntheticShape {
    /// The shape's configuration, as its Hugging Face `config.json` gives it.
    pub(crate) fn config(
        self,
    ) -> Result<node_core::model::LlamaConfig, node_core::model::ModelError> {
        use node_core::model::LlamaConfig;
        // The fields `LlamaConfig::from_hf_json` reads, as Meta's config.json files give them.
        let json = |hidden, ffn, layers, tied, factor: f32| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": {hidden}, "intermediate_size": {ffn},
                "num_hidden_layers": {layers}, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0, "max_position_embeddings": 131072,
                "tie_word_embeddings": {tied}, "rope_scaling": {{"rope_type": "llama3",
                "factor": {factor}, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}}}}"#
            )
        };
        match self {
            Self::Smollm2 => Ok(LlamaConfig::smollm2_135m()),
            Self::Llama1b => LlamaConfig::from_hf_json(&json(2048, 8192, 16, true, 32.0)),
            Self::Llama8b => LlamaConfig::from_hf_json(&json(4096, 14336, 32, false, 8.0)),
        }
    }
}

/// The optimizer a seed gives its mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OptimizerArg {
    /// Adam on the coded adapters.
    Adam,
    /// Plain SGD on every weight.
    Sgd,
}

impl OptimizerArg {
    /// The mesh's optimizer and its learning rate (`lr`, or the optimizer's default).
    pub(crate) fn with_lr(self, lr: Option<f32>) -> (node_core::mesh::Optimizer, f32) {
        use node_core::mesh::{DEFAULT_ADAM_LR, DEFAULT_SGD_LR, Optimizer};
        match self {
            Self::Adam => (Optimizer::AdamAdapters, lr.unwrap_or(DEFAULT_ADAM_LR)),
            Self::Sgd => (Optimizer::Sgd, lr.unwrap_or(DEFAULT_SGD_LR)),
        }
    }

    /// The learning settings of this optimizer at `lr` (or its default), else the defaults.
    pub(crate) fn learning(self, lr: Option<f32>) -> node_core::mesh::LearningConfig {
        let (optimizer, lr) = self.with_lr(lr);
        node_core::mesh::LearningConfig::of(optimizer, lr)
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct NodeArgs {
    /// A mesh node's address (a peer id is optional).
    #[arg(long)]
    pub(crate) bootstrap: Option<libp2p::Multiaddr>,
    /// Misbehave on purpose, to test and demonstrate verification: garbage answers, a shard
    /// scaled by 1 + 1e-3, a shard missing the first update received (stale), or claiming
    /// every update while applying none (lie-version).
    #[arg(long, value_enum)]
    pub(crate) inject_fault: Option<node::InjectedFault>,
    /// Run the node as a child process and start it again when it crashes (with a growing
    /// wait between crashes in a row).
    #[arg(long)]
    pub(crate) supervise: bool,
    #[command(flatten)]
    pub(crate) net: NetArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct EvalArgs {
    /// A mesh node's address.
    #[arg(long)]
    pub(crate) bootstrap: libp2p::Multiaddr,
    /// A UTF-8 text file.
    #[arg(long)]
    pub(crate) file: PathBuf,
    /// Tokens per chunk (a text shorter than a chunk is one chunk of its length).
    #[arg(long, default_value_t = 64)]
    pub(crate) chunk: usize,
    /// Most chunks evaluated (from the start of the file).
    #[arg(long, default_value_t = 16)]
    pub(crate) max_chunks: usize,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ReachArgs {
    /// The peer's address, ending in /p2p/<peer id>: a relay circuit
    /// (…/p2p/<relay>/p2p-circuit/p2p/<peer>) tries hole punching.
    pub(crate) addr: libp2p::Multiaddr,
    /// Where this probe listens (hole punching needs a QUIC socket).
    #[arg(long, default_value = "/ip4/0.0.0.0/udp/0/quic-v1")]
    pub(crate) listen: Vec<libp2p::Multiaddr>,
    /// Longest wait for hole punching, in seconds.
    #[arg(long, default_value_t = 15)]
    pub(crate) wait_s: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct StatusArgs {
    /// A mesh node's address.
    #[arg(long)]
    pub(crate) bootstrap: libp2p::Multiaddr,
    /// Print one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct GenerateArgs {
    /// Run on the mesh reached through this node, instead of in this process.
    #[arg(long)]
    pub(crate) bootstrap: Option<libp2p::Multiaddr>,
    /// How the group is checked, and its spares (mesh only).
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    /// How the forward passes travel (mesh only): `rounds` (this process decodes every stage),
    /// `hop` (the group's members send their coded outputs straight to each other and run the
    /// model between stages themselves; this process feeds the tokens and decodes the logits:
    /// a stage costs one network delay instead of a round trip), or `auto` (hop where a member
    /// is on another machine).
    #[arg(long, default_value_t = node_native::serve::engine::PassRoute::Rounds)]
    pub(crate) pass: node_native::serve::engine::PassRoute,
    /// The prompt.
    #[arg(long)]
    pub(crate) prompt: String,
    /// Shards needed to compute (k).
    #[arg(long, default_value_t = 3)]
    pub(crate) k: usize,
    /// Shards encoded (n ≥ k).
    #[arg(long, default_value_t = 5)]
    pub(crate) n: usize,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub(crate) max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Most drafted tokens checked in one forward pass (prompt lookup: tokens that followed
    /// the text's last words where they occurred before); 0 decodes a token a pass. By
    /// default 4 on a mesh, where a pass costs round trips, and 0 in this process, where a
    /// pass costs compute and drafts gain nothing (docs/perf.md).
    #[arg(long)]
    pub(crate) draft: Option<usize>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub(crate) chat: bool,
    /// A GGUF file or a Hugging Face directory; default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Also run the uncoded model and report whether the tokens agree.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Where to run (in this process only): cpu, gpu (the whole token on any wgpu adapter;
    /// fails without one) or auto (a hardware GPU when there is one, else the CPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: node_core::compute::gpu::DeviceChoice,
    /// Shard storage: f32 (exact to the code's error), f16 (half the bytes, see docs/perf.md)
    /// or q8 (compact, on the integer code); default: what `up` and `seed` give a mesh of n
    /// rows (q8 where the integer code has n rows, else f32); q4 data rows only (n = k).
    #[arg(long)]
    pub(crate) shard_format: Option<ShardFormat>,
    /// Run the request this many times on the mesh, learning after each (mesh only).
    #[arg(long, default_value_t = 1)]
    pub(crate) repeat: usize,
    /// Keep a copy of every learning update this leader publishes in this directory (signed,
    /// as holders take it; mesh only): holders fold updates into their snapshots and drop
    /// them, so this is the record of what a leader taught the mesh.
    #[arg(long)]
    pub(crate) keep_published: Option<PathBuf>,
    /// Publish every due learning update without the canary gate's check (mesh only): they
    /// carry no verdict, so a mesh that runs a gate (`seed` without `--no-canary-gate`)
    /// refuses them.
    #[arg(long)]
    pub(crate) no_canary_gate: bool,
    /// This leader's identity (a libp2p key file, made there if missing; mesh only); default:
    /// a fresh one.
    #[arg(long)]
    pub(crate) identity: Option<PathBuf>,
    /// The certificate by which the mesh admits the identity (`codedmesh admit`; mesh only):
    /// with it the leader publishes its own learning updates, without it the text of its
    /// requests goes to the bootstrap node's trainer.
    #[arg(long, requires = "identity")]
    pub(crate) cert: Option<PathBuf>,
    /// The request does not train the mesh (mesh only).
    #[arg(long)]
    pub(crate) no_learning: bool,
    /// Write every coded step to this file, one JSON line each: time, step, member, bytes,
    /// duration (mesh only).
    #[arg(long)]
    pub(crate) trace_steps: Option<PathBuf>,
}

/// A share between 0 and 1 (`--distil`).
fn share(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a share between 0 and 1")),
    }
}

/// The shard format a new mesh of `nodes` genesis rows gets: `chosen`, else compact (q8) where
/// the integer code has a row for every node, else f32.
pub(crate) fn mesh_format(chosen: Option<ShardFormat>, k: usize, nodes: usize) -> ShardFormat {
    let fits = nodes <= node_core::code::Generator::integer_capacity(k);
    chosen.unwrap_or(if fits {
        ShardFormat::Q8
    } else {
        ShardFormat::F32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_leader_takes_one_set_of_group_flags_with_one_rule_for_spares() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.command);
        // `up`'s members share this machine: no spare unless asked; its nodes are told so.
        let Ok(Command::Up(up)) = parse(&["codedmesh", "up", "--check", "2", "--no-learn"]) else {
            panic!("up parses");
        };
        let node_args: Vec<String> = up
            .serve
            .node_args(true)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        let after = |flag: &str| {
            let i = node_args.iter().position(|a| a == flag).unwrap();
            node_args[i + 1].clone()
        };
        assert_eq!(
            (after("--check"), after("--spares")),
            ("2".into(), "0".into())
        );
        assert!(node_args.contains(&"--no-learn".to_string()));
        // A leader over the network asks a spare unless told otherwise.
        let Ok(Command::Generate(g)) = parse(&["codedmesh", "generate", "--prompt", "hi"]) else {
            panic!("generate parses");
        };
        assert_eq!(g.group.spares(false), 1);
        assert_eq!(g.pass, node_native::serve::engine::PassRoute::Rounds);
        let Ok(Command::Generate(g)) = parse(&[
            "codedmesh",
            "generate",
            "--prompt",
            "hi",
            "--spares",
            "3",
            "--pass",
            "hop",
        ]) else {
            panic!("generate parses");
        };
        assert_eq!(g.group.options(true).spares, 3);
        assert_eq!(g.pass, node_native::serve::engine::PassRoute::Hop);
        assert!(parse(&["codedmesh", "generate", "--prompt", "hi", "--hop"]).is_err());
    }

    #[test]
    fn the_learning_bench_trains_as_ups_trainers_unless_told_otherwise() {
        let parse = |args: &[&str]| match Cli::try_parse_from(args).map(|c| c.command) {
            Ok(Command::Bench(b)) => (TrainedArg::trained(&b.train), b.floor, (b.replay, b.decay)),
            other => panic!("bench parses: {other:?}"),
        };
        let up = node_native::bench::learning::Trainer::AS_UP;
        assert_eq!(
            parse(&["codedmesh", "bench", "--learning"]),
            (up.trained, up.floor, (up.replay, up.decay))
        );
        let args = "codedmesh bench --learning --train head,attention,mlp --floor 0 --replay 64";
        let args: Vec<&str> = args.split(' ').chain(["--decay", "0.05"]).collect();
        let every = parse(&args);
        assert_eq!(every, (node_core::learn::Trained::ALL, 0.0, (64, 0.05)));
    }

    #[test]
    fn a_mesh_defaults_to_compact_shards_where_the_integer_code_reaches() {
        use ShardFormat::{F16, F32, Q8};
        // The integer code has 7 rows for k = 3 and none past k = 5.
        let default = [(3, 5), (3, 7), (3, 10), (6, 8)].map(|(k, n)| mesh_format(None, k, n));
        assert_eq!(default, [Q8, Q8, F32, F32]);
        // A chosen format stands (q8 with too many nodes is refused later, with its reason).
        assert_eq!(mesh_format(Some(F16), 3, 5), F16);
        assert_eq!(mesh_format(Some(F32), 3, 5), F32);
        let e = Q8.code(10, 3).expect_err("10 rows");
        assert!(e.to_string().contains("7 rows for k = 3"), "{e}");
    }
}

/// A part of the model whose adapters a trainer moves (`--train`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TrainedArg {
    /// The LM head (the tied embedding when tied).
    Head,
    /// Attention's projections.
    Attention,
    /// The SwiGLU projections.
    Mlp,
}

impl TrainedArg {
    /// The parts `parts` name.
    pub(crate) fn trained(parts: &[Self]) -> node_core::learn::Trained {
        node_core::learn::Trained {
            head: parts.contains(&Self::Head),
            attention: parts.contains(&Self::Attention),
            mlp: parts.contains(&Self::Mlp),
        }
    }
}
