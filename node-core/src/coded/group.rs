//! The leader's side: send a stage to the group, decode the answers, reassemble the outputs.

use std::sync::atomic::{AtomicUsize, Ordering};

use web_time::{Duration, Instant};

use super::{CodedError, Member, ShardFormat, ShardSet};
use crate::code::{Decoder, Generator};
use crate::model::{LinearExec, LlamaConfig, ModelError, ModelWeights, Stage};
use crate::protocol::{self, StepRequest, StepResponse};

/// A transport could not reach a member or get its answer.
#[derive(Debug, thiserror::Error)]
#[error("node {node}: {reason}")]
pub struct TransportError {
    /// The node index it failed to reach.
    pub node: usize,
    /// Why.
    pub reason: String,
}

/// Carries one encoded request to several members and brings back their encoded answers.
pub trait Transport {
    /// Sends `request` to each of `nodes`; answers come back in the same order.
    fn round(&mut self, nodes: &[usize], request: &[u8]) -> Result<Vec<Vec<u8>>, TransportError>;
}

/// Members living in this process, indexed by node; messages still go through the codec.
#[derive(Debug, Clone)]
pub struct InProcess {
    members: Vec<Member>,
}

impl InProcess {
    /// A transport to these members; each must sit at the index of its node.
    pub fn new(members: Vec<Member>) -> Result<Self, CodedError> {
        for (i, m) in members.iter().enumerate() {
            if m.shards().node != i {
                return Err(CodedError::BadRequest(format!(
                    "member at index {i} holds node {}",
                    m.shards().node
                )));
            }
        }
        Ok(Self { members })
    }

    /// Encodes every node's shards of a model (nodes in parallel) and serves them in process;
    /// `progress(done, total)` counts matrices over all nodes.
    pub fn encode(
        weights: &ModelWeights,
        generator: &Generator,
        format: ShardFormat,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Self, CodedError> {
        let nodes: Vec<usize> = (0..generator.n()).collect();
        let done = AtomicUsize::new(0);
        let sets = crate::compute::par::map(&nodes, |&node| {
            ShardSet::encode(weights, generator, node, format, &mut |_, total| {
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                progress(d, nodes.len() * total)
            })
        });
        let members = sets
            .into_iter()
            .map(|s| s.map(Member::new))
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(members)
    }

    /// The members.
    pub fn members(&self) -> &[Member] {
        &self.members
    }
}

impl Transport for InProcess {
    fn round(&mut self, nodes: &[usize], request: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        // Members run side by side, as they would on separate machines.
        let members = &self.members;
        crate::compute::par::map(nodes, |&node| {
            let fail = |reason: String| TransportError { node, reason };
            let member = members
                .get(node)
                .ok_or_else(|| fail("no such member".into()))?;
            let answer = match protocol::decode::<StepRequest>(request) {
                Ok(req) => member.handle(&req),
                Err(e) => StepResponse::Failed {
                    reason: e.to_string(),
                },
            };
            protocol::encode(&answer).map_err(|e| fail(e.to_string()))
        })
        .into_iter()
        .collect()
    }
}

/// Counters of a leader's coded execution.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecStats {
    /// Rounds sent (one per stage or embedding lookup).
    pub rounds: u64,
    /// Bytes sent to each member (summed over members).
    pub bytes_sent: u64,
    /// Bytes received from members (summed over members).
    pub bytes_received: u64,
    /// Time spent waiting for members (compute and transport).
    pub member_time: Duration,
    /// Time spent decoding and reassembling.
    pub decode_time: Duration,
}

/// A leader's ephemeral group: k members with a decoder for their rows.
#[derive(Debug)]
pub struct CodedGroup<T: Transport> {
    cfg: LlamaConfig,
    generator: Generator,
    decoder: Decoder,
    transport: T,
    stats: ExecStats,
}

impl<T: Transport> CodedGroup<T> {
    /// A group of `nodes` (exactly k distinct rows of `generator`) reached through `transport`.
    pub fn new(
        cfg: LlamaConfig,
        generator: Generator,
        nodes: &[usize],
        transport: T,
    ) -> Result<Self, CodedError> {
        let decoder = Decoder::new(&generator, nodes)?;
        Ok(Self {
            cfg,
            generator,
            decoder,
            transport,
            stats: ExecStats::default(),
        })
    }

    /// The members' node indices.
    pub fn nodes(&self) -> &[usize] {
        self.decoder.nodes()
    }

    /// Condition number of the group's generator submatrix.
    pub fn condition_number(&self) -> f64 {
        self.decoder.condition_number()
    }

    /// Counters so far.
    pub fn stats(&self) -> &ExecStats {
        &self.stats
    }

    /// Clears the counters.
    pub fn reset_stats(&mut self) {
        self.stats = ExecStats::default();
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Sends one request to the group and decodes the answers into `[block j'][c]`.
    fn run(&mut self, req: &StepRequest, c: usize) -> Result<Vec<f32>, CodedError> {
        let bytes = protocol::encode(req)?;
        let nodes = self.decoder.nodes().to_vec();
        let started = Instant::now();
        let answers = self.transport.round(&nodes, &bytes)?;
        self.stats.member_time += started.elapsed();
        self.stats.rounds += 1;
        self.stats.bytes_sent += (bytes.len() * nodes.len()) as u64;
        let started = Instant::now();
        let m = self.generator.sub_blocks();
        let mut parts = Vec::with_capacity(nodes.len());
        for (&node, answer) in nodes.iter().zip(&answers) {
            self.stats.bytes_received += answer.len() as u64;
            let member_err = |reason: String| CodedError::Member { node, reason };
            match protocol::decode::<StepResponse>(answer).map_err(|e| member_err(e.to_string()))? {
                StepResponse::Partial { node: got, values } => {
                    if got as usize != node {
                        return Err(member_err(format!("answered as node {got}")));
                    }
                    if values.len() != m * c {
                        return Err(member_err(format!(
                            "answered {} values, expected {}",
                            values.len(),
                            m * c
                        )));
                    }
                    parts.push(values);
                }
                StepResponse::Failed { reason } => return Err(member_err(reason)),
            }
        }
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let mut out = vec![0.0f32; self.generator.k() * m * c];
        self.decoder.decode(&refs, &mut out)?;
        self.stats.decode_time += started.elapsed();
        Ok(out)
    }

    fn linear_coded(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Result<Vec<Vec<f32>>, CodedError> {
        let shapes = stage.shapes(&self.cfg);
        let lens: Vec<usize> = shapes
            .iter()
            .map(|&(out, _)| self.generator.block_len(out))
            .collect();
        let c: usize = lens.iter().map(|l| t * l).sum();
        let req = StepRequest::Matmul {
            stage,
            t: t as u32,
            x: x.to_vec(),
        };
        let decoded = self.run(&req, c)?;
        let started = Instant::now();
        let blocks = self.generator.k() * self.generator.sub_blocks();
        let mut outputs = Vec::with_capacity(shapes.len());
        let mut offset = 0;
        for (&(out, _), &l) in shapes.iter().zip(&lens) {
            let mut y = vec![0.0f32; t * out];
            for j in 0..blocks {
                let block = &decoded[j * c + offset..j * c + offset + t * l];
                for (tok, src) in block.chunks_exact(l).enumerate() {
                    let first = j * l;
                    if first >= out {
                        break;
                    }
                    let n = l.min(out - first);
                    y[tok * out + first..tok * out + first + n].copy_from_slice(&src[..n]);
                }
            }
            offset += t * l;
            outputs.push(y);
        }
        self.stats.decode_time += started.elapsed();
        Ok(outputs)
    }

    fn embed_coded(&mut self, tokens: &[u32]) -> Result<Vec<f32>, CodedError> {
        let (vocab, d) = (self.cfg.vocab, self.cfg.hidden);
        let l = self.generator.block_len(vocab);
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id: bad, vocab }.into());
        }
        let rows = tokens.iter().map(|&t| (t as usize % l) as u32).collect();
        let c = tokens.len() * d;
        let decoded = self.run(&StepRequest::EmbedRows { rows }, c)?;
        let mut x = Vec::with_capacity(c);
        for (i, &t) in tokens.iter().enumerate() {
            let j = t as usize / l;
            x.extend_from_slice(&decoded[j * c + i * d..j * c + (i + 1) * d]);
        }
        Ok(x)
    }
}

fn exec_err(stage: Stage, e: CodedError) -> ModelError {
    ModelError::Exec {
        stage,
        message: e.to_string(),
    }
}

impl<T: Transport> LinearExec for CodedGroup<T> {
    fn linear(&mut self, stage: Stage, x: &[f32], t: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        self.linear_coded(stage, x, t)
            .map_err(|e| exec_err(stage, e))
    }

    fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.embed_coded(tokens)
            .map_err(|e| ModelError::Embedding(e.to_string()))
    }
}
