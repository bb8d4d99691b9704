//! Requests to peers: one question, the manifest, a learning update's payload.

use anyhow::{Context, Result, bail};
use libp2p::PeerId;
use node_core::holder::describe;
use node_core::mesh::{MeshRequest, MeshResponse, ModelManifest};

use crate::net::swarm::Client;

/// One request, with the answer's `Error` turned into an error.
pub async fn ask(client: &Client, peer: PeerId, req: MeshRequest) -> Result<MeshResponse> {
    match client.request(peer, req).await? {
        MeshResponse::Error(e) => bail!("{peer} answered: {e}"),
        other => Ok(other),
    }
}

/// The model manifest from a peer, checked.
pub async fn fetch_manifest(client: &Client, peer: PeerId) -> Result<(ModelManifest, Vec<u8>)> {
    match ask(client, peer, MeshRequest::Manifest).await? {
        MeshResponse::Manifest(bytes) => {
            let m = ModelManifest::from_bytes(&bytes).context("the peer's manifest")?;
            Ok((m, bytes))
        }
        other => bail!("asked for the manifest, got a {}", describe(&other)),
    }
}
