//! What every page reads: the page's node and its snapshots, shared as one context.

use leptos::prelude::*;
use node_core::holder::LearningStatus;
use node_web::{BrowserNode, NodeSnapshot};

use crate::model::History;

/// What every page reads: the latest snapshot, the history, the latest learning updates, and
/// a start-up error.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    /// The latest snapshot of the page's node.
    pub snapshot: ReadSignal<Option<NodeSnapshot>>,
    /// Rates and counts over the last minute.
    pub history: ReadSignal<History>,
    /// The latest updates the native node that served the page saw, and its API's requests
    /// trained on by key (its `/api/updates`, polled).
    pub learning: ReadSignal<Option<LearningStatus>>,
    /// Why the node could not start, if it could not.
    pub error: ReadSignal<Option<String>>,
    /// The page's node, once started.
    pub node: StoredValue<Option<BrowserNode>, LocalStorage>,
}
