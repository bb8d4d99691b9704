//! Coded Mesh in the browser: a libp2p node that dials the native node that served the page
//! (WebSocket first, WebRTC-direct next), follows the mesh's heartbeats and keeps a live view
//! of every row's health.
//!
//! From Rust (the dashboard uses it this way):
//!
//! ```ignore
//! let node = node_web::BrowserNode::start_from_page().await?;
//! node.on_change(move |info| render(info));
//! ```
//!
//! From JavaScript (the package `scripts/build-web.sh` makes with wasm-bindgen):
//!
//! ```js
//! import init, { Node } from "./pkg/node_web.js";
//! await init();
//! const node = await Node.connect("http://127.0.0.1:8080/");
//! node.onChange(status => console.log(status.summary));
//! ```
//!
//! Natively this crate is empty: the node needs a browser.

#[cfg(wasm_browser)]
mod error;
#[cfg(wasm_browser)]
mod js;
#[cfg(wasm_browser)]
mod node;
#[cfg(wasm_browser)]
mod store;
#[cfg(wasm_browser)]
mod transport;

#[cfg(wasm_browser)]
pub use js::init_logging;
#[cfg(wasm_browser)]
pub use node::holder::{BROWSER_GPU_MIN_WORK, Contribution, WebGpuUse};
#[cfg(wasm_browser)]
pub use node::leader::{Completion, Prompt};
#[cfg(wasm_browser)]
pub use node::{BrowserNode, Connection, Dial, NodeSnapshot, WebError, page_learning};
#[cfg(wasm_browser)]
pub use store::{ShardStore, StoreError, Stored, identity};
