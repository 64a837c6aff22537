#!/bin/sh
# Read only, for `dsv41-exl3 doctor`: the node's docker platform and the registry's manifest of the serving image,
# asked from the node (its network, its `docker login`), before a 22.5 GiB pull would find an image with no build
# for this node's architecture. Prints `platform OS/ARCH`, then `manifest` and `docker manifest inspect -v`'s JSON,
# or `unreadable` and the last lines of its error; image/platforms.py decides.
# Header values (platforms.render_manifest_check):
#   IMAGE     the serving image reference (config `image`)
#   INSECURE  1: the registry is on loopback (docker's own default insecure registries): plain HTTP allowed
set -u
platform=$(docker version --format '{{.Server.Os}}/{{.Server.Arch}}' 2>&1) ||
  fail "${LINENO:-}" "docker is not reachable ($(printf '%s\n' "$platform" | tail -n 1))"
echo "platform $platform"
flag=''
[ "$INSECURE" = 1 ] && flag=--insecure
# shellcheck disable=SC2086 # flag is one word or nothing
if out=$(docker manifest inspect $flag -v "$IMAGE" 2>&1); then
  echo manifest
  printf '%s\n' "$out"
else
  echo unreadable
  printf '%s\n' "$out" | tail -n 3
fi
