//! The node's task: it owns the swarm and the mesh view, answers the page's commands and the
//! peers' requests, and keeps the snapshot the page reads.

use super::*;

/// The task that owns the swarm.
pub(super) struct Task {
    pub(super) swarm: Swarm<MeshBehaviour>,
    pub(super) commands: mpsc::Receiver<Command>,
    pub(super) shared: Rc<RefCell<Shared>>,
    pub(super) view: Option<MeshView<PeerId>>,
    /// Dials and requests in flight (request-response's own timeout ends each request).
    pub(super) driver: Driver,
    /// A handle on this node, for the work the task starts (steps, catch-ups).
    pub(super) node: BrowserNode,
    /// The native node this node listens through once it holds a row.
    pub(super) relay: Option<Multiaddr>,
    /// The row this node serves, once it contributes.
    pub(super) holding: Option<Holding>,
    /// Relayed addresses peers reach this node at.
    pub(super) circuits: Vec<String>,
    /// Updates waiting until no step uses the shard, with the leader waiting for each.
    pub(super) learning: VecDeque<(Vec<u8>, Option<ResponseChannel<MeshResponse>>)>,
}

impl Task {
    pub(super) async fn run(mut self) {
        let mut tick = futures_timer::Delay::new(SNAPSHOT_EVERY).fuse();
        loop {
            futures::select! {
                ev = self.swarm.select_next_some() => {
                    if let Some(ev) = self.driver.on_event(&mut self.swarm, ev) {
                        self.on_net(ev);
                    }
                }
                cmd = self.commands.next() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    // Every handle is gone: the page dropped the node.
                    None => return,
                },
                _ = tick => {
                    tick = futures_timer::Delay::new(SNAPSHOT_EVERY).fuse();
                    self.on_tick();
                }
            }
            self.apply_learning();
        }
    }

    pub(super) fn on_tick(&mut self) {
        let now = Instant::now();
        let Some(view) = self.view.as_mut() else {
            return;
        };
        view.handle_timeout(now);
        while let Some(hb) = view.poll_transmit() {
            // An observer announces nothing: its heartbeats would list it as a node without a
            // row. A holder announces its row once peers can reach it through its relay.
            if hb.row.is_none() {
                continue;
            }
            match protocol::encode(&hb) {
                Ok(data) => self.driver.publish(&mut self.swarm, data),
                Err(e) => tracing::debug!("heartbeat not sent: {e}"),
            }
        }
        while let Some(ev) = view.poll_event() {
            match ev {
                MeshEvent::HealthChanged { peer, row, health } => {
                    tracing::info!(%peer, ?row, %health, "health changed");
                }
                MeshEvent::Refused { peer, error } => tracing::warn!(%peer, "{error}"),
                MeshEvent::Discovered { peer, .. } => tracing::debug!(%peer, "discovered"),
            }
        }
        let info = view.info(now);
        let me = view.me().to_string();
        let contribution = self
            .holding
            .as_ref()
            .map(|h| match self.circuits.is_empty() {
                true => Contribution::Preparing {
                    what: format!("row {} is ready; reserving a slot on the relay", h.row),
                    done: 0,
                    total: 0,
                },
                false => h.contribution(),
            });
        Shared::set(&self.shared, |s| {
            let mut info = info;
            // Show the mesh's nodes; a watching page is not one of them.
            if contribution.is_none() {
                info.nodes.retain(|n| n.peer != me);
            }
            if let Some(old) = &s.info {
                info.dashboard = old.dashboard.clone();
                // Evidence of caught nodes reaches the node a leader reports to; keep what
                // the native node told us.
                for n in &mut info.nodes {
                    if n.caught.is_none() {
                        n.caught = old
                            .nodes
                            .iter()
                            .find(|o| o.peer == n.peer)
                            .and_then(|o| o.caught.clone());
                    }
                }
            }
            s.info = Some(info);
            if let Some(c) = contribution {
                s.contribution = c;
            }
        });
    }

    /// Announces the row, version and addresses this node holds now.
    pub(super) fn announce(&mut self) {
        let (Some(view), Some(h)) = (self.view.as_mut(), self.holding.as_ref()) else {
            return;
        };
        let mut local = view.local().clone();
        // A row nobody can reach would only fail the leaders that pick it.
        local.row = (!self.circuits.is_empty()).then_some(h.row);
        local.version_count = h.state.version.count();
        local.version_digest = h.state.version.digest();
        local.addrs = self.circuits.clone();
        local.device = h.device.clone();
        view.set_local(local);
        view.handle_timeout(Instant::now());
    }

    pub(super) fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Dial { addr, reply } => self.driver.dial(
                &mut self.swarm,
                addr,
                Box::new(move |r| {
                    let _ = reply.send(r);
                }),
            ),
            Command::Request {
                peer,
                request,
                reply,
            } => self.driver.request(
                &mut self.swarm,
                peer,
                request,
                Box::new(move |r| {
                    let _ = reply.send(r);
                }),
            ),
            Command::AddAddrs { peer, addrs } => {
                self.driver.add_addrs(&mut self.swarm, peer, addrs)
            }
            Command::Watch { info, via } => match watch_view(&info, *self.swarm.local_peer_id()) {
                Ok(view) => {
                    self.view = Some(view);
                    self.relay = Some(via);
                }
                Err(e) => {
                    tracing::error!("cannot follow the mesh: {e}");
                    Shared::set(&self.shared, |s| {
                        s.connection = Connection::Failed {
                            reason: e.to_string(),
                        }
                    });
                }
            },
            Command::Hold(holding) => self.hold(*holding),
            Command::Respond { to, response } => {
                if let Some(h) = self.holding.as_mut() {
                    h.answered(&response);
                }
                match to {
                    AnswerTo::Request(channel) => self.respond(channel, response),
                    AnswerTo::Session(reply) => {
                        let _ = reply.send(response);
                    }
                }
            }
            Command::Step {
                version,
                request,
                reply,
            } => {
                let Some(h) = self.holding.as_mut() else {
                    let _ = reply.send(MeshResponse::Error(NO_ROW.into()));
                    return;
                };
                let work = h.step(version, request);
                respond_later(self.node.clone(), AnswerTo::Session(reply), work)
            }
            Command::Spread(got) => match got {
                Ok(bytes) => self.learning.push_back((bytes, None)),
                Err(e) => tracing::warn!("pulling a spreading update: {e}; catching up later"),
            },
            Command::CaughtUp(got) => {
                let behind = match got {
                    Ok(super::holder::CaughtUp::Updates(updates)) => {
                        self.learning
                            .extend(updates.into_iter().map(|bytes| (bytes, None)));
                        None
                    }
                    Ok(super::holder::CaughtUp::Behind(version)) => Some(version),
                    Err(e) => {
                        tracing::warn!("catching up: {e}");
                        None
                    }
                };
                match behind {
                    Some(version) => self.rebuild(version),
                    None => {
                        if let Some(h) = self.holding.as_mut() {
                            h.syncing = false;
                        }
                    }
                }
            }
            Command::Rebuilt(got) => {
                if let Some(h) = self.holding.as_mut() {
                    h.syncing = false;
                    match got {
                        Ok(joined) => h.rebuilt = Some(*joined),
                        Err(e) => tracing::warn!("rebuilding the row: {e}"),
                    }
                }
                self.apply_learning();
            }
        }
    }

    /// Starts serving a row: listens through the relay and announces it.
    pub(super) fn hold(&mut self, holding: Holding) {
        let listening = match self.relay.clone() {
            None => Err("not connected to the mesh".to_string()),
            Some(relay) => {
                let circuit = relay.with(Protocol::P2pCircuit);
                self.swarm
                    .listen_on(circuit.clone())
                    .map(drop)
                    .map_err(|e| format!("listening through the relay {circuit}: {e}"))
            }
        };
        match listening {
            Ok(()) => {
                self.holding = Some(holding);
                self.announce();
            }
            Err(reason) => Shared::set(&self.shared, |s| {
                s.contribution = Contribution::Failed { reason }
            }),
        }
    }

    pub(super) fn respond(
        &mut self,
        channel: ResponseChannel<MeshResponse>,
        response: MeshResponse,
    ) {
        Driver::respond(&mut self.swarm, channel, response)
    }

    /// Rebuilds the row at `version`, which a peer is at and which the updates it keeps cannot
    /// reach: a copy from another holder of the row, else along a chain of k rows.
    pub(super) fn rebuild(&mut self, version: [u8; 32]) {
        let (Some(view), Some(h)) = (self.view.as_ref(), self.holding.as_mut()) else {
            return;
        };
        let offer = view.rebuild_offer(version);
        if offer == node_core::mesh::JoinOffer::Full {
            tracing::info!("behind what the mesh keeps, and no holders at its version yet");
            h.syncing = false;
            return;
        }
        tracing::info!(
            row = h.row,
            "behind what the peers keep: rebuilding the row"
        );
        let node = self.node.clone();
        let manifest = h.manifest.clone();
        wasm_bindgen_futures::spawn_local(async move {
            let boot = node.bootstrap();
            let got = node_core::holder::obtain(&node, &boot, &manifest, offer)
                .await
                .map(Box::new)
                .map_err(|e| e.to_string());
            let _ = node.send(Command::Rebuilt(got)).await;
        });
    }

    /// Applies waiting updates (and a rebuilt row) while no step uses the shard, then folds
    /// the kept updates into a snapshot when they are due.
    pub(super) fn apply_learning(&mut self) {
        let lags = (self.view.as_ref())
            .map(|v| v.lags(Instant::now()))
            .unwrap_or_default();
        let Some(h) = self.holding.as_mut() else {
            self.learning.clear();
            return;
        };
        let mut changed = false;
        if let Some(save) = h.take_rebuilt() {
            wasm_bindgen_futures::spawn_local(save);
            changed = true;
        }
        let mut receipts = Vec::new();
        while let Some((bytes, channel)) = self.learning.pop_front() {
            let answer = match h.learn(&bytes) {
                Ok(None) => {
                    self.learning.push_front((bytes, channel));
                    break;
                }
                Ok(Some((id, applied))) => {
                    if applied {
                        tracing::info!(id = format!("{id:016x}"), "applied an update");
                        changed = true;
                    }
                    MeshResponse::Learned {
                        id,
                        version_count: h.state.version.count(),
                    }
                }
                Err(e) => {
                    tracing::warn!("refused an update: {e}");
                    MeshResponse::Error(e.to_string())
                }
            };
            if let Some(channel) = channel {
                receipts.push((channel, answer));
            }
        }
        if changed && let Some(save) = h.fold_if_due(&lags) {
            wasm_bindgen_futures::spawn_local(save);
        }
        for (channel, answer) in receipts {
            self.respond(channel, answer);
        }
        if changed {
            self.announce();
        }
    }

    pub(super) fn on_net(&mut self, event: NetEvent) {
        match event {
            NetEvent::Listening(address) => {
                tracing::info!(%address, "reachable through the relay");
                let me = *self.swarm.local_peer_id();
                self.circuits.push(with_peer(address, me).to_string());
                self.announce();
            }
            NetEvent::Expired(address) => {
                let me = *self.swarm.local_peer_id();
                let gone = with_peer(address, me).to_string();
                self.circuits.retain(|a| *a != gone);
                self.announce();
            }
            NetEvent::Gossip { peer, data } => self.on_gossip(peer, &data),
            NetEvent::Request {
                peer,
                request,
                channel,
            } => self.on_request(peer, request, channel),
            // A browser is reached through its relay circuits (above); it runs no AutoNAT.
            NetEvent::Reach { .. } => {}
            NetEvent::RoundTrip { peer, rtt } => {
                if let Some(view) = self.view.as_mut() {
                    view.observe_rtt(&peer, rtt);
                }
            }
        }
    }

    pub(super) fn on_gossip(&mut self, peer: PeerId, data: &[u8]) {
        let bytes = data.len() as u64;
        Shared::set_quiet(&self.shared, |s| s.gossip_bytes += bytes);
        match protocol::decode::<Heartbeat>(data) {
            Ok(hb) => {
                self.maybe_sync(peer, &hb);
                let Some(view) = self.view.as_mut() else {
                    return;
                };
                view.handle_heartbeat(Instant::now(), peer, hb);
                Shared::set_quiet(&self.shared, |s| s.heartbeats += 1);
            }
            Err(e) => tracing::warn!(%peer, "bad heartbeat: {e}"),
        }
    }

    /// A peer announces updates this node's row lacks: fetch them from it.
    pub(super) fn maybe_sync(&mut self, peer: PeerId, hb: &Heartbeat) {
        let (Some(view), Some(h)) = (self.view.as_ref(), self.holding.as_mut()) else {
            return;
        };
        if h.syncing || !node_core::holder::worth_catching_up(view.local(), hb) {
            return;
        }
        h.syncing = true;
        let (node, have) = (self.node.clone(), h.state.version.clone());
        wasm_bindgen_futures::spawn_local(async move {
            let got = node.catch_up(peer, &have).await.map_err(|e| e.to_string());
            let _ = node.send(Command::CaughtUp(got)).await;
        });
    }

    pub(super) fn on_request(
        &mut self,
        peer: PeerId,
        request: MeshRequest,
        channel: ResponseChannel<MeshResponse>,
    ) {
        let now = Instant::now();
        let (Some(view), Some(h)) = (self.view.as_mut(), self.holding.as_mut()) else {
            return self.respond(channel, MeshResponse::Error(NO_ROW.into()));
        };
        match h.route(&peer, request, view.live_holders()) {
            Route::Answer(response) => self.respond(channel, response),
            Route::View(query) => {
                let onward = query.onward();
                let response = node_core::holder::answer_view(view, &peer, query, now);
                self.respond(channel, response);
                if let Some((report, to)) = onward {
                    let node = self.node.clone();
                    wasm_bindgen_futures::spawn_local(async move {
                        node_core::holder::pass_report(&node, report, &to).await;
                    });
                }
            }
            // A page holds a few updates waiting for its steps to end, not a peer's flood.
            Route::Learn(_) if self.learning.len() >= MAX_WAITING_UPDATES => self.respond(
                channel,
                MeshResponse::Error("too many updates wait here already: try again".into()),
            ),
            Route::Learn(bytes) => self.learning.push_back((bytes, Some(channel))),
            Route::Teach(_) => self.respond(
                channel,
                MeshResponse::Error("a browser does not train: ask a native node".into()),
            ),
            Route::Spread(notice) => {
                self.respond(channel, MeshResponse::Spreading { id: notice.list.id });
                let node = self.node.clone();
                wasm_bindgen_futures::spawn_local(async move { node.take_spread(notice).await });
            }
            Route::ShardPiece { offset, len } => {
                let response = h.snapshot.piece(&h.state, offset, len);
                self.respond(channel, response)
            }
            Route::UpdatePiece { id, offset, len } => {
                let response = h.update_piece(id, offset, len);
                self.respond(channel, response)
            }
            Route::Step { version, request } => {
                let work = h.step(version, request);
                respond_later(self.node.clone(), AnswerTo::Request(channel), work)
            }
            Route::Chain(part) => {
                let (node, state) = (self.node.clone(), h.state.clone());
                let work = async move { node.chain_piece(state, part).await };
                respond_later(self.node.clone(), AnswerTo::Request(channel), work)
            }
        }
    }
}
