"""Streams one chat completion from a Coded Mesh node's API with the standard library only, so
it runs inside a lab namespace with the system Python (tests/tests/e2e/lab.rs):

    python3 lab_stream.py BASE_URL MAX_TOKENS MARK_AFTER

It prints "MARK" (flushed) once MARK_AFTER chunks have arrived, so the test can break the
network mid-stream, and ends with one JSON line: the chunks, the tokens generated, the finish reason and the
milliseconds between the first chunk and the last.
An error event or a stream without [DONE] raises.
"""

import json
import sys
import time
import urllib.request


def main():
    base, max_tokens, mark_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with urllib.request.urlopen(base + "/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(
        base + "/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    chunks, text, finish, done, usage = 0, "", None, False, None
    first = last = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            chunks += 1
            last = time.monotonic()
            first = first or last
            if chunks == mark_after:
                print("MARK", flush=True)
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    tokens = (usage or {}).get("completion_tokens")
    ms = round((last - first) * 1000.0, 1) if first else None
    result = {"chunks": chunks, "tokens": tokens, "finish_reason": finish, "ms": ms}
    print(json.dumps(result), flush=True)


main()
