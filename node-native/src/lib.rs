//! Coded Mesh native node, by role, in layers (each uses only those above it): the libp2p
//! network ([`net`]); holding a coded row ([`hold`]); leading a request over the network
//! ([`lead`]); serving the OpenAI API and leading its requests ([`serve`]); the node that runs
//! them all ([`node`]); a whole local mesh ([`up`]) and benches ([`bench`]); model files on
//! disk ([`fetch`], [`load`], [`progress`]).

pub mod bench;
pub mod fetch;
pub mod hold;
pub mod lead;
pub mod load;
pub mod net;
pub mod node;
pub mod progress;
pub mod serve;
pub mod up;
