#!/usr/bin/env bash
# Runs a command in a new network namespace whose only interface is loopback (`unshare -n`).
# The Mooncake transfer engine listens on all interfaces whatever it is told; inside this namespace "all"
# is only 127.0.0.0/8, so test servers can never be reached from, or reach, any other machine.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  exec unshare --map-root-user -n bash -c 'ip link set lo up && exec "$@"' in-netns "$@"
fi
exec unshare -n bash -c 'ip link set lo up && exec "$@"' in-netns "$@"
