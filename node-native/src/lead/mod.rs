//! Leading a request from the command line over the network: a coded group of remote members
//! in rounds ([`remote`]) or one hop per stage ([`hop`]), the command line's leader
//! ([`leader`]), and the log of its steps ([`steplog`]).

pub mod hop;
pub mod leader;
pub mod remote;
pub mod steplog;
