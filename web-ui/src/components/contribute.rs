//! "Contribute this GPU": the button that makes this browser a node of the mesh, and what
//! the node does for it since.

use leptos::prelude::*;
use node_web::{Contribution, WebGpuUse};

use crate::live::Live;

/// The line that says what this browser does for the mesh.
pub fn contribution_text(c: &Contribution) -> String {
    match c {
        Contribution::Watching => "this browser watches the mesh; it holds no row".into(),
        Contribution::Preparing { what, done, total } if *total > 0 => format!(
            "{what}: {:.1} of {:.1} MiB",
            *done as f64 / 1048576.0,
            *total as f64 / 1048576.0
        ),
        Contribution::Preparing { what, .. } => format!("{what}…"),
        Contribution::Serving {
            row,
            device,
            source,
            steps,
            gpu_steps,
            step_ms,
            version_count,
            stored_bytes,
        } => format!(
            "serving row {row} on {device} ({source}): {steps} coded steps answered ({gpu_steps} on WebGPU, {step_ms:.1} ms each), {version_count} updates applied; {}",
            match stored_bytes {
                0 => "nothing kept in this browser's storage".to_string(),
                b => format!(
                    "{:.1} MiB kept in this browser's storage",
                    *b as f64 / 1048576.0
                ),
            }
        ),
        Contribution::Failed { reason } => format!("could not contribute: {reason}"),
    }
}

/// What the page's `?webgpu=auto|all|off` asks for (auto when absent).
fn webgpu_choice() -> Result<WebGpuUse, node_web::WebError> {
    let search = web_sys::window()
        .and_then(|w| w.location().search().ok())
        .unwrap_or_default();
    search
        .trim_start_matches('?')
        .split('&')
        .find_map(|kv| kv.strip_prefix("webgpu="))
        .map_or(Ok(WebGpuUse::Auto), str::parse)
}

/// The button, the contribution's state and a progress bar while the shard arrives.
#[component]
pub fn Contribute() -> impl IntoView {
    let live = expect_context::<Live>();
    let contribution = move || live.snapshot.get().map(|s| s.contribution);
    let text = move || {
        contribution().map_or_else(
            || "start this page's node first".into(),
            |c| contribution_text(&c),
        )
    };
    let busy = move || {
        !matches!(
            contribution(),
            Some(Contribution::Watching | Contribution::Failed { .. })
        )
    };
    let progress = move || match contribution() {
        Some(Contribution::Preparing { done, total, .. }) if total > 0 => {
            Some(view! { <progress id="contribute-progress" max=total value=done></progress> })
        }
        _ => None,
    };
    let click = move |_| {
        let Some(node) = live.node.get_value() else {
            return;
        };
        leptos::task::spawn_local(async move {
            // The node shows its own failure in the snapshot.
            let _ = match webgpu_choice() {
                Ok(choice) => node.contribute_with(choice).await,
                Err(e) => Err(e),
            };
        });
    };
    view! {
        <section class="contribute">
            <button id="contribute" on:click=click disabled=busy>
                "Contribute this GPU"
            </button>
            <span id="contribution">{text}</span>
            {progress}
        </section>
    }
}
