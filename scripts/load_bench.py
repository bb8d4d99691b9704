"""Load benchmark of a Coded Mesh API: many concurrent streaming chat clients.

    python scripts/load_bench.py --base http://127.0.0.1:8000/v1 --model MODEL \
        [--clients 64] [--requests 2] [--max-tokens 32] [--time-limit 900] [--pid PID ...]
    python scripts/load_bench.py --base ... --model MODEL --texts [--max-tokens 128]

Each client sends --requests streamed chat completions one after another (different
prompts). A 429 is an explicit "busy": the client waits for its Retry-After and sends the
request again (counted). Anything else that is not a finished stream is an error. The run
stops at --time-limit. While it runs, the resident memory of the given processes (and their
children) is sampled. Prints a Markdown table of throughput, latency percentiles and memory;
exits non-zero if any request failed other than with 429. scripts/load-bench.sh runs it
against `codedmesh up`.

With --texts it sends instead the three texts of `codedmesh bench --speculate` (code, a passage
to summarise, open chat), greedy, one stream at a time, each twice (the first warms up), and
prints each one's decode after its first token: the figure that compares with the bench's
in-process decode, drafts or not.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time

import openai

PROMPTS = [
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is 12 times 12?",
    "Give me a short tip for learning to code.",
    "Describe a cat in a few words.",
    "What is the capital of Italy?",
    "Say hello in French.",
    "Why is the sky blue? Answer briefly.",
]


# The texts of `codedmesh bench --speculate` (node-native/src/bench/mod.rs, SPECULATION_PROMPTS).
TEXTS = [
    ("code", "Write Python functions add(a, b), subtract(a, b), multiply(a, b) and divide(a, b), "
             "each with a one-line docstring."),
    ("summary", "Summarise this passage in three sentences, keeping its words where you can.\n\n"
                "The history of the printing press begins in the fifteenth century, when Johannes "
                "Gutenberg combined movable metal type, oil-based ink and a screw press into a system "
                "that could produce books far faster than scribes. Within fifty years printing shops "
                "had opened in more than two hundred European cities, and the price of books fell so "
                "far that merchants, students and craftsmen could own them. The press spread news, "
                "pamphlets and scientific results, and it fixed spelling and grammar in print."),
    ("chat", "I have rice, eggs, spinach and a lemon. What could I cook for dinner tonight?"),
]


def texts(args):
    """Greedy streams of TEXTS, one at a time: a Markdown table of each one's decode."""
    c = openai.OpenAI(base_url=args.base, api_key=args.api_key or "none",
                      max_retries=0, timeout=args.time_limit)
    print("| text | tokens | decode after the first token | first token |\n|---|---|---|---|")
    for kind, text in TEXTS:
        for _ in range(2):  # the first warms up; the second is timed
            start = time.monotonic()
            first = last = None
            tokens = 0
            stream = c.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": text}],
                max_tokens=args.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            for chunk in stream:
                now = time.monotonic()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if any(ch.delta.content for ch in chunk.choices):
                    first = first or now
                    last = now
        if first is None or tokens < 2 or last <= first:
            sys.exit(f"{kind}: the stream gave no tokens to time")
        print(f"| {kind} | {tokens} | {(tokens - 1) / (last - first):.1f} tok/s "
              f"| {(first - start) * 1000:.0f} ms |")


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def descendants(pid):
    """pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler(threading.Thread):
    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids = pids
        self.peak = {}
        self.peak_total = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            total = 0
            for root in self.pids:
                for p in descendants(root):
                    r = rss_kib(p)
                    total += r
                    self.peak[p] = max(self.peak.get(p, 0), r)
            self.peak_total = max(self.peak_total, total)
            self.stop.wait(0.5)


async def client(i, args, aclient, results, deadline):
    for j in range(args.requests):
        prompt = PROMPTS[(i + j) % len(PROMPTS)]
        retries_429 = 0
        while True:
            if time.monotonic() > deadline:
                results.append({"status": "timeout"})
                return
            start = time.monotonic()
            first = None
            stamps = []
            tokens = 0
            try:
                stream = await aclient.chat.completions.create(
                    model=args.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.max_tokens,
                    temperature=0.7,
                    seed=i * 1000 + j,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    now = time.monotonic()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if any(c.delta.content for c in chunk.choices):
                        if first is None:
                            first = now - start
                        stamps.append(now)
                end = time.monotonic()
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                results.append({
                    "status": "ok", "ttft": first if first is not None else end - start,
                    "latency": end - start, "tokens": tokens, "gaps": gaps,
                    "streaming": stamps[-1] - stamps[0] if stamps else 0.0,
                    "retries_429": retries_429,
                })
                break
            except openai.RateLimitError as e:
                retries_429 += 1
                results.append({"status": "429"})
                wait = float(e.response.headers.get("retry-after") or 1)
                await asyncio.sleep(min(wait, 30))
            except Exception as e:  # anything else is a failure of the run
                results.append({"status": "error", "error": repr(e)})
                break


async def run(args):
    aclient = openai.AsyncOpenAI(base_url=args.base, api_key=args.api_key or "none",
                                 max_retries=0, timeout=args.time_limit)
    results = []
    deadline = time.monotonic() + args.time_limit
    start = time.monotonic()
    await asyncio.gather(*(client(i, args, aclient, results, deadline) for i in range(args.clients)))
    return results, time.monotonic() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=900)
    ap.add_argument("--pid", type=int, action="append", default=[])
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--texts", action="store_true",
                    help="greedy streams of bench --speculate's three texts instead (decode each)")
    args = ap.parse_args()
    if args.texts:
        texts(args)
        return

    sampler = MemorySampler(args.pid)
    sampler.start()
    results, wall = asyncio.run(run(args))
    sampler.stop.set()
    sampler.join()

    ok = [r for r in results if r["status"] == "ok"]
    refused = [r for r in results if r["status"] == "429"]
    errors = [r for r in results if r["status"] not in ("ok", "429")]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    latency = [r["latency"] for r in ok]
    gaps = [g for r in ok for g in r["gaps"]]
    # Decode alone: the tokens after each stream's first, over the time from its first chunk
    # to its last (a chunk carries a token, or a drafted pass's tokens).
    streamed = [r for r in ok if r["tokens"] > 1 and r["streaming"] > 0]
    decode = sum(r["tokens"] - 1 for r in streamed) / max(sum(r["streaming"] for r in streamed), 1e-9)
    ms = lambda v: f"{v * 1000:.0f} ms"
    rows = [
        ("clients × requests each", f"{args.clients} × {args.requests}, {args.max_tokens} tokens max"),
        ("requests finished", f"{len(ok)} of {args.clients * args.requests}"),
        ("429 answers (retried after Retry-After)", str(len(refused))),
        ("errors other than 429", str(len(errors))),
        ("wall time", f"{wall:.1f} s"),
        ("completion tokens", str(tokens)),
        ("throughput", f"{tokens / wall:.1f} tok/s, {len(ok) / wall:.2f} requests/s"),
        ("decode after the first token, per stream", f"{decode:.1f} tok/s"),
        ("time to first token p50 / p90 / p99", " / ".join(ms(percentile(ttft, p)) for p in (50, 90, 99))),
        ("request latency p50 / p90 / p99", " / ".join(ms(percentile(latency, p)) for p in (50, 90, 99))),
        ("gap between streamed chunks p50 / p99", " / ".join(ms(percentile(gaps, p)) for p in (50, 99))),
        ("peak resident memory, all processes", f"{sampler.peak_total / 1024:.0f} MiB"),
        ("peak resident memory, largest process", f"{max(sampler.peak.values(), default=0) / 1024:.0f} MiB"),
    ]
    print("| measurement | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    for e in errors[:5]:
        print("error:", e.get("error", e["status"]), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "results": results}, f)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
