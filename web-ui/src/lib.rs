//! Coded Mesh dashboard: the health of every shard of the model, live, from the page's own
//! browser node (`node-web`), which follows the mesh's heartbeats.
//!
//! Build it with `bash scripts/build-web.sh` (cargo for wasm32, then wasm-bindgen);
//! every native node serves the result at `/`. Natively only the view model is built.

pub mod learning;
pub mod model;

#[cfg(wasm_browser)]
pub mod app;
#[cfg(wasm_browser)]
pub mod components;
#[cfg(wasm_browser)]
pub mod live;
#[cfg(wasm_browser)]
pub mod pages;
