//! The trainer: finished requests in minibatches (each cut to its share), the backward pass
//! through its own group, the canary gate, and the hand-over to the serving task to publish.

use node_core::lead::training::{Due, Lesson, Minibatch, Schedule, minibatch_tokens};
use node_core::lead::{Publisher, Settled, settle};

use super::*;

/// A finished request waiting to be trained on.
pub(super) struct ToLearn {
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_tokens: usize,
    pub(super) generated: usize,
    pub(super) latency: Duration,
    /// A request this node served (counted in the mesh's usage once trained on), not text a
    /// peer handed over to teach.
    pub(super) served: bool,
}

/// The training task: finished requests in, minibatch gradients through its own group,
/// updates through the canary gate and out to the serving task.
pub(super) struct Trainer {
    pub(super) lead: Lead,
    /// The learner and the canary gate that judges every update before it is published.
    pub(super) teacher: Teacher,
    pub(super) requests: mpsc::UnboundedReceiver<ToLearn>,
    pub(super) publish: mpsc::UnboundedSender<PublishRequest>,
    pub(super) backlog: Arc<AtomicUsize>,
}

impl Lesson for ToLearn {
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl Trainer {
    /// Trains as the trainer's [`Schedule`] says, until the serving tasks are gone: every
    /// finished request that came is handed to it, and the task waits until the moment it
    /// names, a request comes, or serving goes quiet.
    pub(super) async fn run(mut self) {
        let shared = self.lead.yield_to.clone();
        // Each minibatch also rehearses general text and teaches earlier lessons again
        // (`Teacher::extra_positions`) within the positions a pass may take.
        let limit = minibatch_tokens(&self.lead.ctx.manifest)
            .saturating_sub(self.teacher.extra_positions());
        let mut schedule = Schedule::new(limit.max(2));
        loop {
            while let Ok(r) = self.requests.try_recv() {
                schedule.arrived(r);
            }
            let serving = shared.as_ref().is_some_and(|s| s.serving());
            match schedule.poll(Instant::now(), serving) {
                Due::Train(minibatch) => self.train_on(minibatch).await,
                Due::Flush => self.flush().await,
                Due::Wait(until) => {
                    let quiet = async {
                        match (&shared, serving) {
                            (Some(s), true) => s.quiet().await,
                            _ => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        r = self.requests.recv() => match r {
                            Some(r) => schedule.arrived(r),
                            None => break,
                        },
                        () = quiet => {}
                        () = tokio::time::sleep_until(until.into()) => {}
                    }
                    continue;
                }
            }
            // It worked: the wait before its next round counts nothing before that round.
            if let Some(s) = &shared {
                s.rest_turns();
            }
        }
    }

    /// Hands out what the learner accumulated (accumulate > 1) once requests stopped.
    async fn flush(&mut self) {
        match tokio::task::block_in_place(|| self.teacher.flush()) {
            Ok(Some(p)) => self.judge_and_hand_over(p).await,
            Ok(None) => {}
            Err(e) => tracing::warn!("the update could not be made: {e}"),
        }
    }

    /// Trains on one minibatch, then counts its requests as served and trained on.
    async fn train_on(&mut self, minibatch: Minibatch<ToLearn>) {
        let Minibatch {
            requests: batch,
            seqs,
        } = minibatch;
        let loss = self.train(&seqs, batch.len()).await;
        for r in batch.iter().filter(|r| r.served) {
            let usage = Usage::of_request(r.prompt_tokens, r.generated, r.latency, loss);
            self.lead.ctx.local.served(usage).await;
        }
        let m = &self.lead.ctx.metrics;
        if loss.is_some() {
            m.train_trained.inc_by(batch.len() as u64);
        }
        self.backlog.fetch_sub(batch.len(), Ordering::Relaxed);
        m.train_backlog.dec_by(batch.len() as i64);
    }

    /// The minibatch's loss (its distinct sequences, for `requests` requests), once its
    /// gradient went into the learner (and out, if due).
    pub(super) async fn train(&mut self, batch: &[Vec<u32>], requests: usize) -> Option<f64> {
        let span = tracing::info_span!("train", sequences = batch.len(), requests);
        let f = match self.lead.group().instrument(span.clone()).await {
            Ok(f) => f,
            Err(why) => {
                tracing::warn!("not trained on {} requests: {why}", batch.len());
                return None;
            }
        };
        f.group
            .transport_mut()
            .set_context(format!("train {} requests", batch.len()));
        let seqs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        let started = Instant::now();
        let studied = self
            .teacher
            .learn(&f.llama, &mut f.group, &seqs, requests)
            .instrument(span.clone())
            .await;
        self.lead.after_rounds().await;
        let studied = match studied {
            Ok(s) => {
                self.lead.leader.ran();
                s
            }
            Err(TeachError::Pass(e)) => {
                tracing::warn!("training on {} requests failed: {e}", batch.len());
                self.lead.pass_failed(false);
                return None;
            }
            Err(TeachError::Update(e)) => {
                self.lead.leader.ran();
                tracing::warn!("the update could not be made: {e}");
                return None;
            }
        };
        let loss = studied.loss;
        self.lead.ctx.metrics.loss.set(loss);
        span.in_scope(|| {
            tracing::info!(
                loss,
                sequences = batch.len(),
                requests,
                positions = studied.positions,
                passes = studied.passes,
                seconds = started.elapsed().as_secs_f64(),
                "trained"
            )
        });
        if let Some(p) = studied.due {
            self.judge_and_hand_over(p).await;
        }
        Some(loss)
    }

    /// Settles an update ([`node_core::lead::settle`]): through the canary gate on this
    /// task's group, and, if it passes, to the serving task to publish between two steps.
    pub(super) async fn judge_and_hand_over(&mut self, published: Published) {
        let f = match self.lead.group().await {
            Ok(f) => f,
            Err(why) => {
                self.teacher.drop_last();
                tracing::warn!("an update could not be judged, not published: {why}");
                return;
            }
        };
        f.group.transport_mut().set_context("canary gate".into());
        let mut hand_over = HandOver {
            to: &self.publish,
            holders: f.holders.clone(),
        };
        let settled = settle(
            &mut self.teacher,
            &f.llama,
            &mut f.group,
            f.version,
            published,
            &mut hand_over,
        )
        .await;
        self.lead.after_rounds().await;
        let m = self.lead.ctx.metrics.clone();
        match settled {
            Settled::Published {
                sent: moved,
                verdict,
                requests,
            } => {
                if let Some(v) = &verdict {
                    self.gate_measured(v).await;
                    tracing::info!(
                        before = v.before,
                        after = v.after,
                        "the canary gate passed an update"
                    );
                }
                // Follows the mesh to the new version (or forms the group again).
                self.lead.move_to(moved.as_ref());
                if moved.is_some() {
                    m.train_learnt.inc_by(u64::from(requests));
                }
            }
            Settled::Refused(why, verdict) => {
                self.gate_measured(&verdict).await;
                self.lead.ctx.local.refused_here(&verdict, &why);
                m.updates_refused.inc();
                tracing::warn!("the canary gate refused an update: {why}");
            }
            Settled::Unjudged(why) => {
                // Unjudged, it is not published: the next minibatch makes another.
                tracing::warn!("an update could not be judged, not published: {why}");
                self.lead.drop_group();
            }
            Settled::Lost(why) => tracing::warn!("an update is lost: {why}"),
        }
    }

    /// Tells the metrics and the mesh's usage the canary loss from here on: after the update
    /// when it goes out, else before it.
    async fn gate_measured(&self, verdict: &Verdict) {
        let canary = if verdict.pass {
            verdict.after
        } else {
            verdict.before
        };
        self.lead.ctx.metrics.canary_loss.set(canary);
        self.lead
            .ctx
            .local
            .served(Usage::of_gate(canary, !verdict.pass))
            .await;
    }
}

/// The trainer's [`Publisher`]: the serving task publishes the update between two of its
/// steps, and answers with the version the mesh moved to and its norm gains (`None`: this
/// node's row did not take it; the group forms again).
struct HandOver<'a> {
    to: &'a mpsc::UnboundedSender<PublishRequest>,
    holders: Vec<PeerId>,
}

impl Publisher for HandOver<'_> {
    type Sent = Option<([u8; 32], LeaderWeights)>;

    async fn publish(
        &mut self,
        published: Published,
        verdict: Option<GateClaim>,
    ) -> Result<(Self::Sent, Option<[u8; 32]>), String> {
        let (done, answer) = oneshot::channel();
        let req = PublishRequest {
            published,
            verdict,
            holders: std::mem::take(&mut self.holders),
            done,
        };
        self.to
            .send(req)
            .map_err(|_| "the serving task is gone".to_string())?;
        let moved = answer
            .await
            .map_err(|_| "the serving task stopped before publishing".to_string())?;
        let version = moved.as_ref().map(|(v, _)| *v);
        Ok((moved, version))
    }
}
