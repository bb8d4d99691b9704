"""Learning through the API of a running `codedmesh up`: what the mesh learns, and at what cost.

    python scripts/learning_bench.py --base http://127.0.0.1:PORT/v1 --model MODEL \
        --bootstrap ADDR --codedmesh PATH [--exposures 20] [--poison 100] [--load]

Teaches a passage (node-native/texts/taught.txt) by sending it --exposures times as a
completion prompt, one request after another, then waits until the trainer has taken every
request; measures the passage's perplexity and held-out perplexity of text of another kind
(node-native/texts/heldout.txt) with `codedmesh eval` before and after. Then a poisoner sends
the same garbage (node-native/texts/garbage.txt) --poison times, and the held-out perplexity and
the canary gate's refusals are measured again. With --load it instead sends --chats streamed
chats from one client back to back (and --clients concurrent clients after that), and reports
throughput and the share of requests trained on (from /metrics). With --facts N it mentions N
made-up facts (node-native/texts/facts.json) in --chats-per-fact ordinary chats each, then asks
each fact's question greedily (not learnt from) and compares the true statement's loss with a
distractor's, before and after. Prints a Markdown table.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TEXTS = os.path.join(ROOT, "node-native", "texts")


def metrics(base):
    """The node's /metrics counters and gauges, by name (without the codedmesh_ prefix)."""
    with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=30) as r:
        out = {}
        for line in r.read().decode().splitlines():
            m = re.match(r"^codedmesh_([a-z_]+?)(?:_total)? ([-0-9.eE+naif]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out


def settled(base, limit=1800):
    """Waits until every request the mesh was asked to learn from is trained, refused or dropped."""
    start = time.time()
    while time.time() - start < limit:
        m = metrics(base)
        done = m.get("train_trained", 0) + m.get("train_over_budget", 0) + m.get("train_dropped", 0)
        if m.get("train_backlog", 0) == 0 and done >= m.get("learn_requests", 0):
            # The last update may still be on its way through the gate and out.
            time.sleep(3)
            return metrics(base)
        time.sleep(1)
    raise SystemExit("the trainer did not settle in time")


def perplexity(args, name, chunk):
    """`codedmesh eval` of one text file: its perplexity (the held-out file's eight passages
    whole, in chunks of `chunk` tokens; any other file's first chunk)."""
    chunks = 16 if name == "heldout.txt" else 1
    out = subprocess.run(
        [args.codedmesh, "eval", "--bootstrap", args.bootstrap, "--file",
         os.path.join(TEXTS, name), "--chunk", str(chunk), "--max-chunks", str(chunks)],
        check=True, capture_output=True, text=True).stdout
    return float(re.search(r"perplexity ([0-9.]+)", out).group(1))


def send(client, model, prompt, n, max_tokens):
    """Sends `prompt` n times as a completion, one after another."""
    for _ in range(n):
        client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0.0)


def teach(args, client, rows):
    taught = open(os.path.join(TEXTS, "taught.txt")).read().strip()
    garbage = open(os.path.join(TEXTS, "garbage.txt")).read().strip()
    before = (perplexity(args, "taught.txt", 80), perplexity(args, "heldout.txt", 128))
    send(client, args.model, taught, args.exposures, 16)
    m = settled(args.base)
    after = (perplexity(args, "taught.txt", 80), perplexity(args, "heldout.txt", 128))
    pct = lambda a, b: f"{a:.2f} → {b:.2f} ({100 * (b / a - 1):+.1f}%)"
    rows.append((f"taught passage perplexity, {args.exposures} requests", pct(before[0], after[0])))
    rows.append(("held-out perplexity (other text)", pct(before[1], after[1])))
    rows.append(("updates published / refused by the canary gate",
                 f"{m.get('updates_published', 0):.0f} / {m.get('updates_refused', 0):.0f}"))
    rows.append(("canary loss after the last judged update", f"{m.get('canary_loss', 0):.4f}"))
    if args.poison:
        published, refused = m.get("updates_published", 0), m.get("updates_refused", 0)
        send(client, args.model, garbage, args.poison, 16)
        m = settled(args.base)
        poisoned = perplexity(args, "heldout.txt", 128)
        rows.append((f"poison: held-out perplexity after {args.poison} garbage requests",
                     pct(after[1], poisoned)))
        rows.append(("poison: updates published / refused by the canary gate",
                     f"{m.get('updates_published', 0) - published:.0f} / "
                     f"{m.get('updates_refused', 0) - refused:.0f}"))


FOLLOW_UPS = ["Tell me more.", "Is that interesting?", "Say one sentence about it.",
              "What do you think?"]


def ask(client, model, question):
    """The greedy answer to a question, which the mesh does not learn from."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=32,
        temperature=0.0, extra_body={"learn": False})
    return r.choices[0].message.content or ""


def text_loss(args, text):
    """`codedmesh eval` of a short text: its total loss in nats (mean loss times tokens)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        out = subprocess.run(
            [args.codedmesh, "eval", "--bootstrap", args.bootstrap, "--file", f.name,
             "--chunk", "64", "--max-chunks", "1"],
            check=True, capture_output=True, text=True).stdout
    m = re.search(r"mean loss ([0-9.]+) nats/token", out)
    return float(m.group(1))


def fact_margin(args, fact):
    """How much likelier the fact's answer is than its distractor after the question: the
    distractor's mean loss over the two texts minus the answer's (nats a token)."""
    qa = lambda a: f"Q: {fact['question']}\nA: {fact['statement'].format(a)}"
    return text_loss(args, qa(fact["distractor"])) - text_loss(args, qa(fact["answer"]))


def facts(args, client, rows):
    """Made-up facts mentioned in ordinary chats (--chats-per-fact each, the five phrasings in
    turn): does a greedy question answer with them afterwards, and does the true statement gain
    on a distractor? Held-out perplexity before and after."""
    facts = json.load(open(os.path.join(TEXTS, "facts.json")))[: args.facts]
    held = perplexity(args, "heldout.txt", 128)
    before = [(ask(client, args.model, f["question"]), fact_margin(args, f)) for f in facts]
    for i in range(args.chats_per_fact):
        for f in facts:
            say = f"{f['phrasings'][i % len(f['phrasings'])]} {FOLLOW_UPS[i % len(FOLLOW_UPS)]}"
            client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": say}], max_tokens=16)
    m = settled(args.base)
    after = [(ask(client, args.model, f["question"]), fact_margin(args, f)) for f in facts]
    answered = 0
    for f, (a0, m0), (a1, m1) in zip(facts, before, after):
        known = f["answer"].lower() in a0.lower()
        now = f["answer"].lower() in a1.lower()
        answered += now and not known
        rows.append((f"{f['question']} (answer {f['answer']})",
                     f"before: {a0.strip()[:60]!r}; after: {a1.strip()[:60]!r}; "
                     f"margin over {f['distractor']!r} {m0:+.3f} → {m1:+.3f} nats/token"))
    rows.append((f"facts answered after {args.chats_per_fact} chats each (not before)",
                 f"{answered} of {len(facts)}"))
    rows.append(("held-out perplexity (other text)",
                 f"{held:.2f} → {perplexity(args, 'heldout.txt', 128):.2f}"))
    rows.append(("updates published / refused by the canary gate",
                 f"{m.get('updates_published', 0):.0f} / {m.get('updates_refused', 0):.0f}"))


def load(args, rows):
    """Back-to-back chats from one client, then concurrent clients: throughput, trained share."""
    python = sys.executable
    for clients, requests in ((1, args.chats), (args.clients, args.requests)):
        if clients == 0:
            continue
        before = metrics(args.base)
        out = subprocess.run(
            [python, os.path.join(ROOT, "scripts", "load_bench.py"), "--base", args.base,
             "--model", args.model, "--clients", str(clients), "--requests", str(requests),
             "--max-tokens", "48"],
            check=True, capture_output=True, text=True).stdout
        tput = re.search(r"\| throughput \| ([0-9.]+) tok/s", out)
        m = settled(args.base)
        delta = lambda k: m.get(k, 0) - before.get(k, 0)
        asked = delta("learn_requests")
        trained = delta("train_trained")
        learnt = delta("train_learnt")
        rows.append((f"{clients} client(s) × {requests} chats: throughput (tok/s)",
                     tput.group(1) if tput else "?"))
        if asked:
            rows.append((f"{clients} client(s): requests trained / asked to learn "
                         f"(dropped, over budget)",
                         f"{trained:.0f} / {asked:.0f} = {100 * trained / asked:.0f}% "
                         f"({delta('train_dropped'):.0f}, {delta('train_over_budget'):.0f})"))
            rows.append((f"{clients} client(s): requests in a published update "
                         f"(the canary gate refused {delta('updates_refused'):.0f} updates)",
                         f"{learnt:.0f} / {asked:.0f} = {100 * learnt / asked:.0f}%"))
            rows.append((f"{clients} client(s): updates published", f"{delta('updates_published'):.0f}"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--codedmesh", required=True)
    p.add_argument("--exposures", type=int, default=20)
    p.add_argument("--poison", type=int, default=100)
    p.add_argument("--load", action="store_true")
    p.add_argument("--chats", type=int, default=150)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--facts", type=int, default=0,
                   help="teach this many made-up facts in chats instead (at most 5)")
    p.add_argument("--chats-per-fact", type=int, default=20)
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base, api_key="none", timeout=600)
    rows = []
    if args.load:
        load(args, rows)
    elif args.facts:
        facts(args, client, rows)
    else:
        teach(args, client, rows)
    print("| measurement | value |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")


if __name__ == "__main__":
    main()
