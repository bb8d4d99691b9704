//! How a leader reaches its members: the [`Transport`] a group sends its rounds through, and
//! [`InProcess`], members in this process.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::code::Generator;
use crate::coded::{CodedError, Member, ShardFormat, ShardSet};
use crate::model::ModelWeights;
use crate::protocol;

/// A transport could not reach a member or get its answer.
#[derive(Debug, thiserror::Error)]
#[error("node {node}: {reason}")]
pub struct TransportError {
    /// The node index it failed to reach.
    pub node: usize,
    /// Why.
    pub reason: String,
}

/// Carries one encoded request to a group's members and brings back their encoded answers.
/// In-process transports finish at the first poll; network ones wait on their members.
#[allow(
    async_fn_in_trait,
    reason = "the browser's transport is !Send by nature; native callers name the concrete type"
)]
pub trait Transport {
    /// Sends `request` to `members` and returns the answers of at least `need` distinct nodes,
    /// first come first served, as `(node, bytes)`. A transport that loses a member may drop it
    /// from `members` and ask a replacement it adds there.
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError>;

    /// Sends each node its own request and returns every node's answer (backward steps, where
    /// each member gets a different input). The default asks them one after the other.
    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        let mut out = Vec::with_capacity(requests.len());
        for (node, request) in requests {
            let mut members = vec![node];
            let answers = self.round(&mut members, &request, 1).await?;
            let answer = answers
                .into_iter()
                .find(|(n, _)| *n == node)
                .ok_or_else(|| TransportError {
                    node,
                    reason: "no answer".into(),
                })?;
            out.push(answer);
        }
        Ok(out)
    }

    /// Names the step the next rounds belong to (`Qkv(3)`, `LmHead backward`…), for logs and
    /// step traces; the default ignores it.
    fn label(&mut self, _what: &str) {}

    /// The number of the last [`Transport::round`], as [`Transport::late_answers`] names it;
    /// `None` (the default) where answers never come late.
    fn last_round(&self) -> Option<u64> {
        None
    }

    /// Answers that came after their round had its `need` (so were not used there), as
    /// `(round, node, bytes)`, taken out; none by default.
    fn late_answers(&mut self) -> Vec<(u64, usize, Vec<u8>)> {
        Vec::new()
    }

    /// Whether this leader may ask a round again later on its own: its rounds are its own
    /// asks of each member, not run in step by every member of a hop group (the default: no).
    /// A round's check can then wait for an answer still to come.
    fn asks_alone(&self) -> bool {
        false
    }
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
            if m.row() != i {
                return Err(CodedError::BadRequest(format!(
                    "member at index {i} answers as node {}",
                    m.row()
                )));
            }
        }
        Ok(Self { members })
    }

    /// Encodes every genesis row's shards of a model (rows in parallel) and serves them in
    /// process; `progress(done, total)` counts matrices over all rows.
    pub fn encode(
        weights: &ModelWeights,
        generator: &Generator,
        format: ShardFormat,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Self, CodedError> {
        let nodes: Vec<usize> = (0..generator.genesis_rows()).collect();
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

    /// The members back.
    pub fn into_members(self) -> Vec<Member> {
        self.members
    }

    /// The members, to apply a learning update to each.
    pub fn members_mut(&mut self) -> &mut [Member] {
        &mut self.members
    }
}

impl InProcess {
    /// One member's encoded answer to an encoded request.
    fn answer(&self, node: usize, request: &[u8]) -> Result<(usize, Vec<u8>), TransportError> {
        let fail = |reason: String| TransportError { node, reason };
        let member = self
            .members
            .get(node)
            .ok_or_else(|| fail("no such member".into()))?;
        protocol::encode(&member.handle_bytes(request))
            .map(|bytes| (node, bytes))
            .map_err(|e| fail(e.to_string()))
    }
}

impl Transport for InProcess {
    async fn round(
        &mut self,
        nodes: &mut Vec<usize>,
        request: &[u8],
        _need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        // Members run side by side, as they would on separate machines.
        crate::compute::par::map(nodes, |&node| self.answer(node, request))
            .into_iter()
            .collect()
    }

    fn asks_alone(&self) -> bool {
        true
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        crate::compute::par::map(&requests, |(node, request)| self.answer(*node, request))
            .into_iter()
            .collect()
    }
}
