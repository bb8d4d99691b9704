//! Coded Mesh native node, by role: serving the OpenAI API and leading its requests
//! ([`serve`]), holding a coded row ([`hold`]), leading from the command line ([`lead`]), the
//! libp2p network ([`net`]), benches ([`bench`]), a whole local mesh ([`up`]), and model files
//! on disk.

pub mod bench;
pub mod fetch;
pub mod hold;
pub mod lead;
pub mod load;
pub mod net;
pub mod progress;
pub mod serve;
pub mod up;
