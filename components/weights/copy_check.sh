#!/bin/sh
# Says, without reading any weights, which files of this worker's local copy are not the verified ones
# (weights.share: copy): each expected file must be in the copier's record with the expected sha256 and size,
# and still have the recorded size and mtime. Prints one line per file that is not, then `COPY_CHECK <n>`.
# A file rewritten in place (right size, other content) changes its mtime, so it is seen here.
# Header values (local_copy.render_copy_check):
#   COPY_ROOT  the copy root as configured (`~` expanded here)
#   RECORD     the copier's record file name at the copy root
#   EXPECTED   (text) one line per file: sha256, size, path (tab-separated)
set -eu
case "$COPY_ROOT" in
  "~") root="$HOME" ;;
  \~/*) root="$HOME/${COPY_ROOT#\~/}" ;;
  *) root="$COPY_ROOT" ;;
esac
tab=$(printf '\t')
if [ ! -d "$root" ]; then
  printf '%b' "$EXPECTED" | while IFS="$tab" read -r _sha _size path; do echo "MISSING $path"; done
  printf '%b' "$EXPECTED" | awk 'END { print "COPY_CHECK " NR }'
  exit 0
fi
cd "$root"
stats=$(mktemp)
trap 'rm -f "$stats"' EXIT
printf '%b' "$EXPECTED" | while IFS="$tab" read -r _sha _size path; do
  if [ -f "$path" ]; then stat -c "%s$tab%.9Y$tab%n" -- "$path"; fi
done > "$stats"
printf '%b' "$EXPECTED" | awk -F "$tab" -v record="${RECORD}" -v stats="$stats" '
  BEGIN {
    while ((getline line < record) > 0) { split(line, r, "\t"); rec[r[4]] = r[1] "\t" r[2] "\t" r[3] }
    while ((getline line < stats) > 0) { split(line, s, "\t"); st[s[3]] = s[1] "\t" s[2] }
  }
  {
    path = $3
    if (!(path in st)) { print "MISSING " path; bad++; next }
    if (!(path in rec)) { print "UNVERIFIED " path; bad++; next }
    split(rec[path], r, "\t")
    if (r[1] != $1 || r[2] != $2) { print "CHANGED " path; bad++; next }
    if (st[path] != r[2] "\t" r[3]) { print "MODIFIED " path; bad++; next }
  }
  END { print "COPY_CHECK " bad + 0 }'
