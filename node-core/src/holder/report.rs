//! Reports of members caught answering against the code, signed by the leader that caught
//! them. A holder acts on another's report (leaves the member out of its groups, offers its
//! row to joiners) only when the mesh's key admits the reporter to report: anyone may lead,
//! but PeerIds are free, so a report from a peer the mesh has not admitted is the reporter's
//! own business. It is refused, counted, and not passed on: nobody can frame a holder.

use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use super::{HolderError, Refusal, Refused, Rules};
use crate::coded::Caught;
use crate::learn::Signer;
use crate::learn::{Header, Power};

/// Most bytes of a signed report (the accused, the evidence, the reporter's key, certificate
/// and signature).
pub const MAX_REPORT_BYTES: usize = 4096;

/// Most characters of the step a report names, and most witnesses it lists.
const MAX_STEP_CHARS: usize = 128;
const MAX_WITNESSES: usize = 256;

#[derive(Serialize, Deserialize)]
struct Body {
    #[serde(with = "serde_bytes")]
    accused: Vec<u8>,
    evidence: Caught,
}

/// A report whose reporter the mesh admits to report.
#[derive(Debug, Clone)]
pub struct Report {
    /// The member caught.
    pub accused: PeerId,
    /// What it was caught doing.
    pub evidence: Caught,
    /// Who caught it.
    pub reporter: PeerId,
    /// The reporter's name, as its certificate gives it.
    pub name: String,
}

/// `accused`'s report with `evidence`, signed as `signer` at `now_ms` (unix milliseconds).
pub fn sign_report(
    signer: &Signer,
    accused: PeerId,
    evidence: &Caught,
    now_ms: u64,
) -> Result<Vec<u8>, HolderError> {
    let body = Body {
        accused: accused.to_bytes(),
        evidence: evidence.clone(),
    };
    let body = postcard::to_allocvec(&body)
        .map_err(|e| HolderError::Download(format!("encoding a report: {e}")))?;
    let header = Header {
        issued_ms: now_ms,
        verdict: None,
    };
    Ok(crate::learn::seal(
        body,
        &signer.key,
        signer.cert.as_ref(),
        header,
    )?)
}

/// A report from the network, if the mesh admits its signer to report at `now_ms` and it is
/// recent and well formed; refused and counted otherwise.
pub fn open_report(bytes: &[u8], rules: &Rules, now_ms: u64) -> Result<Report, Refused> {
    let malformed = |e: String| Refused::count(Refusal::ReportMalformed, e);
    if bytes.len() > MAX_REPORT_BYTES {
        return Err(malformed(format!(
            "a report of {} bytes, over {MAX_REPORT_BYTES}",
            bytes.len()
        )));
    }
    let signed = crate::learn::open(bytes).map_err(|e| malformed(e.to_string()))?;
    let mesh = rules
        .mesh
        .as_ref()
        .ok_or_else(|| malformed("the mesh's manifest names no usable key".into()))?;
    let cert = signed
        .admitted(mesh, Power::Report, Some(now_ms / 1000))
        .map_err(|e| {
            Refused::count(
                Refusal::ReportUnadmitted,
                format!("a report by {}: {e}", signed.signer),
            )
        })?;
    let at = signed.header.issued_ms;
    if at.saturating_add(super::MAX_UPDATE_AGE_MS) < now_ms
        || at > now_ms.saturating_add(super::CLOCK_SKEW_MS)
    {
        return Err(malformed(format!(
            "a report issued at {at} ms, out of turn"
        )));
    }
    let body: Body = postcard::from_bytes(&signed.payload)
        .map_err(|e| malformed(format!("not a report: {e}")))?;
    let accused =
        PeerId::from_bytes(&body.accused).map_err(|e| malformed(format!("accused: {e}")))?;
    let e = &body.evidence;
    if e.step.chars().count() > MAX_STEP_CHARS
        || e.witnesses.len() > MAX_WITNESSES
        || !(e.residual.is_finite() && e.threshold.is_finite())
    {
        return Err(malformed("the evidence is out of shape".into()));
    }
    Ok(Report {
        accused,
        evidence: body.evidence,
        reporter: signed.signer,
        name: cert.name,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use libp2p::identity::Keypair;

    use super::*;
    use crate::learn::{Certificate, MeshKey};

    const NOW: u64 = 1_800_000_000_000;

    fn evidence() -> Caught {
        Caught {
            node: 2,
            step: "block 3 gate/up".into(),
            residual: 0.4,
            threshold: 1e-3,
            witnesses: vec![0, 1, 3],
            missing_update: None,
        }
    }

    #[test]
    fn only_a_leader_the_mesh_admits_to_report_is_acted_on() {
        let mesh = Keypair::generate_ed25519();
        let mut rules = Rules::of_test();
        rules.mesh = Some(MeshKey::of(&mesh));
        let accused = Keypair::generate_ed25519().public().to_peer_id();
        let leader = Keypair::generate_ed25519();
        let cert = |powers: &[Power]| {
            Certificate::issue(
                &mesh,
                leader.public().to_peer_id(),
                "api",
                1,
                u64::MAX,
                powers,
            )
            .unwrap()
        };
        let admitted = Signer {
            key: leader.clone(),
            cert: Some(cert(&[Power::Write, Power::Report])),
        };
        let bytes = sign_report(&admitted, accused, &evidence(), NOW).unwrap();
        let report = open_report(&bytes, &rules, NOW).unwrap();
        assert_eq!(report.accused, accused);
        assert_eq!(report.evidence, evidence());
        assert_eq!(report.name, "api");
        // A stranger, a trainer without the power to report, an old report: refused, counted.
        let before = Refusal::ReportUnadmitted.count();
        let stranger = Signer::unadmitted(Keypair::generate_ed25519());
        for (signer, at) in [
            (stranger, NOW),
            (
                Signer {
                    key: leader.clone(),
                    cert: Some(cert(&[Power::Write])),
                },
                NOW,
            ),
        ] {
            let bytes = sign_report(&signer, accused, &evidence(), at).unwrap();
            let err = open_report(&bytes, &rules, NOW).unwrap_err();
            assert_eq!(err.why, Refusal::ReportUnadmitted, "{err}");
        }
        assert!(Refusal::ReportUnadmitted.count() >= before + 2);
        let old = sign_report(
            &admitted,
            accused,
            &evidence(),
            NOW - 2 * super::super::MAX_UPDATE_AGE_MS,
        )
        .unwrap();
        assert_eq!(
            open_report(&old, &rules, NOW).unwrap_err().why,
            Refusal::ReportMalformed
        );
        assert_eq!(
            open_report(&vec![7u8; MAX_REPORT_BYTES + 1], &rules, NOW)
                .unwrap_err()
                .why,
            Refusal::ReportMalformed
        );
    }
}
