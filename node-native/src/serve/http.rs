//! The HTTP side of a native node: the dashboard at `/`, the OpenAI-compatible API at `/v1`,
//! Prometheus metrics at `/metrics`, the mesh's status and the latest learning updates as
//! JSON, and what a browser needs to dial this node.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use node_core::mesh::BrowserBootstrap;
use tokio::sync::{mpsc, oneshot};
use tower_http::services::ServeDir;

/// Environment variable naming the dashboard's built files (`web-ui/dist`, scripts/build-web.sh).
pub const WEB_DIR_ENV: &str = "CODEDMESH_WEB";

use crate::hold::learning::UpdateStore;
pub use crate::hold::row::InfoRequest;

#[derive(Clone)]
struct AppState {
    info: mpsc::Sender<InfoRequest>,
    bootstrap: BrowserBootstrap,
    metrics: crate::serve::metrics::Metrics,
    updates: UpdateStore,
    /// The names of the callers the API knows.
    callers: std::sync::Arc<Vec<String>>,
}

/// What the HTTP server serves.
#[derive(Debug)]
pub struct Parts {
    /// The dashboard's built files.
    pub web: Option<PathBuf>,
    /// Asks the node's loop for the mesh's view.
    pub info: mpsc::Sender<InfoRequest>,
    /// What a browser needs to dial the node.
    pub bootstrap: BrowserBootstrap,
    /// The OpenAI-compatible API.
    pub api: crate::serve::api::Api,
    /// The node's metrics.
    pub metrics: crate::serve::metrics::Metrics,
    /// The node's updates, with the latest it applied or refused.
    pub updates: UpdateStore,
}

/// A running HTTP server.
#[derive(Debug)]
pub struct HttpServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The dashboard's URL.
    pub url: String,
}

/// The dashboard's built files: `--web-dir`, else `$CODEDMESH_WEB`, else `web-ui/dist` in a
/// folder above the executable or the working directory (a checkout's build).
pub fn find_web_dir(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(dir) = explicit {
        return Some(dir.to_path_buf());
    }
    if let Some(dir) = std::env::var_os(WEB_DIR_ENV) {
        return Some(PathBuf::from(dir));
    }
    let starts = [std::env::current_exe().ok(), std::env::current_dir().ok()];
    starts.into_iter().flatten().find_map(|start| {
        start
            .ancestors()
            .map(|a| a.join("web-ui").join("dist"))
            .find(|d| d.join("index.html").is_file())
    })
}

/// Binds `addr` and serves until the process ends.
pub async fn start(addr: SocketAddr, parts: Parts) -> Result<HttpServer> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("HTTP: binding {addr}"))?;
    let addr = listener.local_addr()?;
    let Parts {
        web,
        info,
        bootstrap,
        api,
        metrics,
        updates,
    } = parts;
    let state = AppState {
        info,
        bootstrap,
        metrics,
        updates,
        callers: std::sync::Arc::new(api.caller_names()),
    };
    let api = axum::Router::new()
        .route("/api/status", get(status))
        .route("/api/updates", get(learning))
        .route("/api/bootstrap", get(browser_bootstrap))
        .route("/metrics", get(metrics_text))
        .with_state(state)
        .merge(api.router());
    let app = match web {
        Some(dir) => {
            if dir.join("index.html").is_file() {
                tracing::info!(dir = %dir.display(), "serving the dashboard");
            } else {
                tracing::warn!(dir = %dir.display(), "the dashboard is not built yet; it is served once it is");
            }
            // Checked on every request, so a dashboard built while the node runs is served.
            let index = dir.join("index.html");
            let missing = move || {
                let index = index.clone();
                async move {
                    if index.is_file() {
                        (StatusCode::NOT_FOUND, "not found").into_response()
                    } else {
                        not_built(format!(
                            "{} has no index.html yet",
                            index
                                .parent()
                                .map_or_else(String::new, |d| d.display().to_string())
                        ))
                        .await
                    }
                }
            };
            api.fallback_service(
                ServeDir::new(dir)
                    .fallback(axum::handler::HandlerWithoutStateExt::into_service(missing)),
            )
        }
        None => {
            let why = format!("no web-ui/dist found and {WEB_DIR_ENV} is not set");
            tracing::warn!("the dashboard is not built: {why}");
            api.fallback(move || not_built(why.clone()))
        }
    };
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("HTTP server stopped: {e}");
        }
    });
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        addr.ip().to_string()
    };
    let url = format!("http://{host}:{}/", addr.port());
    Ok(HttpServer { addr, url })
}

async fn not_built(why: String) -> Response {
    let body = format!(
        "<!doctype html><title>Coded Mesh</title><h1>Coded Mesh</h1>\
         <p>This node serves the API (<a href=\"/v1/models\">/v1</a>), but its dashboard is not built ({}).</p>\
         <p>Build it with <code>bash scripts/build-web.sh</code> (<code>codedmesh up</code> does it for you), \
         then reload this page; or point <code>--web-dir</code> \
         or <code>{WEB_DIR_ENV}</code> at a built <code>web-ui/dist</code> folder. \
         The mesh's status is at <a href=\"/api/status\">/api/status</a>.</p>",
        html_escape(&why)
    );
    (StatusCode::NOT_FOUND, Html(body)).into_response()
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

async fn status(State(state): State<AppState>) -> Response {
    let (tx, rx) = oneshot::channel();
    let info = match state.info.send(InfoRequest(tx)).await {
        Ok(()) => rx.await.ok(),
        Err(_) => None,
    };
    match info {
        Some(info) => Json(info).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "the node is stopping").into_response(),
    }
}

/// `/api/updates`: the latest updates this node applied or refused, and its API's requests
/// trained on by key.
async fn learning(State(state): State<AppState>) -> Json<node_core::holder::LearningStatus> {
    let keys = state
        .metrics
        .key_shares(state.callers.iter().map(String::as_str));
    Json(state.updates.learning(keys))
}

/// `/metrics`: the node's counters, with the mesh's health as this node sees it now.
async fn metrics_text(State(state): State<AppState>) -> Response {
    let (tx, rx) = oneshot::channel();
    if state.info.send(InfoRequest(tx)).await.is_ok()
        && let Ok(info) = rx.await
    {
        state.metrics.healthy_rows.set(i64::from(info.healthy_rows));
        state.metrics.rows.set(i64::from(info.n));
        state.metrics.k.set(i64::from(info.k));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn browser_bootstrap(State(state): State<AppState>) -> Json<BrowserBootstrap> {
    Json(state.bootstrap)
}
