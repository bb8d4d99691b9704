//! Coded Mesh native node: model files on disk, the default model's fetcher, the CLI's parts.

pub mod api;
pub mod background;
pub mod bench;
pub mod engine;
pub mod fetch;
pub mod gpubench;
pub mod hop;
pub mod http;
pub mod learning;
pub mod link;
pub mod load;
pub mod local_session;
pub mod localmesh;
pub mod metrics;
pub mod node;
pub mod progress;
pub mod remote;
pub mod row;
pub mod rpc;
pub mod session;
pub mod steplog;
pub mod store;
pub mod supervise;
pub mod swarm;
pub mod up;
pub mod verifybench;
