//! The line a person reads first: is the model available, and how many failures it tolerates.

use leptos::prelude::*;

use crate::live::Live;

/// "model available: yes — 5 of 6 rows healthy, k = 3, tolerates 2 more failures".
#[component]
pub fn Summary() -> impl IntoView {
    let live = expect_context::<Live>();
    let info = move || live.snapshot.get().and_then(|s| s.info);
    let class = move || match info() {
        Some(i) if i.available => "summary available",
        Some(_) => "summary unavailable",
        None => "summary",
    };
    let text = move || info().map_or_else(|| "waiting for the mesh…".to_string(), |i| i.summary());
    let model = move || {
        info().map(|i| {
            format!(
                "{} (model {}…)",
                i.model_name,
                &i.model[..i.model.len().min(16)]
            )
        })
    };
    // Which groups of nearby nodes (network coordinates) hold k rows and serve alone.
    let regions = move || info().map(|i| i.regions_line());
    view! {
        <section>
            <p class=class id="summary">{text}</p>
            <p class="model">{model}</p>
            <p class="regions" id="regions">{regions}</p>
        </section>
    }
}
