#!/bin/sh
# Installs the test-only packages (never needed to run memshelf itself):
#   pytest, the official MCP Python SDK, jsonschema, uv, model2vec   (PyPI)
#   the official mcpb CLI, @anthropic-ai/mcpb                         (npm, into .ci/node)
#   the Claude Code CLI, @anthropic-ai/claude-code (plugin validate)  (npm, into .ci/node)
#   Debian's chromium, where apt-get works                            (the mirror browser test)
set -e
cd "$(dirname "$0")/.."
python3 -m pip install -q -r tests/requirements.txt
npm install --prefix .ci/node --no-save --no-audit --no-fund --loglevel=error @anthropic-ai/mcpb@2.1.2 \
  @anthropic-ai/claude-code@2.1.197
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = "0" ] || SUDO="sudo -n"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "chromium could not be installed; the mirror browser test will be skipped" >&2
fi
