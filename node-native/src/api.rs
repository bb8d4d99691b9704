//! The OpenAI-compatible API of a native node: `GET /v1/models`, `POST /v1/chat/completions`
//! (the model's ChatML template), `POST /v1/completions`, each streamed as server-sent events
//! with `stream: true`, and `GET /v1/stream`, a WebSocket that streams the same chunks. Requests
//! go to the node's [`Engine`]; a full queue answers 429 with `Retry-After`; errors are
//! OpenAI's error JSON with its status codes; an optional bearer key guards every route.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::{SinkExt, Stream, StreamExt};
use node_core::mesh::ModelManifest;
use node_core::model::{ChatMessage, SamplingParams, StopReason, Tokenizer};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{Engine, EngineError, Event, GenRequest, SubmitError};

/// Completion tokens when a request of `/v1/completions` names none (OpenAI's default).
const COMPLETION_DEFAULT_TOKENS: usize = 16;
/// Most completion tokens a chat request gets when it names none.
const CHAT_DEFAULT_TOKENS: usize = 1024;
/// Most stop strings a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// The API's state: the engine, the tokenizer, the served model's id, the key.
#[derive(Clone)]
pub struct Api {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    model: String,
    key: Option<Arc<str>>,
    created: u64,
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
    /// The API of a node serving `manifest`'s model through `engine`; `key` is the bearer key
    /// every request must carry, if set.
    pub fn new(
        engine: Engine,
        manifest: &ModelManifest,
        key: Option<String>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            engine,
            tokenizer: Arc::new(Tokenizer::from_data(&manifest.tokenizer)?),
            model: model_id(manifest),
            key: key.filter(|k| !k.is_empty()).map(Into::into),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
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

    /// Refuses a request without the key, when there is one.
    fn authorize(&self, headers: &HeaderMap, query_key: Option<&str>) -> Result<(), ApiError> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.or(query_key) == Some(&**key) {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided: give the node's key as `Authorization: Bearer KEY`.",
            )
            .code("invalid_api_key"))
        }
    }
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
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

    fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
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

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A chat message's content: text, or a list of parts of which only text is supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// `prompt`: text, a list of one text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

/// The fields shared by both kinds of request.
#[derive(Debug, Deserialize)]
struct Common {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stop: Option<Stop>,
    seed: Option<u64>,
    n: Option<u64>,
    /// Coded Mesh's own field: `false` keeps this request out of the mesh's learning.
    learn: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<InMessage>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
}

/// Which endpoint a request came through: it decides the response's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// A request checked and ready for the engine.
#[derive(Debug)]
struct Prepared {
    kind: Kind,
    request: GenRequest,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("We could not parse the JSON body of your request: {e}"),
        )
    })
}

impl Api {
    /// Checks the shared fields and builds the engine's request for `prompt`.
    fn prepare(&self, kind: Kind, prompt: Vec<u32>, c: Common) -> Result<Prepared, ApiError> {
        match c.model.as_deref() {
            None => return Err(ApiError::bad("model", "you must provide a model parameter")),
            Some(m) if m != self.model => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "The model `{m}` does not exist; this mesh serves `{}` (GET /v1/models)",
                        self.model
                    ),
                )
                .code("model_not_found"));
            }
            Some(_) => {}
        }
        if c.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("n", "only n = 1 is supported"));
        }
        if prompt.is_empty() {
            return Err(ApiError::bad(
                if kind == Kind::Chat {
                    "messages"
                } else {
                    "prompt"
                },
                "the prompt is empty",
            ));
        }
        let vocab = self.tokenizer.vocab_size();
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::bad(
                "prompt",
                format!("token id {id} is outside the vocabulary of {vocab}"),
            ));
        }
        let context = self.engine.max_context();
        let room = context.saturating_sub(prompt.len());
        if room == 0 {
            return Err(ApiError::bad(
                "messages",
                format!(
                    "This model's maximum context length is {context} tokens; the prompt has {}",
                    prompt.len()
                ),
            )
            .code("context_length_exceeded"));
        }
        let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
            Some(0) => return Err(ApiError::bad("max_tokens", "max_tokens must be at least 1")),
            Some(m) if m as usize > room => {
                return Err(ApiError::bad(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {context} tokens; the prompt has {} and {m} were asked for",
                        prompt.len()
                    ),
                )
                .code("context_length_exceeded"));
            }
            Some(m) => m as usize,
            None if kind == Kind::Chat => room.min(CHAT_DEFAULT_TOKENS),
            None => room.min(COMPLETION_DEFAULT_TOKENS),
        };
        let mut temperature = c.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad(
                "temperature",
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = c.top_p.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::bad(
                "top_p",
                format!("top_p must be between 0 and 1, got {top_p}"),
            ));
        }
        if top_p == 0.0 {
            temperature = 0.0;
        }
        let stops = match c.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        if stops.len() > MAX_STOPS {
            return Err(ApiError::bad(
                "stop",
                format!("at most {MAX_STOPS} stop sequences, got {}", stops.len()),
            ));
        }
        let seed = c.seed.unwrap_or_else(rand_seed);
        Ok(Prepared {
            kind,
            request: GenRequest {
                prompt,
                max_tokens,
                sampling: SamplingParams {
                    temperature,
                    top_p: top_p.max(f32::MIN_POSITIVE),
                    seed,
                },
                stop_ids: self.tokenizer.eos_ids().to_vec(),
                learn: c.learn.unwrap_or(true),
                // The node has one key: whoever holds it shares its budget.
                caller: if self.key.is_some() {
                    "api-key".into()
                } else {
                    "anonymous".into()
                },
            },
            stops,
            stream: c.stream,
            include_usage: c.stream_options.is_some_and(|o| o.include_usage),
        })
    }

    fn prepare_chat(&self, body: ChatBody) -> Result<Prepared, ApiError> {
        if body.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages must not be empty"));
        }
        let mut messages = Vec::with_capacity(body.messages.len());
        for m in body.messages {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err(ApiError::bad(
                        "messages",
                        format!("role {other:?} is not supported (system, user, assistant)"),
                    ));
                }
            };
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.get("type").and_then(Value::as_str), p.get("text")) {
                            (Some("text"), Some(Value::String(t))) => text.push_str(t),
                            _ => {
                                return Err(ApiError::bad(
                                    "messages",
                                    "only text content parts are supported",
                                ));
                            }
                        }
                    }
                    text
                }
            };
            messages.push(ChatMessage {
                role: role.to_string(),
                content,
            });
        }
        let text = self.tokenizer.chat_prompt(&messages);
        let prompt = self
            .tokenizer
            .encode(&text)
            .map_err(|e| ApiError::bad("messages", e.to_string()))?;
        self.prepare(Kind::Chat, prompt, body.common)
    }

    fn prepare_completion(&self, body: CompletionBody) -> Result<Prepared, ApiError> {
        let prompt = match body.prompt {
            Prompt::Text(t) => self.encode(&t)?,
            Prompt::Texts(v) if v.len() == 1 => self.encode(&v[0])?,
            Prompt::Texts(v) => {
                return Err(ApiError::bad(
                    "prompt",
                    format!("one prompt per request is supported, got {}", v.len()),
                ));
            }
            Prompt::Ids(ids) => ids,
        };
        self.prepare(Kind::Completion, prompt, body.common)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text)
            .map_err(|e| ApiError::bad("prompt", e.to_string()))
    }

    /// Submits a request and turns its events into pieces of text (decoded, cut at stop
    /// strings), on a task of its own; dropping the receiver cancels the request.
    fn run(&self, p: &Prepared) -> Result<(u64, mpsc::Receiver<Piece>), ApiError> {
        let submitted = self.engine.submit(p.request.clone())?;
        let (tx, rx) = mpsc::channel(64);
        let tokenizer = self.tokenizer.clone();
        let stops = p.stops.clone();
        let prompt_tokens = p.request.prompt.len();
        tokio::spawn(pieces(
            tokenizer,
            submitted.events,
            stops,
            prompt_tokens,
            tx,
        ));
        Ok((submitted.id, rx))
    }
}

/// A random sampling seed for a request that gives none.
fn rand_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now())
}

/// Token counts of a request, as OpenAI reports them.
#[derive(Debug, Clone, Copy, Serialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

impl Usage {
    fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// What a completion produces, in order: text, then the end or an error.
#[derive(Debug)]
enum Piece {
    Text(String),
    End { finish: &'static str, usage: Usage },
    Error(ApiError),
}

/// Decodes a request's tokens into text as it completes and cuts it at the first stop string.
async fn pieces(
    tokenizer: Arc<Tokenizer>,
    mut events: mpsc::UnboundedReceiver<Event>,
    stops: Vec<String>,
    prompt_tokens: usize,
    out: mpsc::Sender<Piece>,
) {
    let mut text = tokenizer.stream();
    let mut stop = StopMatcher::new(stops);
    let mut generated = 0;
    while let Some(ev) = events.recv().await {
        let piece = match ev {
            Event::Token(id) => {
                generated += 1;
                let Some(new) = text.push(id) else {
                    continue;
                };
                let (emit, hit) = stop.push(&new);
                if !emit.is_empty() && out.send(Piece::Text(emit)).await.is_err() {
                    return;
                }
                if !hit {
                    continue;
                }
                // Dropping `events` tells the engine to stop this request.
                Piece::End {
                    finish: "stop",
                    usage: Usage::new(prompt_tokens, generated),
                }
            }
            Event::Done(f) => {
                let rest = stop.finish();
                if !rest.is_empty() && out.send(Piece::Text(rest)).await.is_err() {
                    return;
                }
                Piece::End {
                    finish: match f.stop {
                        StopReason::Length | StopReason::Context => "length",
                        StopReason::Stop | StopReason::Cancelled => "stop",
                    },
                    usage: Usage::new(f.prompt_tokens, f.tokens),
                }
            }
            Event::Failed(e) => Piece::Error(e.into()),
        };
        let _ = out.send(piece).await;
        return;
    }
    let _ = out
        .send(Piece::Error(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the request ended without an answer",
        )))
        .await;
}

/// Cuts generated text at the first of some stop strings, holding back a tail that could be
/// the start of one.
#[derive(Debug)]
struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    /// Adds text; returns what can be emitted and whether a stop string was reached (then
    /// nothing after it is emitted).
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| longest_prefix_at_end(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// What is held back, at the end of the completion.
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
fn longest_prefix_at_end(text: &str, stop: &str) -> usize {
    stop.char_indices()
        .map(|(i, _)| i)
        .filter(|&i| i > 0)
        .rev()
        .find(|&i| text.ends_with(&stop[..i]))
        .unwrap_or(0)
}

/// Builds the JSON objects of one response, in the endpoint's shape.
struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Shape {
    fn new(api: &Api, kind: Kind, id: u64) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        Self {
            kind,
            id: format!("{prefix}-{id}-{:x}", api.created),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(api.created, |d| d.as_secs()),
            model: api.model.clone(),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// A streamed chunk of text (`first`: the chat's opening chunk that names the role).
    fn delta(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// The last streamed chunk when usage is asked for: no choices, the counts.
    fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = json!(usage);
        v
    }

    /// The whole response, not streamed.
    fn whole(&self, text: &str, finish: &str, usage: Usage) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = json!(usage);
        v
    }
}

/// The stream of JSON chunks of a streamed response (the `[DONE]` marker is the caller's).
fn chunks(
    shape: Shape,
    rx: mpsc::Receiver<Piece>,
    include_usage: bool,
) -> impl Stream<Item = Value> {
    struct St {
        shape: Shape,
        rx: mpsc::Receiver<Piece>,
        first: bool,
        pending: Vec<Value>,
        done: bool,
    }
    let st = St {
        shape,
        rx,
        first: true,
        pending: Vec::new(),
        done: false,
    };
    futures::stream::unfold(st, move |mut st| async move {
        loop {
            if let Some(v) = st.pending.pop() {
                return Some((v, st));
            }
            if st.done {
                return None;
            }
            let piece = st.rx.recv().await.unwrap_or(Piece::Error(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the request ended without an answer",
            )));
            match piece {
                Piece::Text(t) => {
                    let v = st.shape.delta(&t, None, st.first);
                    st.first = false;
                    return Some((v, st));
                }
                Piece::End { finish, usage } => {
                    st.done = true;
                    // `pending` pops from the end: last first.
                    if include_usage {
                        st.pending.push(st.shape.usage_chunk(usage));
                    }
                    let last = st.shape.delta("", Some(finish), st.first);
                    st.pending.push(last);
                }
                Piece::Error(e) => {
                    st.done = true;
                    return Some((e.body(), st));
                }
            }
        }
    })
}

/// Answers a prepared request: server-sent events when streamed, else one JSON body.
async fn respond(api: &Api, p: Prepared) -> Response {
    let (id, mut rx) = match api.run(&p) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let shape = Shape::new(api, p.kind, id);
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
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::End { finish, usage }) => {
                return Json(shape.whole(&text, finish, usage)).into_response();
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

async fn chat(State(api): State<Api>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = api
        .authorize(&headers, None)
        .and_then(|()| parse::<ChatBody>(&body))
        .and_then(|b| api.prepare_chat(b));
    match prepared {
        Ok(p) => respond(&api, p).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(api): State<Api>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = api
        .authorize(&headers, None)
        .and_then(|()| parse::<CompletionBody>(&body))
        .and_then(|b| api.prepare_completion(b));
    match prepared {
        Ok(p) => respond(&api, p).await,
        Err(e) => e.into_response(),
    }
}

fn model_object(api: &Api) -> Value {
    json!({"id": api.model, "object": "model", "created": api.created, "owned_by": "codedmesh"})
}

async fn models(State(api): State<Api>, headers: HeaderMap) -> Response {
    match api.authorize(&headers, None) {
        Ok(()) => Json(json!({"object": "list", "data": [model_object(&api)]})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model(
    State(api): State<Api>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if let Err(e) = api.authorize(&headers, None) {
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
    headers: HeaderMap,
    Query(q): Query<WsQuery>,
    ws: WebSocketUpgrade,
) -> Response {
    if let Err(e) = api.authorize(&headers, q.api_key.as_deref()) {
        return e.into_response();
    }
    ws.on_upgrade(move |socket| serve_socket(api, socket))
}

/// One WebSocket: each text message is a request (a chat when it has `messages`, else a
/// completion); the answer streams back as the same chunks as server-sent events (usage
/// included), then `[DONE]`. Requests on one socket run one after another.
async fn serve_socket(api: Api, socket: WebSocket) {
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
                api.prepare_chat(serde_json::from_value(v).map_err(|e| {
                    ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request: {e}"))
                })?)
            } else {
                api.prepare_completion(serde_json::from_value(v).map_err(|e| {
                    ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request: {e}"))
                })?)
            }
        });
        let stream = prepared.and_then(|p| {
            let (id, rx) = api.run(&p)?;
            Ok(chunks(Shape::new(&api, p.kind, id), rx, true))
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
