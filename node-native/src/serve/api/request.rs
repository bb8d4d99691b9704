//! What a request asks: its body (chat or completion, the shared fields), parsed and checked,
//! and the engine's request built from it.

use super::*;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A chat message's content: text, or a list of parts of which only text is supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub(super) struct InMessage {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Option<Content>,
}

#[derive(Debug, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// `prompt`: text, a list of one text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

/// The fields shared by both kinds of request.
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) stream: bool,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    /// llama-server's extension: the likeliest tokens kept (0: every token).
    pub(super) top_k: Option<u32>,
    /// llama-server's extension: the least share of the likeliest token's probability kept.
    pub(super) min_p: Option<f32>,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) stop: Option<Stop>,
    pub(super) seed: Option<u64>,
    pub(super) n: Option<u64>,
    /// Coded Mesh's own field: `false` keeps this request out of the mesh's learning.
    pub(super) learn: Option<bool>,
    /// What the output must follow: text, JSON (`json_object`) or a JSON schema.
    pub(super) response_format: Option<Value>,
    /// Every other parameter: refused unless it asks for nothing ([`refuse_unsupported`]).
    #[serde(flatten)]
    pub(super) other: std::collections::BTreeMap<String, Value>,
}

/// Parameters OpenAI's clients send that change nothing here, whatever their value (who the
/// caller is, what to store, how to bill).
const HARMLESS: [&str; 5] = [
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
];

/// Whether `value` of parameter `name` asks for something: anything but its default (null,
/// false, 0, an empty string, list or object; `best_of` 1, a `tool_choice` or `function_call`
/// of "none" or "auto", `modalities` of text alone).
fn asks(name: &str, value: &Value) -> bool {
    match (name, value) {
        ("best_of", v) => v.as_u64() != Some(1),
        ("tool_choice" | "function_call", Value::String(s)) => s != "none" && s != "auto",
        ("modalities", Value::Array(a)) => a.iter().any(|m| m.as_str() != Some("text")),
        (_, Value::Null) => false,
        (_, Value::Bool(b)) => *b,
        (_, Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
        (_, Value::String(s)) => !s.is_empty(),
        (_, Value::Array(a)) => !a.is_empty(),
        (_, Value::Object(o)) => !o.is_empty(),
    }
}

/// Refuses a request that asks for what this mesh does not do, so no parameter is ignored
/// silently: tools, penalties and biases, several candidates, a suffix, log-probabilities or an
/// echo on the endpoint that has none, or any parameter it does not know.
fn refuse_unsupported(other: &std::collections::BTreeMap<String, Value>) -> Result<(), ApiError> {
    let Some((name, _)) = other
        .iter()
        .find(|(name, value)| !HARMLESS.contains(&name.as_str()) && asks(name, value))
    else {
        return Ok(());
    };
    let what = match name.as_str() {
        "top_logprobs" => "a completion takes `logprobs: N` (0 to 5) instead",
        "echo" => "only a completion (`/v1/completions`) echoes its prompt",
        "tools" | "tool_choice" | "functions" | "function_call" => "tool calls are not supported",
        "presence_penalty" | "frequency_penalty" | "repetition_penalty" | "logit_bias" => {
            "penalties and logit biases are not supported yet"
        }
        "best_of" => "only best_of = 1 is supported",
        "suffix" => "a suffix (insertion) is not supported",
        _ => "this parameter is not known to this mesh",
    };
    Err(ApiError::bad(
        name.clone(),
        format!("`{name}`: {what}; the request was not run (send it without `{name}`)"),
    )
    .code("unsupported_parameter"))
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatBody {
    pub(super) messages: Vec<InMessage>,
    /// Each generated token's log-probability.
    pub(super) logprobs: Option<bool>,
    /// With `logprobs`, this many likeliest tokens at each position (0 to 20).
    pub(super) top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub(super) common: Common,
}

#[derive(Debug, Deserialize)]
pub(super) struct CompletionBody {
    pub(super) prompt: Prompt,
    /// Each generated token's log-probability, with this many likeliest tokens (0 to 5).
    pub(super) logprobs: Option<u32>,
    /// The prompt comes back before the completion (with its log-probabilities, when asked).
    pub(super) echo: Option<bool>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// Most `top_logprobs` a chat may ask for (OpenAI's bound).
const MAX_CHAT_TOP_LOGPROBS: u32 = node_core::model::MAX_TOP_LOGPROBS as u32;
/// Most `logprobs` a completion may ask for (OpenAI's bound).
const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// What a request asks about its tokens' log-probabilities.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Scoring {
    /// Each generated token's, with this many alternatives.
    logprobs: Option<usize>,
    /// The prompt comes back before the completion (its scores too, with `logprobs`).
    echo: bool,
}

impl Scoring {
    /// A chat's: `logprobs: true` with `top_logprobs` 0 to 20.
    fn chat(logprobs: Option<bool>, top: Option<u32>) -> Result<Self, ApiError> {
        let top = top.unwrap_or(0);
        if top > MAX_CHAT_TOP_LOGPROBS {
            return Err(ApiError::bad(
                "top_logprobs",
                format!("top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got {top}"),
            ));
        }
        let logprobs = logprobs.unwrap_or(false);
        if top > 0 && !logprobs {
            return Err(ApiError::bad(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true",
            ));
        }
        Ok(Self {
            logprobs: logprobs.then_some(top as usize),
            echo: false,
        })
    }

    /// A completion's: `logprobs: N` with N 0 to 5, and `echo`.
    fn completion(logprobs: Option<u32>, echo: Option<bool>) -> Result<Self, ApiError> {
        if let Some(n) = logprobs.filter(|&n| n > MAX_COMPLETION_LOGPROBS) {
            return Err(ApiError::bad(
                "logprobs",
                format!("logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {n}"),
            ));
        }
        Ok(Self {
            logprobs: logprobs.map(|n| n as usize),
            echo: echo.unwrap_or(false),
        })
    }
}

/// Which endpoint a request came through: it decides the response's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

/// A request checked and ready for the engine.
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) kind: Kind,
    pub(super) request: GenRequest,
    pub(super) stops: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// The prompt's text, which the completion's text begins with (`echo`).
    pub(super) echo: Option<String>,
}

pub(super) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("We could not parse the JSON body of your request: {e}"),
        )
    })
}

impl Api {
    /// Checks the shared fields and builds the engine's request for `prompt`.
    pub(super) fn prepare(
        &self,
        kind: Kind,
        prompt: Vec<u32>,
        lesson: Option<Vec<u32>>,
        scoring: Scoring,
        c: Common,
        caller: &super::keys::Caller,
    ) -> Result<Prepared, ApiError> {
        if c.learn == Some(true) && !caller.teach {
            return Err(ApiError {
                param: Some("learn".into()),
                ..ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!("the key {:?} may not teach the mesh", caller.name),
                )
                .code("learning_not_allowed")
            });
        }
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
        refuse_unsupported(&c.other)?;
        let constraint = match c.response_format.as_ref().filter(|f| !f.is_null()) {
            Some(format) if schema_of(format)?.is_some() => self.grammars()?.compile(format)?,
            _ => None,
        };
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
        if scoring.echo && c.stream {
            return Err(ApiError::bad(
                "echo",
                "`echo` is not supported with `stream`: ask without streaming",
            ));
        }
        let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
            // An echo with no tokens scores the prompt (as lm-evaluation-harness asks).
            Some(0) if scoring.echo => 0,
            Some(0) => {
                return Err(ApiError::bad(
                    "max_tokens",
                    "max_tokens must be at least 1 (0 only with `echo`)",
                ));
            }
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
        // What the request does not set, the model's publisher recommends (llama.cpp's
        // defaults where the model's file gives none).
        let recommended = self.tokenizer.sampling();
        let mut temperature = c.temperature.unwrap_or(recommended.temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad(
                "temperature",
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = c.top_p.unwrap_or(recommended.top_p);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::bad(
                "top_p",
                format!("top_p must be between 0 and 1, got {top_p}"),
            ));
        }
        let min_p = c.min_p.unwrap_or(recommended.min_p);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::bad(
                "min_p",
                format!("min_p must be between 0 and 1, got {min_p}"),
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
                    top_k: c.top_k.unwrap_or(recommended.top_k),
                    min_p,
                    seed,
                },
                stop_ids: self.tokenizer.eos_ids().to_vec(),
                learn: c.learn.unwrap_or(true) && caller.teach,
                lesson,
                caller: caller.name.clone(),
                budget: caller.budget(),
                asks: Asks {
                    logprobs: scoring.logprobs,
                    echo: scoring.logprobs.filter(|_| scoring.echo),
                    constraint,
                },
            },
            stops,
            stream: c.stream,
            include_usage: c.stream_options.is_some_and(|o| o.include_usage),
            echo: None,
        })
    }

    pub(super) fn prepare_chat(
        &self,
        body: ChatBody,
        caller: &super::keys::Caller,
    ) -> Result<Prepared, ApiError> {
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
        // A chat teaches what its user said, as plain text: not the template, whose tokens the
        // model predicts already, nor the model's own earlier answers (docs/coding.md).
        // Cut only where the request may teach.
        let lesson = if body.common.learn != Some(false) && caller.teach {
            let said: Vec<&str> = messages
                .iter()
                .filter(|m| m.role == "user" && !m.content.trim().is_empty())
                .map(|m| m.content.trim())
                .collect();
            let said = self.tokenizer.encode(&said.join("\n"));
            Some(said.map_err(|e| ApiError::bad("messages", e.to_string()))?)
        } else {
            None
        };
        let scoring = Scoring::chat(body.logprobs, body.top_logprobs)?;
        self.prepare(Kind::Chat, prompt, lesson, scoring, body.common, caller)
    }

    pub(super) fn prepare_completion(
        &self,
        body: CompletionBody,
        caller: &super::keys::Caller,
    ) -> Result<Prepared, ApiError> {
        let (prompt, text) = match body.prompt {
            Prompt::Text(t) => (self.encode(&t)?, Some(t)),
            Prompt::Texts(mut v) if v.len() == 1 => {
                let t = v.remove(0);
                (self.encode(&t)?, Some(t))
            }
            Prompt::Texts(v) => {
                return Err(ApiError::bad(
                    "prompt",
                    format!("one prompt per request is supported, got {}", v.len()),
                ));
            }
            Prompt::Ids(ids) => (ids, None),
        };
        let scoring = Scoring::completion(body.logprobs, body.echo)?;
        let mut p = self.prepare(Kind::Completion, prompt, None, scoring, body.common, caller)?;
        if scoring.echo {
            let text = match text {
                Some(t) => t,
                None => (self.tokenizer.decode(&p.request.prompt))
                    .map_err(|e| ApiError::bad("prompt", e.to_string()))?,
            };
            p.echo = Some(text);
        }
        Ok(p)
    }

    pub(super) fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text)
            .map_err(|e| ApiError::bad("prompt", e.to_string()))
    }

    /// Submits a request and turns its events into pieces of text (decoded, cut at stop
    /// strings), on a task of its own; dropping the receiver cancels the request.
    pub(super) fn run(&self, p: &Prepared) -> Result<(u64, mpsc::Receiver<Piece>), ApiError> {
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
pub(super) fn rand_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    fn refused(body: &str) -> Option<String> {
        let body: CompletionBody = parse(body.as_bytes()).unwrap();
        refuse_unsupported(&body.common.other)
            .err()
            .map(|e| e.body()["error"]["param"].as_str().unwrap().to_string())
    }

    #[test]
    fn a_parameter_that_asks_for_what_the_mesh_does_not_do_is_refused_and_defaults_pass() {
        let base = r#""model": "m", "prompt": "x""#;
        for (extra, param) in [
            // A completion's log-probabilities are `logprobs: N`, not a chat's `top_logprobs`.
            (r#""top_logprobs": 3"#, "top_logprobs"),
            (r#""tools": [{"type": "function"}]"#, "tools"),
            (r#""frequency_penalty": 0.5"#, "frequency_penalty"),
            (r#""best_of": 3"#, "best_of"),
            (r#""mirostat": 2"#, "mirostat"),
            (r#""suffix": "end""#, "suffix"),
        ] {
            let body = format!("{{{base}, {extra}}}");
            assert_eq!(refused(&body).as_deref(), Some(param), "{body}");
        }
        for extra in [
            r#""logprobs": 5, "echo": true"#,
            r#""logprobs": null, "top_logprobs": 0, "echo": false"#,
            r#""response_format": {"type": "json_schema", "json_schema": {"schema": {}}}"#,
            r#""response_format": {"type": "text"}, "best_of": 1, "tool_choice": "none""#,
            r#""presence_penalty": 0, "logit_bias": {}, "tools": [], "suffix": """#,
            r#""user": "someone", "metadata": {"a": "b"}, "store": true"#,
            r#""top_k": 40, "min_p": 0.05"#,
        ] {
            let body = format!("{{{base}, {extra}}}");
            assert_eq!(refused(&body), None, "{body}");
        }
        // A chat's echo is refused: only a completion echoes.
        let chat: ChatBody = parse(br#"{"model": "m", "messages": [], "echo": true, "logprobs": true, "top_logprobs": 20}"#).unwrap();
        assert_eq!(chat.logprobs, Some(true));
        assert_eq!(chat.top_logprobs, Some(20));
        let e = refuse_unsupported(&chat.common.other).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "echo");
        // The bounds: OpenAI's.
        let param = |r: Result<Scoring, ApiError>| r.unwrap_err().body()["error"]["param"].clone();
        assert_eq!(param(Scoring::chat(Some(true), Some(21))), "top_logprobs");
        assert_eq!(param(Scoring::chat(None, Some(2))), "top_logprobs");
        assert_eq!(
            Scoring::chat(Some(true), Some(20)).unwrap().logprobs,
            Some(20)
        );
        assert_eq!(Scoring::chat(Some(false), None).unwrap().logprobs, None);
        assert_eq!(param(Scoring::completion(Some(6), None)), "logprobs");
        let s = Scoring::completion(Some(0), Some(true)).unwrap();
        assert_eq!((s.logprobs, s.echo), (Some(0), true));
        // Log-probabilities of the wrong type are a parse error, not ignored.
        assert!(parse::<ChatBody>(br#"{"messages": [], "logprobs": 3}"#).is_err());
        assert!(parse::<CompletionBody>(br#"{"prompt": "x", "logprobs": true}"#).is_err());
    }
}
