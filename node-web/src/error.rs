//! What can go wrong in the browser node.

/// Errors of the browser node.
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    /// The swarm could not be built.
    #[error("libp2p transport: {0}")]
    Transport(String),
    /// An HTTP fetch of the page's origin failed.
    #[error("fetching {url}: {reason}")]
    Fetch {
        /// What was fetched.
        url: String,
        /// Why it failed.
        reason: String,
    },
    /// No address of the native node could be dialed.
    #[error("could not dial the native node at any of {addrs:?}: {reason}")]
    Dial {
        /// The addresses tried.
        addrs: Vec<String>,
        /// The last failure.
        reason: String,
    },
    /// A peer answered with an error or something unexpected.
    #[error("the mesh answered: {0}")]
    Mesh(String),
    /// The node's task has stopped.
    #[error("the browser node has stopped")]
    Stopped,
}
