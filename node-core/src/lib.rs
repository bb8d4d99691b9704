//! Coded Mesh core.
