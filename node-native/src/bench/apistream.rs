//! One streamed completion through a node's OpenAI API, timed as its client sees it: how
//! `bench --mesh` measures a stream the way a user of `codedmesh up` gets it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Most bytes of one server-sent event the client holds while it waits for the event's end.
const MAX_EVENT: usize = 1 << 20;

/// How one stream went, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Streamed {
    /// Tokens generated (the usage chunk's count).
    pub tokens: usize,
    /// From sending the request to the first chunk of text.
    pub first: Duration,
    /// From the first chunk of text to the last.
    pub streaming: Duration,
    /// The longest wait between two chunks of text.
    pub longest_gap: Duration,
}

impl Streamed {
    /// Decode after the first token, tokens a second.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.tokens.saturating_sub(1) as f64 / self.streaming.as_secs_f64().max(1e-9)
    }
}

/// What one server-sent event of a streamed completion said.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    /// A chunk with text (possibly empty, e.g. the last one with the finish reason).
    Text(String),
    /// The usage chunk: tokens generated.
    Usage(usize),
    /// The end marker.
    Done,
    /// A comment or keep-alive: nothing.
    Nothing,
}

/// Splits the bytes of a server-sent event stream into events as they arrive.
#[derive(Debug, Default)]
struct Events {
    buf: Vec<u8>,
}

impl Events {
    /// Takes `bytes` and returns every event they complete.
    fn push(&mut self, bytes: &[u8]) -> Result<Vec<Event>> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let raw: Vec<u8> = self.buf.drain(..end + 2).collect();
            events.push(parse_event(&raw[..end])?);
        }
        if self.buf.len() > MAX_EVENT {
            bail!("an event of the stream is longer than {MAX_EVENT} bytes");
        }
        Ok(events)
    }
}

/// One event's lines: its `data:` field as a completion chunk, `[DONE]` or an error body.
fn parse_event(raw: &[u8]) -> Result<Event> {
    let text = std::str::from_utf8(raw).context("an event of the stream is not UTF-8")?;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect();
    if data.is_empty() {
        return Ok(Event::Nothing);
    }
    let data = data.join("\n");
    if data == "[DONE]" {
        return Ok(Event::Done);
    }
    let v: Value = serde_json::from_str(&data)
        .with_context(|| format!("an event of the stream is not JSON: {data:.200}"))?;
    if let Some(e) = v.get("error") {
        bail!("the API answered with an error: {e}");
    }
    if let Some(n) = v.pointer("/usage/completion_tokens") {
        let n = n
            .as_u64()
            .with_context(|| format!("usage.completion_tokens is not a count: {n}"))?;
        return Ok(Event::Usage(n as usize));
    }
    match v.pointer("/choices/0/text") {
        Some(Value::String(t)) => Ok(Event::Text(t.clone())),
        _ => bail!("a chunk of the stream has no choices[0].text: {data:.200}"),
    }
}

/// Streams a greedy completion by `model` of up to `max_tokens` after `prompt` (token ids)
/// from the API at `addr` (`POST /v1/completions`), kept out of the mesh's learning, and times
/// it.
pub async fn stream_completion(
    addr: SocketAddr,
    model: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<Streamed> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the API at {addr}"))?;
    tcp.set_nodelay(true)?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .context("an HTTP/1 handshake with the API")?;
    let conn = tokio::spawn(conn);
    let body = serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "learn": false,
    });
    let request = hyper::Request::post("/v1/completions")
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let sent = Instant::now();
    let result = read_stream(&mut send, request, sent).await;
    conn.abort();
    result
}

/// Sends `request` and reads its event stream to the end marker.
async fn read_stream(
    send: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    request: hyper::Request<Full<Bytes>>,
    sent: Instant,
) -> Result<Streamed> {
    let mut response = send
        .send_request(request)
        .await
        .context("sending the completion request")?;
    if !response.status().is_success() {
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        bail!(
            "the API answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(500)])
        );
    }
    let (mut events, mut first, mut last, mut tokens) = (Events::default(), None, None, None);
    let mut longest_gap = Duration::ZERO;
    while let Some(frame) = response.body_mut().frame().await {
        let frame = frame.context("reading the stream")?;
        let now = Instant::now();
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for event in events.push(data)? {
            match event {
                Event::Text(t) if !t.is_empty() => {
                    first.get_or_insert(now);
                    if let Some(l) = last {
                        longest_gap = longest_gap.max(now - l);
                    }
                    last = Some(now);
                }
                Event::Usage(n) => tokens = Some(n),
                Event::Done => {
                    let (Some(first), Some(last)) = (first, last) else {
                        bail!("the stream ended without text");
                    };
                    let tokens = tokens.context("the stream ended without a usage chunk")?;
                    return Ok(Streamed {
                        tokens,
                        first: first - sent,
                        streaming: last - first,
                        longest_gap,
                    });
                }
                Event::Text(_) | Event::Nothing => {}
            }
        }
    }
    bail!("the stream closed before its end marker")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str) -> String {
        format!(
            "data: {}\n\n",
            serde_json::json!({"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": null}]})
        )
    }

    /// Events split anywhere across reads come out whole and in order.
    #[test]
    fn events_split_across_reads_come_out_whole() -> Result<()> {
        let usage = serde_json::json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}});
        let stream = format!(
            "{}: keep-alive\n\n{}data: {usage}\n\ndata: [DONE]\n\n",
            chunk("Hello"),
            chunk(" world")
        );
        let want = vec![
            Event::Text("Hello".into()),
            Event::Nothing,
            Event::Text(" world".into()),
            Event::Usage(2),
            Event::Done,
        ];
        for split in [1, 2, 7, 50, stream.len()] {
            let mut events = Events::default();
            let mut got = Vec::new();
            for piece in stream.as_bytes().chunks(split) {
                got.extend(events.push(piece)?);
            }
            assert_eq!(got, want, "read {split} bytes at a time");
        }
        Ok(())
    }

    /// An error body in the stream, bytes that are not JSON and an endless event are errors,
    /// not panics.
    #[test]
    fn bad_streams_are_errors() {
        let error = "data: {\"error\": {\"message\": \"the mesh has no group\"}}\n\n";
        let err = Events::default().push(error.as_bytes()).unwrap_err();
        assert!(
            format!("{err:#}").contains("the mesh has no group"),
            "{err:#}"
        );
        assert!(Events::default().push(b"data: {not json\n\n").is_err());
        assert!(Events::default().push(b"data: \xff\xfe\n\n").is_err());
        assert!(
            Events::default()
                .push(b"data: {\"choices\": []}\n\n")
                .is_err()
        );
        let endless = vec![b'a'; MAX_EVENT + 1];
        assert!(Events::default().push(&endless).is_err());
    }

    /// A stream served over real HTTP (chunked, as axum sends server-sent events) is read to
    /// its end marker and timed from its first text to its last.
    #[tokio::test]
    async fn a_served_stream_is_read_and_timed() -> Result<()> {
        use axum::response::sse::{Event as SseEvent, Sse};
        let app = axum::Router::new().route(
            "/v1/completions",
            axum::routing::post(|body: String| async move {
                let asked: Value = serde_json::from_str(&body).unwrap_or_default();
                let n = asked["max_tokens"].as_u64().unwrap_or(0);
                // A request the bench sends names the model and stays out of the learning.
                let kept_out = asked["learn"] == Value::Bool(false) && asked["model"] == "m";
                let stream = futures::stream::unfold(0u64, move |i| async move {
                    let data = match i {
                        _ if !kept_out => {
                            if i > 0 {
                                return None;
                            }
                            serde_json::json!({"error": "another model, or asked to learn"})
                                .to_string()
                        }
                        _ if i < n => {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            serde_json::json!({"choices": [{"text": format!("t{i}")}]}).to_string()
                        }
                        _ if i == n => {
                            serde_json::json!({"choices": [], "usage": {"completion_tokens": n}})
                                .to_string()
                        }
                        _ if i == n + 1 => "[DONE]".into(),
                        _ => return None,
                    };
                    let event = SseEvent::default().data(data);
                    Some((Ok::<_, std::convert::Infallible>(event), i + 1))
                });
                Sse::new(stream)
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let run = stream_completion(addr, "m", &[1, 2, 3], 6).await?;
        server.abort();
        assert_eq!(run.tokens, 6);
        // Five gaps of 20 ms between the first text and the last.
        assert!(run.streaming >= Duration::from_millis(100), "{run:?}");
        assert!(run.decode_tokens_per_s() <= 50.0, "{run:?}");
        Ok(())
    }

    /// An answer that is not a success says what the API said.
    #[tokio::test]
    async fn a_refused_request_says_why() -> Result<()> {
        let app = axum::Router::new().route(
            "/v1/completions",
            axum::routing::post(|| async {
                (
                    axum::http::StatusCode::TOO_MANY_REQUESTS,
                    "the queue is full",
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let err = stream_completion(addr, "m", &[1], 4).await.unwrap_err();
        server.abort();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("429") && msg.contains("the queue is full"),
            "{msg}"
        );
        Ok(())
    }
}
