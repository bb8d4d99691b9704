//! The libp2p network: the swarm and its client ([`swarm`]), requests to peers ([`rpc`]).

pub mod rpc;
pub mod swarm;
