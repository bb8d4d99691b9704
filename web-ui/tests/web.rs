//! The dashboard's components in headless Chromium (wasm-bindgen-test): mounted with a mesh
//! snapshot, they show it, and follow a new one without a reload.

#![cfg(target_arch = "wasm32")]
#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use leptos::prelude::*;
use leptos::wasm_bindgen::JsCast;
use node_core::holder::LearningStatus;
use node_core::mesh::{Health, MeshInfo, NodeStatus};
use node_web::{Completion, Connection, Contribution, NodeSnapshot};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};
use web_ui::components::{Ask, Contribute, Learning, RowsTable, Summary, completion_text};
use web_ui::live::Live;
use web_ui::model::History;

wasm_bindgen_test_configure!(run_in_browser);

fn node(row: u32, health: Health, device: &str) -> NodeStatus {
    NodeStatus {
        peer: format!("12D3KooWpeer000{row}"),
        row: Some(row),
        health,
        version_count: 2,
        version_digest: "ab".repeat(32),
        addrs: vec![],
        silent_for_s: 0.1,
        lag: 0,
        caught: None,
        device: device.into(),
        usage: Default::default(),
        reach: "relayed".into(),
        trains: false,
        coord: Default::default(),
        rtt_ms: (row > 0).then_some(40.0 * row as f32),
    }
}

fn snapshot(healths: [Health; 3]) -> NodeSnapshot {
    let healthy = healths.iter().filter(|h| **h == Health::Healthy).count() as u32;
    NodeSnapshot {
        peer: "12D3KooWbrowser".into(),
        connection: Connection::Connected {
            via: "/ip4/127.0.0.1/tcp/1/ws".into(),
        },
        info: Some(MeshInfo {
            k: 2,
            n: 3,
            n_max: 3,
            rows: Vec::new(),
            health: Default::default(),
            model: "cd".repeat(32),
            model_name: "SmolLM2".into(),
            available: healthy >= 2,
            healthy_rows: healthy,
            tolerates: healthy.saturating_sub(2),
            version_count: 2,
            version_digest: "ab".repeat(32),
            nodes: vec![
                node(0, healths[0], "cpu"),
                node(1, healths[1], "NVIDIA H200 (Vulkan)"),
                node(2, healths[2], "browser WebGPU: SwiftShader"),
            ],
            dashboard: None,
            usage: Default::default(),
        }),
        heartbeats: 10,
        gossip_bytes: 1000,
        contribution: Contribution::Watching,
    }
}

fn cell(root: &web_sys::Element, row: u32, col: usize) -> String {
    root.query_selector(&format!("tr[data-row='{row}'] td:nth-child({})", col + 1))
        .unwrap()
        .map(|e| e.text_content().unwrap_or_default())
        .unwrap_or_default()
}

/// `view` mounted in a fresh element of the page, its live state the snapshot and learning
/// status these signals give (no history, no error, no node): the element, and the mount,
/// which unmounts when dropped.
fn mounted<V: IntoView + 'static>(
    snapshot: ReadSignal<Option<NodeSnapshot>>,
    learning: ReadSignal<Option<LearningStatus>>,
    view: impl FnOnce() -> V + 'static,
) -> (web_sys::Element, impl Sized) {
    let document = document();
    let root = document.create_element("div").unwrap();
    document.body().unwrap().append_child(&root).unwrap();
    let mount = mount_to(root.clone().unchecked_into(), move || {
        provide_context(Live {
            snapshot,
            history: signal(History::default()).0,
            learning,
            error: signal(None).0,
            node: StoredValue::new_local(None),
        });
        view()
    });
    (root, mount)
}

fn text_of(root: &web_sys::Element, css: &str) -> String {
    root.query_selector(css)
        .unwrap()
        .and_then(|e| e.text_content())
        .unwrap_or_default()
}

#[wasm_bindgen_test]
async fn the_summary_and_rows_show_the_mesh_and_follow_it_live() {
    let (snap, set_snap) = signal(Some(snapshot([Health::Healthy; 3])));
    let (root, _mounted) = mounted(snap, signal(None).0, || {
        view! {
            <Summary />
            <Contribute />
            <RowsTable />
        }
    });
    let text = root.text_content().unwrap_or_default();
    assert!(
        text.contains(
            "model available: yes — 3 of 3 rows healthy, k = 2, tolerates 1 more failure"
        ),
        "{text}"
    );
    assert_eq!(cell(&root, 1, 2), "GPU (NVIDIA H200 (Vulkan))");
    assert_eq!(
        cell(&root, 2, 2),
        "browser WebGPU (browser WebGPU: SwiftShader)"
    );
    assert_eq!(cell(&root, 1, 3), "relayed");
    assert_eq!(cell(&root, 1, 4), "40 ms");
    assert_eq!(cell(&root, 0, 4), "—");
    assert_eq!(cell(&root, 1, 5), "Healthy");
    assert_eq!(
        text_of(&root, "#contribution"),
        "this browser watches the mesh; it holds no row"
    );
    assert!(
        root.query_selector("#contribute-progress")
            .unwrap()
            .is_none()
    );

    // The browser takes a row: a progress bar while its shard arrives, then what it serves.
    let mut s = snapshot([Health::Healthy; 3]);
    s.contribution = Contribution::Preparing {
        what: "downloading row 2".into(),
        done: 1 << 20,
        total: 4 << 20,
    };
    set_snap.set(Some(s.clone()));
    leptos::task::tick().await;
    assert_eq!(
        text_of(&root, "#contribution"),
        "downloading row 2: 1.0 of 4.0 MiB"
    );
    let bar = root
        .query_selector("#contribute-progress")
        .unwrap()
        .unwrap();
    assert_eq!(
        bar.get_attribute("value").as_deref(),
        Some(&*(1u64 << 20).to_string())
    );
    s.contribution = Contribution::Serving {
        row: 2,
        device: "browser WebGPU: SwiftShader".into(),
        source: "genesis row 2".into(),
        steps: 7,
        gpu_steps: 3,
        step_ms: 2.25,
        version_count: 1,
        stored_bytes: 3 << 19,
    };
    set_snap.set(Some(s));
    leptos::task::tick().await;
    assert_eq!(
        text_of(&root, "#contribution"),
        "serving row 2 on browser WebGPU: SwiftShader (genesis row 2): 7 coded steps answered (3 on WebGPU, 2.2 ms each), 1 updates applied; 1.5 MiB kept in this browser's storage"
    );
    assert!(
        root.query_selector("#contribute-progress")
            .unwrap()
            .is_none()
    );

    // Two rows go down: the page follows, and the model is no longer available.
    set_snap.set(Some(snapshot([
        Health::Healthy,
        Health::Dead,
        Health::Suspect,
    ])));
    leptos::task::tick().await;
    let text = root.text_content().unwrap_or_default();
    assert!(
        text.contains("model available: no — 1 of 3 rows healthy"),
        "{text}"
    );
    assert_eq!(cell(&root, 1, 5), "Dead");
    assert_eq!(cell(&root, 2, 5), "Suspect");
}

#[wasm_bindgen_test]
async fn the_prompt_box_waits_for_a_connection_and_reports_a_completion() {
    let mut s = snapshot([Health::Healthy; 3]);
    s.connection = Connection::Connecting;
    let (snap, set_snap) = signal(Some(s));
    let (root, _mounted) = mounted(snap, signal(None).0, || view! { <Ask /> });
    let disabled = |root: &web_sys::Element| {
        root.query_selector("#ask")
            .unwrap()
            .unwrap()
            .has_attribute("disabled")
    };
    assert!(disabled(&root), "no request before the node is connected");
    set_snap.set(Some(snapshot([Health::Healthy; 3])));
    leptos::task::tick().await;
    assert!(!disabled(&root), "connected: a person can ask");
    let checked = root
        .query_selector("#chat")
        .unwrap()
        .unwrap()
        .unchecked_into::<web_sys::HtmlInputElement>()
        .checked();
    assert!(checked, "the chat template is on by default");

    let mut done = Completion {
        text: " in 1440".into(),
        prompt_tokens: 7,
        tokens: 8,
        stop: "Length".into(),
        group: vec![0, 1, 3, 4],
        live_rows: 4,
        prefill_tokens_per_s: 12.04,
        decode_tokens_per_s: 3.5,
        rounds: 250,
        checked_rounds: 250,
        unchecked_rounds: 0,
        sessions: (4, 1000),
        caught: vec![],
        loss: None,
        update: None,
    };
    assert_eq!(
        completion_text(&done),
        "8 tokens (Length): prefill 12.0 tok/s, decode 3.5 tok/s; group [0, 1, 3, 4] of 4 live rows; 250 rounds on 4 session streams (1000 asks), 250 checked, 0 unchecked, nobody caught"
    );
    done.loss = Some(2.5);
    done.update = Some("00000000000000ab: 100 bytes, taken by 4 of 4 holders".into());
    done.caught = vec!["row 3: answered against the code".into()];
    assert!(
        completion_text(&done).ends_with(
            "caught: row 3: answered against the code; loss 2.5000, update 00000000000000ab: 100 bytes, taken by 4 of 4 holders"
        ),
        "{}",
        completion_text(&done)
    );
}

#[wasm_bindgen_test]
async fn the_learning_section_lists_each_update_with_its_trainer_and_verdict() {
    use node_core::holder::{KeyShare, UpdateLog, UpdateSeen};
    let (snap, _) = signal(Some(snapshot([Health::Healthy; 3])));
    let (learning, set_learning) = signal(None::<LearningStatus>);
    let (root, _mounted) = mounted(snap, learning, || view! { <Learning /> });
    assert_eq!(
        text_of(&root, "#learning-summary"),
        "waiting for this node's updates…"
    );
    let mut log = UpdateLog::default();
    log.push(UpdateSeen {
        id: "00000000000000ab".into(),
        version: Some(3),
        trainer: "12D3KooWtrainer1".into(),
        trainer_name: "up-0".into(),
        gate: Some(node_core::learn::GateClaim {
            before: 3.2,
            after: 3.205,
            reference: 3.19,
        }),
        applied: true,
        why: None,
        bytes: 5_000_000,
        issued_ms: 0,
        seen_ms: 0,
    });
    let keys = vec![KeyShare {
        key: "alice".into(),
        requests: 4,
        trained: 3,
    }];
    set_learning.set(Some(LearningStatus::new(&log, keys)));
    leptos::task::tick().await;
    assert_eq!(
        text_of(&root, "#learning-summary"),
        "1 applied, 0 refused: the latest updates this node saw, newest first (it keeps 32)"
    );
    let row = text_of(&root, "#updates tbody tr");
    assert!(row.contains("…trainer1 (up-0)"), "{row}");
    assert!(row.contains("3.2050"), "{row}");
    assert!(row.contains("applied"), "{row}");
    assert_eq!(text_of(&root, "#key-shares"), "alice3 of 4 requests (75%)");
}
