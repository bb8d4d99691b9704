//! What a node reports at `/metrics`, in Prometheus' text format: the requests it leads
//! (tokens/s, latency, time to first token), its coded groups (formed, members replaced,
//! decode residuals, rounds checked, members caught), learning (updates published and applied),
//! gossip traffic and the mesh's health.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A node's metrics; clones share the same values.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// What this node refused from peers (updates, notices, reports), by reason
    /// ([`node_core::holder::Refusal`]); read from node-core's counts when scraped.
    pub refused: Family<Vec<(String, String)>, Counter>,
    /// Frames from peers refused (past their kind's size, the node's budget for frames in
    /// flight, or a request that does not decode), by reason; read from node-core's counts
    /// when scraped.
    pub frames_refused: Family<Vec<(String, String)>, Counter>,
    /// Per API key (its name): requests, requests over its rate, requests handed to the
    /// trainer, requests past its learning budget.
    keys: Family<Vec<(String, String)>, Counter>,
    /// Requests finished (any outcome but an error).
    pub requests: Counter,
    /// Requests that failed after they were admitted.
    pub request_errors: Counter,
    /// Requests turned away with 429 because the queue was full.
    pub requests_rejected: Counter,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub tokens_generated: Counter,
    /// Tokens generated per second over the last 10 s.
    pub tokens_per_second: Gauge<f64, AtomicU64>,
    /// Seconds from a request's arrival to its last token.
    pub request_latency: Histogram,
    /// Seconds from a request's arrival to its first token.
    pub time_to_first_token: Histogram,
    /// Requests waiting for a place in the batch.
    pub queue_depth: Gauge,
    /// Sequences being generated together.
    pub active_sequences: Gauge,
    /// Forward steps run (one coded round per stage for the whole batch).
    pub forward_steps: Counter,
    /// Of those, steps run one hop per stage (members pass coded outputs to each other).
    pub hop_steps: Counter,
    /// Hop passes fed again without members that failed them (one's parts did not come).
    pub hop_reruns: Counter,
    /// Coded groups formed.
    pub groups_formed: Counter,
    /// Groups let go to be formed again with a row that came back or a much closer holder.
    pub groups_regrouped: Counter,
    /// Serving threads holding a coded group now.
    pub serving_groups: Gauge,
    /// Forward steps that failed (the group is then formed again).
    pub forward_step_failures: Counter,
    /// Members dropped from a group and replaced (failed, stalled or caught).
    pub members_replaced: Counter,
    /// Coded rounds checked against the code (by extra answers or by projection).
    pub rounds_checked: Counter,
    /// Of those, rounds checked against the check row's secret projections.
    pub rounds_projected: Counter,
    /// Per forward step, the largest residual of a passing check over its threshold.
    pub decode_residual_ratio: Histogram,
    /// Members caught answering against the code.
    pub members_caught: Counter,
    /// Rounds whose answers disagreed with the code and no member could be told wrong (the
    /// leader's next groups take one more check).
    pub rounds_unlocated: Counter,
    /// Learning updates this node published as a leader.
    pub updates_published: Counter,
    /// Learning updates applied to this node's shard.
    pub updates_applied: Counter,
    /// Snapshots saved: kept updates folded into the shard blob.
    pub snapshots: Counter,
    /// Finished requests waiting to be trained on.
    pub train_backlog: Gauge,
    /// Finished requests served but not trained on: the trainer was too far behind.
    pub train_dropped: Counter,
    /// Finished requests that asked to be learnt from on a learning mesh.
    pub learn_requests: Counter,
    /// Requests whose tokens went into a gradient.
    pub train_trained: Counter,
    /// Requests whose gradient went into an update the canary gate passed and this node
    /// published.
    pub train_learnt: Counter,
    /// Requests not trained on: their caller's learning budget was spent.
    pub train_over_budget: Counter,
    /// Updates the canary gate refused to publish.
    pub updates_refused: Counter,
    /// The mesh's canary loss as of the last update the gate judged (after it when it was
    /// published, before it when refused).
    pub canary_loss: Gauge<f64, AtomicU64>,
    /// Mean next-token loss of the last training batch.
    pub loss: Gauge<f64, AtomicU64>,
    /// Bytes of gossip received.
    pub gossip_bytes: Counter,
    /// Heartbeats from peers this node's view refused (another model, out of shape, a network
    /// coordinate out of range, no room for a new peer).
    pub heartbeats_refused: Counter,
    /// Bytes of learning updates this node sent: with a leader's notices, or as pieces served
    /// to holders pulling them.
    pub update_bytes_sent: Counter,
    /// Bytes of learning updates this node received: handed to it, or fetched catching up.
    pub update_bytes_received: Counter,
    /// Bytes of the learning updates this node published as a leader (each counted once).
    pub update_bytes_published: Counter,
    /// Pieces of learning updates this node received that it already had.
    pub update_duplicate_pieces: Counter,
    /// Bytes of running sums received while building other nodes' rows along a chain.
    pub chain_bytes: Counter,
    /// Tokens drafted by prompt lookup and checked in forward passes.
    pub draft_tokens: Counter,
    /// Of those, the tokens kept.
    pub draft_accepted: Counter,
    /// Healthy rows at the mesh version (set when scraped).
    pub healthy_rows: Gauge,
    /// Rows of the code.
    pub rows: Gauge,
    /// Rows needed to compute.
    pub k: Gauge,
    /// Bytes of the coded row this node holds (its shard set).
    pub row_bytes: Gauge,
    /// Resident memory of this node's process (set when scraped; Linux).
    pub resident_bytes: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric at zero, registered under the `codedmesh` prefix.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("codedmesh");
        let seconds = || Histogram::new(exponential_buckets(0.005, 2.0, 16));
        let m = Self {
            registry: Arc::new(Registry::default()),
            refused: Family::default(),
            frames_refused: Family::default(),
            keys: Family::default(),
            requests: Counter::default(),
            request_errors: Counter::default(),
            requests_rejected: Counter::default(),
            prompt_tokens: Counter::default(),
            tokens_generated: Counter::default(),
            tokens_per_second: Gauge::default(),
            request_latency: seconds(),
            time_to_first_token: seconds(),
            queue_depth: Gauge::default(),
            active_sequences: Gauge::default(),
            forward_steps: Counter::default(),
            hop_steps: Counter::default(),
            hop_reruns: Counter::default(),
            groups_formed: Counter::default(),
            groups_regrouped: Counter::default(),
            serving_groups: Gauge::default(),
            forward_step_failures: Counter::default(),
            members_replaced: Counter::default(),
            rounds_checked: Counter::default(),
            rounds_projected: Counter::default(),
            decode_residual_ratio: Histogram::new(exponential_buckets(1e-4, 4.0, 10)),
            members_caught: Counter::default(),
            rounds_unlocated: Counter::default(),
            updates_published: Counter::default(),
            updates_applied: Counter::default(),
            snapshots: Counter::default(),
            train_backlog: Gauge::default(),
            train_dropped: Counter::default(),
            learn_requests: Counter::default(),
            train_trained: Counter::default(),
            train_learnt: Counter::default(),
            train_over_budget: Counter::default(),
            updates_refused: Counter::default(),
            canary_loss: Gauge::default(),
            loss: Gauge::default(),
            gossip_bytes: Counter::default(),
            heartbeats_refused: Counter::default(),
            update_bytes_sent: Counter::default(),
            update_bytes_received: Counter::default(),
            update_duplicate_pieces: Counter::default(),
            update_bytes_published: Counter::default(),
            chain_bytes: Counter::default(),
            draft_tokens: Counter::default(),
            draft_accepted: Counter::default(),
            healthy_rows: Gauge::default(),
            rows: Gauge::default(),
            k: Gauge::default(),
            row_bytes: Gauge::default(),
            resident_bytes: Gauge::default(),
        };
        r.register("requests", "Requests finished", m.requests.clone());
        r.register(
            "request_errors",
            "Requests that failed after they were admitted",
            m.request_errors.clone(),
        );
        r.register(
            "requests_rejected",
            "Requests turned away with 429 because the queue was full",
            m.requests_rejected.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "tokens_generated",
            "Tokens generated",
            m.tokens_generated.clone(),
        );
        r.register(
            "tokens_per_second",
            "Tokens generated per second over the last 10 s",
            m.tokens_per_second.clone(),
        );
        r.register(
            "request_latency_seconds",
            "Seconds from a request's arrival to its last token",
            m.request_latency.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting for a place in the batch",
            m.queue_depth.clone(),
        );
        r.register(
            "active_sequences",
            "Sequences being generated together",
            m.active_sequences.clone(),
        );
        r.register(
            "forward_steps",
            "Forward steps run, one coded round per stage for the whole batch",
            m.forward_steps.clone(),
        );
        r.register(
            "hop_steps",
            "Forward steps run one hop per stage, the members passing coded outputs to each other",
            m.hop_steps.clone(),
        );
        r.register(
            "hop_reruns",
            "Hop passes fed again without members that failed them, so every member decodes the same rows",
            m.hop_reruns.clone(),
        );
        r.register(
            "groups_formed",
            "Coded groups formed",
            m.groups_formed.clone(),
        );
        r.register(
            "groups_regrouped",
            "Groups formed again with a row that came back or a much closer holder",
            m.groups_regrouped.clone(),
        );
        r.register(
            "serving_groups",
            "Serving threads holding a coded group now",
            m.serving_groups.clone(),
        );
        r.register(
            "forward_step_failures",
            "Forward steps that failed; the group is formed again",
            m.forward_step_failures.clone(),
        );
        r.register(
            "members_replaced",
            "Members dropped from a group and replaced",
            m.members_replaced.clone(),
        );
        r.register(
            "rounds_checked",
            "Coded rounds checked against the code (by extra answers or by projection)",
            m.rounds_checked.clone(),
        );
        r.register(
            "rounds_projected",
            "Coded rounds checked against the check row's secret projections",
            m.rounds_projected.clone(),
        );
        r.register(
            "decode_residual_ratio",
            "Per forward step, the largest residual of a passing check over its threshold",
            m.decode_residual_ratio.clone(),
        );
        r.register(
            "members_caught",
            "Members caught answering against the code",
            m.members_caught.clone(),
        );
        r.register(
            "rounds_unlocated",
            "Rounds whose answers disagreed with the code and no member could be told wrong",
            m.rounds_unlocated.clone(),
        );
        r.register(
            "updates_published",
            "Learning updates this node published as a leader",
            m.updates_published.clone(),
        );
        r.register(
            "updates_applied",
            "Learning updates applied to this node's shard",
            m.updates_applied.clone(),
        );
        r.register(
            "update_bytes_sent",
            "Bytes of learning updates sent: with a leader's notices, or as pieces served to holders pulling them",
            m.update_bytes_sent.clone(),
        );
        r.register(
            "update_bytes_received",
            "Bytes of learning updates received: with a notice, or as pieces pulled",
            m.update_bytes_received.clone(),
        );
        r.register(
            "update_bytes_published",
            "Bytes of the learning updates this node published as a leader, each counted once",
            m.update_bytes_published.clone(),
        );
        r.register(
            "update_duplicate_pieces",
            "Pieces of learning updates received that this node already had",
            m.update_duplicate_pieces.clone(),
        );
        r.register(
            "snapshots",
            "Snapshots saved: kept learning updates folded into the shard blob",
            m.snapshots.clone(),
        );
        r.register(
            "train_backlog",
            "Finished requests waiting to be trained on",
            m.train_backlog.clone(),
        );
        r.register(
            "train_dropped",
            "Finished requests served but not trained on: the trainer was too far behind",
            m.train_dropped.clone(),
        );
        r.register(
            "learn_requests",
            "Finished requests that asked to be learnt from on a learning mesh",
            m.learn_requests.clone(),
        );
        r.register(
            "train_trained",
            "Requests whose tokens went into a gradient",
            m.train_trained.clone(),
        );
        r.register(
            "train_learnt",
            "Requests whose gradient went into an update the canary gate passed and this node published",
            m.train_learnt.clone(),
        );
        r.register(
            "train_over_budget",
            "Requests not trained on: their caller's learning budget was spent",
            m.train_over_budget.clone(),
        );
        r.register(
            "updates_refused",
            "Learning updates the canary gate refused to publish",
            m.updates_refused.clone(),
        );
        r.register(
            "canary_loss",
            "The mesh's canary loss as of the last learning update the gate judged (after it if published, before it if refused)",
            m.canary_loss.clone(),
        );
        r.register(
            "loss",
            "Mean next-token loss of the last training batch",
            m.loss.clone(),
        );
        r.register(
            "gossip_bytes",
            "Bytes of gossip received",
            m.gossip_bytes.clone(),
        );
        r.register(
            "heartbeats_refused",
            "Heartbeats from peers the view refused (another model, out of shape, a coordinate out of range, no room)",
            m.heartbeats_refused.clone(),
        );
        r.register(
            "sessions_local",
            "Sessions this node opened with members over a local socket (on this machine)",
            crate::hold::session::OPENED_LOCAL.clone(),
        );
        r.register(
            "sessions_libp2p",
            "Sessions this node opened with members over libp2p",
            crate::hold::session::OPENED_LIBP2P.clone(),
        );
        r.register(
            "chain_bytes",
            "Bytes of running sums received while building other nodes' rows along a chain",
            m.chain_bytes.clone(),
        );
        r.register(
            "draft_tokens",
            "Tokens drafted by prompt lookup and checked in forward passes",
            m.draft_tokens.clone(),
        );
        r.register(
            "draft_accepted",
            "Drafted tokens the model agreed with and kept",
            m.draft_accepted.clone(),
        );
        r.register(
            "healthy_rows",
            "Healthy rows at the mesh version",
            m.healthy_rows.clone(),
        );
        r.register("rows", "Rows of the code", m.rows.clone());
        r.register("k", "Rows needed to compute", m.k.clone());
        r.register(
            "row_bytes",
            "Bytes of the coded row this node holds",
            m.row_bytes.clone(),
        );
        r.register(
            "refused",
            "Learning updates, notices and reports this node refused from peers, by reason (a stranger's signature, out of turn, past the mesh's sizes or gate …)",
            m.refused.clone(),
        );
        r.register(
            "frames_refused",
            "Frames from peers refused: past the size their kind needs, past the node's budget for frames in flight, a request that does not decode (a list past its bound), or a local session's shared memory that may shrink, is another size or holds a position past its ring",
            m.frames_refused.clone(),
        );
        r.register(
            "api_key",
            "API requests by key name and what became of them (requests, rate_limited, finished, taught, forwarded, over_budget)",
            m.keys.clone(),
        );
        r.register(
            "resident_memory_bytes",
            "Resident memory of this node's process (Linux; set when scraped)",
            m.resident_bytes.clone(),
        );
        Self {
            registry: Arc::new(r),
            ..m
        }
    }

    /// The counter of `what` (requests, rate_limited, finished, taught, forwarded,
    /// over_budget) of the API key named `key`.
    pub fn by_key(&self, what: &str, key: &str) -> Counter {
        self.keys
            .get_or_create(&vec![
                ("key".to_string(), key.to_string()),
                ("what".to_string(), what.to_string()),
            ])
            .clone()
    }

    /// Each of `keys`' requests this node finished and those handed to training (its own
    /// trainer's or, not admitted to write, another's), for those with any.
    pub fn key_shares<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a str>,
    ) -> Vec<node_core::holder::KeyShare> {
        let count = |what: &str, key: &str| {
            let labels = vec![
                ("key".to_string(), key.to_string()),
                ("what".to_string(), what.to_string()),
            ];
            self.keys.get(&labels).map_or(0, |c| c.get())
        };
        keys.into_iter()
            .map(|key| node_core::holder::KeyShare {
                key: key.to_string(),
                requests: count("finished", key),
                trained: count("taught", key) + count("forwarded", key),
            })
            .filter(|k| k.requests > 0)
            .collect()
    }

    /// The metrics in Prometheus' text exposition format, the resident memory read now.
    pub fn render(&self) -> String {
        for why in node_core::holder::Refusal::ALL {
            let c = self
                .refused
                .get_or_create(&vec![("reason".to_string(), why.label().to_string())]);
            c.inc_by(why.count().saturating_sub(c.get()));
        }
        let frames = [
            ("oversized", &node_core::net::frames::OVERSIZED),
            ("over_budget", &node_core::net::frames::OVER_BUDGET),
            ("undecodable", &node_core::net::frames::UNDECODABLE),
            (
                "session_memory",
                &crate::hold::session::local::MEMORY_REFUSED,
            ),
        ];
        for (reason, n) in frames {
            let c = (self.frames_refused).get_or_create(&vec![("reason".into(), reason.into())]);
            c.inc_by(
                n.load(std::sync::atomic::Ordering::Relaxed)
                    .saturating_sub(c.get()),
            );
        }
        if let Some(rss) = resident_bytes() {
            self.resident_bytes
                .set(i64::try_from(rss).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::warn!("encoding metrics: {e}");
        }
        out
    }
}

/// This process's resident memory (`VmRSS` of /proc/self/status), where there is one.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_keys_share_counts_its_finished_requests_and_those_handed_to_training() {
        let m = Metrics::new();
        for _ in 0..4 {
            m.by_key("requests", "alice").inc();
            m.by_key("finished", "alice").inc();
        }
        m.by_key("taught", "alice").inc_by(2);
        m.by_key("forwarded", "alice").inc();
        m.by_key("requests", "bob").inc();
        let shares = m.key_shares(["alice", "bob", "carol"]);
        assert_eq!(
            shares,
            vec![node_core::holder::KeyShare {
                key: "alice".into(),
                requests: 4,
                trained: 3,
            }]
        );
        assert_eq!(shares[0].share(), 0.75);
    }
}
