//! A leader's group inside the node: formed when needed, kept while it works, regrouped on
//! failure, as its [`node_core::lead::Leader`] rules; what the serving and the training task
//! each hold, and the shell the serving task's steps run over.

use node_core::lead::{Failure, LeadShell, Looking, Measured, PassRoute, Route};

use super::*;

/// A leader's group inside the node, formed when needed and kept while it works: what the
/// serving and the training task each hold.
pub(super) struct Lead {
    pub(super) ctx: EngineContext,
    /// A serving group's place among the node's serving groups (the trainer's has none).
    pub(super) slot: Option<(usize, Arc<Shared>)>,
    pub(super) formed: Option<Formed>,
    /// Its rules and its batch of sequences (the trainer's stays empty).
    pub(super) leader: node_core::lead::Leader<Served>,
    pub(super) trace: Option<StepLog>,
    /// The serving tasks this group's rounds wait for (the trainer's: it computes only
    /// while they have nothing to serve).
    pub(super) yield_to: Option<Arc<Shared>>,
    /// The group's passes one hop per stage, when they go so.
    pub(super) hop: HopSide,
    /// The serving task's steps so far (the step trace's context).
    pub(super) steps: u64,
}

impl Lead {
    /// A group whose passes travel as `route` says (the trainer's backward rounds need the
    /// leader: [`PassRoute::Rounds`]).
    pub(super) fn new(ctx: EngineContext, trace: Option<StepLog>, route: PassRoute) -> Self {
        let limits = BatchLimits {
            max_batch: ctx.cfg.max_batch,
            step_tokens: ctx.cfg.step_tokens,
        };
        let (k, cfg) = (ctx.manifest.generator.k(), &ctx.cfg);
        let leader =
            node_core::lead::Leader::new(&ctx.manifest.cfg, limits, k, cfg.verify, cfg.spares)
                .with_route(route);
        Self {
            ctx,
            slot: None,
            formed: None,
            leader,
            trace,
            yield_to: None,
            hop: HopSide::default(),
            steps: 0,
        }
    }

    /// The mesh's view from the node's loop.
    pub(super) async fn info(&self) -> Result<MeshInfo> {
        let (tx, rx) = oneshot::channel();
        self.ctx
            .info
            .send(InfoRequest(tx))
            .await
            .map_err(|_| anyhow!("the node is stopping"))?;
        rx.await.map_err(|_| anyhow!("the node is stopping"))
    }

    /// The group, once the leader's rules let a pass run ([`node_core::lead::ready`]):
    /// formed (again) if there is none, after the backoff of a run of failed passes, and let go
    /// for a row that came back when it is short; why not when the mesh cannot give one.
    pub(super) async fn group(&mut self) -> Result<&mut Formed, String> {
        self.route().await?;
        self.formed.as_mut().ok_or_else(|| "no group".to_string())
    }

    /// The group made ready as [`Lead::group`] does, and how the next pass travels.
    pub(super) async fn route(&mut self) -> Result<Route, String> {
        node_core::lead::ready(self).await
    }

    /// A pass on the group failed (`moved`: it met members at another version): the group
    /// goes, formed again after the rules' backoff.
    pub(super) fn pass_failed(&mut self, moved: bool) {
        self.drop_group();
        let failure = Failure { moved, hop: false };
        let _ = self.leader.failed(Instant::now(), failure);
    }

    /// Lets the group go (it is formed again when next needed).
    pub(super) fn drop_group(&mut self) {
        self.formed = None;
        self.leader.let_go();
        self.hop.drop_group();
        if let Some((slot, shared)) = &self.slot {
            shared.set_busy(*slot, Vec::new());
        }
    }

    /// Writes out the step trace.
    pub(super) fn flush_trace(&self) {
        if let Some(t) = &self.trace {
            t.flush();
        }
    }

    /// Counts what the group's rounds did since the last call, and reports members it caught.
    pub(super) async fn after_rounds(&mut self) {
        self.flush_trace();
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        let s = f.group.stats().clone();
        f.group.reset_stats();
        let computed = f.group.transport().stats().compute;
        let unlocated = s.unlocated > 0;
        if unlocated {
            tracing::warn!(
                "a wrong answer could not be located: the next group takes one more check"
            );
        }
        let measured = Measured {
            rounds: s.rounds,
            waited: s.member_time,
            computed,
            unlocated,
        };
        self.leader.measured(Instant::now(), measured);
        if s.members_dropped > 0 {
            // Replacements came from free rows: the other serving groups must now avoid them
            // (and may use the holders this one let go).
            let t = f.group.transport();
            f.members = f
                .group
                .nodes()
                .iter()
                .filter_map(|&r| t.peer_of(r))
                .collect();
            if let Some((slot, shared)) = &self.slot {
                shared.set_busy(*slot, f.members.clone());
            }
        }
        self.ctx.count_rounds(s, &f.rows, &f.holders).await;
    }

    /// Moves the group to a version every member now holds, with its norm gains; forms it
    /// again when that is not possible.
    pub(super) fn move_to(&mut self, moved: Option<&([u8; 32], LeaderWeights)>) {
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        match moved.map(|(v, n)| (v, Llama::new(self.ctx.manifest.cfg.clone(), n.clone()))) {
            Some((version, Ok(llama))) => {
                // The members' keys and values were made at the old version: a hop group forms
                // again at the new one.
                self.hop.drop_group();
                f.group.transport_mut().set_version(*version);
                f.group.weights_moved();
                f.version = *version;
                f.llama = llama;
            }
            _ => self.drop_group(),
        }
    }
}

/// The node's leader as its rules drive it. The first serving group takes the best holders;
/// every other one leaves out the holders the others compute with. Each pass goes over the
/// leader's rounds or one hop per stage, as the rules route it.
impl LeadShell<Served> for Lead {
    fn leader(&mut self) -> &mut node_core::lead::Leader<Served> {
        &mut self.leader
    }

    fn rows(&self) -> Vec<usize> {
        (self.formed.as_ref()).map_or_else(Vec::new, |f| f.group.nodes().to_vec())
    }

    async fn wait_until(&mut self, until: Instant) {
        tokio::time::sleep_until(until.into()).await
    }

    async fn form(&mut self, checks: usize) -> Result<bool, String> {
        self.drop_group();
        let avoid = match &self.slot {
            Some((slot, shared)) if *slot > 0 => shared.busy_except(*slot),
            _ => Default::default(),
        };
        let mut opts = GroupOptions::new(checks, self.ctx.cfg.spares);
        opts.trace.clone_from(&self.trace);
        opts.group.avoid = avoid;
        opts.group.project = self.ctx.cfg.project;
        opts.group.probed = self.ctx.probed.clone();
        let formed = form_group(
            &self.ctx.client,
            &self.ctx.manifest,
            || self.info(),
            Some(&self.ctx.local),
            &opts,
        )
        .await;
        let mut f = formed.map_err(|e| {
            let why = format!("{e:#}");
            if matches!(self.slot, Some((slot, _)) if slot > 0) {
                tracing::debug!("no further group: {why}");
            } else {
                tracing::warn!("no group: {why}");
            }
            why
        })?;
        if let Some(serving) = &self.yield_to {
            let serving = serving.clone();
            f.group.transport_mut().set_gate(serving.training_turns());
        }
        tracing::info!(
            members = ?f.group.nodes(),
            live = f.live_rows,
            condition_number = f.condition_number,
            version = node_core::mesh::hex(&f.version[..8]),
            "formed a group"
        );
        self.ctx.metrics.groups_formed.inc();
        if let Some((slot, shared)) = &self.slot {
            shared.set_busy(*slot, f.members.clone());
        }
        let far = crate::lead::remote::far(&f);
        self.formed = Some(f);
        Ok(far)
    }

    /// Not another serving group's holder, nor this node's own row when it is not a member. A
    /// hop group looks only for a much closer hop group (its sequences live on its members,
    /// and start again on the new one): a short one goes on short.
    async fn look(&mut self, looking: &Looking) -> Option<usize> {
        let version = self.formed.as_ref().map(|f| f.version)?;
        let whole = looking.rows.len() >= looking.wanted;
        if self.hop.leader.is_some() && !whole {
            return None;
        }
        let mut avoid = match &self.slot {
            Some((slot, shared)) => shared.busy_except(*slot),
            None => Default::default(),
        };
        let me = self.ctx.client.peer_id();
        avoid.insert(me);
        let info = self.info().await.ok()?;
        if self.hop.leader.is_some() {
            return node_core::lead::closer_hop_row(&info, &self.hop.members, &avoid, me);
        }
        if whole {
            // Whole: a much closer group, if the view now knows one.
            let f = self.formed.as_ref()?;
            let rows = f.holders_of(f.group.nodes());
            let g = &self.ctx.manifest.generator;
            let extra = looking.wanted.saturating_sub(g.k());
            return node_core::lead::closer_row(&info, g, &rows, extra, &avoid, Some(me));
        }
        let left = self.formed.as_ref()?.left(&looking.rows);
        looking.in_view(&info, &version, &avoid, &left)
    }

    fn regroup(&mut self, row: usize, looking: &Looking) {
        let members = &looking.rows;
        if members.len() >= looking.wanted {
            tracing::info!(
                row,
                ?members,
                "a much closer group: forming the group again"
            );
        } else {
            tracing::info!(row, ?members, "a row came back: forming the group again");
        }
        self.ctx.metrics.groups_regrouped.inc();
        self.drop_group();
    }

    /// A hop pass needs the hop group (formed now if there is none); a rounds pass never
    /// follows a hop group's (the members' keys and values are not the leader's), so the hop
    /// group goes and its sequences start again on the rounds.
    async fn route(&mut self, route: Route) -> Result<u64, String> {
        match route {
            Route::Hop => {
                self.hop_group()?;
            }
            Route::Rounds => self.hop.drop_group(),
        }
        Ok(self.hop.epoch)
    }

    async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        let batch = self.leader.batch();
        let span = tracing::info_span!(
            "forward_step",
            step = self.steps,
            batch = batch.len(),
            rows = batch.rows(),
            hop = self.hops()
        );
        let result = if self.hops() {
            self.hop_pass().instrument(span).await
        } else {
            self.rounds_pass().instrument(span).await
        };
        self.ctx.metrics.forward_steps.inc();
        result
    }

    fn failed(&mut self, why: &ModelError) -> Option<Failure> {
        self.ctx.metrics.forward_step_failures.inc();
        let attempt = self.leader.failures() + 1;
        let hop = self.hops();
        // A rounds pass that failed on members at another version: the mesh moved on.
        let moved = !hop
            && (self.formed.as_ref()).is_some_and(|f| f.group.transport().met_another_version());
        if moved {
            tracing::info!(
                attempt,
                "members are at another version (the mesh moved on): forming the group again"
            );
        } else {
            tracing::warn!(attempt, hop, "a forward step failed: {why}");
        }
        self.drop_group();
        Some(Failure { moved, hop })
    }
}

impl Lead {
    /// Whether this step's pass goes one hop per stage: the route chose a hop group and it
    /// formed.
    fn hops(&self) -> bool {
        self.hop.leader.is_some()
    }

    /// The batch's pass through the leader's rounds; notes whether a failure met members at
    /// another version.
    async fn rounds_pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        let Some(f) = self.formed.as_mut() else {
            return Err(ModelError::NoGroup("no group".into()));
        };
        let batch = self.leader.batch_mut();
        let ids: Vec<String> = (batch.entries().iter())
            .map(|s| s.job.job.id.to_string())
            .collect();
        f.group
            .transport_mut()
            .set_context(format!("step {} req {}", self.steps, ids.join(",")));
        let mut items = batch.rounds_items();
        let result = f.llama.forward_batch(&mut f.group, &mut items).await;
        drop(items);
        self.after_rounds().await;
        result
    }

    /// The batch's pass one hop per stage: the members hold the sequences.
    async fn hop_pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        let Some(leader) = self.hop.leader.as_mut() else {
            return Err(ModelError::NoGroup("no hop group".into()));
        };
        let seqs: Vec<node_core::net::hop::HopSeq<'_>> = (self.leader.batch().passes())
            .map(|(s, pass)| node_core::net::hop::HopSeq {
                seq: s.job.id,
                pass,
            })
            .collect();
        let reruns = leader.reruns();
        let result = leader.forward_batch(&seqs).await;
        let reran = leader.reruns() - reruns;
        drop(seqs);
        self.ctx.metrics.hop_reruns.inc_by(reran);
        if result.is_ok() {
            self.ctx.metrics.hop_steps.inc();
        }
        self.after_hop().await;
        result
    }
}

impl EngineContext {
    /// Counts a group's rounds (checked, projected, members replaced) and reports the members
    /// they caught to the node and to every holder.
    pub(super) async fn count_rounds(
        &self,
        s: node_core::coded::ExecStats,
        rows: &std::collections::BTreeMap<usize, PeerId>,
        holders: &[PeerId],
    ) {
        let m = &self.metrics;
        m.rounds_checked.inc_by(s.verified_rounds);
        m.rounds_projected.inc_by(s.projected_rounds);
        m.members_replaced.inc_by(s.members_dropped);
        m.rounds_unlocated.inc_by(s.unlocated);
        if s.verified_rounds > 0 {
            m.decode_residual_ratio
                .observe(s.max_pass_ratio.max(s.max_projected_ratio));
        }
        if s.caught.is_empty() {
            return;
        }
        m.members_caught.inc_by(s.caught.len() as u64);
        for c in &s.caught {
            if let Some(&peer) = rows.get(&c.node) {
                tracing::warn!(%peer, "caught: {c}");
                self.local.caught(peer, c.to_string()).await;
            }
        }
        let link = crate::hold::link::NativeLink::quiet(self.client.clone());
        let (rows, holders, signer) = (rows.clone(), holders.to_vec(), self.signer.clone());
        self.runtime.spawn(async move {
            let now = node_core::holder::wall_ms();
            node_core::lead::report_caught(&link, &signer, now, &s.caught, &rows, &holders).await;
        });
    }
}
