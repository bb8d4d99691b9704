//! Live numbers and one-minute charts of the mesh's work, traffic and health.

use leptos::prelude::*;

use crate::live::Live;

/// Tokens/s, requests, latency, loss, the canary loss and the share trained on, gossip bytes/s,
/// heartbeats/s, healthy rows and updates applied, now.
#[component]
pub fn LiveNumbers() -> impl IntoView {
    let live = expect_context::<Live>();
    let latest = move || live.history.get().latest().unwrap_or_default();
    view! {
        <section>
            <h2>"Live"</h2>
            <dl class="live">
                <dt>"tokens/s"</dt>
                <dd id="tokens-per-s">{move || format!("{:.1}", latest().tokens_per_s)}</dd>
                <dt>"requests served"</dt>
                <dd id="requests">{move || latest().requests}</dd>
                <dt>"request latency"</dt>
                <dd id="latency">
                    {move || match latest().requests {
                        0 => "–".to_string(),
                        _ => format!("{:.0} ms", latest().latency_ms),
                    }}
                </dd>
                <dt>"loss"</dt>
                <dd id="loss">
                    {move || {
                        let l = latest().loss;
                        if l > 0.0 { format!("{l:.4}") } else { "–".to_string() }
                    }}
                </dd>
                <dt>"canary loss"</dt>
                <dd id="canary">
                    {move || {
                        let c = latest().canary_loss;
                        if c > 0.0 { format!("{c:.4}") } else { "–".to_string() }
                    }}
                </dd>
                <dt>"requests trained on"</dt>
                <dd id="trained-share">
                    {move || format!("{:.0}%", 100.0 * latest().trained_share)}
                </dd>
                <dt>"updates refused by the canary gate"</dt>
                <dd id="refused">{move || latest().refused}</dd>
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

/// The last minute of tokens/s and loss, of gossip traffic and healthy rows, and of learning:
/// the canary loss and the share of requests trained on.
#[component]
pub fn HistoryChart() -> impl IntoView {
    let live = expect_context::<Live>();
    let (w, h) = (600.0, 80.0);
    let tokens = move || live.history.get().polyline(w, h, |s| s.tokens_per_s);
    let loss = move || live.history.get().polyline(w, h, |s| s.loss);
    let gossip = move || live.history.get().polyline(w, h, |s| s.gossip_bytes_per_s);
    let healthy = move || live.history.get().polyline(w, h, |s| s.healthy_rows as f64);
    let canary = move || live.history.get().polyline(w, h, |s| s.canary_loss);
    let share = move || live.history.get().polyline(w, h, |s| s.trained_share);
    view! {
        <section>
            <h2>"Last minute"</h2>
            <svg class="chart" viewBox=format!("0 0 {w} {h}") preserveAspectRatio="none">
                <polyline class="tokens" points=tokens />
                <polyline class="loss" points=loss />
            </svg>
            <p class="legend">
                <span class="tokens">"tokens/s"</span>
                " "
                <span class="loss">"loss"</span>
            </p>
            <svg class="chart" viewBox=format!("0 0 {w} {h}") preserveAspectRatio="none">
                <polyline class="gossip" points=gossip />
                <polyline class="healthy" points=healthy />
            </svg>
            <p class="legend">
                <span class="gossip">"gossip B/s"</span>
                " "
                <span class="healthy">"healthy rows"</span>
            </p>
            <svg class="chart" viewBox=format!("0 0 {w} {h}") preserveAspectRatio="none">
                <polyline class="canary" points=canary />
                <polyline class="share" points=share />
            </svg>
            <p class="legend">
                <span class="canary">"canary loss"</span>
                " "
                <span class="share">"share of requests trained on"</span>
            </p>
        </section>
    }
}
