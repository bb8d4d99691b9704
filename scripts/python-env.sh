#!/usr/bin/env bash
# Makes (once) a Python virtual environment with the official `openai` client, `websockets` and
# `jsonschema` (the API test validates constrained output with it), pinned, in target/py, and
# prints the path of its python. The API test and the load benchmark use it. Run from anywhere in
# the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/py
# Pinned: the releases the API test and the load benchmark were written against.
packages="openai==3.54.0 websockets==17.4 jsonschema==4.23.0"
if ! "$venv/bin/python" -c "import openai, websockets, jsonschema; assert openai.__version__ == '3.54.0'" 2>/dev/null; then
  mkdir -p target
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $packages >&2
fi
echo "$PWD/$venv/bin/python"
