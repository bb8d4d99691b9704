//! Requests to peers: one question, the manifest, and blobs fetched piece by piece.

use anyhow::{Context, Result, bail};
use libp2p::PeerId;
use node_core::holder::{Download, describe, update_chunk_request};
use node_core::mesh::{MeshRequest, MeshResponse, ModelManifest};

use crate::swarm::Client;

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

/// Downloads a blob piece by piece (`request(offset)` asks for the piece at `offset`): the
/// total and the version must stay the same throughout, and the total under `limit`.
async fn fetch_chunked(
    client: &Client,
    peer: PeerId,
    limit: u64,
    request: impl Fn(u64) -> MeshRequest,
) -> Result<(Vec<u8>, [u8; 32])> {
    let mut download = Download::new(limit);
    loop {
        let resp = client.request(peer, request(download.offset())).await?;
        let done = download.accept(resp)?;
        if done {
            return Ok(download.finish());
        }
    }
}

/// Downloads an update's payload in chunks.
pub(crate) async fn fetch_update(client: &Client, peer: PeerId, id: u64) -> Result<Vec<u8>> {
    let limit = crate::learning::MAX_UPDATE_BYTES;
    let req = |offset| update_chunk_request(id, offset);
    Ok(fetch_chunked(client, peer, limit, req).await?.0)
}
