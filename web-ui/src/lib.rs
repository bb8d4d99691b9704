//! Coded Mesh dashboard.
