#!/bin/sh
# The volunteer container's entrypoint: environment variables -> `python -m ravnest_p2p.peer` flags.
# `peer-id` as the only argument prints the peer id of the identity (creating it) and exits.
# Every variable is optional; extra arguments (the compose `command`, or after the image name in
# `docker run`) are passed on as flags and win over these.
#   RAVNEST_INITIAL_PEERS    multiaddrs of peers already in the swarm, space-separated (omit: a new swarm)
#   RAVNEST_ANNOUNCE_MADDRS  how others reach this peer, e.g. /ip4/<public ip>/tcp/31337 (space-separated)
#   RAVNEST_RUN_ID           the run to join (default: 'default')
#   RAVNEST_RUN_OWNER        the run owner's peer id: only its jobs are trained
#   RAVNEST_MAX_MEMORY_GB    memory this peer offers (set it at or below the container's memory limit)
#   RAVNEST_PORT             TCP port to listen on, all interfaces (default 31337)
#   RAVNEST_IDENTITY         key file (default /id/peer.key, on the /id volume: the same peer id on restart)
#   RAVNEST_LOG_LEVEL        DEBUG, INFO (default), WARNING or ERROR
set -eu
IDENTITY="${RAVNEST_IDENTITY:-/id/peer.key}"
if [ "${1:-}" = peer-id ]; then  # print this container's peer id (creating its key if missing), exit
    exec python -c 'import sys; from ravnest_p2p import load_or_create_identity as l; print(l(sys.argv[1]).peer_id)' "$IDENTITY"
fi
set -- --identity-path "$IDENTITY" \
    --host-maddrs "/ip4/0.0.0.0/tcp/${RAVNEST_PORT:-31337}" \
    --log-level "${RAVNEST_LOG_LEVEL:-INFO}" "$@"
# a space-separated list becomes one flag with several values (word splitting is wanted here)
# shellcheck disable=SC2086
if [ -n "${RAVNEST_INITIAL_PEERS:-}" ]; then set -- --initial-peers $RAVNEST_INITIAL_PEERS "$@"; fi
# shellcheck disable=SC2086
if [ -n "${RAVNEST_ANNOUNCE_MADDRS:-}" ]; then set -- --announce-maddrs $RAVNEST_ANNOUNCE_MADDRS "$@"; fi
if [ -n "${RAVNEST_RUN_ID:-}" ]; then set -- --run-id "$RAVNEST_RUN_ID" "$@"; fi
if [ -n "${RAVNEST_RUN_OWNER:-}" ]; then set -- --run-owner "$RAVNEST_RUN_OWNER" "$@"; fi
if [ -n "${RAVNEST_MAX_MEMORY_GB:-}" ]; then set -- --max-memory-gb "$RAVNEST_MAX_MEMORY_GB" "$@"; fi
exec python -m ravnest_p2p.peer "$@"
