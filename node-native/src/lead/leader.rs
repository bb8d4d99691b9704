//! A leader on the mesh from the command line (`generate --bootstrap`, `eval`, the mesh
//! bench): its session, the group node-core formed for it (formed again when a pass fails),
//! learning from its requests (or handing their text to a trainer when the mesh does not admit
//! it), and publishing what it learnt.

use anyhow::{Context, Result, bail};
use libp2p::{Multiaddr, PeerId};
use node_core::lead::{
    Failure, LeadShell, Looking, Measured, PassRoute, Publisher, Route, Sealed, Sent, Settled,
    settle,
};
use node_core::learn::{GateClaim, Header, Published, Teacher};
use node_core::mesh::{MeshRequest, MeshResponse, ModelManifest, Usage};
use node_core::model::ModelError;
use node_core::net::hop::HopLeader;

use super::hop::NetFeedLink;
use super::remote::{Formed, GroupOptions, Session, form_group};
use crate::hold::link::NativeLink;
use crate::net::rpc::ask;

/// A leader on the mesh from the command line: its connection, the model, and the group
/// node-core formed for it ([`node_core::lead::form`]).
#[derive(Debug)]
pub struct Leader {
    /// The connection through the bootstrap node; its key signs the updates.
    pub session: Session,
    /// The model's manifest.
    pub manifest: ModelManifest,
    /// Its tokenizer.
    pub tokenizer: node_core::model::Tokenizer,
    /// The group, with the leader's side of the model and every live holder.
    pub formed: Formed,
    /// Where a copy of every update this leader publishes goes (signed, as holders take it),
    /// if anywhere.
    pub archive: Option<std::path::PathBuf>,
    /// Who it signs as: its identity and, when the mesh admits it, its certificate.
    pub signer: node_core::lead::Signer,
    /// How its group is formed (again, after a pass fails).
    opts: GroupOptions,
    /// Its rules and its sequence ([`node_core::lead::Leader`]).
    leader: node_core::lead::Leader<()>,
    /// The hop group over its group's members, while its passes go one hop per stage.
    pub hop: Option<HopLeader<NetFeedLink>>,
    /// Hop groups formed so far: where the sequence's keys and values live (0: the rounds).
    hop_groups: u64,
}

impl Leader {
    /// Its passes travel as `pass` says from now on (an automatic choice goes one hop per stage
    /// where a member of its group is on another machine).
    pub fn set_pass(&mut self, pass: PassRoute) {
        self.leader.set_route(pass);
    }

    /// Connects through `bootstrap`, fetches the manifest and forms a group of k + `verify` +
    /// `spares`; every forward round is checked with `verify` answers beyond the k decoded.
    pub async fn connect(bootstrap: Multiaddr, verify: usize, spares: usize) -> Result<Self> {
        Self::connect_with(bootstrap, &GroupOptions::new(verify, spares)).await
    }

    /// [`Leader::connect`] with every option of the group, as a fresh identity.
    pub async fn connect_with(bootstrap: Multiaddr, opts: &GroupOptions) -> Result<Self> {
        let key = libp2p::identity::Keypair::generate_ed25519();
        Self::connect_as(bootstrap, opts, key, None).await
    }

    /// [`Leader::connect_with`] as the identity `key`, with the certificate by which the mesh
    /// admits it (without one, holders refuse what it publishes, and its requests teach the
    /// mesh through its bootstrap node instead: [`Leader::learn`]).
    pub async fn connect_as(
        bootstrap: Multiaddr,
        opts: &GroupOptions,
        key: libp2p::identity::Keypair,
        cert: Option<node_core::learn::Certificate>,
    ) -> Result<Self> {
        let session = Session::connect_as(bootstrap, key.clone()).await?;
        let manifest = session.manifest().await?;
        let signer = crate::hold::trust::signer(key, cert, &manifest);
        let formed = form_group(&session.client, &manifest, || session.info(), None, opts).await?;
        let tokenizer = node_core::model::Tokenizer::from_data(&manifest.tokenizer)?;
        let cfg = &manifest.cfg;
        let (k, g) = (manifest.generator.k(), &opts.group);
        let limits = node_core::lead::one_at_a_time(cfg);
        let mut leader = node_core::lead::Leader::new(cfg, limits, k, g.verify, g.spares);
        leader.formed(super::remote::far(&formed));
        Ok(Self {
            session,
            manifest,
            tokenizer,
            formed,
            archive: None,
            signer,
            opts: opts.clone(),
            leader,
            hop: None,
            hop_groups: 0,
        })
    }

    /// Trains on what `prompt` teaches ([`node_core::learn::taught`]) if the mesh learns: the
    /// gradient through the group, folded into `teacher`; an update that falls due is settled
    /// ([`Leader::settle`]). Returns the loss and what became of the update, if one was due. A
    /// leader the mesh does not admit to write hands the text to its bootstrap node instead,
    /// whose trainer trains on it under its own budget and gate ([`Learned::taught_by`]).
    pub async fn learn(
        &mut self,
        prompt: &[u32],
        teacher: &mut Teacher,
    ) -> Result<Option<Learned>> {
        let cfg = self.manifest.learning;
        if !cfg.enabled || prompt.len() < 2 {
            return Ok(None);
        }
        let max = node_core::learn::training_window(&cfg, &self.manifest.cfg);
        let tokens = node_core::learn::taught(prompt, max);
        if self.signer.cert.is_none() {
            let to = self.session.bootstrap;
            match ask(
                &self.session.client,
                to,
                MeshRequest::Teach(tokens.to_vec()),
            )
            .await?
            {
                MeshResponse::Taught => {}
                MeshResponse::Error(e) => bail!("{to} did not take the text to teach: {e}"),
                _ => bail!("asked {to} to teach a text, got something else"),
            }
            return Ok(Some(Learned {
                loss: f64::NAN,
                positions: tokens.len(),
                settled: None,
                taught_by: Some(to),
            }));
        }
        let studied = teacher
            .learn(&self.formed.llama, &mut self.formed.group, &[tokens], 1)
            .await?;
        let loss = studied.loss;
        let settled = match studied.due {
            Some(p) => Some(self.settle(teacher, p).await),
            None => None,
        };
        Ok(Some(Learned {
            loss,
            positions: tokens.len(),
            settled,
            taught_by: None,
        }))
    }

    /// Settles a due update ([`node_core::lead::settle`]): judged by `teacher`'s canary gate on
    /// this group, and if it passes signed and handed to every live row's holder (and a copy
    /// to the archive, if set).
    pub async fn settle(&mut self, teacher: &mut Teacher, p: Published) -> Settled<Sent> {
        let mut out = NetPublisher {
            link: NativeLink::quiet(self.session.client.clone()),
            signer: &self.signer,
            holders: &self.formed.holders,
            members: &self.formed.members,
            archive: self.archive.as_deref(),
        };
        settle(
            teacher,
            &self.formed.llama,
            &mut self.formed.group,
            self.formed.version,
            p,
            &mut out,
        )
        .await
    }

    /// Tells every live row's holder about the members this leader caught; returns how many
    /// nodes took the reports (they act on them only when the mesh admits this leader to
    /// report).
    pub async fn report_caught(&self) -> usize {
        let link = NativeLink::quiet(self.session.client.clone());
        let caught = &self.formed.group.stats().caught;
        node_core::lead::report_caught(
            &link,
            &self.signer,
            node_core::holder::wall_ms(),
            caught,
            &self.formed.rows,
            &self.formed.holders,
        )
        .await
        .taken_by
    }

    /// Tells the node this leader connected through what a request did; the mesh's usage
    /// (tokens/s, latency, loss on the dashboards) counts it.
    pub async fn report_served(&self, usage: Usage) -> Result<()> {
        ask(
            &self.session.client,
            self.session.bootstrap,
            MeshRequest::Served(usage),
        )
        .await?;
        Ok(())
    }
}

/// The command line's leader: its group formed (again) from the mesh's view, each pass over
/// its rounds or one hop per stage over a hop group of its members, as its rules route it.
impl LeadShell<()> for Leader {
    fn leader(&mut self) -> &mut node_core::lead::Leader<()> {
        &mut self.leader
    }

    fn rows(&self) -> Vec<usize> {
        self.formed.group.nodes().to_vec()
    }

    async fn wait_until(&mut self, until: std::time::Instant) {
        tokio::time::sleep_until(until.into()).await
    }

    /// Forms the group anew from the mesh's view now, after reporting the members the old one
    /// caught.
    async fn form(&mut self, checks: usize) -> Result<bool, String> {
        if !self.formed.group.stats().caught.is_empty() {
            self.report_caught().await;
        }
        self.hop = None;
        let session = &self.session;
        let context = self.formed.group.transport().context().to_string();
        let mut opts = self.opts.clone();
        opts.group.verify = checks;
        let formed = form_group(
            &session.client,
            &self.manifest,
            || session.info(),
            None,
            &opts,
        )
        .await
        .map_err(|e| format!("{e:#}"))?;
        eprintln!(
            "formed the group again at version {}, group {:?}",
            node_core::mesh::hex(&formed.version[..8]),
            formed.group.nodes()
        );
        let far = super::remote::far(&formed);
        self.formed = formed;
        self.formed.group.transport_mut().set_context(context);
        Ok(far)
    }

    async fn look(&mut self, looking: &Looking) -> Option<usize> {
        let info = self.session.info().await.ok()?;
        let left = self.formed.left(&looking.rows);
        looking.in_view(
            &info,
            &self.formed.version,
            &std::collections::BTreeSet::<PeerId>::new(),
            &left,
        )
    }

    fn regroup(&mut self, row: usize, _: &Looking) {
        eprintln!("row {row} came back: forming the group again");
    }

    /// A hop pass runs on a hop group over the group's members, formed when there is none
    /// (its keys and values start again there); a rounds pass lets any hop group go.
    async fn route(&mut self, route: Route) -> Result<u64, String> {
        if route == Route::Rounds {
            self.hop = None;
            return Ok(0);
        }
        if self.hop.is_none() {
            let g = &self.opts.group;
            let (hop, _) = super::hop::lead_group(
                &tokio::runtime::Handle::current(),
                &self.session.client,
                &self.manifest,
                &self.formed,
                g.verify,
                g.spares,
                self.leader.route() == PassRoute::Auto,
            )
            .map_err(|e| format!("{e:#}"))?;
            eprintln!("one hop per stage, members {:?}", hop.rows());
            self.hop = Some(hop);
            self.hop_groups += 1;
        }
        Ok(self.hop_groups)
    }

    async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        let batch = self.leader.batch_mut();
        if let Some(hop) = self.hop.as_mut() {
            let no = || ModelError::NoGroup("no sequence".into());
            let (_, pass) = batch.passes().next().ok_or_else(no)?;
            return Ok(vec![hop.forward(pass).await?]);
        }
        let mut items = batch.rounds_items();
        let f = &mut self.formed;
        f.llama.forward_batch(&mut f.group, &mut items).await
    }

    fn measured(&mut self) -> Option<Measured> {
        Some(Measured {
            unlocated: self.formed.group.stats().unlocated > 0,
            ..Measured::default()
        })
    }

    fn failed(&mut self, why: &ModelError) -> Option<Failure> {
        let moved = self.formed.group.transport().met_another_version();
        if moved {
            eprintln!("the mesh moved to a new version ({why}): forming the group again");
        } else {
            eprintln!("a pass failed ({why}): forming the group again");
        }
        if self.formed.group.stats().unlocated > 0 {
            eprintln!("a wrong answer could not be located: the next group takes one more check");
        }
        let hop = self.hop.take().is_some();
        Some(Failure { moved, hop })
    }
}

/// A leader's [`Publisher`] over the network: signs an update, keeps a copy in the archive if
/// set, starts it spreading through every live row's holder (the group's members first) and
/// waits until the members have applied it.
struct NetPublisher<'a> {
    link: NativeLink,
    signer: &'a node_core::lead::Signer,
    holders: &'a [PeerId],
    members: &'a [PeerId],
    archive: Option<&'a std::path::Path>,
}

impl NetPublisher<'_> {
    /// Signs `p` (with the gate's `verdict`, at this moment) and keeps a copy in the archive.
    fn seal(&self, p: &Published, verdict: Option<GateClaim>) -> Result<Sealed> {
        let header = Header {
            issued_ms: node_core::holder::wall_ms(),
            verdict,
        };
        let sealed = node_core::lead::seal_update(p, self.signer, header)?;
        if let Some(dir) = self.archive {
            std::fs::create_dir_all(dir)?;
            let path = dir.join(format!("{:016x}.update", sealed.id));
            std::fs::write(&path, &sealed.bytes)
                .with_context(|| format!("archiving the update in {}", path.display()))?;
        }
        Ok(sealed)
    }
}

impl Publisher for NetPublisher<'_> {
    type Sent = Sent;

    async fn publish(
        &mut self,
        p: Published,
        verdict: Option<GateClaim>,
    ) -> Result<(Sent, Option<[u8; 32]>), String> {
        let sealed = self.seal(&p, verdict).map_err(|e| format!("{e:#}"))?;
        let out =
            crate::hold::spread::hand_out(&self.link, &sealed, self.members, self.holders, None)
                .await;
        tracing::debug!(
            members_at = out.members_at,
            members = out.members,
            "published an update"
        );
        let sent = Sent {
            id: sealed.id,
            bytes: sealed.bytes.len(),
            told: out.passed.taken,
            sent_bytes: out.passed.inline_bytes,
            requests: p.requests,
            kept: p.kept,
        };
        Ok((sent, None))
    }
}

/// What one learning step did.
#[derive(Debug, Clone)]
pub struct Learned {
    /// Mean next-token loss on the request's tokens before the update.
    pub loss: f64,
    /// Positions trained on.
    pub positions: usize,
    /// What became of the update that fell due after this request, if one did.
    pub settled: Option<Settled<Sent>>,
    /// The node the text went to, when this leader may not write and handed it to a trainer
    /// instead (the loss is then not measured here).
    pub taught_by: Option<PeerId>,
}
