#!/bin/sh
# LiveRanks' drift probe from the head itself (components/gates/live_ranks.py confirm_from_head): the first line
# on stdin is the request (with the API key: stdin, never argv), the rest is head_request.py, run with the
# serving image's python3 inside the head's container, so the request reaches the API on the container's own
# loopback. Prints head_request.py's one JSON line; a docker exec that fails (the container stopped, no python3)
# exits non-zero with docker's message on stderr. Header value (scripts.render): CONTAINER.
set -u
IFS= read -r request || { echo "no request line on stdin" >&2; exit 2; }
program=$(cat)
printf '%s\n' "$request" | docker exec -i "$CONTAINER" python3 -c "$program"
