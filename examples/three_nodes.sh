#!/usr/bin/env bash
# Try a split on one machine: three meshd nodes (a, b, c) on loopback, the default model
# split over a and b, and a question asked of c, which holds no stage of it (it passes
# the request through a's and b's stages). Everything stops when the script ends,
# however it ends.
#
#   ./three_nodes.sh                          # ports 17470-17478
#   BASE_PORT=20000 ./three_nodes.sh          # ports 20000-20008
#   PROMPT="Name three rivers" ./three_nodes.sh
#
# Node i (a=0, b=1, c=2) takes three ports from BASE_PORT + 3*i, like one default node
# takes 7470-7472: the API, the mesh (ROUTER) and the join port (the mesh port + 1).
# Each node also binds a gossip PUB port the OS picks.
#
# What it shows, in meshd's own words (docs/operations.md):
#   - a shared secret file: every node is a member at once (`meshctl secret new`);
#   - --no-discovery and --peer 127.0.0.1:MESH_PORT: seeds instead of Bonjour, so it
#     works where multicast does not (the first node starts the cluster, the others
#     name it as their seed);
#   - the ready line every node prints on stdout when it serves:
#     `meshd ready node=ID name=NAME api=URL mesh=PORT pub=PORT`;
#   - POST /v1/instances {"model": ..., "nodes": ["a", "b"]} (`meshctl place MODEL
#     --nodes a,b`), then GET /v1/instances until every stage is ready (`meshctl ls`);
#   - any node answers: the question goes to c (`meshctl chat`, which is
#     POST /v1/chat/completions; curl works too, see the end).
#
# Settings (environment):
#   BASE_PORT      first of the 9 ports (default 17470)
#   MODEL          what to split (default smollm2-135m)
#   PROMPT         the question (default "Tell me a joke about computers.")
#   MAX_TOKENS     longest answer (default 64)
#   READY_TIMEOUT  seconds a node may take to print its ready line (default 60)
#   LOAD_TIMEOUT   seconds the split may take to load (default 180)
#   DRAIN_TIMEOUT  each node's --drain-timeout when it stops (default 5)
#   WORK_DIR       where data dirs, the secret and logs go (default: a new temporary
#                  folder, deleted at the end unless something failed)
#   MESHD, MESHCTL the commands (default: meshd and meshctl on PATH)
set -euo pipefail

BASE_PORT=${BASE_PORT:-17470}
MODEL=${MODEL:-smollm2-135m}
PROMPT=${PROMPT:-"Tell me a joke about computers."}
MAX_TOKENS=${MAX_TOKENS:-64}
READY_TIMEOUT=${READY_TIMEOUT:-60}
LOAD_TIMEOUT=${LOAD_TIMEOUT:-180}
DRAIN_TIMEOUT=${DRAIN_TIMEOUT:-5}
MESHD=${MESHD:-meshd}
MESHCTL=${MESHCTL:-meshctl}

for cmd in "$MESHD" "$MESHCTL"; do
    command -v "$cmd" >/dev/null || { echo "three_nodes.sh: $cmd not found on PATH" >&2; exit 1; }
done

if [ -n "${WORK_DIR:-}" ]; then
    made_work_dir=0
    mkdir -p "$WORK_DIR"
else
    made_work_dir=1
    WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/meshd-three-nodes.XXXXXX")
fi
SECRET=$WORK_DIR/cluster.secret
NAMES=(a b c)
PIDS=()

api_port() { echo $((BASE_PORT + 3 * $1)); }
mesh_port() { echo $((BASE_PORT + 3 * $1 + 1)); }

log() { echo "three_nodes.sh: $*" >&2; }

stop_nodes() {
    local status=$? pid deadline
    trap - EXIT INT TERM
    set +e
    # SIGTERM: each node drains (for at most DRAIN_TIMEOUT s) and stops its runners.
    for pid in ${PIDS[@]+"${PIDS[@]}"}; do
        kill -TERM "$pid" 2>/dev/null
    done
    deadline=$((SECONDS + DRAIN_TIMEOUT + 20))
    for pid in ${PIDS[@]+"${PIDS[@]}"}; do
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "node pid $pid did not stop in time: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    if [ "$status" -ne 0 ]; then
        for name in "${NAMES[@]}"; do
            if [ -f "$WORK_DIR/$name.log" ]; then
                log "last lines of node $name's log ($WORK_DIR/$name.log):"
                tail -n 20 "$WORK_DIR/$name.log" >&2
            fi
        done
        log "failed (exit $status); logs and data dirs kept in $WORK_DIR"
    elif [ "$made_work_dir" -eq 1 ]; then
        rm -rf "$WORK_DIR"
    fi
    exit "$status"
}
trap stop_nodes EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_node I [meshd up flags...]: node NAMES[I] in the background, logs to its file.
start_node() {
    local i=$1 name=${NAMES[$1]}
    shift
    "$MESHD" up \
        --name "$name" \
        --cluster three-nodes \
        --data-dir "$WORK_DIR/$name" \
        --secret-file "$SECRET" \
        --api-host 127.0.0.1 --api-port "$(api_port "$i")" \
        --mesh-host 127.0.0.1 --mesh-port "$(mesh_port "$i")" \
        --no-discovery \
        --no-model \
        --drain-timeout "$DRAIN_TIMEOUT" \
        "$@" >"$WORK_DIR/$name.log" 2>&1 </dev/null &
    PIDS+=($!)
}

# wait_ready I: until node I printed its ready line (fails if it exits or takes too long).
wait_ready() {
    local i=$1 name=${NAMES[$1]} pid=${PIDS[$1]} deadline=$((SECONDS + READY_TIMEOUT))
    until grep -q '^meshd ready ' "$WORK_DIR/$name.log" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "node $name exited before it was ready"
            return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "node $name not ready in ${READY_TIMEOUT}s"
            return 1
        fi
        sleep 0.2
    done
    echo "node $name: $(grep -m1 '^meshd ready ' "$WORK_DIR/$name.log")"
}

# c's data dir holds its owner token: meshctl reads it there to place and remove (this
# user runs the nodes, so it is their owner; another user could chat, not administer).
ctl() { "$MESHCTL" --node "127.0.0.1:$(api_port 2)" --data-dir "$WORK_DIR/${NAMES[2]}" "$@"; }

# 1. One secret for the cluster (a file only this user reads: 0600; kept when WORK_DIR is
#    reused, with the data dirs that remember the cluster).
[ -f "$SECRET" ] || "$MESHCTL" secret new -o "$SECRET"

# 2. a starts the cluster; b and c name a as their seed.
start_node 0
wait_ready 0
start_node 1 --peer "127.0.0.1:$(mesh_port 0)"
start_node 2 --peer "127.0.0.1:$(mesh_port 0)"
wait_ready 1
wait_ready 2

# 3. Wait until c sees all three alive (gossip: a second or two).
deadline=$((SECONDS + READY_TIMEOUT))
until [ "$(ctl nodes --json | grep -c '"liveness": "alive"')" -ge 3 ]; do
    [ "$SECONDS" -lt "$deadline" ] || { log "c does not see three live nodes"; exit 1; }
    sleep 0.5
done
echo "c sees a, b and c alive"

# 4. The model split over a and b: layers [0, k) on a, [k, n) on b.
#    curl -X POST http://127.0.0.1:PORT/v1/instances -H 'Content-Type: application/json' \
#         -H "x-meshd-admin: $(cat "$WORK_DIR/c/owner.token")" \
#         -d '{"model": "smollm2-135m", "nodes": ["a", "b"]}'
ctl place "$MODEL" --nodes a,b

# 5. Wait until every stage is ready (each node's runner loaded its slice).
deadline=$((SECONDS + LOAD_TIMEOUT))
while :; do
    states=$(ctl ls --json | grep '"state":' || true)
    total=$(printf '%s\n' "$states" | grep -c '"state":' || true)
    ready=$(printf '%s\n' "$states" | grep -c '"state": "ready"' || true)
    if [ "$total" -gt 0 ] && [ "$ready" -eq "$total" ]; then
        break
    fi
    [ "$SECONDS" -lt "$deadline" ] || { log "the split did not load in ${LOAD_TIMEOUT}s"; ctl ls; exit 1; }
    sleep 1
done
ctl ls

# 6. Ask c. The same with curl:
#    curl http://127.0.0.1:PORT/v1/chat/completions -H 'Content-Type: application/json' \
#         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
echo
echo "asking node c (no stage of $MODEL on it): $PROMPT"
echo "--- answer ---"
ctl chat --model "$MODEL" --max-tokens "$MAX_TOKENS" --temperature 0 "$PROMPT"
echo "--- end ---"
# The EXIT trap stops the three nodes.
