//! The dashboard: availability at a glance, every row's health, a prompt box, live numbers,
//! a chart, and the mesh's learning.

use leptos::prelude::*;

use crate::components::{Ask, Contribute, HistoryChart, Learning, LiveNumbers, RowsTable, Summary};
use crate::live::Live;

/// The dashboard page.
#[component]
pub fn Dashboard() -> impl IntoView {
    let live = expect_context::<Live>();
    let connection = move || match live.error.get() {
        Some(e) => format!("not connected: {e}"),
        None => match live.snapshot.get() {
            None => "starting this page's node…".into(),
            Some(s) => match s.connection {
                node_web::Connection::Connecting => "connecting to the mesh…".into(),
                node_web::Connection::Connected { via } => {
                    format!(
                        "this page's node {} follows the mesh through {via}",
                        crate::model::short_peer(&s.peer)
                    )
                }
                node_web::Connection::Failed { reason } => format!("not connected: {reason}"),
            },
        },
    };
    view! {
        <header>
            <h1>"Coded Mesh"</h1>
            <p class="connection" id="connection">{connection}</p>
        </header>
        <main>
            <Summary />
            <Contribute />
            <RowsTable />
            <Ask />
            <LiveNumbers />
            <HistoryChart />
            <Learning />
        </main>
    }
}
