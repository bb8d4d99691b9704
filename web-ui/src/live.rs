//! What every page reads: the page's node and its snapshots, shared as one context.

use leptos::prelude::*;
use node_web::{BrowserNode, NodeSnapshot};

use crate::model::History;

/// What every page reads: the latest snapshot, the history, and a start-up error.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    /// The latest snapshot of the page's node.
    pub snapshot: ReadSignal<Option<NodeSnapshot>>,
    /// Rates and counts over the last minute.
    pub history: ReadSignal<History>,
    /// Why the node could not start, if it could not.
    pub error: ReadSignal<Option<String>>,
    /// The page's node, once started.
    pub node: StoredValue<Option<BrowserNode>, LocalStorage>,
}
