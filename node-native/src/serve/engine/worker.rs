//! The serving task: the queue's intake, the batch of sequences, one coded step at a time,
//! finishing requests (and handing them to the trainer), and publishing the trainer's updates.

use super::*;

/// The serving task's end of the queue: requests in order, one of them possibly held back
/// until the batch has room for it.
pub(super) struct Intake {
    /// The queue, shared by the serving tasks.
    pub(super) jobs: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    /// A request taken from the queue that did not fit yet (the step's token budget); it
    /// comes out first.
    pub(super) held: Option<Job>,
    pub(super) queue_depth: Gauge,
}

/// What the queue gives next.
pub(super) enum Next {
    /// A request to admit (boxed: a request is far larger than the other answers).
    Job(Box<Job>),
    /// Nothing waits now.
    Empty,
    /// The queue is closed and empty.
    Closed,
}

impl Intake {
    /// The next request: the held one, else one from the queue.
    pub(super) fn next(&mut self) -> Next {
        if let Some(job) = self.held.take() {
            return Next::Job(Box::new(job));
        }
        // Another serving task waiting on the queue takes what comes.
        let Ok(mut jobs) = self.jobs.try_lock() else {
            return Next::Empty;
        };
        match jobs.try_recv() {
            Ok(job) => {
                self.queue_depth.dec();
                Next::Job(Box::new(job))
            }
            Err(mpsc::error::TryRecvError::Empty) => Next::Empty,
            Err(mpsc::error::TryRecvError::Disconnected) => Next::Closed,
        }
    }

    /// Whether a request is held back for this task.
    pub(super) fn holds(&self) -> bool {
        self.held.is_some()
    }

    /// Holds a request back: `next` gives it first.
    pub(super) fn hold(&mut self, job: Job) {
        debug_assert!(self.held.is_none(), "one request is held at a time");
        self.held = Some(job);
    }

    /// Waits up to `wait` while nothing runs: with the held request if there is one (it waits
    /// for room), else for a request to come, which is then held. False once the queue is
    /// closed and nothing is held.
    pub(super) async fn idle(&mut self, wait: Duration) -> bool {
        if self.held.is_some() {
            tokio::time::sleep(wait).await;
            return true;
        }
        let jobs = self.jobs.clone();
        let next = tokio::time::timeout(wait, async move { jobs.lock().await.recv().await }).await;
        match next {
            Ok(Some(job)) => {
                self.queue_depth.dec();
                self.held = Some(job);
                true
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }
}

/// The serving task: the batch, the queue, and publishing the trainer's updates.
pub(super) struct Worker {
    pub(super) lead: Lead,
    pub(super) intake: Intake,
    /// Where finished requests go to be trained on (when the mesh learns).
    pub(super) to_train: Option<mpsc::UnboundedSender<ToLearn>>,
    /// Where the text of finished requests goes when this node may not write the model: to a
    /// task that hands it to a node that trains ([`super::forward_to_trainers`]).
    pub(super) forward: Option<mpsc::Sender<(String, Vec<u32>)>>,
    pub(super) publishes: mpsc::UnboundedReceiver<PublishRequest>,
    /// Finished requests not yet trained on.
    pub(super) backlog: Arc<AtomicUsize>,
    pub(super) latency_ms: Arc<AtomicU64>,
    /// What the serving tasks share.
    pub(super) shared: Arc<Shared>,
}

impl Worker {
    pub(super) async fn run(mut self) {
        let slot = self.slot();
        let shared = self.shared.clone();
        loop {
            self.publish_due().await;
            if slot > 0 && self.lead.leader.batch().is_empty() {
                // Registered before looking, so a group formed meanwhile still wakes this task.
                let changed = shared.groups_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if !self.ready().await {
                    // A further group waits until the groups before it hold theirs and the
                    // mesh has holders for one more; only then does it take requests.
                    if self.lead.ctx.info.is_closed() {
                        break;
                    }
                    let _ = tokio::time::timeout(IDLE_TICK, changed).await;
                    continue;
                }
            }
            if !self.admit() {
                break;
            }
            if self.lead.leader.batch().is_empty() {
                // Idle: woken by a request, an update to publish, or the gauge's tick.
                tokio::select! {
                    more = self.intake.idle(IDLE_TICK) => if !more {
                        break;
                    },
                    Some(req) = self.publishes.recv() => self.publish_one(req).await,
                }
                self.update_rate();
                continue;
            }
            self.step().await;
        }
        tracing::info!(slot, "a serving task stopped");
    }

    /// This serving task's place among the node's serving groups.
    pub(super) fn slot(&self) -> usize {
        self.lead.slot.as_ref().map_or(0, |(slot, _)| *slot)
    }

    /// Whether a further serving task holds a group it can serve with: formed once every
    /// group before it has one.
    pub(super) async fn ready(&mut self) -> bool {
        let slot = self.slot();
        if self.lead.formed.is_some() {
            return true;
        }
        if !self.shared.formed_before(slot) {
            return false;
        }
        self.lead.group().await.is_ok()
    }

    /// Takes queued requests into the batch while there is room; false once the queue is
    /// closed and nothing is left to do.
    pub(super) fn admit(&mut self) -> bool {
        while !self.lead.leader.batch().is_full() {
            // A busy task leaves new requests to an idle one: its own group runs them.
            if !self.lead.leader.batch().is_empty()
                && !self.intake.holds()
                && self.shared.another_is_idle(self.slot())
            {
                break;
            }
            let job = match self.intake.next() {
                Next::Job(j) => *j,
                Next::Empty => break,
                Next::Closed => return !self.lead.leader.batch().is_empty(),
            };
            if job.events.is_closed() {
                continue;
            }
            if !self.lead.leader.batch().fits(job.req.prompt.len()) {
                self.intake.hold(job);
                break;
            }
            let constraint = job
                .req
                .asks
                .constraint
                .as_ref()
                .map(|c| (c.0)())
                .transpose();
            let constraint = match constraint {
                Ok(c) => c,
                Err(why) => {
                    let _ = job.events.send(Event::Failed(EngineError::Failed(why)));
                    continue;
                }
            };
            let opts = GenerateOptions {
                max_tokens: job.req.max_tokens,
                sampling: job.req.sampling,
                stop_ids: job.req.stop_ids.clone(),
                draft: self.lead.ctx.cfg.draft,
            };
            let prompt = job.req.prompt.clone();
            let asks = (job.req.asks.logprobs, job.req.asks.echo);
            let served = Served {
                job,
                first_token: None,
            };
            match self.lead.leader.admit(served, prompt, opts) {
                Ok(()) => {
                    let Some(last) = self.lead.leader.batch_mut().entries_mut().last_mut() else {
                        continue;
                    };
                    if let Some(top) = asks.0 {
                        last.step.want_logprobs(top);
                    }
                    if let Some(top) = asks.1 {
                        last.step.want_echo(top);
                    }
                    if let Some(c) = constraint {
                        last.step.constrain(c);
                    }
                    last.job.job.span.in_scope(|| tracing::debug!("admitted"));
                }
                Err((served, e)) => {
                    let _ = served
                        .job
                        .events
                        .send(Event::Failed(EngineError::Failed(e.to_string())));
                }
            }
        }
        self.count_active();
        true
    }

    /// Sets the active-sequences gauge.
    pub(super) fn count_active(&self) {
        let slot = self.slot();
        let all = (self.shared).set_active(slot, self.lead.leader.batch().len());
        self.lead.ctx.metrics.active_sequences.set(all as i64);
    }

    /// Fails every request in the batch.
    pub(super) fn fail_all(&mut self, error: &EngineError) {
        let all = self.lead.leader.batch_mut().drain();
        self.fail_each(all, error);
    }

    /// Fails each of `seqs`.
    fn fail_each(&mut self, seqs: Vec<Seq>, error: &EngineError) {
        for seq in seqs {
            self.fail(seq, error);
        }
    }

    /// Fails one request; the hop group's members forget it.
    fn fail(&mut self, seq: Seq, error: &EngineError) {
        if let Some(hop) = self.lead.hop.leader.as_mut() {
            hop.forget(seq.job.job.id);
        }
        self.lead.ctx.metrics.request_errors.inc();
        let _ = seq.job.job.events.send(Event::Failed(error.clone()));
    }

    /// One forward step of every sequence in the batch, then a token for each: the step every
    /// leader runs ([`node_core::lead::step`]) over this task's group ([`Lead`]).
    pub(super) async fn step(&mut self) {
        self.lead.steps += 1;
        let (m, shared) = (self.lead.ctx.metrics.clone(), self.shared.clone());
        let stepped = node_core::lead::step_scored(&mut self.lead, |s, next, scored| {
            if s.first_token.is_none() {
                let t = s.job.arrived.elapsed();
                s.first_token = Some(t);
                m.time_to_first_token.observe(t.as_secs_f64());
            }
            m.tokens_generated.inc();
            shared.record_token();
            s.job.events.send(Event::Token(next, scored)).is_ok()
        })
        .await;
        // The prompt's log-probabilities of the sequences whose first pass just ran.
        for e in self.lead.leader.batch_mut().entries_mut() {
            if let Some(scored) = e.step.take_prompt_logprobs() {
                let _ = e.job.job.events.send(Event::Prompt(scored));
            }
        }
        match stepped {
            Ok(Stepped::Took(took)) => {
                m.draft_tokens.inc_by(took.drafted as u64);
                m.draft_accepted.inc_by(took.kept as u64);
                for ended in took.ended {
                    match ended {
                        Ended::Finished(seq, stop) => self.finish(seq, stop).await,
                        Ended::Failed(seq, e) => {
                            self.fail(seq, &EngineError::Failed(e.to_string()))
                        }
                    }
                }
            }
            Ok(Stepped::Failed(_)) => {}
            Ok(Stepped::GaveUp(gone, e)) => {
                self.fail_each(gone, &EngineError::Failed(e.to_string()))
            }
            Err(e) => {
                self.fail_all(&EngineError::Unavailable(e.to_string()));
                return;
            }
        }
        self.count_active();
        self.update_rate();
    }

    /// Ends a sequence: tells its submitter, counts it, and hands it to the trainer.
    pub(super) async fn finish(&mut self, mut seq: Seq, stop: StopReason) {
        if let Some(scored) = seq.step.take_prompt_logprobs() {
            let _ = seq.job.job.events.send(Event::Prompt(scored));
        }
        if let Some(hop) = self.lead.hop.leader.as_mut() {
            hop.forget(seq.job.job.id);
        }
        let latency = seq.job.job.arrived.elapsed();
        let m = &self.lead.ctx.metrics;
        m.requests.inc();
        m.by_key("finished", &seq.job.job.req.caller).inc();
        m.prompt_tokens.inc_by(seq.job.job.req.prompt.len() as u64);
        m.request_latency.observe(latency.as_secs_f64());
        let old = self.latency_ms.load(Ordering::Relaxed);
        let ms = latency.as_millis() as u64;
        self.latency_ms.store((old * 7 + ms) / 8, Ordering::Relaxed);
        let done = Finished {
            prompt_tokens: seq.job.job.req.prompt.len(),
            tokens: seq.step.generated(),
            stop,
            first_token: seq.job.first_token,
            latency,
        };
        seq.job.job.span.in_scope(|| {
            tracing::info!(
                tokens = done.tokens,
                stop = ?stop,
                latency_ms = latency.as_millis() as u64,
                "finished"
            )
        });
        let _ = seq.job.job.events.send(Event::Done(done));
        let ctx = &self.lead.ctx;
        let window = node_core::learn::training_window(&ctx.manifest.learning, &ctx.manifest.cfg)
            .min(node_core::lead::training::LEARN_TOKENS);
        let item = ToLearn {
            tokens: node_core::learn::taught(
                seq.job
                    .job
                    .req
                    .lesson
                    .as_deref()
                    .unwrap_or(&seq.job.job.req.prompt),
                window,
            )
            .to_vec(),
            prompt_tokens: done.prompt_tokens,
            generated: done.tokens,
            latency,
            served: true,
        };
        let teaches = self.to_train.is_some() || self.forward.is_some();
        let mut learn = item.tokens.len() >= 2 && seq.job.job.req.learn && teaches;
        if learn {
            m.learn_requests.inc();
            let req = &seq.job.job.req;
            if !self
                .shared
                .spend(&req.caller, Some(req.budget), item.tokens.len())
            {
                learn = false;
                m.train_over_budget.inc();
                m.by_key("over_budget", &req.caller).inc();
                tracing::info!(
                    caller = seq.job.job.req.caller,
                    "served, not trained on: the caller's learning budget is spent"
                );
            }
        }
        let behind = self.backlog.load(Ordering::Relaxed) >= MAX_TRAIN_BACKLOG;
        if learn && behind {
            m.train_dropped.inc();
            tracing::info!(
                backlog = MAX_TRAIN_BACKLOG,
                "served, not trained on: the trainer is that many requests behind and serving comes first"
            );
        }
        if let Some(fwd) = self.forward.as_ref().filter(|_| learn) {
            // Not admitted to write: the text goes to a trainer; when the hand-over queue is
            // full, the request is served and not taught.
            let caller = seq.job.job.req.caller.clone();
            if fwd.try_send((caller.clone(), item.tokens)).is_ok() {
                m.by_key("forwarded", &caller).inc();
            }
            let usage = Usage::of_request(done.prompt_tokens, done.tokens, latency, None);
            ctx.local.served(usage).await;
            return;
        }
        match &self.to_train {
            Some(tx) if learn && !behind => {
                m.by_key("taught", &seq.job.job.req.caller).inc();
                self.backlog.fetch_add(1, Ordering::Relaxed);
                m.train_backlog.inc();
                if tx.send(item).is_err() {
                    self.backlog.fetch_sub(1, Ordering::Relaxed);
                    m.train_backlog.dec();
                }
            }
            _ => {
                ctx.local
                    .served(Usage::of_request(
                        done.prompt_tokens,
                        done.tokens,
                        latency,
                        None,
                    ))
                    .await
            }
        }
    }

    /// Publishes the trainer's updates, if any wait.
    pub(super) async fn publish_due(&mut self) {
        while let Ok(req) = self.publishes.try_recv() {
            self.publish_one(req).await;
        }
    }

    /// Publishes one of the trainer's updates and moves the group to the version it makes.
    pub(super) async fn publish_one(&mut self, req: PublishRequest) {
        let moved = self.publish(req.published, req.verdict, &req.holders).await;
        self.lead.move_to(moved.as_ref());
        let _ = req.done.send(moved);
    }

    /// Applies an update to this node's own row, then starts it spreading through every live
    /// row's holder (the group's members first: they tell the rest), pulling its pieces from
    /// this node; waits until the group's members have applied it. The version that makes and
    /// its norm gains when this node's row took it.
    pub(super) async fn publish(
        &mut self,
        p: Published,
        verdict: Option<GateClaim>,
        holders: &[PeerId],
    ) -> Option<([u8; 32], LeaderWeights)> {
        let ctx = &self.lead.ctx;
        let header = node_core::learn::Header {
            issued_ms: node_core::holder::wall_ms(),
            verdict,
        };
        let sealed = match node_core::lead::seal_update(&p, &ctx.signer, header) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("signing the update: {e}");
                return None;
            }
        };
        let (before, _) = ctx.local.norms();
        let (local, bytes) = (ctx.local.clone(), sealed.bytes.clone());
        let local = tokio::task::spawn_blocking(move || local.learn(&bytes))
            .await
            .unwrap_or_else(|e| MeshResponse::Error(e.to_string()));
        let took_here = matches!(local, MeshResponse::Learned { .. });
        let members = (self.lead.formed.as_ref()).map_or(Vec::new(), |f| f.members.clone());
        let link = crate::hold::link::NativeLink::quiet(ctx.client.clone());
        let me = took_here.then(|| ctx.client.peer_id());
        let out = crate::hold::spread::hand_out(&link, &sealed, &members, holders, me).await;
        ctx.metrics
            .update_bytes_sent
            .inc_by(out.passed.inline_bytes);
        ctx.metrics.updates_published.inc();
        (ctx.metrics.update_bytes_published).inc_by(sealed.bytes.len() as u64);
        tracing::info!(
            id = format!("{:016x}", sealed.id),
            requests = p.requests,
            bytes = sealed.bytes.len(),
            told = out.passed.taken,
            members_at = out.members_at,
            members = out.members,
            "published an update"
        );
        let was_at = self.lead.formed.as_ref().map_or(before, |f| f.version);
        (took_here && before == was_at).then(|| ctx.local.norms())
    }

    /// Sets the tokens/s gauge from the tokens of the last [`RATE_WINDOW`].
    pub(super) fn update_rate(&mut self) {
        let tokens = self.shared.recent_tokens();
        self.lead
            .ctx
            .metrics
            .tokens_per_second
            .set(tokens as f64 / RATE_WINDOW.as_secs_f64());
    }
}
