//! Coded Mesh native node: model files on disk, the default model's fetcher, the CLI's parts.

pub mod bench;
pub mod fetch;
pub mod gpubench;
pub mod http;
pub mod learning;
pub mod load;
pub mod localmesh;
pub mod node;
pub mod progress;
pub mod remote;
pub mod store;
pub mod swarm;
pub mod verifybench;
