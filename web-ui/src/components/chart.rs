//! Live numbers and a one-minute chart of the mesh's traffic and health.

use leptos::prelude::*;

use crate::app::Live;

/// Gossip bytes/s, heartbeats/s, healthy rows and updates applied, now.
#[component]
pub fn LiveNumbers() -> impl IntoView {
    let live = expect_context::<Live>();
    let latest = move || live.history.get().latest().unwrap_or_default();
    view! {
        <section>
            <h2>"Live"</h2>
            <dl class="live">
                <dt>"gossip received"</dt>
                <dd id="gossip">{move || format!("{:.0} B/s", latest().gossip_bytes_per_s)}</dd>
                <dt>"heartbeats"</dt>
                <dd>{move || format!("{:.1} /s", latest().heartbeats_per_s)}</dd>
                <dt>"healthy rows"</dt>
                <dd>{move || latest().healthy_rows}</dd>
                <dt>"updates applied"</dt>
                <dd id="updates">{move || latest().updates}</dd>
            </dl>
        </section>
    }
}

/// The last minute of gossip traffic and healthy rows.
#[component]
pub fn HistoryChart() -> impl IntoView {
    let live = expect_context::<Live>();
    let (w, h) = (600.0, 80.0);
    let gossip = move || live.history.get().polyline(w, h, |s| s.gossip_bytes_per_s);
    let healthy = move || live.history.get().polyline(w, h, |s| s.healthy_rows as f64);
    view! {
        <section>
            <h2>"Last minute"</h2>
            <svg class="chart" viewBox=format!("0 0 {w} {h}") preserveAspectRatio="none">
                <polyline class="gossip" points=gossip />
                <polyline class="healthy" points=healthy />
            </svg>
            <p class="legend">
                <span class="gossip">"gossip B/s"</span>
                " "
                <span class="healthy">"healthy rows"</span>
            </p>
        </section>
    }
}
