//! The OpenAI-compatible API of a native node: `GET /v1/models`, `POST /v1/chat/completions`
//! (the model's ChatML template), `POST /v1/completions`, each streamed as server-sent events
//! with `stream: true`, and `GET /v1/stream`, a WebSocket that streams the same chunks. Requests
//! go to the node's [`Engine`]; a full queue answers 429 with `Retry-After`; errors are
//! OpenAI's error JSON with its status codes; an optional bearer key guards every route.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::{SinkExt, Stream, StreamExt};
use node_core::mesh::ModelManifest;
use node_core::model::{ChatMessage, SamplingParams, StopReason, TokenLogprob, Tokenizer};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::serve::engine::{Asks, Engine, EngineError, Event, GenRequest, SubmitError};

mod constrain;
pub mod keys;
mod request;
mod scored;
mod stream;

use constrain::*;
use request::*;
use scored::*;
use stream::*;

/// Completion tokens when a request of `/v1/completions` names none (OpenAI's default).
const COMPLETION_DEFAULT_TOKENS: usize = 16;
/// Most completion tokens a chat request gets when it names none.
const CHAT_DEFAULT_TOKENS: usize = 1024;
/// Most stop strings a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// The API's state: the engine, the tokenizer, the served model's id, the keys.
#[derive(Clone)]
pub struct Api {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    model: String,
    keys: keys::Keys,
    created: u64,
    metrics: crate::serve::metrics::Metrics,
    /// The vocabulary's tokens as bytes, read the first time log-probabilities are asked for.
    tokens: Arc<std::sync::OnceLock<Arc<TokenTable>>>,
    /// The compiler of `response_format`s, built the first time one is asked for.
    grammars: Arc<std::sync::OnceLock<Result<Arc<Grammars>, String>>>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("model", &self.model).finish()
    }
}

/// The id the API serves a model under: its file name without the extension.
pub fn model_id(manifest: &ModelManifest) -> String {
    let name = manifest.name.as_str();
    name.strip_suffix(".gguf")
        .or_else(|| name.strip_suffix(".safetensors"))
        .unwrap_or(name)
        .to_string()
}

impl Api {
    /// The API of a node serving `manifest`'s model through `engine`, to the callers `keys`
    /// admits, counting each in `metrics`.
    pub fn new(
        engine: Engine,
        manifest: &ModelManifest,
        keys: keys::Keys,
        metrics: crate::serve::metrics::Metrics,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            engine,
            tokenizer: Arc::new(Tokenizer::from_data(&manifest.tokenizer)?),
            model: model_id(manifest),
            keys,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            metrics,
            tokens: Arc::default(),
            grammars: Arc::default(),
        })
    }

    /// The names of the callers the API knows (each key's and the anonymous user's).
    pub fn caller_names(&self) -> Vec<String> {
        self.keys.callers().map(|c| c.name.clone()).collect()
    }

    /// The compiler of `response_format`s (built once), or why this model has none.
    fn grammars(&self) -> Result<Arc<Grammars>, ApiError> {
        let built = self.grammars.get_or_init(|| {
            Grammars::new(self.tokenizer.clone(), &self.token_table()).map(Arc::new)
        });
        built.clone().map_err(|why| {
            ApiError::bad(
                "response_format",
                format!("constrained output is not available for this model: {why}"),
            )
        })
    }

    /// The vocabulary's tokens as bytes (read once).
    fn token_table(&self) -> Arc<TokenTable> {
        let table = self
            .tokens
            .get_or_init(|| Arc::new(TokenTable::new(&self.tokenizer)));
        table.clone()
    }

    /// The `/v1` routes.
    pub fn router(self) -> axum::Router {
        axum::Router::new()
            .route("/v1/models", get(models))
            .route("/v1/models/{id}", get(model))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/v1/stream", get(websocket))
            .route("/v1/{*rest}", axum::routing::any(unknown))
            .with_state(self)
    }

    /// Who makes a request with `headers` (or a WebSocket's `query_key`) from `from`: refused
    /// without a key the API knows (the anonymous user is one from this machine), or past its
    /// requests a minute; counted by key.
    fn authorize(
        &self,
        headers: &HeaderMap,
        query_key: Option<&str>,
        from: SocketAddr,
    ) -> Result<keys::Caller, ApiError> {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match self.keys.caller(bearer.or(query_key), Some(from.ip())) {
            Ok(c) => {
                self.metrics.by_key("requests", &c.name).inc();
                Ok(c.clone())
            }
            Err(keys::Refused::Unauthorized) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided: give a key of this node as `Authorization: Bearer KEY`.",
            )
            .code("invalid_api_key")),
            Err(keys::Refused::Rate(after)) => {
                let name = self.keys.name_of(bearer.or(query_key));
                self.metrics.by_key("rate_limited", &name).inc();
                Err(ApiError {
                    retry_after: Some(after),
                    ..ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "this key's requests a minute are spent; try again later",
                    )
                    .code("rate_limit_exceeded")
                })
            }
        }
    }
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<std::borrow::Cow<'static, str>>,
    code: Option<&'static str>,
    retry_after: Option<Duration>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = match status.as_u16() {
            429 => "rate_limit_error",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        };
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    fn bad(param: impl Into<std::borrow::Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            ..Self::new(StatusCode::BAD_REQUEST, message)
        }
    }

    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Busy { retry_after, .. } => Self {
                retry_after: Some(retry_after),
                ..Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("{e}; try again later"),
                )
                .code("rate_limit_exceeded")
            },
            SubmitError::Stopped => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).code("unavailable")
            }
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Unavailable(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).code("model_unavailable")
            }
            EngineError::Failed(_) => Self::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

/// Answers a prepared request: server-sent events when streamed, else one JSON body.
async fn respond(api: &Api, p: Prepared) -> Response {
    let (id, mut rx) = match api.run(&p) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let mut shape = Shape::new(api, p.kind, id, p.request.asks.logprobs.is_some());
    if p.stream {
        let events = chunks(shape, rx, p.include_usage)
            .map(|v| SseEvent::default().data(v.to_string()))
            .chain(futures::stream::once(async {
                SseEvent::default().data("[DONE]")
            }))
            .map(Ok::<_, Infallible>);
        return Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let (mut text, mut scored, mut prompt_scored) = (String::new(), Vec::new(), Vec::new());
    loop {
        match rx.recv().await {
            Some(Piece::Text(t, s)) => {
                text.push_str(&t);
                scored.extend(s);
            }
            Some(Piece::Prompt(s)) => prompt_scored = s,
            Some(Piece::End { finish, usage }) => {
                let echo = p.echo.as_deref().map(|echoed| Echo {
                    text: echoed,
                    tokens: &p.request.prompt,
                    scored: &prompt_scored,
                });
                let whole = shape.whole(&text, &scored, echo, finish, usage);
                return Json(whole).into_response();
            }
            Some(Piece::Error(e)) => return e.into_response(),
            None => {
                return ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the request ended without an answer",
                )
                .into_response();
            }
        }
    }
}

async fn chat(
    State(api): State<Api>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let prepared = api
        .authorize(&headers, None, from)
        .and_then(|caller| parse::<ChatBody>(&body).and_then(|b| api.prepare_chat(b, &caller)));
    match prepared {
        Ok(p) => respond(&api, p).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(api): State<Api>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let prepared = api.authorize(&headers, None, from).and_then(|caller| {
        parse::<CompletionBody>(&body).and_then(|b| api.prepare_completion(b, &caller))
    });
    match prepared {
        Ok(p) => respond(&api, p).await,
        Err(e) => e.into_response(),
    }
}

fn model_object(api: &Api) -> Value {
    json!({"id": api.model, "object": "model", "created": api.created, "owned_by": "codedmesh"})
}

async fn models(
    State(api): State<Api>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    match api.authorize(&headers, None, from) {
        Ok(_) => Json(json!({"object": "list", "data": [model_object(&api)]})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model(
    State(api): State<Api>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if let Err(e) = api.authorize(&headers, None, from) {
        return e.into_response();
    }
    if id == api.model {
        Json(model_object(&api)).into_response()
    } else {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!("The model `{id}` does not exist"),
        )
        .code("model_not_found")
        .into_response()
    }
}

async fn unknown(uri: axum::http::Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Unknown request URL: {}", uri.path()),
    )
    .code("unknown_url")
    .into_response()
}

/// The key in a WebSocket URL (`?api_key=…`): browsers cannot set headers on one.
#[derive(Debug, Deserialize)]
struct WsQuery {
    api_key: Option<String>,
}

async fn websocket(
    State(api): State<Api>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(q): Query<WsQuery>,
    ws: WebSocketUpgrade,
) -> Response {
    match api.authorize(&headers, q.api_key.as_deref(), from) {
        Ok(caller) => ws.on_upgrade(move |socket| serve_socket(api, socket, caller)),
        Err(e) => e.into_response(),
    }
}

/// One WebSocket: each text message is a request (a chat when it has `messages`, else a
/// completion); the answer streams back as the same chunks as server-sent events (usage
/// included), then `[DONE]`. Requests on one socket run one after another.
async fn serve_socket(api: Api, socket: WebSocket, caller: keys::Caller) {
    let (mut tx, mut rx) = socket.split();
    while let Some(Ok(msg)) = rx.next().await {
        let text = match msg {
            Message::Text(t) => t.to_string(),
            Message::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
            Message::Close(_) => break,
            _ => continue,
        };
        let prepared = parse::<Value>(text.as_bytes()).and_then(|v| {
            if v.get("messages").is_some() {
                api.prepare_chat(
                    serde_json::from_value(v).map_err(|e| {
                        ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request: {e}"))
                    })?,
                    &caller,
                )
            } else {
                api.prepare_completion(
                    serde_json::from_value(v).map_err(|e| {
                        ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request: {e}"))
                    })?,
                    &caller,
                )
            }
        });
        let stream = prepared.and_then(|p| {
            if p.echo.is_some() {
                return Err(ApiError::bad(
                    "echo",
                    "`echo` is not supported on a stream: ask through /v1/completions",
                ));
            }
            let (id, rx) = api.run(&p)?;
            let scored = p.request.asks.logprobs.is_some();
            Ok(chunks(Shape::new(&api, p.kind, id, scored), rx, true))
        });
        match stream {
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                while let Some(v) = stream.next().await {
                    if tx.send(Message::Text(v.to_string().into())).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                if tx
                    .send(Message::Text(e.body().to_string().into()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        if tx.send(Message::Text("[DONE]".into())).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (emit, hit) = m.push(p);
            out.push_str(&emit);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_strings_cut_the_text_even_across_pieces() {
        assert_eq!(
            run(&["\n\n"], &["Hello", " world", "\n", "\nmore"]),
            ("Hello world".into(), true)
        );
        assert_eq!(run(&["END"], &["abcE", "N", "Dxyz"]), ("abc".into(), true));
        assert_eq!(run(&["END"], &["abcE", "N", "x"]), ("abcENx".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        // The earliest of several stops wins.
        assert_eq!(run(&["zz", "b"], &["aab zz"]), ("aa".into(), true));
        // Multi-byte characters are held back whole.
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }

    #[test]
    fn held_back_text_is_only_a_possible_stop_prefix() {
        let mut m = StopMatcher::new(vec!["###".into()]);
        assert_eq!(m.push("a#"), ("a".into(), false));
        assert_eq!(m.push("#b"), ("##b".into(), false));
        assert_eq!(m.finish(), "");
    }
}
