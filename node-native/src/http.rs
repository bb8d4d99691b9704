//! The HTTP side of a native node: the dashboard at `/`, the mesh's status as JSON, and what a
//! browser needs to dial this node.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use node_core::mesh::{BrowserBootstrap, MeshInfo};
use tokio::sync::{mpsc, oneshot};
use tower_http::services::ServeDir;

/// Environment variable naming the dashboard's built files (trunk's `dist`).
pub const WEB_DIR_ENV: &str = "CODEDMESH_WEB";

/// Asks the node's loop for the mesh as it sees it.
#[derive(Debug)]
pub struct InfoRequest(pub oneshot::Sender<MeshInfo>);

#[derive(Clone)]
struct AppState {
    info: mpsc::Sender<InfoRequest>,
    bootstrap: BrowserBootstrap,
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

/// Binds `addr` and serves until the process ends; `web` holds the dashboard's files.
pub async fn start(
    addr: SocketAddr,
    web: Option<PathBuf>,
    info: mpsc::Sender<InfoRequest>,
    bootstrap: BrowserBootstrap,
) -> Result<HttpServer> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("HTTP: binding {addr}"))?;
    let addr = listener.local_addr()?;
    let state = AppState { info, bootstrap };
    let api = axum::Router::new()
        .route("/api/status", get(status))
        .route("/api/bootstrap", get(browser_bootstrap))
        .with_state(state);
    let app = match web {
        Some(dir) if dir.join("index.html").is_file() => {
            tracing::info!(dir = %dir.display(), "serving the dashboard");
            api.fallback_service(ServeDir::new(dir))
        }
        other => {
            let why = match other {
                Some(dir) => format!("{} has no index.html", dir.display()),
                None => format!("no web-ui/dist found and {WEB_DIR_ENV} is not set"),
            };
            tracing::warn!("the dashboard is not built: {why}");
            api.fallback(move || not_built(why.clone()))
        }
    };
    tokio::spawn(async move {
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
         <p>This node serves the API, but its dashboard is not built ({}).</p>\
         <p>Build it with <code>bash scripts/build-web.sh</code>, or point <code>--web-dir</code> \
         or <code>{WEB_DIR_ENV}</code> at trunk's <code>dist</code> folder. \
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

async fn browser_bootstrap(State(state): State<AppState>) -> Json<BrowserBootstrap> {
    Json(state.bootstrap)
}
