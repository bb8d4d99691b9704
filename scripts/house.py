#!/usr/bin/env python3
"""The house rules the test command checks (issue 55): no import cycle between the modules of
any crate, no Rust source file over 900 lines, README.md at most 450 lines, docs/perf.md at
most 400. Prints every breach and exits 1 if there is one.

A module's dependencies are the modules it names: `crate::a::b` paths (in `use` or inline),
`super::x` and the crate root's bare `use a::…`. Doc comments do not count. A module and its
A parent may use its children and a child its ancestors (Rust's `super::`); no other chain of
modules may lead back to where it began. Folders must form layers too (`a::x` naming `b::y` is
folder `a` using folder `b`); `--layers CRATE_SRC` prints a crate's folder cycles.

    python3 scripts/house.py [--graph CRATE_SRC | --layers CRATE_SRC]
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["node-core/src", "node-native/src", "node-web/src", "web-ui/src", "tests/src", "tests/tests/e2e"]
MAX_LINES = 900
DOCS = {"README.md": 450, "docs/perf.md": 400}


def modules(src):
    """Module path (`a::b`, `crate` for the roots) → source text without comments."""
    out = {}
    for d, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(d, f), src)[:-3].replace(os.sep, "/")
            if rel in ("lib", "main"):
                name = "crate"
            elif os.path.dirname(rel) == "bin":
                continue
            else:
                name = re.sub(r"/mod$", "", rel).replace("/", "::")
            text = open(os.path.join(d, f), encoding="utf-8").read()
            text = re.sub(r"//[^\n]*", "", text)
            out[name] = out.get(name, "") + text
    return out


def expand(prefix, body):
    """`a::{b, c::{d}}` → [a::b, a::c::d]."""
    body = body.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    items, depth, cur = [], 0, ""
    for ch in body:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    paths = []
    for it in (i.strip() for i in items):
        if not it:
            continue
        if "::{" in it:
            head, rest = it.split("::{", 1)
            paths += expand(prefix + head + "::", "{" + rest)
        elif it.startswith("{"):
            paths += expand(prefix, it)
        else:
            paths.append(prefix + it.split(" as ")[0])
    return paths


def edges(mods):
    def owner(path):
        parts, best = path.split("::"), None
        for i in range(1, len(parts) + 1):
            if "::".join(parts[:i]) in mods:
                best = "::".join(parts[:i])
        return best

    graph = {}
    for m, text in mods.items():
        deps = set()
        for use in re.findall(r"\buse\s+crate::([^;]+);", text):
            deps.update(filter(None, map(owner, expand("", re.sub(r"\s", "", use)))))
        deps.update(filter(None, map(owner, re.findall(r"crate::((?:\w+::)*\w+)", text))))
        parent = m.rsplit("::", 1)[0] if "::" in m else None
        for name in re.findall(r"\bsuper::(\w+)", text):
            target = f"{parent}::{name}" if parent else name
            deps.add(target if target in mods else (parent or "crate"))
        if m == "crate":
            for use in re.findall(r"^\s*(?:pub\s+)?use\s+(\w+)::", text, re.M):
                if use in mods:
                    deps.add(use)
        graph[m] = {d for d in deps if d not in ("crate", m) and not d.startswith(m + "::")}
    return graph


def lifted(graph):
    """Each edge between two modules neither of which is the other's ancestor, as the edge
    between the two children of their nearest common ancestor that hold them: `a::x -> b::y`
    is `a -> b`. A child naming its ancestor lifts to nothing."""
    out = {}
    for a, deps in graph.items():
        for b in deps:
            pa, pb = a.split("::"), b.split("::")
            i = 0
            while i < min(len(pa), len(pb)) and pa[i] == pb[i]:
                i += 1
            if i == len(pa) or i == len(pb):
                continue
            out.setdefault("::".join(pa[: i + 1]), set()).add("::".join(pb[: i + 1]))
    return out


def cycles(graph):
    """Strongly connected components of more than one module. (Edges to descendants are left
    out, so no component is an ancestor chain: its deepest module would have no way in.)"""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--graph":
        for m, deps in sorted(edges(modules(sys.argv[2])).items()):
            print(m, "->", " ".join(sorted(deps)))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--layers":
        graph = lifted(edges(modules(sys.argv[2])))
        for comp in cycles(graph):
            print("folders in a cycle:", ", ".join(comp))
        return 0
    breaches = []
    for crate in CRATES:
        graph = edges(modules(os.path.join(ROOT, crate)))
        for comp in cycles(graph):
            inside = set(comp)
            detail = "; ".join(f"{a} -> {', '.join(sorted(graph.get(a, set()) & inside))}" for a in comp)
            breaches.append(f"{crate}: import cycle between {', '.join(comp)} ({detail})")
        folders = lifted(graph)
        for comp in cycles(folders):
            inside = set(comp)
            detail = "; ".join(f"{a} -> {', '.join(sorted(folders.get(a, set()) & inside))}" for a in comp)
            breaches.append(f"{crate}: folders in a cycle: {', '.join(comp)} ({detail})")
    for d, _, files in os.walk(ROOT):
        rel = os.path.relpath(d, ROOT)
        if rel.split(os.sep)[0] in ("target", ".git", "shared") or "/target" in rel:
            continue
        for f in files:
            if f.endswith(".rs"):
                path = os.path.join(d, f)
                n = sum(1 for _ in open(path, encoding="utf-8"))
                if n > MAX_LINES:
                    breaches.append(f"{os.path.relpath(path, ROOT)}: {n} lines (at most {MAX_LINES})")
    for doc, most in DOCS.items():
        n = sum(1 for _ in open(os.path.join(ROOT, doc), encoding="utf-8"))
        if n > most:
            breaches.append(f"{doc}: {n} lines (at most {most})")
    for b in breaches:
        print(b)
    if breaches:
        return 1
    print(f"no import cycle in {len(CRATES)} crates, no source file over {MAX_LINES} lines, "
          + ", ".join(f"{d} within {n} lines" for d, n in DOCS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
