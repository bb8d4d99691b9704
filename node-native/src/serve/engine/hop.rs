//! The serving batch's passes one hop per stage ([`node_core::net::hop`]), where the leader's
//! rules route them ([`node_core::lead::Route`]): the batch's sequences then live on the
//! members, and start again there whenever the hop group changes.

use node_core::net::hop::HopLeader;

use super::*;
use crate::lead::hop::NetFeedLink;

/// A serving group's hop side: the hop group while it runs.
#[derive(Debug, Default)]
pub(super) struct HopSide {
    /// The hop group, while passes run on it.
    pub(super) leader: Option<HopLeader<NetFeedLink>>,
    /// Its members as formed: row and holder.
    pub(super) members: crate::lead::hop::Members,
    /// Changes whenever the sequences' keys and values move (a hop group formed or let go):
    /// a sequence started at another epoch starts again.
    pub(super) epoch: u64,
}

impl HopSide {
    /// Lets the hop group go: the sequences start again wherever they run next.
    pub(super) fn drop_group(&mut self) {
        if self.leader.take().is_some() {
            self.epoch += 1;
        }
    }
}

impl Lead {
    /// The hop group, formed now over the rounds group's members other than this node (k, the
    /// checked ones and the spares); why not when there are too few.
    pub(super) fn hop_group(&mut self) -> Result<&mut HopLeader<NetFeedLink>, String> {
        if self.hop.leader.is_none() {
            let f = self.formed.as_ref().ok_or("no group")?;
            let ctx = &self.ctx;
            let (check, spares) = (ctx.cfg.verify, ctx.cfg.spares);
            let (runtime, chosen) = (&ctx.runtime, self.leader.route() == PassRoute::Auto);
            let (leader, members) = crate::lead::hop::lead_group(
                runtime,
                &ctx.client,
                &ctx.manifest,
                f,
                check,
                spares,
                chosen,
            )
            .map_err(|e| format!("{e:#}"))?;
            self.trace_hop_group(&members);
            self.hop.members = members;
            tracing::info!(
                rows = ?leader.rows(),
                network_per_round_us = self.leader.network_per_round().map(|d| d.as_micros() as u64),
                "passes go one hop per stage"
            );
            self.hop.leader = Some(leader);
            self.hop.epoch += 1;
        }
        self.hop
            .leader
            .as_mut()
            .ok_or_else(|| "no hop group".into())
    }

    /// Writes the hop group's members to the step trace, one line each (step `hop group`,
    /// outcome `formed`): its passes' stages go member to member, not through the leader, so
    /// this is where the trace says who computes them.
    fn trace_hop_group(&self, members: &crate::lead::hop::Members) {
        let Some(trace) = &self.trace else {
            return;
        };
        let context = format!("hop group {}", self.hop.epoch + 1);
        for &(row, peer) in members {
            trace.record(&crate::lead::steplog::StepRecord {
                unix_ms: crate::lead::steplog::unix_ms(),
                context: &context,
                step: "hop group",
                round: 0,
                member: row,
                peer: peer.to_string(),
                local: false,
                bytes_sent: 0,
                bytes_received: 0,
                ms: 0.0,
                compute_ms: 0.0,
                outcome: "formed",
            });
        }
        trace.flush();
    }

    /// Counts what the hop group's rounds did since the last call, and reports members it
    /// caught.
    pub(super) async fn after_hop(&mut self) {
        let Some(leader) = self.hop.leader.as_mut() else {
            return;
        };
        let s = leader.stats().clone();
        leader.reset_stats();
        let none = std::collections::BTreeMap::new();
        let (rows, holders) = self
            .formed
            .as_ref()
            .map_or((&none, &[][..]), |f| (&f.rows, &f.holders[..]));
        self.ctx.count_rounds(s, rows, holders).await;
    }
}
