//! Coded Mesh core: the Cauchy code, the model, coded execution and protocol messages.

pub mod blob;
pub mod code;
pub mod coded;
pub mod compute;
pub mod gguf;
pub mod model;
pub mod protocol;
