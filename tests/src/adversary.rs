//! A hostile peer on real libp2p, for the red team: it connects to a live mesh as any stranger
//! can (a fresh identity) and tries each way of taking the mesh over or wearing it down that
//! the protocol offers — forged, replayed, malformed and oversized updates, notices naming
//! a crowd or claiming a quarter gigabyte, streams of frames far past what a request needs, a
//! report framing an honest holder, heartbeats lying about its version. Each attack returns
//! what the node answered; the red-team test checks that each was refused or contained, and
//! counted.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::AsyncWriteExt;
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId, StreamProtocol};
use node_core::coded::Caught;
use node_core::lead::Signer;
use node_core::learn::{Certificate, GateClaim, Header, Power, seal};
use node_core::mesh::{Coord, Heartbeat, MeshRequest, MeshResponse, ModelManifest, Notice};
use node_native::lead::remote::Session;
use node_native::net::rpc::ask;

/// How long a flood may spend opening its streams, all of them together.
const FLOOD_OPENING: Duration = Duration::from_secs(30);

/// A stranger connected to one node of a mesh.
pub struct Adversary {
    /// Its connection.
    pub session: Session,
    /// The mesh's manifest, as any peer may fetch it.
    pub manifest: ModelManifest,
    /// Its identity (fresh: the mesh admits nothing of it).
    pub key: Keypair,
}

impl std::fmt::Debug for Adversary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adversary")
            .field("peer", &self.session.client.peer_id())
            .finish()
    }
}

/// What an answer says, for assertions: an error's text, or the answer's kind.
pub fn said(r: &Result<MeshResponse>) -> String {
    match r {
        Ok(MeshResponse::Error(e)) => e.clone(),
        Ok(other) => format!("{other:?}").chars().take(80).collect(),
        Err(e) => format!("{e:#}"),
    }
}

impl Adversary {
    /// Connects to the node at `bootstrap` with a fresh identity and fetches the manifest.
    pub async fn connect(bootstrap: Multiaddr) -> Result<Self> {
        let key = Keypair::generate_ed25519();
        let session = Session::connect_as(bootstrap, key.clone()).await?;
        let manifest = session.manifest().await?;
        Ok(Self {
            session,
            manifest,
            key,
        })
    }

    /// The node it connected to.
    pub fn target(&self) -> PeerId {
        self.session.bootstrap
    }

    /// Asks the node it connected to.
    pub async fn ask(&self, request: MeshRequest) -> Result<MeshResponse> {
        ask(&self.session.client, self.target(), request).await
    }

    /// A signer admitted by `mesh_key` (the operator's key: what an insider gone bad, or a
    /// stolen trainer key, holds), or the adversary itself unadmitted.
    pub fn signer(&self, mesh_key: Option<&Keypair>) -> Result<Signer> {
        let cert = match mesh_key {
            Some(mesh) => Some(Certificate::issue(
                mesh,
                self.key.public().to_peer_id(),
                "insider",
                7,
                node_core::holder::wall_ms() / 1000 + 3600,
                &[Power::Write, Power::Report],
            )?),
            None => None,
        };
        Ok(Signer {
            key: self.key.clone(),
            cert,
        })
    }

    /// `payload` sealed as `signer`, issued at `issued_ms`, with a verdict at the mesh's
    /// reference (or none).
    pub fn sealed(
        &self,
        signer: &Signer,
        payload: Vec<u8>,
        issued_ms: u64,
        verdict: bool,
    ) -> Result<Vec<u8>> {
        let reference = self.manifest.canary_loss.unwrap_or(3.0);
        let header = Header {
            issued_ms,
            verdict: verdict.then_some(GateClaim {
                before: reference,
                after: reference,
                reference,
            }),
        };
        Ok(seal(payload, &signer.key, signer.cert.as_ref(), header)?)
    }

    /// Hands the node an update's bytes directly, as a leader would.
    pub async fn learn(&self, bytes: Vec<u8>) -> Result<MeshResponse> {
        self.ask(MeshRequest::Learn(bytes)).await
    }

    /// A notice of an update of `total` bytes signed as `signer`, naming `named` peers.
    pub async fn notice(&self, signer: &Signer, total: u64, named: usize) -> Result<MeshResponse> {
        let list = node_core::holder::PieceList {
            id: 0x5eed,
            total,
            digests: vec![
                [0; 32];
                total.div_ceil(u64::from(node_core::holder::PIECE_BYTES)) as usize
            ],
        };
        let header = Header {
            issued_ms: node_core::holder::wall_ms(),
            verdict: None,
        };
        let list = list.seal(signer, header)?;
        let peer = self.session.client.peer_id().to_string();
        self.ask(MeshRequest::Spread(Notice {
            list,
            sources: vec![peer.clone()],
            to: vec![peer; named],
            inline: None,
        }))
        .await
    }

    /// A report that `accused` answered against the code, signed as `signer`.
    pub async fn frame(&self, signer: &Signer, accused: PeerId) -> Result<MeshResponse> {
        let evidence = Caught {
            node: 1,
            step: "block 0 q/k/v".into(),
            residual: 1.0,
            threshold: 1e-3,
            witnesses: vec![0, 2, 3],
            missing_update: None,
        };
        let report = node_core::holder::sign_report(
            signer,
            accused,
            &evidence,
            node_core::holder::wall_ms(),
        )?;
        self.ask(MeshRequest::Report {
            report,
            to: Vec::new(),
        })
        .await
    }

    /// Opens `streams` raw streams of the mesh's request protocol, each claiming a frame of
    /// `claimed` bytes of request kind `variant` (7: an update) and sending `sent` of them,
    /// then holding the rest back for `hold`. Returns how many streams opened and how many
    /// failed to open or to take the bytes (the node closed them, or cut the peer off). Every
    /// step has a deadline: a node that neither reads nor closes a stream costs the adversary
    /// nothing but time.
    pub async fn flood(
        &self,
        streams: usize,
        (variant, claimed): (u8, u32),
        sent: usize,
        hold: Duration,
    ) -> (usize, usize) {
        let protocol = StreamProtocol::new(node_core::net::MESH_PROTOCOL);
        let mut control = self.session.client.control();
        let deadline = Duration::from_secs(5);
        // The opening as a whole is bounded too: a node that lets each open wait out its
        // deadline would otherwise hold the flood for `streams` × 5 s (85 min for 1024); the
        // streams not opened by then count as cut.
        let opening_ends = tokio::time::Instant::now() + FLOOD_OPENING;
        let mut opened = Vec::new();
        for _ in 0..streams {
            let left = opening_ends.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let open = control.open_stream(self.target(), protocol.clone());
            if let Ok(Ok(s)) = tokio::time::timeout(deadline.min(left), open).await {
                opened.push(s);
            }
        }
        let count = opened.len();
        let mut failed = streams - count;
        // A request's head: the length, the protocol version, the variant.
        let mut head = claimed.to_le_bytes().to_vec();
        head.extend(
            postcard::to_allocvec(&node_core::protocol::PROTOCOL_VERSION).unwrap_or_default(),
        );
        head.push(variant);
        let body = vec![0x41u8; sent];
        let writes = opened.iter_mut().map(|s| {
            let (head, body) = (&head, &body);
            async move {
                let write = async {
                    s.write_all(head).await?;
                    s.write_all(body).await?;
                    s.flush().await
                };
                matches!(tokio::time::timeout(deadline, write).await, Ok(Ok(())))
            }
        });
        failed += futures::future::join_all(writes)
            .await
            .into_iter()
            .filter(|ok| !ok)
            .count();
        tokio::time::sleep(hold).await;
        drop(opened);
        (count, failed)
    }

    /// Asks for a row near 60 made-up peers (a joiner's samples list, bounded at 32 names; the
    /// frame within the 4 KiB a join may take): the node should refuse the request unread.
    pub async fn join_near_a_crowd(&self) -> Result<MeshResponse> {
        let peers: Vec<String> = (0..60).map(|_| PeerId::random().to_string()).collect();
        let rtt_us = vec![1_000; peers.len()];
        self.ask(MeshRequest::JoinNear { peers, rtt_us }).await
    }

    /// Publishes heartbeats as a holder of `row` at a version of `count` updates it made up,
    /// `times` times a little apart: a liar who would be the source others catch up from.
    pub async fn lie_about_version(&self, row: u32, count: u64, times: usize) -> Result<()> {
        self.heartbeats(row, count, Coord::ORIGIN, times).await
    }

    /// Publishes heartbeats as a holder of `row` whose network coordinate is a billion
    /// milliseconds out, `times` times a little apart: a liar who would be nearest of all.
    pub async fn lie_about_place(&self, row: u32, times: usize) -> Result<()> {
        let far = Coord {
            vec: [1e9; node_core::mesh::coords::DIMS],
            ..Coord::ORIGIN
        };
        self.heartbeats(row, 0, far, times).await
    }

    /// Publishes `times` heartbeats as a holder of `row` at `count` updates, at `coord`.
    async fn heartbeats(&self, row: u32, count: u64, coord: Coord, times: usize) -> Result<()> {
        let model = self.manifest.digest()?;
        for seq in 0..times as u64 {
            let hb = Heartbeat {
                model,
                row: Some(row),
                version_count: count,
                version_digest: [0x7e; 32],
                addrs: Vec::new(),
                offers: Vec::new(),
                incarnation: 1,
                seq,
                uptime_ms: seq * 200,
                device: "cpu".into(),
                usage: Default::default(),
                reach: Default::default(),
                trains: false,
                coord,
            };
            let bytes = node_core::protocol::encode(&hb)?;
            // Before the gossip mesh forms, a heartbeat has no one to go to: the next goes.
            let _ = self.session.client.publish(bytes).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }
}

/// The Learn answer's refusal reason, from the node's error text (`update refused (REASON)`).
pub fn refusal(r: &Result<MeshResponse>) -> Result<String> {
    let text = said(r);
    let Some(rest) = text.split("update refused (").nth(1) else {
        bail!("not a refusal: {text}");
    };
    rest.split(')').next().map(str::to_string).context("reason")
}
