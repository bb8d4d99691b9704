//! The prompt box: a person leads a request on the mesh from this page, with no native
//! client; the completion streams in, then what the request did.

use leptos::prelude::*;
use node_web::{Completion, Prompt};

use crate::live::Live;

/// The line under a completion: speed, the group, how its rounds were checked, learning.
pub fn completion_text(c: &Completion) -> String {
    let caught = match c.caught.is_empty() {
        true => "nobody caught".to_string(),
        false => format!("caught: {}", c.caught.join("; ")),
    };
    let learned = match (c.loss, &c.update) {
        (Some(loss), Some(update)) => format!("; loss {loss:.4}, update {update}"),
        (Some(loss), None) => format!("; loss {loss:.4}, gradient kept for the next update"),
        // A page is not admitted to write the model: its native node's trainer takes the text.
        (None, Some(taught)) => format!("; {taught}"),
        (None, None) => String::new(),
    };
    format!(
        "{} tokens ({}): prefill {:.1} tok/s, decode {:.1} tok/s; group {:?} of {} live rows; {} rounds on {} session streams ({} asks), {} checked, {} unchecked, {caught}{learned}",
        c.tokens,
        c.stop,
        c.prefill_tokens_per_s,
        c.decode_tokens_per_s,
        c.group,
        c.live_rows,
        c.rounds,
        c.sessions.0,
        c.sessions.1,
        c.checked_rounds,
        c.unchecked_rounds,
    )
}

/// The prompt box, the streamed completion and its report.
#[component]
pub fn Ask() -> impl IntoView {
    let live = expect_context::<Live>();
    let (text, set_text) = signal(String::new());
    let (chat, set_chat) = signal(true);
    let (max_tokens, set_max_tokens) = signal(48usize);
    let (answer, set_answer) = signal(String::new());
    let (report, set_report) = signal(String::new());
    let (busy, set_busy) = signal(false);
    let connected = move || {
        matches!(
            live.snapshot.get().map(|s| s.connection),
            Some(node_web::Connection::Connected { .. })
        )
    };
    let click = move |_| {
        let Some(node) = live.node.get_value() else {
            return;
        };
        let prompt = Prompt {
            text: text.get_untracked(),
            max_tokens: max_tokens.get_untracked(),
            chat: chat.get_untracked(),
            ..Prompt::default()
        };
        set_busy.set(true);
        set_answer.set(String::new());
        set_report.set("forming a group…".into());
        leptos::task::spawn_local(async move {
            let mut on_text = |piece: &str| set_answer.update(|a| a.push_str(piece));
            let done = node.generate(&prompt, &mut on_text).await;
            set_report.set(match done {
                Ok(c) => completion_text(&c),
                Err(e) => format!("the request failed: {e}"),
            });
            set_busy.set(false);
        });
    };
    view! {
        <section class="ask">
            <h2>"Ask the model"</h2>
            <textarea
                id="prompt"
                rows="3"
                placeholder="Write a prompt; this page leads it on the mesh"
                prop:value=text
                on:input=move |ev| set_text.set(event_target_value(&ev))
            ></textarea>
            <div class="ask-options">
                <label>
                    <input
                        type="checkbox"
                        id="chat"
                        prop:checked=chat
                        on:change=move |ev| set_chat.set(event_target_checked(&ev))
                    />
                    " chat template"
                </label>
                <label>
                    "max tokens "
                    <input
                        type="number"
                        id="max-tokens"
                        min="1"
                        max="2048"
                        prop:value=move || max_tokens.get().to_string()
                        on:input=move |ev| {
                            if let Ok(n) = event_target_value(&ev).parse::<usize>() {
                                set_max_tokens.set(n.clamp(1, 2048));
                            }
                        }
                    />
                </label>
                <button id="ask" on:click=click disabled=move || busy.get() || !connected()>
                    "Generate"
                </button>
            </div>
            <pre id="completion">{answer}</pre>
            <p id="completion-stats">{report}</p>
        </section>
    }
}
