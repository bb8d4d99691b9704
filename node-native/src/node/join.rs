//! Joining: a new node takes a row of the mesh through a bootstrap address.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use libp2p::Multiaddr;
use node_core::compute::gpu::Gpu;
use node_core::holder::{self, Joined};

use super::server::run_server;
use super::{Holding, JOIN_TRIES, NodeOptions, dial_with_backoff, start_network};
use crate::hold::learning::UpdateStore;
use crate::hold::link::NativeLink;
use crate::hold::store::DataDir;
use crate::net::rpc::fetch_manifest;

/// Times a node tries to obtain its row before it gives up.
const JOIN_ATTEMPTS: usize = 3;

/// Joins through `bootstrap`: dials it (trying for about 2 minutes while it does not answer),
/// obtains a row ([`node_core::holder::join`]), keeps it in `data` and serves it.
pub(super) async fn join(
    opts: NodeOptions,
    gpu: Option<Arc<Gpu>>,
    data: DataDir,
    bootstrap: Multiaddr,
) -> Result<()> {
    let net = start_network(&opts, &data).await?;
    let client = net.client.clone();
    // The bootstrap node may still be starting (a mesh started in any order): keep trying.
    let peer = match client.dial(bootstrap.clone()).await {
        Ok(peer) => peer,
        Err(e) => {
            eprintln!(
                "bootstrap {bootstrap} does not answer yet ({e:#}); trying again for about 2 minutes"
            );
            dial_with_backoff(&client, &bootstrap, JOIN_TRIES)
                .await
                .with_context(|| {
                    format!("bootstrap {bootstrap} did not answer for about 2 minutes: is a mesh node listening there?")
                })?
        }
    };
    let (manifest, manifest_bytes) = fetch_manifest(&client, peer).await?;
    data.save_manifest(&manifest_bytes)?;
    let started = std::time::Instant::now();
    let link = NativeLink::new(client.clone());
    // A row copied while its source takes a learning update is refused at the end (its
    // version moved): on a mesh that learns, a second try usually lands between updates.
    let mut joined = holder::join(&link, &peer, &manifest).await;
    for attempt in 2..=JOIN_ATTEMPTS {
        let Err(e) = &joined else { break };
        eprintln!("joining failed ({e}); trying again ({attempt} of {JOIN_ATTEMPTS})");
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        joined = holder::join(&link, &peer, &manifest).await;
    }
    link.finish();
    let Joined {
        shard,
        blob,
        version,
        norms,
        how,
        received,
    } = joined?;
    UpdateStore::open(&data)?.save_snapshot(&blob, &version, &norms)?;
    drop(blob);
    eprintln!(
        "joined as row {} ({how}): received {:.1} MiB ({received} bytes; the row's shard holds {}) in {:.1} s",
        shard.node,
        received as f64 / 1048576.0,
        shard.bytes(),
        started.elapsed().as_secs_f64()
    );
    let holding = Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis: BTreeMap::new(),
    };
    run_server(&opts, gpu, net, data, holding).await
}
