//! The mesh's learning: the share of requests trained on, each update the page's native node
//! applied or refused (who trained it, the canary verdict, the canary loss after it), and the
//! share trained on by API key.

use leptos::prelude::*;
use node_core::holder::UPDATES_SEEN;

use crate::learning::{counts, key_row, update_rows};
use crate::live::Live;

/// The learning section: the share trained on, the latest updates, the share by key.
#[component]
pub fn Learning() -> impl IntoView {
    let live = expect_context::<Live>();
    let share = move || {
        let s = live.history.get().latest().unwrap_or_default();
        format!("{:.0}%", 100.0 * s.trained_share)
    };
    let now_ms = move || {
        web_time::SystemTime::now()
            .duration_since(web_time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let summary = move || match live.learning.get() {
        None => "waiting for this node's updates…".to_string(),
        Some(s) if s.updates.is_empty() => "no update applied or refused here yet".to_string(),
        Some(s) => {
            let (applied, refused) = counts(&s);
            format!(
                "{applied} applied, {refused} refused: the latest updates this node saw, newest first (it keeps {UPDATES_SEEN})"
            )
        }
    };
    let rows = move || {
        live.learning
            .get()
            .map(|s| update_rows(&s, now_ms()))
            .unwrap_or_default()
    };
    let keys = move || live.learning.get().map(|s| s.keys).unwrap_or_default();
    view! {
        <section class="learning">
            <h2>"Learning"</h2>
            <p>
                "share of the mesh's requests trained on (last 10 s): "
                <span id="learning-share">{share}</span>
            </p>
            <p id="learning-summary">{summary}</p>
            <table class="updates" id="updates">
                <thead>
                    <tr>
                        <th>"seen"</th>
                        <th>"update"</th>
                        <th>"trained by"</th>
                        <th>"canary loss after"</th>
                        <th>"gate verdict"</th>
                        <th>"bytes"</th>
                        <th>"outcome"</th>
                    </tr>
                </thead>
                <tbody>
                    {move || {
                        rows()
                            .into_iter()
                            .map(|r| {
                                let class = if r.applied { "applied" } else { "refused" };
                                view! {
                                    <tr class=class>
                                        <td>{r.when}</td>
                                        <td>{r.update}</td>
                                        <td>{r.trainer}</td>
                                        <td>{r.canary_after}</td>
                                        <td>{r.gate}</td>
                                        <td>{r.bytes}</td>
                                        <td>{r.outcome}</td>
                                    </tr>
                                }
                            })
                            .collect_view()
                    }}
                </tbody>
            </table>
            <h3>"Requests trained on, by API key (this node's API)"</h3>
            <table class="keys" id="key-shares">
                <tbody>
                    {move || {
                        keys()
                            .iter()
                            .map(|k| {
                                let (key, share) = key_row(k);
                                view! {
                                    <tr>
                                        <td>{key}</td>
                                        <td>{share}</td>
                                    </tr>
                                }
                            })
                            .collect_view()
                    }}
                </tbody>
            </table>
        </section>
    }
}
