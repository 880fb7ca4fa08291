#!/bin/sh
# meshd-launchd.sh: runs `meshd ARGS...` for launchd (dev.meshd.plist) and maps
# meshd's exit code 3 to 0.
#
# meshd exits 3 when another live process holds its node id (a cloned machine or data
# dir; docs/operations.md, "The data dir"): a restart would clash again. launchd has no
# per-exit-code rule: `KeepAlive: {SuccessfulExit: false}` restarts a job after any
# non-zero exit. So this wrapper reports 3 as success (and says why in the log), and
# every other exit code as it is: a crash (non-zero) is restarted, a clean stop (0) is
# not.
#
# It stays the parent of meshd (to see its exit code) and passes SIGTERM on to it:
# launchd signals this process alone, and `launchctl bootout` should still drain the node
# (docs/operations.md, "Stopping"). SIGINT is not passed on: from a terminal, Ctrl-C
# reaches meshd already (a second one would stop it at once, skipping the drain).
#
# The meshd it runs: $MESHD if set (an absolute path), else `meshd` on PATH.
#
# Install (macOS, as the user who runs the node):
#
#   meshctl secret new -o ~/.config/meshd/cluster.secret     # once per cluster; 0600
#   install -d ~/.local/bin ~/Library/LaunchAgents
#   install -m 755 meshd-launchd.sh ~/.local/bin/meshd-launchd.sh
#   sed "s|/Users/YOU|$HOME|g" dev.meshd.plist > ~/Library/LaunchAgents/dev.meshd.plist
#   plutil -lint ~/Library/LaunchAgents/dev.meshd.plist
#   launchctl bootstrap "gui/$(id -u)" ~/Library/LaunchAgents/dev.meshd.plist
#
#   tail -f ~/Library/Logs/meshd.log                          # its log
#   launchctl print "gui/$(id -u)/dev.meshd"                  # state, last exit code
#   launchctl kickstart -k "gui/$(id -u)/dev.meshd"           # restart it
#   launchctl bootout "gui/$(id -u)/dev.meshd"                # stop it (drains) for good
#
# The secret file must be a plain file (not a symlink) only you can read: `meshctl
# secret new -o FILE` makes it 0600; a copied one: `chmod 600 FILE`.
set -u

meshd=${MESHD:-meshd}
child=

forward() {
    if [ -n "$child" ]; then
        kill "-$1" "$child" 2>/dev/null || true
    fi
}
trap 'forward TERM' TERM
trap ':' INT

"$meshd" "$@" &
child=$!

while :; do
    wait "$child"
    rc=$?
    # A status above 128 is either meshd's death by a signal or a trapped signal that
    # interrupted `wait` while meshd goes on (draining): wait again while it lives.
    if [ "$rc" -le 128 ]; then
        break
    fi
    if kill -0 "$child" 2>/dev/null; then
        continue
    fi
    # Gone: the shell may hold its status from the interrupted wait; 127 = no more.
    wait "$child" 2>/dev/null
    last=$?
    if [ "$last" -ne 127 ]; then
        rc=$last
    fi
    break
done

if [ "$rc" -eq 3 ]; then
    echo "meshd-launchd: meshd exited 3 (another process holds this node's id); not" \
        "restarting it. See 'The data dir' in docs/operations.md, then" \
        "'launchctl kickstart gui/$(id -u)/dev.meshd'." >&2
    exit 0
fi
exit "$rc"
