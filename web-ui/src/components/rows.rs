//! One line per row of the code: holder, device, reachability, round trip, health, version
//! lag, verification.

use leptos::prelude::*;

use crate::live::Live;
use crate::model::{health_label, rows};

/// The rows table.
#[component]
pub fn RowsTable() -> impl IntoView {
    let live = expect_context::<Live>();
    let lines = move || {
        let info = live.snapshot.get().and_then(|s| s.info);
        info.map(|i| rows(&i)).unwrap_or_default()
    };
    view! {
        <section>
            <h2>"Rows"</h2>
            <table id="rows">
                <thead>
                    <tr>
                        <th>"row"</th>
                        <th>"holder"</th>
                        <th>"device"</th>
                        <th>"reached"</th>
                        <th>"round trip"</th>
                        <th>"health"</th>
                        <th>"updates behind"</th>
                        <th>"last verification"</th>
                    </tr>
                </thead>
                <tbody>
                    {move || {
                        lines()
                            .into_iter()
                            .map(|r| {
                                let health = health_label(r.health);
                                let class = format!("health {}", health.to_lowercase());
                                view! {
                                    <tr data-row=r.row>
                                        <td>{r.row}</td>
                                        <td class="peer">{r.holder_label()}</td>
                                        <td>{r.device()}</td>
                                        <td class="reach">{r.reach()}</td>
                                        <td class="rtt">{r.round_trips()}</td>
                                        <td class=class>{health}</td>
                                        <td class="lag">{r.lags()}</td>
                                        <td>{r.verification()}</td>
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
