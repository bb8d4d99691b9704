//! The JavaScript API: what a web page calls to run a node.

use wasm_bindgen::prelude::*;

use crate::node::{BrowserNode, NodeSnapshot};

/// A Coded Mesh node running in this page.
#[wasm_bindgen(js_name = Node)]
#[derive(Debug)]
pub struct JsNode(BrowserNode);

#[wasm_bindgen(js_class = Node)]
impl JsNode {
    /// Joins the mesh of the native node serving HTTP at `origin` (e.g.
    /// `"http://127.0.0.1:8080"`); resolves once connected. `transport` is the one tried
    /// first: `"websocket"` (the default) or `"webrtc-direct"`; the other is the fallback.
    pub async fn connect(origin: String, transport: Option<String>) -> Result<JsNode, JsError> {
        init_logging();
        let dial = match transport {
            Some(t) => t.parse()?,
            None => crate::Dial::default(),
        };
        Ok(JsNode(BrowserNode::connect(&origin, dial).await?))
    }

    /// Takes a row of the code (from this browser's storage, or from the mesh with progress in
    /// `status().contribution`) and serves coded steps on WebGPU, or on the wasm CPU path where
    /// the browser has none; resolves once the row is obtained (`status().contribution` says
    /// when it serves).
    /// `webgpu` is `"auto"` (the default: large products on WebGPU), `"all"` or `"off"`.
    pub async fn contribute(&self, webgpu: Option<String>) -> Result<(), JsError> {
        let webgpu = match webgpu {
            Some(w) => w.parse()?,
            None => crate::WebGpuUse::Auto,
        };
        Ok(self.0.contribute_with(webgpu).await?)
    }

    /// Leads a request on the mesh from this page. `prompt` is the text, or an object
    /// `{ text, max_tokens, temperature, chat, check, learn }` (defaults: 32 tokens, greedy,
    /// chat template, one checking answer per round, learning on). `onText(piece)` sees the
    /// completion as it is generated; resolves to what the request did (text, tokens/s, the
    /// group, rounds checked, loss, the learning update).
    pub async fn generate(
        &self,
        prompt: JsValue,
        on_text: Option<js_sys::Function>,
    ) -> Result<JsValue, JsError> {
        let prompt: crate::Prompt = match prompt.as_string() {
            Some(text) => crate::Prompt {
                text,
                ..Default::default()
            },
            None => {
                let json = js_sys::JSON::stringify(&prompt)
                    .map_err(|e| JsError::new(&format!("the prompt is not JSON: {e:?}")))?;
                serde_json::from_str(&String::from(json))?
            }
        };
        let mut on_text = |piece: &str| {
            if let Some(f) = &on_text
                && let Err(e) = f.call1(&JsValue::NULL, &JsValue::from_str(piece))
            {
                tracing::warn!("the onText callback threw: {e:?}");
            }
        };
        let done = self.0.generate(&prompt, &mut on_text).await?;
        let json = serde_json::to_string(&done)?;
        js_sys::JSON::parse(&json).map_err(|e| JsError::new(&format!("{e:?}")))
    }

    /// This node's peer id.
    #[wasm_bindgen(js_name = peerId)]
    pub fn peer_id(&self) -> String {
        self.0.snapshot().peer
    }

    /// The latest snapshot: `{ peer, connection, info, heartbeats, gossip_bytes }`, where
    /// `info` is the mesh's status (as `/api/status` returns it) with a `summary` line.
    pub fn status(&self) -> Result<JsValue, JsError> {
        to_js(&self.0.snapshot())
    }

    /// Calls `callback(status)` with every new snapshot.
    #[wasm_bindgen(js_name = onChange)]
    pub fn on_change(&self, callback: js_sys::Function) {
        self.0.on_change(move |s| match to_js(s) {
            Ok(v) => {
                if let Err(e) = callback.call1(&JsValue::NULL, &v) {
                    tracing::warn!("the onChange callback threw: {e:?}");
                }
            }
            Err(e) => tracing::warn!("{e:?}"),
        });
    }
}

/// What the page logs unless `localStorage.RUST_LOG` says otherwise (same syntax, no regex).
const DEFAULT_LOG: &str = "warn,node_web=info,node_core=info,web_ui=info";

/// Sends `tracing` output to the browser console (once), filtered by `localStorage.RUST_LOG`.
pub fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if DONE.with(|d| d.replace(true)) {
        return;
    }
    let asked = web_sys::window()
        .and_then(|w| w.local_storage().ok().flatten())
        .and_then(|s| s.get_item("RUST_LOG").ok().flatten());
    let default = || DEFAULT_LOG.parse().unwrap_or_default();
    let (filter, bad) = match asked.as_deref().map(str::parse) {
        Some(Ok(f)) => (f, None),
        Some(Err(e)) => (default(), Some(e)),
        None => (default(), None),
    };
    // Performance marks for every event cost more than the events themselves: off.
    let layer = tracing_wasm::WASMLayer::new(
        tracing_wasm::WASMLayerConfigBuilder::new()
            .set_report_logs_in_timings(false)
            .build(),
    );
    let subscriber = tracing_subscriber::Registry::default()
        .with::<tracing_subscriber::filter::Targets>(filter)
        .with(layer);
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        web_sys::console::warn_1(&"another tracing subscriber is already installed".into());
    }
    if let Some(e) = bad {
        tracing::warn!("localStorage.RUST_LOG is not a filter ({e}); using {DEFAULT_LOG:?}");
    }
}

/// The snapshot as a plain JavaScript object, with the one-line summary added.
fn to_js(s: &NodeSnapshot) -> Result<JsValue, JsError> {
    let mut v = serde_json::to_value(s)?;
    if let (Some(info), Some(obj)) = (&s.info, v.get_mut("info").and_then(|i| i.as_object_mut())) {
        obj.insert("summary".into(), info.summary().into());
    }
    js_sys::JSON::parse(&v.to_string()).map_err(|e| JsError::new(&format!("{e:?}")))
}
