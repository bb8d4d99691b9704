"""Drives a Coded Mesh node's OpenAI-compatible API with the official `openai` client.

Run by tests/tests/api.rs against `codedmesh up` on the tiny test model:

    python openai_api.py BASE_URL API_KEY MODEL EXPECTED_JSON

BASE_URL is the API's root (http://127.0.0.1:PORT/v1). EXPECTED_JSON names a prompt, its token
ids and the greedy completion's token ids of the uncoded model at the mesh's first version,
computed in process by the Rust test: the first request must reproduce it through the mesh.
Every check raises on failure; the last line printed is a JSON summary for the Rust side.
"""

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import websockets


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}", flush=True)


def raw(base, path, key=None, data=None):
    """A plain HTTP request, a POST when there is `data` (bytes): (status, headers, text)."""
    url = base.rsplit("/v1", 1)[0] + path
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def main():
    base, key, model, expected_path = sys.argv[1:5]
    expected = json.load(open(expected_path))
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)
    summary = {}

    # A streamed chat completion: chunks arrive one by one, usage at the end when asked. It is
    # the mesh's first request; with the one after it, a seeded repeat.
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Say something."}],
        max_tokens=12,
        temperature=0.8,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"learn": False},
    )
    chunks, text, finish, usage, times = 0, "", None, None, []
    for chunk in stream:
        chunks += 1
        times.append(time.monotonic() - started)
        check_obj = chunk.object == "chat.completion.chunk"
        if not check_obj:
            raise AssertionError(f"chunk object {chunk.object}")
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finish = c.finish_reason
    check(chunks >= 3, f"the chat streamed in {chunks} chunks")
    check(finish in ("stop", "length"), f"the stream ended with finish_reason {finish}")
    check(usage is not None and usage.completion_tokens >= 1 and usage.completion_tokens <= 12,
          f"the last chunk carries usage {usage}")
    summary["chat_stream_text"] = text
    summary["chat_stream_chunks"] = chunks

    # The same seed gives the same sampled text (non-streamed this time): neither request
    # trains the mesh (`learn: false`) and nothing did before them, so both run at the genesis
    # version.
    again = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Say something."}],
        max_tokens=12,
        temperature=0.8,
        seed=7,
        # Parameters at their defaults ask for nothing and pass.
        logprobs=False,
        presence_penalty=0,
        response_format={"type": "text"},
        user="the test",
        extra_body={"learn": False},
    )
    check(again.object == "chat.completion", "a chat.completion object")
    check(again.choices[0].message.role == "assistant", "the answer is the assistant's")
    check(again.choices[0].message.content == text,
          f"seed 7 at one version gives the same text: {again.choices[0].message.content!r} == {text!r}")
    summary["chat_text"] = again.choices[0].message.content
    # Requests the mesh was told not to learn from.
    summary["untrained"] = 2

    # Log-probabilities, still at the genesis version: of the model's own softmax over its raw
    # logits, so an echo of the prompt and its greedy completion (max_tokens 0, as
    # lm-evaluation-harness scores text) gives the uncoded model's in-process values.
    scored = client.completions.create(model=model, prompt=expected["text_ids"], max_tokens=0,
                                       echo=True, logprobs=2, temperature=0,
                                       extra_body={"learn": False})
    lp = scored.choices[0].logprobs
    check(len(lp.tokens) == len(expected["text_ids"]) and lp.token_logprobs[0] is None
          and lp.top_logprobs[0] is None,
          f"an echo scores the prompt's {len(lp.tokens)} tokens, the first with null")
    check(scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length",
          "max_tokens 0 generates nothing")
    # The mesh computes with its coded (quantised) shards: close to the uncoded model, not equal.
    diff = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected["text_logprobs"]))
    check(diff < 0.15, f"the echo's log-probabilities are the uncoded model's (largest difference {diff:.2e})")
    summary["echo_logprob_diff"] = diff
    check(all(len(t) <= 2 and max(t.values()) >= v - 1e-6
              for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])),
          "each position's top_logprobs hold at most 2 tokens, none less likely than the one scored")
    check(lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0, "text offsets increase from 0")
    # A greedy completion's tokens are scored as the echo scored them.
    n_prompt = len(expected["prompt_ids"])
    greedy = client.completions.create(model=model, prompt=expected["prompt"],
                                       max_tokens=len(expected["completion_ids"]), temperature=0,
                                       logprobs=3, extra_body={"learn": False})
    glp = greedy.choices[0].logprobs
    whole = not any(t.startswith("bytes:") for t in glp.tokens)
    check(len(glp.tokens) == greedy.usage.completion_tokens
          and (not whole or "".join(glp.tokens) == greedy.choices[0].text),
          f"a completion's {len(glp.tokens)} scored tokens spell its text")
    check(glp.tokens == lp.tokens[n_prompt:], "the greedy completion is the text the echo scored")
    diff = max(abs(a - b) for a, b in zip(glp.token_logprobs, lp.token_logprobs[n_prompt:]))
    check(diff < 1e-3, f"the completion's log-probabilities are the echo's (largest difference {diff:.2e})")
    summary["completion_echo_logprob_diff"] = diff
    # A chat's, in OpenAI's shape: greedy picks the likeliest token of the raw softmax.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"learn": False})
    content = chat.choices[0].logprobs.content
    check(len(content) == chat.usage.completion_tokens, f"a chat's {len(content)} tokens are scored")
    check(all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
              and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
              and all(a.logprob >= b.logprob for a, b in zip(c.top_logprobs, c.top_logprobs[1:]))
              and c.logprob <= 0
              and (c.token.startswith("bytes:") or bytes(c.bytes).decode() == c.token)
              for c in content),
          "each chat token: its logprob, bytes, and 3 top_logprobs sorted, the greedy pick first")
    spelt = b"".join(bytes(c.bytes) for c in content).decode(errors="replace")
    check(spelt == chat.choices[0].message.content, "the chat's scored tokens' bytes spell its text")
    # Streamed, each chunk carries its tokens' scores.
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"learn": False})
    items, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                items.extend(c.logprobs.content)
    check(usage is not None and len(items) == usage.completion_tokens
          and [i.token for i in items] == [c.token for c in content],
          f"a streamed chat carries its {len(items)} tokens' scores, as the whole answer did")
    summary["untrained"] += 4

    # Constrained output: a JSON schema the answer must follow, whatever the model would say.
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "mood": {"enum": ["calm", "busy", "curious"]},
        },
        "required": ["name", "age", "mood"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=64, temperature=0.9, seed=5,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "strict": True, "schema": schema}},
        extra_body={"learn": False})
    out = json.loads(answer.choices[0].message.content)
    jsonschema.validate(out, schema)
    check(answer.choices[0].finish_reason == "stop",
          f"the answer {answer.choices[0].message.content!r} follows the schema and ends there")
    summary["json_schema_answer"] = out
    mode = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON please."}], max_tokens=8,
        temperature=0, response_format={"type": "json_object"}, extra_body={"learn": False})
    check(mode.choices[0].message.content.startswith("{"), "JSON mode starts an object")
    summary["untrained"] += 2
    # A schema past the bounds, or a format the mesh does not follow, is a 400, never ignored.
    deep = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    big = {"type": "object",
           "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(2000)}}
    for fmt, what in (
        ({"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}, "nests deeper"),
        ({"type": "json_schema", "json_schema": {"name": "b", "schema": big}}, "bytes; at most"),
        ({"type": "json_schema", "json_schema": {"name": "i", "schema": {
            "type": "integer", "minimum": -1e300, "maximum": 1e300}}}, "cannot be followed"),
        ({"type": "grammar", "grammar": "root ::= x"}, "not supported"),
    ):
        started = time.monotonic()
        try:
            client.chat.completions.create(model=model, max_tokens=4, response_format=fmt,
                                           messages=[{"role": "user", "content": "hi"}])
            raise AssertionError(f"{what}: accepted")
        except openai.BadRequestError as e:
            took = time.monotonic() - started
            check(e.status_code == 400 and e.param == "response_format" and what in str(e)
                  and took < 5, f"response_format ({what}): 400 on param response_format in {took:.2f} s")

    # The first request the mesh learns from, still at the genesis version: a greedy completion
    # cut by a stop string must be the uncoded model's greedy completion up to that string.
    text = expected["completion_text"]
    at = next((i for i in range(2, len(text) - 1) if text.find(text[i:i + 2]) == i), None)
    if at is None:
        raise AssertionError(f"no usable stop string in {text!r}")
    stop = text[at:at + 2]
    first = client.completions.create(
        model=model,
        prompt=expected["prompt"],
        max_tokens=len(expected["completion_ids"]),
        temperature=0,
        stop=[stop],
    )
    check(first.object == "text_completion", "a completion object")
    check(first.choices[0].text == text[:at],
          f"greedy completion through the mesh, cut at {stop!r}: {first.choices[0].text!r} is the uncoded model's {text[:at]!r}")
    check(first.choices[0].finish_reason == "stop", "finish_reason is stop at the stop string")
    check(first.usage.prompt_tokens == len(expected["prompt_ids"]),
          f"usage counts the prompt's {len(expected['prompt_ids'])} tokens")
    check(1 <= first.usage.completion_tokens <= len(expected["completion_ids"]),
          f"usage counts {first.usage.completion_tokens} completion tokens")
    summary["first_text"] = first.choices[0].text

    # max_tokens ends a completion with finish_reason length.
    short = client.completions.create(model=model, prompt=expected["prompt"], max_tokens=3,
                                      temperature=0)
    check(short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3,
          "max_tokens = 3 gives 3 tokens and finish_reason length")

    # Models.
    models = client.models.list()
    ids = [m.id for m in models.data]
    check(ids == [model], f"/v1/models lists the served model {ids}")

    # Errors, in OpenAI's shape and status codes.
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.code == "model_not_found", f"unknown model: 404 {e.code}")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=5)
        raise AssertionError("temperature 5 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.param == "temperature", "temperature out of range: 400 on param temperature")
    # llama-server's top_k and min_p are taken (a request without them gets the model's
    # recommended sampling, else llama.cpp's defaults), and checked.
    r = client.completions.create(model=model, prompt="x", max_tokens=2, seed=3,
                                  extra_body={"top_k": 1, "min_p": 0.1, "learn": False})
    check(r.usage.completion_tokens >= 1, "top_k and min_p are taken")
    summary["untrained"] += 1
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"min_p": 1.5})
        raise AssertionError("min_p 1.5 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.param == "min_p", "min_p out of range: 400 on param min_p")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=100000)
        raise AssertionError("max_tokens beyond the context was accepted")
    except openai.BadRequestError as e:
        check(e.code == "context_length_exceeded", "max_tokens beyond the context: context_length_exceeded")
    # What the mesh does not do is refused, naming the parameter, never ignored.
    for create, kwargs, param in (
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}],
                                          "extra_body": {"echo": True}}, "echo"),
        (client.completions.create, {"prompt": "x", "best_of": 2}, "best_of"),
        (client.completions.create, {"prompt": "x", "extra_body": {"mirostat": 2}}, "mirostat"),
    ):
        try:
            create(model=model, max_tokens=2, **kwargs)
            raise AssertionError(f"{param} was accepted and ignored")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.param == param and e.code == "unsupported_parameter"
                  and param in str(e), f"{param}: 400 unsupported_parameter on param {param}")
    # OpenAI's bounds on log-probabilities, and what does not go with them.
    for create, kwargs, param in (
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}],
                                          "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (client.completions.create, {"prompt": "x", "logprobs": 6}, "logprobs"),
        (client.completions.create, {"prompt": "x", "echo": True, "stream": True}, "echo"),
        (client.completions.create, {"prompt": "x", "n": 2}, "n"),
    ):
        try:
            r = create(model=model, max_tokens=2, **kwargs)
            if kwargs.get("stream"):
                list(r)
            raise AssertionError(f"{param} out of bounds was accepted")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.param == param, f"{param} out of bounds: 400 on param {param}")
    try:
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "a wrong key: 401")
    status, _, body = raw(base, "/v1/chat/completions", key, data=b"")
    check(status == 400 and "error" in json.loads(body), "an empty body: 400 with an error object")
    status, _, body = raw(base, "/v1/chat/completions", key, data=b'{"model": "%s", "messages": "hi"}' % model.encode())
    check(status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error",
          "messages of the wrong type: 400 invalid_request_error")

    # Overload: more concurrent requests than batch + queue; the rest get 429 with Retry-After.
    async def burst(n):
        aclient = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)

        async def one(i):
            try:
                r = await aclient.completions.create(model=model, prompt=f"burst {i}",
                                                     max_tokens=32, temperature=0)
                return ("ok", r.usage.completion_tokens)
            except openai.RateLimitError as e:
                return ("429", e.response.headers.get("retry-after"))

        return await asyncio.gather(*(one(i) for i in range(n)))

    results = asyncio.run(burst(int(expected["burst"])))
    served = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    check(len(served) + len(refused) == len(results), "every burst request was served or refused with 429")
    check(len(served) >= 1, f"{len(served)} burst requests served")
    check(len(refused) >= 1, f"{len(refused)} burst requests refused with 429")
    check(all(r[1] and int(r[1]) >= 1 for r in refused), "every 429 says Retry-After")
    summary["burst_served"] = len(served)
    summary["burst_refused"] = len(refused)

    # The WebSocket streams the same chunks, then [DONE]; two requests on one socket.
    async def socket():
        url = base.replace("http://", "ws://") + f"/stream?api_key={key}"
        out = []
        async with websockets.connect(url) as ws:
            for req in ({"model": model, "prompt": "ws", "max_tokens": 5, "temperature": 0},
                        {"model": model, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 5, "temperature": 0}):
                await ws.send(json.dumps(req))
                msgs = []
                while True:
                    m = await asyncio.wait_for(ws.recv(), 120)
                    if m == "[DONE]":
                        break
                    msgs.append(json.loads(m))
                out.append(msgs)
        return out

    ws_runs = asyncio.run(socket())
    for msgs in ws_runs:
        check(all("error" not in m for m in msgs), "the WebSocket answered without errors")
        check(any(m.get("usage") for m in msgs), "the WebSocket's last chunk carries usage")
    summary["ws_text"] = "".join(c.get("text", "") for m in ws_runs[0] for c in m["choices"])
    check(ws_runs[1][0]["object"] == "chat.completion.chunk", "a chat over the WebSocket streams chat chunks")

    # Metrics in Prometheus' text format, counting what happened.
    status, headers, metrics = raw(base, "/metrics")
    check(status == 200 and "text/plain" in headers.get("content-type", ""), "/metrics answers in text")
    values = {}
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for name in ["codedmesh_tokens_generated_total", "codedmesh_requests_total",
                 "codedmesh_groups_formed_total", "codedmesh_rounds_checked_total",
                 "codedmesh_rounds_projected_total",
                 "codedmesh_request_latency_seconds_count", "codedmesh_time_to_first_token_seconds_count",
                 "codedmesh_requests_rejected_total", "codedmesh_healthy_rows",
                 "codedmesh_gossip_bytes_total"]:
        # Updates are counted by the Rust side once every request was trained on: the trainer
        # gathers and yields to serving, so none need be out yet (published = 0 here, once).
        check(values.get(name, 0) > 0, f"{name} = {values.get(name)}")
    summary["metrics"] = values
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
