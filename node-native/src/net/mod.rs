//! The libp2p network: the swarm and its client ([`swarm`]), requests to peers ([`rpc`]),
//! and the reachability probe ([`probe`]).

pub mod probe;
pub mod rpc;
pub mod swarm;
