//! Coded Mesh browser node.
