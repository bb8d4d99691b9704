//! What a request gets back: the engine's events as text pieces, cut at stop strings, shaped
//! as OpenAI's chunks (streamed) or one body.

use super::*;

/// Token counts of a request, as OpenAI reports them.
#[derive(Debug, Clone, Copy, Serialize)]
pub(super) struct Usage {
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) total_tokens: usize,
}

impl Usage {
    pub(super) fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// What a completion produces, in order: text (with the log-probabilities of the tokens it
/// completes, when asked), then the end or an error; the prompt's log-probabilities come
/// before the end where an echo asked for them.
#[derive(Debug)]
pub(super) enum Piece {
    Text(String, Vec<TokenLogprob>),
    Prompt(Vec<TokenLogprob>),
    End { finish: &'static str, usage: Usage },
    Error(ApiError),
}

/// Decodes a request's tokens into text as it completes and cuts it at the first stop string.
pub(super) async fn pieces(
    tokenizer: Arc<Tokenizer>,
    mut events: mpsc::UnboundedReceiver<Event>,
    stops: Vec<String>,
    prompt_tokens: usize,
    out: mpsc::Sender<Piece>,
) {
    let mut text = tokenizer.stream();
    let mut stop = StopMatcher::new(stops);
    let mut generated = 0;
    // Scores of tokens whose text is not out yet: they go with the next text (a token that
    // ends inside a character, or text held back as a possible stop string).
    let mut scored = Vec::new();
    while let Some(ev) = events.recv().await {
        let piece = match ev {
            Event::Prompt(p) => {
                if out.send(Piece::Prompt(p)).await.is_err() {
                    return;
                }
                continue;
            }
            Event::Token(id, lp) => {
                generated += 1;
                scored.extend(lp);
                let Some(new) = text.push(id) else {
                    continue;
                };
                let (emit, hit) = stop.push(&new);
                if (!emit.is_empty() || (hit && !scored.is_empty()))
                    && out
                        .send(Piece::Text(emit, std::mem::take(&mut scored)))
                        .await
                        .is_err()
                {
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
                if (!rest.is_empty() || !scored.is_empty())
                    && out
                        .send(Piece::Text(rest, std::mem::take(&mut scored)))
                        .await
                        .is_err()
                {
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
pub(super) struct StopMatcher {
    pub(super) stops: Vec<String>,
    pub(super) held: String,
}

impl StopMatcher {
    pub(super) fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    /// Adds text; returns what can be emitted and whether a stop string was reached (then
    /// nothing after it is emitted).
    pub(super) fn push(&mut self, piece: &str) -> (String, bool) {
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
    pub(super) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
pub(super) fn longest_prefix_at_end(text: &str, stop: &str) -> usize {
    stop.char_indices()
        .map(|(i, _)| i)
        .filter(|&i| i > 0)
        .rev()
        .find(|&i| text.ends_with(&stop[..i]))
        .unwrap_or(0)
}

/// Builds the JSON objects of one response, in the endpoint's shape.
pub(super) struct Shape {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    /// The vocabulary's tokens, where log-probabilities were asked for.
    pub(super) scoring: Option<Arc<TokenTable>>,
    /// Characters of the completion's text so far (a streamed completion's `text_offset`).
    pub(super) offset: usize,
}

impl Shape {
    /// The shape of response `id` to a request of `kind`, with log-probabilities if `scored`.
    pub(super) fn new(api: &Api, kind: Kind, id: u64, scored: bool) -> Self {
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
            scoring: scored.then(|| api.token_table()),
            offset: 0,
        }
    }

    /// The `logprobs` of a streamed chunk's tokens: null where none were asked for or the
    /// chunk has none.
    fn chunk_logprobs(&mut self, scored: &[TokenLogprob]) -> Value {
        match (&self.scoring, self.kind) {
            (Some(_), _) if scored.is_empty() => Value::Null,
            (Some(t), Kind::Chat) => chat_logprobs(t, scored),
            (Some(t), Kind::Completion) => completion_logprobs(t, None, scored, &mut self.offset),
            (None, _) => Value::Null,
        }
    }

    pub(super) fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        }
    }

    pub(super) fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// A streamed chunk of text and its tokens' scores (`first`: the chat's opening chunk that
    /// names the role).
    pub(super) fn delta(
        &mut self,
        text: &str,
        scored: &[TokenLogprob],
        finish: Option<&str>,
        first: bool,
    ) -> Value {
        let logprobs = self.chunk_logprobs(scored);
        let choice = match self.kind {
            Kind::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// The last streamed chunk when usage is asked for: no choices, the counts.
    pub(super) fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = json!(usage);
        v
    }

    /// The whole response, not streamed: the text, its tokens' scores, and where an echo asked
    /// for it the prompt (its text, its tokens and their scores).
    pub(super) fn whole(
        &mut self,
        text: &str,
        scored: &[TokenLogprob],
        echo: Option<Echo<'_>>,
        finish: &str,
        usage: Usage,
    ) -> Value {
        let logprobs = match (&self.scoring, self.kind) {
            (Some(t), Kind::Chat) => chat_logprobs(t, scored),
            (Some(t), Kind::Completion) => {
                let prompt = echo
                    .as_ref()
                    .and_then(|e| Some((*e.tokens.first()?, e.scored)));
                completion_logprobs(t, prompt, scored, &mut self.offset)
            }
            (None, _) => Value::Null,
        };
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Kind::Completion => {
                let text = match &echo {
                    Some(e) => format!("{}{text}", e.text),
                    None => text.to_string(),
                };
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = json!(usage);
        v
    }
}

/// The prompt a completion echoes: its text, its tokens, and their scores (each after the
/// first; none when log-probabilities were not asked for).
pub(super) struct Echo<'a> {
    pub(super) text: &'a str,
    pub(super) tokens: &'a [u32],
    pub(super) scored: &'a [TokenLogprob],
}

/// The stream of JSON chunks of a streamed response (the `[DONE]` marker is the caller's).
pub(super) fn chunks(
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
                Piece::Text(t, scored) => {
                    let v = st.shape.delta(&t, &scored, None, st.first);
                    st.first = false;
                    return Some((v, st));
                }
                // A streamed request does not echo (refused when it asks).
                Piece::Prompt(_) => {}
                Piece::End { finish, usage } => {
                    st.done = true;
                    // `pending` pops from the end: last first.
                    if include_usage {
                        st.pending.push(st.shape.usage_chunk(usage));
                    }
                    let last = st.shape.delta("", &[], Some(finish), st.first);
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
