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
    /// `"http://127.0.0.1:8080"`); resolves once connected.
    pub async fn connect(origin: String) -> Result<JsNode, JsError> {
        init_logging();
        Ok(JsNode(BrowserNode::connect(&origin).await?))
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

/// Sends `tracing` output to the browser console (once).
pub fn init_logging() {
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    DONE.with(|d| {
        if !d.replace(true) {
            tracing_wasm::set_as_global_default();
        }
    });
}

/// The snapshot as a plain JavaScript object, with the one-line summary added.
fn to_js(s: &NodeSnapshot) -> Result<JsValue, JsError> {
    let mut v = serde_json::to_value(s)?;
    if let (Some(info), Some(obj)) = (&s.info, v.get_mut("info").and_then(|i| i.as_object_mut())) {
        obj.insert("summary".into(), info.summary().into());
    }
    js_sys::JSON::parse(&v.to_string()).map_err(|e| JsError::new(&format!("{e:?}")))
}
