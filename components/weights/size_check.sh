#!/bin/sh
# Stats every manifest file under WEIGHTS_ROOT and fails naming the node and the bad files. Runs where the weights are
# seen: `sh -s` on the node (bind), or `sh -s` inside a container that mounts the two volumes (check.sh).
# Header values (manifest.render_size_check):
#   NODE         the node's name, for messages
#   WEIGHTS_ROOT where the staged tree is seen from here
#   WHERE        how it is seen (host path ..., or volumes ...), for messages
#   FILES        (text) one `<size> <relative path>` line per manifest file
set -u
root="$WEIGHTS_ROOT"
bad=""
n=0
listing=$(printf '%b' "$FILES")
while IFS=' ' read -r size path; do
  [ -n "$path" ] || continue
  n=$((n+1))
  actual=$(stat -c %s "$root/$path" 2>/dev/null) || actual=missing
  if [ "$actual" != "$size" ]; then
    echo "  $path: expected $size bytes, found $actual" >&2
    bad="$bad $path"
  fi
done <<DSV41_FILES
$listing
DSV41_FILES
if [ -n "$bad" ]; then
  fail "${LINENO:-}" "weights not visible on node $NODE ($WHERE): missing or wrong size:$bad; check staging and this node's share of the head's weights"
fi
echo "weights visible on node $NODE: $n files"
