//! A learning update spreading from its leader to every live holder, in virtual time, as
//! `node_core::holder::spread` does it: the leader hands the notice to at most `fanout`
//! holders and each passes it on to at most `fanout` more (a tree over the live holders in
//! random order); each pulls the pieces from the holder that told it, which serves each piece
//! as soon as it has it; a holder whose sender dies notices after `notice` (the node's
//! `PULL_AFTER`) and pulls what it lacks from a random holder that has the whole update. Beside
//! it, the protocol before: the leader hands the update to every holder itself.
//!
//! Modelled: every holder's uplink and downlink (a sender shares its uplink evenly among the
//! holders it feeds, and a pipeline runs at its slowest share upstream), one `hop_latency` a
//! piece relayed, the time a holder takes to check and apply the update, and holders dying at
//! random while it spreads (exponential lifetimes at the churn rate; the leader lives). Not
//! modelled: a pull source's other uploads (pulls find idle uplinks), congestion beyond the
//! uplink share, a piece's request (a holder keeps two asked at once, so its pipeline keeps its
//! sender's rate; a relay starts a round trip after its sender's piece, not one delay), and the
//! gossip that announces the update (a holder that has received nothing notices its sender's death the same
//! way, after `notice`).

use std::time::Duration;

use node_core::code::Generator;
use node_core::learn::{Precision, StageFactors, Update};
use node_core::model::{LeaderWeights, LlamaConfig, Stage};

use crate::sim::SimRng;

/// Bytes a second of `mbit` Mbit/s.
pub fn mbit(mbit: f64) -> f64 {
    mbit * 1e6 / 8.0
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct SpreadConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Live holders when the update is published (the leader not among them).
    pub holders: usize,
    /// The signed update's bytes.
    pub update_bytes: usize,
    /// Bytes of a piece (the unit a holder forwards as soon as it has it).
    pub piece: usize,
    /// Holders the leader, and each holder, hands the update to.
    pub fanout: usize,
    /// The leader's uplink, bytes a second.
    pub leader_up: f64,
    /// A holder's uplink, bytes a second.
    pub up: f64,
    /// A holder's downlink, bytes a second.
    pub down: f64,
    /// One-way delay a piece takes from one holder to the next.
    pub hop_latency: Duration,
    /// The time a holder takes to check the signature and digest and apply the update.
    pub apply: Duration,
    /// How long a holder waits for its sender's next piece before it pulls from another.
    pub notice: Duration,
    /// Fraction of the holders that die per minute.
    pub churn_per_minute: f64,
}

impl Default for SpreadConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            holders: 1000,
            update_bytes: 4_992_604,
            piece: 256 * 1024,
            fanout: 3,
            leader_up: mbit(10.0),
            up: mbit(10.0),
            down: mbit(50.0),
            hop_latency: Duration::from_millis(50),
            apply: Duration::from_millis(500),
            notice: Duration::from_secs(2),
            churn_per_minute: 0.10,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SpreadReport {
    /// Bytes the leader sent, over the update's size.
    pub leader_copies: f64,
    /// Seconds from publishing until a holder applied the update: p50, p99 and the last, over
    /// the holders alive when they applied it.
    pub applied_s: (f64, f64, f64),
    /// Relays from the leader to a holder (its depth in the tree, plus one a pull): p50, p99.
    pub rounds: (usize, usize),
    /// Holders that died before they applied it.
    pub died: usize,
    /// Holders that pulled after their sender died.
    pub pulled: usize,
    /// Bytes a holder received beyond the update's, on average (a piece in flight when its
    /// sender died is fetched again whole).
    pub duplicate_bytes: f64,
    /// Holders alive that never got it (no holder had it to pull from).
    pub missed: usize,
}

/// A holder's stream of the update: from when its first piece arrived to its last, at what
/// rate, and how many relays from the leader.
#[derive(Debug, Clone, Copy)]
struct Stream {
    first: f64,
    last: f64,
    rate: f64,
    rounds: usize,
}

/// The update spread over `cfg.holders` holders by a tree of `cfg.fanout`, with pulls after a
/// sender's death.
pub fn run_spread(cfg: &SpreadConfig) -> SpreadReport {
    let n = cfg.holders;
    let (s, piece, f) = (
        cfg.update_bytes as f64,
        (cfg.piece.min(cfg.update_bytes).max(1)) as f64,
        cfg.fanout.max(1),
    );
    let hop = cfg.hop_latency.as_secs_f64();
    let mut rng = SimRng::new(cfg.seed);
    // Lifetimes from the publish: exponential at the churn rate.
    let per_s = -(1.0 - cfg.churn_per_minute.clamp(0.0, 0.999)).ln() / 60.0;
    let death: Vec<f64> = (0..n)
        .map(|_| {
            if per_s > 0.0 {
                -(1.0 - rng.unit()).ln() / per_s
            } else {
                f64::INFINITY
            }
        })
        .collect();
    // The tree: holder i's children are f·(i+1) … f·(i+1)+f−1; the leader's are 0 … f−1.
    let parent = |i: usize| (i >= f).then(|| i / f - 1);
    let children = |i: Option<usize>| {
        let first = i.map_or(0, |i| f * (i + 1));
        (first..(first + f).min(n)).len()
    };
    let mut streams: Vec<Stream> = Vec::with_capacity(n);
    let (mut pulled, mut duplicate) = (0usize, 0.0f64);
    for i in 0..n {
        let p = parent(i);
        let (from, up, alive_until) = match p {
            None => (
                Stream {
                    first: 0.0,
                    last: 0.0,
                    rate: f64::INFINITY,
                    rounds: 0,
                },
                cfg.leader_up,
                f64::INFINITY,
            ),
            Some(p) => (streams[p], cfg.up, death[p]),
        };
        let rate = from.rate.min(up / children(p) as f64).min(cfg.down);
        let first = from.first + piece / rate + hop;
        let last = (from.last + piece / rate + hop).max(first + (s - piece) / rate);
        let mut mine = Stream {
            first,
            last,
            rate,
            rounds: from.rounds + 1,
        };
        if alive_until < last {
            // The sender died mid-stream: what came before stays, the piece in flight is lost,
            // and the rest comes from a holder that has it all by the time this one notices.
            let got = ((alive_until - (first - piece / rate)) * rate).clamp(0.0, s);
            let kept = (got / piece).floor() * piece;
            duplicate += got - kept;
            let noticed = alive_until.max(0.0) + cfg.notice.as_secs_f64();
            let sources: Vec<usize> = (0..i)
                .filter(|&j| streams[j].last <= noticed && death[j] > noticed)
                .collect();
            let source = if sources.is_empty() {
                // Nobody has it yet: the first to have it (and live then) serves.
                (0..i)
                    .filter(|&j| death[j] > streams[j].last)
                    .min_by(|&a, &b| streams[a].last.total_cmp(&streams[b].last))
            } else {
                Some(sources[(rng.next_u64() % sources.len() as u64) as usize])
            };
            let Some(j) = source else {
                streams.push(Stream {
                    first: f64::INFINITY,
                    last: f64::INFINITY,
                    rate,
                    rounds: usize::MAX,
                });
                continue;
            };
            pulled += 1;
            let start = noticed.max(streams[j].last);
            let rate = cfg.up.min(cfg.down);
            mine = Stream {
                first: start + piece / rate + hop,
                last: start + (s - kept) / rate + hop,
                rate,
                rounds: streams[j].rounds + 1,
            };
        }
        streams.push(mine);
    }
    let apply = cfg.apply.as_secs_f64();
    let mut applied = Vec::new();
    let mut rounds = Vec::new();
    let (mut died, mut missed) = (0, 0);
    for (i, st) in streams.iter().enumerate() {
        let at = st.last + apply;
        // A holder no source reached is missed, whenever it dies.
        if !at.is_finite() {
            missed += 1;
        } else if death[i] < at {
            died += 1;
        } else {
            applied.push(at);
            rounds.push(st.rounds);
        }
    }
    applied.sort_by(f64::total_cmp);
    rounds.sort_unstable();
    let q = |p| quantile(&applied, p).unwrap_or(f64::NAN);
    let qr = |p| quantile(&rounds, p).unwrap_or(0);
    SpreadReport {
        leader_copies: children(None) as f64,
        applied_s: (q(0.5), q(0.99), q(1.0)),
        rounds: (qr(0.5), qr(0.99)),
        died,
        pulled,
        duplicate_bytes: duplicate / n.max(1) as f64,
        missed,
    }
}

/// The `p` quantile of sorted `v` (its last value at 1).
fn quantile<T: Copy>(v: &[T], p: f64) -> Option<T> {
    let i = ((v.len() as f64 * p) as usize).min(v.len().checked_sub(1)?);
    v.get(i).copied()
}

/// Today's protocol: the leader hands the update to each of `holders` itself, its uplink
/// shared among them; seconds until the last has it, applied.
pub fn leader_hands_out_s(cfg: &SpreadConfig) -> f64 {
    let n = cfg.holders as f64;
    let rate = (cfg.leader_up / n).min(cfg.down);
    cfg.update_bytes as f64 / rate + cfg.hop_latency.as_secs_f64() + cfg.apply.as_secs_f64()
}

/// The shape of Llama-3.1-8B.
pub fn llama_8b() -> LlamaConfig {
    LlamaConfig {
        hidden: 4096,
        ffn: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        vocab: 128_256,
        norm_eps: 1e-5,
        rope_theta: 500_000.0,
        max_seq: 8192,
        tied_embeddings: false,
        family: node_core::model::Family::Llama,
        rope_freq_factors: Vec::new(),
    }
}

/// The wire bytes of a learning update of a model of `cfg` (rank-`rank` f16 factors of every
/// stage, `embed_tokens` rows of the lookup's gradient, every norm's gradient), made by the
/// project's own encoder; with `share` (a generator), the output factors are one row's encoded
/// share, `G[i,:]·dy`, as a holder of that row alone would need.
pub fn update_bytes(
    cfg: &LlamaConfig,
    rank: usize,
    embed_tokens: usize,
    share: Option<&Generator>,
) -> usize {
    let stages = Stage::all(cfg)
        .into_iter()
        .map(|stage| {
            let shapes = stage.shapes(cfg);
            let inp = shapes.first().map_or(0, |&(_, i)| i);
            StageFactors {
                stage,
                rows: rank as u32,
                x: vec![0.0; rank * inp],
                dy: shapes
                    .iter()
                    .map(|&(out, _)| {
                        let out = share.map_or(out, |g| g.block_len(out) * g.sub_blocks());
                        vec![0.0; rank * out]
                    })
                    .collect(),
            }
        })
        .collect();
    let gains = vec![0.0; cfg.hidden];
    let update = Update {
        step: 0.0,
        t: rank as u32,
        stages,
        embed_tokens: (0..embed_tokens as u32).collect(),
        embed_dx: vec![0.0; embed_tokens * cfg.hidden],
        norms: LeaderWeights {
            attn_norm: vec![gains.clone(); cfg.layers],
            ffn_norm: vec![gains.clone(); cfg.layers],
            final_norm: gains,
            ..Default::default()
        },
        precision: Precision::F16,
    };
    update.encode().len()
}
