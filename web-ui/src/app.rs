//! The app: starts the page's browser node and shares its snapshots with the pages.

use leptos::prelude::*;
use node_web::{BrowserNode, NodeSnapshot};

use crate::live::Live;
use crate::model::History;
use crate::pages::dashboard::Dashboard;

/// The whole page.
#[component]
pub fn App() -> impl IntoView {
    node_web::init_logging();
    let (snapshot, set_snapshot) = signal(None::<NodeSnapshot>);
    let (history, set_history) = signal(History::default());
    let (error, set_error) = signal(None::<String>);
    let node = StoredValue::new_local(None::<BrowserNode>);
    let started = web_time::Instant::now();
    let record = move |s: &NodeSnapshot| {
        let t = started.elapsed().as_secs_f64();
        set_history.update(|h| h.push(t, s.gossip_bytes, s.heartbeats, s.info.as_ref()));
        set_snapshot.set(Some(s.clone()));
    };
    leptos::task::spawn_local(async move {
        match BrowserNode::start_from_page().await {
            Ok(n) => {
                record(&n.snapshot());
                n.on_change(record);
                // The node's task runs while a handle lives: the page keeps one.
                node.set_value(Some(n));
            }
            Err(e) => set_error.set(Some(e.to_string())),
        }
    });
    provide_context(Live {
        snapshot,
        history,
        error,
        node,
    });
    view! { <Dashboard /> }
}
