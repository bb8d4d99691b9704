//! Checksummed, erasure-protected shard blobs.
