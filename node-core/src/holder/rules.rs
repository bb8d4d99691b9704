//! What an update must satisfy before a holder applies it, checked on untrusted bytes in the
//! order that costs the least first: its size against the most the manifest's adapter shapes
//! make, the signature, the certificate by which the mesh's key admits the signer to write,
//! the time it was issued (an old update replayed, or one from the future, is out of turn),
//! the trainer's canary verdict against the mesh's reference loss, then the update itself
//! against the model and the mesh's learning settings. Every refusal is counted by reason.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::coded::ShardFormat;
use crate::learn::{
    AdmitError, GateClaim, LearningConfig, MAX_CANARY_DRIFT, MAX_CANARY_STEP, MeshKey, Power,
    Update, max_update_bytes,
};
use crate::mesh::ModelManifest;
use crate::model::LlamaConfig;

/// The wall clock in unix milliseconds, as updates, reports and certificates are dated (the
/// same on a native node and in a page).
pub fn wall_ms() -> u64 {
    web_time::SystemTime::now()
        .duration_since(web_time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Oldest an update may be when a holder takes it, in milliseconds: a holder remembers the ids
/// of the latest updates it applied ([`crate::mesh::RECENT_FOLDED`]), far more than a mesh
/// publishes in this time, so an update replayed after it is refused as out of turn rather than
/// applied twice. A holder further behind than this rebuilds its row.
pub const MAX_UPDATE_AGE_MS: u64 = 30 * 60 * 1000;

/// How far ahead of a holder's clock an update's time may be (the trainer's clock runs ahead).
pub const CLOCK_SKEW_MS: u64 = 2 * 60 * 1000;

/// Bytes of a signed envelope beyond its payload: the signer's key, the certificate, the
/// header, the signature and their length prefixes (a bound, with room).
const ENVELOPE_BYTES: u64 = 2048;

/// How far a trainer's measured canary loss may sit from the manifest's reference for the
/// same model (a coded group's decoding noise is far below this), in nats per token.
const REFERENCE_TOLERANCE: f64 = 1e-3;

/// Why a holder refused an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Larger than any update of this mesh.
    Oversized,
    /// Not signed, or its signature does not hold.
    Signature,
    /// Its signer is not admitted to write by the mesh's key (no certificate, a self-signed or
    /// another mesh's one, one for another peer or without the power).
    Unadmitted,
    /// Its signer's certificate expired.
    Expired,
    /// Issued too long ago (a replay) or in the future.
    OutOfTurn,
    /// The mesh runs a canary gate and the trainer attached no verdict.
    Ungated,
    /// The trainer's verdict breaks the mesh's canary bounds.
    Gate,
    /// Not an update of this model, or against its learning settings.
    Malformed,
    /// A report of a caught member by a peer the mesh does not admit to report.
    ReportUnadmitted,
    /// A report out of shape, unsigned or out of turn.
    ReportMalformed,
}

impl Refusal {
    /// Every reason, in the order [`REFUSED`] counts them.
    pub const ALL: [Refusal; 10] = [
        Refusal::Oversized,
        Refusal::Signature,
        Refusal::Unadmitted,
        Refusal::Expired,
        Refusal::OutOfTurn,
        Refusal::Ungated,
        Refusal::Gate,
        Refusal::Malformed,
        Refusal::ReportUnadmitted,
        Refusal::ReportMalformed,
    ];

    /// The reason as `/metrics` labels it.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Oversized => "oversized",
            Refusal::Signature => "signature",
            Refusal::Unadmitted => "unadmitted",
            Refusal::Expired => "expired",
            Refusal::OutOfTurn => "out_of_turn",
            Refusal::Ungated => "ungated",
            Refusal::Gate => "gate",
            Refusal::Malformed => "malformed",
            Refusal::ReportUnadmitted => "report_unadmitted",
            Refusal::ReportMalformed => "report_malformed",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|&r| r == self).unwrap_or(0)
    }

    /// Updates refused for this reason since the process started.
    pub fn count(self) -> u64 {
        REFUSED[self.index()].load(Ordering::Relaxed)
    }
}

/// Updates (and reports) refused since the process started, by [`Refusal`] (in
/// [`Refusal::ALL`]'s order).
pub static REFUSED: [AtomicU64; Refusal::ALL.len()] =
    [const { AtomicU64::new(0) }; Refusal::ALL.len()];

/// An update the mesh's rules refuse: why, and the details.
#[derive(Debug, Clone, thiserror::Error)]
#[error("update refused ({}): {detail}", why.label())]
pub struct Refused {
    /// The reason.
    pub why: Refusal,
    /// What was wrong.
    pub detail: String,
    /// Who signed it, where its signature held.
    pub sender: Option<Box<Sender>>,
}

/// A refused update whose signature held: its id, signer and what the signer said beside it,
/// so a holder can record whose it was without opening it again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sender {
    /// The update's id (the hash of the signed payload).
    pub id: u64,
    /// The signer's peer id.
    pub signer: libp2p::PeerId,
    /// When it was signed, and the trainer's canary verdict.
    pub header: crate::learn::Header,
}

impl Refused {
    /// Counts and logs a refusal of something an update brings (a notice of one).
    pub fn count(why: Refusal, detail: impl std::fmt::Display) -> Self {
        Self::new(why, detail)
    }

    /// Counts and logs a refusal.
    fn new(why: Refusal, detail: impl std::fmt::Display) -> Self {
        let n = REFUSED[why.index()].fetch_add(1, Ordering::Relaxed) + 1;
        let detail = detail.to_string();
        tracing::warn!(
            reason = why.label(),
            "refused an update: {detail} ({n} so far)"
        );
        Self {
            why,
            detail,
            sender: None,
        }
    }

    /// The same refusal naming `signed`'s signer.
    fn by(mut self, signed: &crate::learn::Signed) -> Self {
        self.sender = Some(Box::new(Sender {
            id: Update::id_of(&signed.payload),
            signer: signed.signer,
            header: signed.header,
        }));
        self
    }
}

/// What an update must satisfy on this mesh.
#[derive(Debug, Clone)]
pub struct Rules {
    /// The model's shape.
    pub cfg: LlamaConfig,
    /// The mesh's learning settings.
    pub learning: LearningConfig,
    /// How the mesh's shards are stored (an adapter step's bound depends on it).
    pub format: ShardFormat,
    /// The mesh's key, which admits trainers (`None`: a manifest whose key does not parse,
    /// which admits no one).
    pub mesh: Option<MeshKey>,
    /// The mesh's reference canary loss, when it runs a gate.
    pub canary: Option<f64>,
    /// Most bytes of a signed update of this mesh.
    pub max_sealed: u64,
}

/// A checked update: its id (the hash of the signed payload), who signed it, and the name its
/// certificate gives the signer.
#[derive(Debug)]
pub struct Checked {
    /// The update.
    pub update: Update,
    /// Its id.
    pub id: u64,
    /// The signer's peer id.
    pub signer: libp2p::PeerId,
    /// The trainer's name, as the mesh's key admitted it.
    pub trainer: String,
    /// What the trainer said beside it: when it signed, and its canary verdict.
    pub header: crate::learn::Header,
}

impl Rules {
    /// Rules of a small model's mesh with no key, for tests.
    #[cfg(test)]
    pub(crate) fn of_test() -> Self {
        let cfg = LlamaConfig::small();
        let learning = LearningConfig::default();
        Self {
            max_sealed: max_update_bytes(&cfg, &learning) + ENVELOPE_BYTES,
            cfg,
            learning,
            format: ShardFormat::F32,
            mesh: None,
            canary: None,
        }
    }

    /// The rules of the mesh `manifest` describes.
    pub fn of(manifest: &ModelManifest) -> Self {
        Self {
            cfg: manifest.cfg.clone(),
            learning: manifest.learning,
            format: manifest.format,
            mesh: manifest.mesh_key().ok(),
            canary: manifest.canary_loss,
            max_sealed: max_update_bytes(&manifest.cfg, &manifest.learning) + ENVELOPE_BYTES,
        }
    }

    /// Opens and checks a signed update from untrusted bytes. `now_ms` is the holder's clock
    /// (unix milliseconds) for an update arriving now; `None` for one this holder accepted
    /// before (replayed from its own disk), whose certificate may have expired since.
    pub fn check(&self, bytes: &[u8], now_ms: Option<u64>) -> Result<Checked, Refused> {
        if bytes.len() as u64 > self.max_sealed {
            return Err(Refused::new(
                Refusal::Oversized,
                format!(
                    "{} bytes, over the {} an update of this mesh takes",
                    bytes.len(),
                    self.max_sealed
                ),
            ));
        }
        let signed = crate::learn::open(bytes).map_err(|e| Refused::new(Refusal::Signature, e))?;
        self.check_signed(&signed, now_ms)
            .map_err(|refused| refused.by(&signed))
    }

    /// [`Self::check`] of an update whose signature held.
    fn check_signed(
        &self,
        signed: &crate::learn::Signed,
        now_ms: Option<u64>,
    ) -> Result<Checked, Refused> {
        let mesh = self.mesh.as_ref().ok_or_else(|| {
            Refused::new(
                Refusal::Unadmitted,
                "the mesh's manifest names no usable key",
            )
        })?;
        let cert = signed
            .admitted(mesh, Power::Write, now_ms.map(|ms| ms / 1000))
            .map_err(|e| match e {
                AdmitError::Expired(_) => Refused::new(Refusal::Expired, e),
                e => Refused::new(
                    Refusal::Unadmitted,
                    format!("signed by {}: {e}", signed.signer),
                ),
            })?;
        if let Some(now) = now_ms {
            let at = signed.header.issued_ms;
            if at.saturating_add(MAX_UPDATE_AGE_MS) < now || at > now.saturating_add(CLOCK_SKEW_MS)
            {
                return Err(Refused::new(
                    Refusal::OutOfTurn,
                    format!(
                        "issued {} s from now (at most {} s ago, {} s ahead)",
                        (at as i128 - now as i128) / 1000,
                        MAX_UPDATE_AGE_MS / 1000,
                        CLOCK_SKEW_MS / 1000
                    ),
                ));
            }
        }
        if let Some(reference) = self.canary {
            let verdict = signed.header.verdict.ok_or_else(|| {
                Refused::new(
                    Refusal::Ungated,
                    "the mesh runs a canary gate and the trainer attached no verdict",
                )
            })?;
            gate_holds(&verdict, reference).map_err(|e| Refused::new(Refusal::Gate, e))?;
        }
        let update =
            Update::decode(&signed.payload).map_err(|e| Refused::new(Refusal::Malformed, e))?;
        update
            .validate_for(&self.cfg, &self.learning, self.format)
            .map_err(|e| Refused::new(Refusal::Malformed, e))?;
        Ok(Checked {
            update,
            id: Update::id_of(&signed.payload),
            signer: signed.signer,
            trainer: cert.name,
            header: signed.header,
        })
    }
}

/// Whether a trainer's verdict keeps within the mesh's canary bounds: measured from the mesh's
/// reference `reference`, an update raises the loss at most [`MAX_CANARY_STEP`], and the loss
/// after it stays within [`MAX_CANARY_DRIFT`] of the reference.
pub fn gate_holds(v: &GateClaim, reference: f64) -> Result<(), String> {
    let finite = v.before.is_finite() && v.after.is_finite() && v.reference.is_finite();
    if !finite || (v.reference - reference).abs() > REFERENCE_TOLERANCE * reference.max(1.0) {
        return Err(format!(
            "the verdict counts from a canary loss of {:.4}, not the mesh's {reference:.4}",
            v.reference
        ));
    }
    let slack = REFERENCE_TOLERANCE;
    if v.after - v.before > MAX_CANARY_STEP + slack
        || v.after - reference > MAX_CANARY_DRIFT + slack
    {
        return Err(format!(
            "the canary loss would go {:.4} → {:.4} (the mesh's reference {reference:.4}; at most +{MAX_CANARY_STEP} an update, +{MAX_CANARY_DRIFT} in all)",
            v.before, v.after
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use libp2p::identity::Keypair;

    use super::*;
    use crate::learn::fixtures::{setup, teacher};
    use crate::learn::{Certificate, Header, seal};

    const NOW_MS: u64 = 1_800_000_000_000;
    const REFERENCE: f64 = 3.0;

    struct Mesh {
        key: Keypair,
        rules: Rules,
        update: Vec<u8>,
    }

    fn mesh() -> Mesh {
        let (llama, _, [g1, _]) = setup();
        let update = teacher(None).fold(g1).unwrap().unwrap().update.encode();
        let key = Keypair::generate_ed25519();
        let learning = LearningConfig::default();
        let cfg = llama.config().clone();
        let rules = Rules {
            max_sealed: max_update_bytes(&cfg, &learning) + ENVELOPE_BYTES,
            cfg,
            learning,
            format: ShardFormat::Q8,
            mesh: Some(MeshKey::of(&key)),
            canary: Some(REFERENCE),
        };
        Mesh { key, rules, update }
    }

    fn admitted(mesh: &Keypair, trainer: &Keypair, not_after_s: u64) -> Certificate {
        let peer = trainer.public().to_peer_id();
        Certificate::issue(mesh, peer, "trainer", 1, not_after_s, &[Power::Write]).unwrap()
    }

    fn gated(issued_ms: u64, after: f64) -> Header {
        Header {
            issued_ms,
            verdict: Some(GateClaim {
                before: REFERENCE,
                after,
                reference: REFERENCE,
            }),
        }
    }

    /// The refusal `bytes` meet on `m`'s mesh at [`NOW_MS`], if any.
    fn refusal(m: &Mesh, bytes: &[u8]) -> Option<Refusal> {
        m.rules.check(bytes, Some(NOW_MS)).err().map(|e| e.why)
    }

    #[test]
    fn what_a_holder_shows_of_an_update_names_its_trainer_and_the_verdict_it_carried() {
        use super::super::UpdateSeen;
        let m = mesh();
        let trainer = Keypair::generate_ed25519();
        let cert = admitted(&m.key, &trainer, NOW_MS / 1000 + 3600);
        // The mesh's update, signed by the trainer with a canary loss after it of `after`.
        let sealed = |after: f64| {
            seal(
                m.update.clone(),
                &trainer,
                Some(&cert),
                gated(NOW_MS, after),
            )
            .unwrap()
        };
        let good = sealed(REFERENCE + 0.005);
        let checked = m.rules.check(&good, Some(NOW_MS)).unwrap();
        let seen = UpdateSeen::checked(&checked, good.len(), NOW_MS + 1);
        assert_eq!(seen.trainer, trainer.public().to_peer_id().to_string());
        assert_eq!(
            (seen.trainer_name.as_str(), seen.applied),
            ("trainer", true)
        );
        assert_eq!(seen.gate.map(|g| g.after), Some(REFERENCE + 0.005));
        assert_eq!((seen.issued_ms, seen.seen_ms), (NOW_MS, NOW_MS + 1));
        assert_eq!(seen.id, format!("{:016x}", checked.id));
        // Past the drift: refused, and still named by its signer, with what it claimed.
        let far = sealed(REFERENCE + 1.0);
        let refused = m.rules.check(&far, Some(NOW_MS)).unwrap_err();
        let seen = UpdateSeen::refused(&far, &refused, NOW_MS);
        assert!(!seen.applied);
        assert_eq!(seen.trainer, trainer.public().to_peer_id().to_string());
        assert_eq!(seen.gate.map(|g| g.after), Some(REFERENCE + 1.0));
        assert!(seen.why.as_deref().is_some_and(|w| w.starts_with("gate: ")));
        assert_eq!(seen.bytes, far.len() as u64);
        // Garbage: nobody to name.
        let refused = m.rules.check(b"garbage", Some(NOW_MS)).unwrap_err();
        let seen = UpdateSeen::refused(b"garbage", &refused, NOW_MS);
        assert_eq!((seen.trainer.as_str(), seen.id.as_str()), ("", ""));
        assert!(
            seen.why
                .as_deref()
                .is_some_and(|w| w.starts_with("signature: "))
        );
    }

    #[test]
    fn only_an_admitted_trainers_gated_update_of_now_is_taken_and_each_refusal_is_counted() {
        let m = mesh();
        let trainer = Keypair::generate_ed25519();
        let cert = admitted(&m.key, &trainer, NOW_MS / 1000 + 3600);
        let before: Vec<u64> = Refusal::ALL.iter().map(|r| r.count()).collect();
        let seal_with = |key: &Keypair, cert: Option<&Certificate>, h: Header| {
            seal(m.update.clone(), key, cert, h).unwrap()
        };
        // An admitted trainer, a verdict within the bounds, issued now: taken.
        let good = seal_with(&trainer, Some(&cert), gated(NOW_MS, REFERENCE + 0.005));
        let checked = m.rules.check(&good, Some(NOW_MS)).unwrap();
        assert_eq!(checked.trainer, "trainer");
        assert_eq!(checked.signer, trainer.public().to_peer_id());
        // Strangers: no certificate, a self-signed one, another peer's.
        let stranger = Keypair::generate_ed25519();
        let cases = [
            (
                seal_with(&stranger, None, gated(NOW_MS, REFERENCE)),
                Refusal::Unadmitted,
            ),
            (
                seal_with(
                    &stranger,
                    Some(&admitted(&stranger, &stranger, u64::MAX)),
                    gated(NOW_MS, REFERENCE),
                ),
                Refusal::Unadmitted,
            ),
            (
                seal_with(&stranger, Some(&cert), gated(NOW_MS, REFERENCE)),
                Refusal::Unadmitted,
            ),
            // Expired certificate.
            (
                seal_with(
                    &trainer,
                    Some(&admitted(&m.key, &trainer, NOW_MS / 1000 - 1)),
                    gated(NOW_MS, REFERENCE),
                ),
                Refusal::Expired,
            ),
            // Out of turn: replayed after the window, or from the future.
            (
                seal_with(
                    &trainer,
                    Some(&cert),
                    gated(NOW_MS - MAX_UPDATE_AGE_MS - 1, REFERENCE),
                ),
                Refusal::OutOfTurn,
            ),
            (
                seal_with(
                    &trainer,
                    Some(&cert),
                    gated(NOW_MS + CLOCK_SKEW_MS + 1000, REFERENCE),
                ),
                Refusal::OutOfTurn,
            ),
            // No verdict; one past a step's bound; one past the drift; one counted from
            // another reference.
            (
                seal_with(
                    &trainer,
                    Some(&cert),
                    Header {
                        issued_ms: NOW_MS,
                        verdict: None,
                    },
                ),
                Refusal::Ungated,
            ),
            (
                seal_with(
                    &trainer,
                    Some(&cert),
                    gated(NOW_MS, REFERENCE + MAX_CANARY_STEP + 0.01),
                ),
                Refusal::Gate,
            ),
            (
                seal_with(
                    &trainer,
                    Some(&cert),
                    Header {
                        issued_ms: NOW_MS,
                        verdict: Some(GateClaim {
                            before: REFERENCE + MAX_CANARY_DRIFT,
                            after: REFERENCE + MAX_CANARY_DRIFT + 0.005,
                            reference: REFERENCE,
                        }),
                    },
                ),
                Refusal::Gate,
            ),
            (
                seal_with(
                    &trainer,
                    Some(&cert),
                    Header {
                        issued_ms: NOW_MS,
                        verdict: Some(GateClaim {
                            before: 9.0,
                            after: 9.0,
                            reference: 9.0,
                        }),
                    },
                ),
                Refusal::Gate,
            ),
            // Not signed; larger than any update of the mesh; signed and not an update.
            (b"not signed at all".to_vec(), Refusal::Signature),
            (
                vec![0u8; m.rules.max_sealed as usize + 1],
                Refusal::Oversized,
            ),
            (
                seal(
                    b"payload".to_vec(),
                    &trainer,
                    Some(&cert),
                    gated(NOW_MS, REFERENCE),
                )
                .unwrap(),
                Refusal::Malformed,
            ),
        ];
        let mut counted = vec![0u64; Refusal::ALL.len()];
        for (i, (bytes, want)) in cases.iter().enumerate() {
            assert_eq!(refusal(&m, bytes), Some(*want), "case {i}");
            counted[want.index()] += 1;
        }
        for (r, (b, c)) in Refusal::ALL.iter().zip(before.iter().zip(&counted)) {
            // Other tests refuse updates beside this one: at least this many more.
            assert!(
                r.count() >= b + c,
                "{} counted {} → {}",
                r.label(),
                b,
                r.count()
            );
        }
        // An update accepted before: replayed from disk after its certificate expired and its
        // time passed, it is still taken.
        let old = seal_with(
            &trainer,
            Some(&admitted(&m.key, &trainer, NOW_MS / 1000 - 10)),
            gated(NOW_MS - 2 * MAX_UPDATE_AGE_MS, REFERENCE),
        );
        assert!(m.rules.check(&old, None).is_ok());
        // A mesh without a gate takes an update without a verdict.
        let mut ungated = mesh();
        ungated.rules.canary = None;
        let cert = admitted(&ungated.key, &trainer, u64::MAX);
        let bytes = seal(
            ungated.update.clone(),
            &trainer,
            Some(&cert),
            Header {
                issued_ms: NOW_MS,
                verdict: None,
            },
        )
        .unwrap();
        assert!(ungated.rules.check(&bytes, Some(NOW_MS)).is_ok());
    }

    #[test]
    fn the_bound_on_an_updates_bytes_follows_the_adapters_and_is_tight() {
        let m = mesh();
        let bound = max_update_bytes(&m.rules.cfg, &m.rules.learning);
        let got = m.update.len() as u64;
        assert!(
            got <= bound,
            "an update of {got} bytes over the bound {bound}"
        );
        assert!(
            bound - got < 1024,
            "the bound {bound} is {} bytes over a real update",
            bound - got
        );
    }
}
