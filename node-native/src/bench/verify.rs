//! `codedmesh bench --verify`: how well the residual check catches wrong members on the real
//! model, in one process: honest noise and false positives, detection with r = 1, location with
//! r = 2 for each kind of fault, and the smallest shard perturbation still caught.

use anyhow::{Result, bail};
use node_core::coded::{
    CodedGroup, InProcess, Member, NOISE_MARGIN, PROBE_MIN_FIT, PROBE_SIGMAS, ShardFormat,
    Transport, TransportError, UpdateProbe, VerifyConfig, measure_noise,
};
use node_core::learn::Update;
use node_core::model::{KvCache, LeaderWeights, Llama, ModelWeights};
use node_core::protocol::{self, StepResponse};

use crate::bench::Row;

/// Tokens in each served-like honest request's prompt.
const SERVED_PROMPT: usize = 16;
/// Single-token steps each served-like honest request takes after its prompt.
const SERVED_STEPS: usize = 8;

/// SplitMix64: reproducible trials without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// What the faulty row does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Honest,
    Garbage,
    Scale(f32),
    /// Misses the last learning update.
    Stale,
    /// Claims the group's version while holding the genesis shard (three updates behind).
    LieVersion,
    WrongRow,
}

/// Members at three versions: genesis, after two updates, after three (the group's).
struct Versions {
    genesis: Vec<Member>,
    two: Vec<Member>,
    three: Vec<Member>,
}

/// In-process members where row `bad` misbehaves.
struct Trial<'a> {
    v: &'a Versions,
    bad: usize,
    fault: Fault,
    seed: u64,
}

impl Trial<'_> {
    fn answer(&self, node: usize, request: &[u8]) -> Result<(usize, Vec<u8>), TransportError> {
        let fail = |reason: String| TransportError { node, reason };
        let (member, fault) = match (node == self.bad, self.fault) {
            (false, _) | (true, Fault::Honest) => (&self.v.three[node], Fault::Honest),
            (true, Fault::Stale) => (&self.v.two[node], Fault::Honest),
            (true, Fault::LieVersion) => (&self.v.genesis[node], Fault::Honest),
            (true, Fault::WrongRow) => (
                &self.v.three[(node + 1) % self.v.three.len()],
                Fault::WrongRow,
            ),
            (true, f) => (&self.v.three[node], f),
        };
        let answer = match member.handle_bytes(request) {
            StepResponse::Partial { mut values, .. } => {
                match fault {
                    Fault::Scale(f) => values.iter_mut().for_each(|v| *v *= f),
                    Fault::Garbage => {
                        let scale = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        let mut rng = Rng(self.seed ^ request.len() as u64);
                        values
                            .iter_mut()
                            .for_each(|v| *v = scale * (2.0 * rng.unit() - 1.0));
                    }
                    _ => {}
                }
                // Every answer goes out under the row it was asked of (a wrong row lies).
                StepResponse::Partial {
                    node: node as u32,
                    values,
                }
            }
            failed => failed,
        };
        Ok((
            node,
            protocol::encode(&answer).map_err(|e| fail(e.to_string()))?,
        ))
    }
}

impl Transport for Trial<'_> {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        _need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        node_core::compute::par::map(members, |&n| self.answer(n, request))
            .into_iter()
            .collect()
    }
}

/// Counts over trials of one kind.
#[derive(Debug, Default)]
struct Tally {
    trials: usize,
    flagged: usize,
    located: usize,
    correct: usize,
    wrongly_blamed: usize,
}

/// Encodes the model in `format`, makes three learning updates (f16 shards do not learn) and
/// measures every kind of fault.
pub fn run(
    weights: &ModelWeights,
    prompts: &[Vec<u32>],
    trials: usize,
    honest: usize,
    format: ShardFormat,
) -> Result<Vec<Row>> {
    if prompts.len() < 3 {
        bail!("need three prompts to train on");
    }
    let learns = format != ShardFormat::F16;
    let g = format.code(5, 3)?;
    let cfg = weights.cfg.clone();
    let mut norms = LeaderWeights::from_model(weights);
    eprintln!("encoding 5 rows ({format:?}) and making 3 learning updates at the default rate…");
    let genesis = InProcess::encode(weights, &g, format, &|_, _| {})?
        .members()
        .to_vec();
    let mut current = genesis.clone();
    let mut two = Vec::new();
    let mut made = Vec::new();
    if !learns {
        two = genesis.clone();
    }
    for (i, p) in prompts.iter().take(if learns { 3 } else { 0 }).enumerate() {
        let mesh = InProcess::new(current.clone())?;
        let mut group = CodedGroup::new(cfg.clone(), g.clone(), &[0, 1, 2], mesh)?;
        let llama = Llama::new(cfg.clone(), norms.clone())?;
        let learning = node_core::mesh::LearningConfig::default();
        let update = Update::from_gradients(
            futures::executor::block_on(llama.gradients(&mut group, p))?,
            node_core::mesh::DEFAULT_SGD_LR,
            learning.clip,
        );
        for m in &mut current {
            update.apply_to_shards(m.shards_mut())?;
        }
        update.apply_to_norms(&mut norms);
        // Compact shards learn each update's projection (docs/coding.md).
        made.push((i as u64 + 1, std::sync::Arc::new(update.taken_by(format))));
        if i == 1 {
            two = current.clone();
        }
    }
    // The threshold as a mesh sets it at genesis: measured honest noise times the margin.
    let calibration = 30;
    let (noise, mesh) = measure_noise(&cfg, &norms, &g, InProcess::new(current)?, calibration)?;
    let v = Versions {
        genesis,
        two,
        three: mesh.into_members(),
    };
    let llama = Llama::new(cfg.clone(), norms)?;
    let verify = VerifyConfig {
        extra: 1,
        noise: NOISE_MARGIN * noise,
        project: false,
    };
    let mut rng = Rng(7);
    let forward = |trial: Trial, rows: &[usize], extra: usize, token: u32| {
        let mut group = CodedGroup::new(cfg.clone(), g.clone(), rows, trial)?;
        group.set_verify(VerifyConfig { extra, ..verify });
        if !made.is_empty() {
            group.set_probe(Some(UpdateProbe::new(made.clone(), g.n())));
        }
        let out = futures::executor::block_on(llama.forward(
            &mut group,
            &[token],
            &mut KvCache::new(&cfg),
        ));
        anyhow::Ok((out, group.stats().clone()))
    };
    let mut rows_out = Vec::new();
    // Honest requests: r = 1 over a random 4-group in random order.
    let started = std::time::Instant::now();
    let (mut false_pos, mut worst, mut worst_fit) = (0usize, 0.0f64, 0.0f64);
    for i in 0..honest {
        let mut rows: Vec<usize> = (0..5).collect();
        shuffle(&mut rows, &mut rng);
        rows.truncate(4);
        let token = rng.below(cfg.vocab) as u32;
        let trial = Trial {
            v: &v,
            bad: usize::MAX,
            fault: Fault::Honest,
            seed: i as u64,
        };
        let (out, stats) = forward(trial, &rows, 1, token)?;
        if out.is_err() || !stats.caught.is_empty() {
            false_pos += 1;
        }
        worst = worst.max(stats.max_pass_ratio);
        worst_fit = worst_fit.max(stats.max_probe_sigmas);
        if (i + 1) % 1000 == 0 {
            eprintln!(
                "honest {}/{honest} ({:.0} s)",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    rows_out.push(Row {
        what: format!(
            "honest requests (r = 1, random 4-groups, 1 random token, {} rounds each)",
            2 + 4 * cfg.layers
        ),
        value: format!(
            "{false_pos} flagged of {honest}; largest residual {worst:.3} of the threshold; largest update fit {worst_fit:.1} σ"
        ),
    });
    // Honest requests shaped like served ones: a prompt, then steps on its KV cache (the
    // calibration's shape; single tokens on an empty cache once hid false alarms).
    let served = (honest / 10).max(1);
    let (mut served_pos, mut served_worst) = (0usize, 0.0f64);
    for i in 0..served {
        let mut rows: Vec<usize> = (0..5).collect();
        shuffle(&mut rows, &mut rng);
        rows.truncate(4);
        let trial = Trial {
            v: &v,
            bad: usize::MAX,
            fault: Fault::Honest,
            seed: (honest + i) as u64,
        };
        let mut group = CodedGroup::new(cfg.clone(), g.clone(), &rows, trial)?;
        group.set_verify(verify);
        if !made.is_empty() {
            group.set_probe(Some(UpdateProbe::new(made.clone(), g.n())));
        }
        let prompt: Vec<u32> = (0..SERVED_PROMPT)
            .map(|_| rng.below(cfg.vocab) as u32)
            .collect();
        let mut cache = KvCache::new(&cfg);
        let mut ok =
            futures::executor::block_on(llama.forward(&mut group, &prompt, &mut cache)).is_ok();
        for _ in 0..SERVED_STEPS {
            let token = rng.below(cfg.vocab) as u32;
            ok &= futures::executor::block_on(llama.forward(&mut group, &[token], &mut cache))
                .is_ok();
        }
        if !ok || !group.stats().caught.is_empty() {
            served_pos += 1;
        }
        served_worst = served_worst.max(group.stats().max_pass_ratio);
    }
    rows_out.push(Row {
        what: format!(
            "honest served-like requests (r = 1, random 4-groups, a {SERVED_PROMPT}-token prompt then {SERVED_STEPS} steps on its cache)"
        ),
        value: format!(
            "{served_pos} flagged of {served}; largest residual {served_worst:.3} of the threshold"
        ),
    });
    eprintln!(
        "served-like {served}/{served} ({:.0} s)",
        started.elapsed().as_secs_f64()
    );
    let kinds = [
        ("garbage", Fault::Garbage),
        ("shard scaled by 1 + 1e-3", Fault::Scale(1.0 + 1e-3)),
        ("stale (missing the last update)", Fault::Stale),
        (
            "lies about its version (3 updates behind)",
            Fault::LieVersion,
        ),
        ("answers with another row's result", Fault::WrongRow),
    ];
    for (name, fault) in kinds {
        if !learns && matches!(fault, Fault::Stale | Fault::LieVersion) {
            rows_out.push(Row {
                what: format!("{name}: detected with r = 1"),
                value: format!("does not apply: {format:?} shards do not learn"),
            });
            continue;
        }
        let (d, l) = measure(&v, fault, trials, &mut rng, &forward)?;
        rows_out.push(Row {
            what: format!("{name}: detected with r = 1"),
            value: format!(
                "{} of {} ({:.1}%)",
                d.flagged,
                d.trials,
                pct(d.flagged, d.trials)
            ),
        });
        rows_out.push(Row {
            what: format!("{name}: located with r = 2, answer correct"),
            value: format!(
                "{} located, {} correct of {}; honest rows blamed: {}",
                l.located, l.correct, l.trials, l.wrongly_blamed
            ),
        });
        eprintln!("{name} done ({:.0} s)", started.elapsed().as_secs_f64());
    }
    // The smallest perturbation still caught: shard scaled by 1 + ε.
    let mut smallest = None;
    for eps in [1e-4f32, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7] {
        let n = (trials / 10).max(20);
        let d = measure_detect(&v, Fault::Scale(1.0 + eps), n, &mut rng, &forward)?;
        rows_out.push(Row {
            what: format!("shard scaled by 1 + {eps:.0e}: detected with r = 1"),
            value: format!(
                "{} of {} ({:.1}%)",
                d.flagged,
                d.trials,
                pct(d.flagged, d.trials)
            ),
        });
        if d.flagged == d.trials {
            smallest = Some(eps);
        }
    }
    rows_out.push(Row {
        what: "smallest relative perturbation caught in every trial".into(),
        value: smallest.map_or("none tried".into(), |e| format!("{e:.0e}")),
    });
    rows_out.push(Row {
        what: "update probe".into(),
        value: if learns {
            format!(
                "the 3 updates of the group's version; a member is caught when one update's fit reaches {PROBE_SIGMAS} σ, covers at least {PROBE_MIN_FIT} of the update and beats the next row's by {PROBE_SIGMAS}² σ²"
            )
        } else {
            "not run: the members hold no updates".into()
        },
    });
    rows_out.push(Row {
        what: "threshold".into(),
        value: format!(
            "{:.2e} × condition number of the decoding k ({NOISE_MARGIN} × the largest honest residual per unit of κ over {calibration} calibration requests, {noise:.2e})",
            verify.noise
        ),
    });
    Ok(rows_out)
}

fn pct(a: usize, b: usize) -> f64 {
    100.0 * a as f64 / b.max(1) as f64
}

fn shuffle(v: &mut [usize], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i + 1);
        v.swap(i, j);
    }
}

type Forward<'a> = dyn Fn(
        Trial<'a>,
        &[usize],
        usize,
        u32,
    ) -> Result<(
        Result<Vec<f32>, node_core::model::ModelError>,
        node_core::coded::ExecStats,
    )> + 'a;

/// r = 1 trials: the bad row among the first four members, a fifth honest one behind them.
fn measure_detect<'a>(
    v: &'a Versions,
    fault: Fault,
    trials: usize,
    rng: &mut Rng,
    forward: &Forward<'a>,
) -> Result<Tally> {
    let mut t = Tally::default();
    for i in 0..trials {
        let bad = rng.below(5);
        let mut rows: Vec<usize> = (0..5).filter(|&r| r != bad).collect();
        shuffle(&mut rows, rng);
        rows.insert(rng.below(4), bad);
        let token = rng.below(v.three[0].shards().cfg.vocab) as u32;
        let trial = Trial {
            v,
            bad,
            fault,
            seed: i as u64,
        };
        let (out, stats) = forward(trial, &rows, 1, token)?;
        t.trials += 1;
        if out.is_err() || !stats.caught.is_empty() || stats.members_dropped > 0 {
            t.flagged += 1;
        }
    }
    Ok(t)
}

/// Detection with r = 1, then location with r = 2 (all five rows answer) against the honest
/// logits of the four good rows.
fn measure<'a>(
    v: &'a Versions,
    fault: Fault,
    trials: usize,
    rng: &mut Rng,
    forward: &Forward<'a>,
) -> Result<(Tally, Tally)> {
    let d = measure_detect(v, fault, trials, rng, forward)?;
    let mut l = Tally::default();
    for i in 0..trials {
        let bad = rng.below(5);
        let mut rows: Vec<usize> = (0..5).collect();
        shuffle(&mut rows, rng);
        let token = rng.below(v.three[0].shards().cfg.vocab) as u32;
        let good: Vec<usize> = rows.iter().copied().filter(|&r| r != bad).collect();
        let honest = Trial {
            v,
            bad,
            fault: Fault::Honest,
            seed: 0,
        };
        let (want, _) = forward(honest, &good, 0, token)?;
        let trial = Trial {
            v,
            bad,
            fault,
            seed: i as u64,
        };
        let (out, stats) = forward(trial, &rows, 2, token)?;
        l.trials += 1;
        if stats.caught.iter().any(|c| c.node == bad) {
            l.located += 1;
        }
        l.wrongly_blamed += stats.caught.iter().filter(|c| c.node != bad).count();
        if let (Ok(got), Ok(want)) = (out, want) {
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            if err <= 1e-4 * scale {
                l.correct += 1;
            }
        }
    }
    Ok((d, l))
}
