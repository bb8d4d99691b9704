//! The app: starts the page's browser node, polls its native node's learning updates, and
//! shares both with the pages.

use leptos::prelude::*;
use node_core::holder::LearningStatus;
use node_web::{BrowserNode, NodeSnapshot};

use crate::live::Live;
use crate::model::History;
use crate::pages::dashboard::Dashboard;

/// How often the page asks its native node for the latest learning updates.
const LEARNING_POLL: std::time::Duration = std::time::Duration::from_secs(3);

/// The whole page.
#[component]
pub fn App() -> impl IntoView {
    node_web::init_logging();
    let (snapshot, set_snapshot) = signal(None::<NodeSnapshot>);
    let (history, set_history) = signal(History::default());
    let (error, set_error) = signal(None::<String>);
    let (learning, set_learning) = signal(None::<LearningStatus>);
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
    // The native node's latest updates: asked now and every few seconds.
    // A failure is logged once, until a poll succeeds again.
    let failing = StoredValue::new(false);
    let poll = move || {
        leptos::task::spawn_local(async move {
            match node_web::page_learning().await {
                Ok(s) => {
                    failing.set_value(false);
                    set_learning.set(Some(s));
                }
                Err(e) if !failing.get_value() => {
                    failing.set_value(true);
                    leptos::logging::warn!("the node's learning updates: {e}");
                }
                Err(_) => {}
            }
        })
    };
    poll();
    set_interval(poll, LEARNING_POLL);
    provide_context(Live {
        snapshot,
        history,
        learning,
        error,
        node,
    });
    view! { <Dashboard /> }
}
