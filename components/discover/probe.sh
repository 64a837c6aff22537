#!/bin/sh
# What one Spark can tell about the stack config lines (discover.py decides over it; parse.py reads it).
# Read only: it changes nothing on the node. It never fails as a whole: each `==name==` section holds what it
# found or one `unavailable: <reason>` line, and `==end==` closes a report that ran through.
#
# Header values (scripts.render):
#   LABEL_KEY      the docker label every container of a stack carries (components/labels.py STACK_LABEL)
#   SUDO_COMMANDS  what the NFS export runs as root, space-separated absolute paths (checked with `sudo -n -l`)
# Environment overrides for fixture trees (tests), the real paths by default: DSV41_SYSFS_ROOT (as gid_check.sh),
# DSV41_MEMINFO (as preflight.sh), DSV41_ROOT_CANDIDATES (the weight roots besides $HOME, space-separated).
set -u
LC_ALL=C; export LC_ALL   # English tool messages, '.' decimal points
PATH="$PATH:/usr/sbin:/sbin"   # `ip` lives there, and a non-login ssh session's PATH may lack it (as export.sh)
SYSFS_IB="${DSV41_SYSFS_ROOT:-/sys}/class/infiniband"
MEMINFO="${DSV41_MEMINFO:-/proc/meminfo}"
ROOTS="${DSV41_ROOT_CANDIDATES:-/srv /opt /var/lib}"
# A hung daemon (docker, an LDAP-backed sudo) must not hold the whole probe: each such call gets this bound.
BOUND_S=10
ZERO_GID=0000:0000:0000:0000:0000:0000:0000:0000

section() { echo "==$1=="; }
unavailable() { echo "unavailable: $1"; }
has() { command -v "$1" >/dev/null 2>&1; }
bounded() { if has timeout; then timeout "$BOUND_S" "$@"; else "$@"; fi; }
last_line() { printf '%s\n' "$1" | awk 'NF { l = $0 } END { print l }'; }

section user
echo "name $(id -un 2>/dev/null || echo '?')"
echo "uid $(id -u 2>/dev/null || echo '?')"
echo "home ${HOME:-}"
# The login shell runs every command ssh sends: nologin / false run none (the program's and the doctor's alike).
if has getent; then
  echo "shell $(getent passwd "$(id -un)" 2>/dev/null | awk -F: '{ print $7 }')"
fi

section ip
if ! has ip; then
  unavailable "no ip command (iproute2) on PATH"
elif out=$(ip -j addr show 2>/dev/null) && [ "${out#\[}" != "$out" ]; then
  echo "format json"
  printf '%s\n' "$out"
elif out=$(ip -o addr show 2>&1); then
  echo "format oneline"
  printf '%s\n' "$out"
else
  unavailable "ip addr show failed: $(last_line "$out")"
fi

# Records, one a line (GIDs that read all-zero are unused entries and skipped; an unreadable type or netdev is
# normal for an unused index and prints as `-`):
#   netdev <hca> <netdev>                            from <hca>/device/net/
#   port <hca> <port> <state text>                   e.g. `port rocep1s0f1 1 4: ACTIVE`
#   gid <hca> <port> <index> <gid> <netdev> <type>   e.g. `gid rocep1s0f1 1 3 0000:...:c0a8:6401 enp1s0f1np1 RoCE v2`
section ib
if [ ! -d "$SYSFS_IB" ]; then
  unavailable "no $SYSFS_IB (no RDMA driver loaded)"
else
  for d in "$SYSFS_IB"/*; do
    [ -d "$d" ] || continue
    h=${d##*/}
    for n in "$d"/device/net/*; do
      [ -e "$n" ] && echo "netdev $h ${n##*/}"
    done
    for p in "$d"/ports/*; do
      [ -d "$p" ] || continue
      st=$(cat "$p/state" 2>/dev/null) || st="unreadable"
      echo "port $h ${p##*/} $st"
      # One grep per table, not one cat per entry (256 of them per port); /dev/null makes grep name every file.
      {
        grep . /dev/null "$p"/gids/*
        grep . /dev/null "$p"/gid_attrs/types/*
        grep . /dev/null "$p"/gid_attrs/ndevs/*
      } 2>/dev/null | P="$p" H="$h" PORT="${p##*/}" ZERO="$ZERO_GID" awk '
        function take(prefix,    rest, k) {
          if (index($0, prefix) != 1) return 0
          rest = substr($0, length(prefix) + 1); k = index(rest, ":")
          if (k < 2) return 0
          idx = substr(rest, 1, k - 1); value = substr(rest, k + 1)
          return idx ~ /^[0-9]+$/
        }
        BEGIN { p = ENVIRON["P"]; max = -1 }
        take(p "/gids/") { gid[idx] = value; if (idx + 0 > max) max = idx + 0; next }
        take(p "/gid_attrs/types/") { type[idx] = value; next }
        take(p "/gid_attrs/ndevs/") { ndev[idx] = value; next }
        END {
          for (i = 0; i <= max; i++) {
            if (!(i in gid) || gid[i] == ENVIRON["ZERO"]) continue
            n = (i in ndev && ndev[i] != "") ? ndev[i] : "-"
            t = (i in type && type[i] != "") ? type[i] : "-"
            print "gid " ENVIRON["H"] " " ENVIRON["PORT"] " " i " " gid[i] " " n " " t
          }
        }'
    done
  done
fi

section meminfo
if line=$(grep '^MemAvailable:' "$MEMINFO" 2>/dev/null); then
  echo "$line"
else
  unavailable "no MemAvailable in $MEMINFO"
fi

# `exit <status>`, then what docker printed (its JSON, or its error).
# MemFree beside MemAvailable: the GB10 driver does not reclaim page cache by itself (docs/hardware.md), so a
# host full of cache passes MemAvailable and still cannot allocate.
section memfree
if line=$(grep '^MemFree:' "$MEMINFO" 2>/dev/null); then
  echo "$line"
else
  unavailable "no MemFree in $MEMINFO"
fi

section docker
if has docker; then
  out=$(bounded docker info --format '{{json .}}' 2>&1)
  echo "exit $?"
  printf '%s\n' "$out"
else
  unavailable "no docker command on PATH"
fi

section gpu
if has nvidia-smi; then
  out=$(bounded nvidia-smi -L 2>&1)
  echo "exit $?"
  printf '%s\n' "$out"
else
  unavailable "no nvidia-smi on PATH"
fi

# Per candidate: `candidate <fstype> <dir>` then df's data line as `df <line>`, or `missing <dir>`.
section disk
# shellcheck disable=SC2086 # ROOTS is a space-separated list of plain directories
for d in $ROOTS "${HOME:-}"; do
  [ -n "$d" ] || continue
  if [ ! -d "$d" ]; then
    echo "missing $d"
    continue
  fi
  fs=$(stat -f -c %T "$d" 2>/dev/null) || fs="unknown"
  echo "candidate ${fs:-unknown} $d"
  if line=$(df -P -k "$d" 2>&1 | awk 'NR == 2'); [ -n "$line" ]; then
    echo "df $line"
  else
    echo "df unavailable"
  fi
done

section nfs
if has dpkg-query; then
  # shellcheck disable=SC2016 # ${Status} is dpkg-query's field, not a shell expansion
  out=$(dpkg-query -W -f='${Status}' nfs-kernel-server 2>&1)
  echo "exit $?"
  printf '%s\n' "$out"
else
  unavailable "no dpkg-query (not Debian or Ubuntu)"
fi

# `exit <status>` and `systemctl is-active nfs-server`'s answer: the export needs the server running, not only installed.
section nfsserver
if has systemctl; then
  out=$(bounded systemctl is-active nfs-server 2>&1)
  echo "exit $?"
  printf '%s\n' "$out"
else
  unavailable "no systemctl (the NFS server's state is not known)"
fi

# `sudo-true <status>`, then `sudo-l <status> <command>` for each command the NFS export runs as root.
section sudo
if has sudo; then
  bounded sudo -n true >/dev/null 2>&1
  echo "sudo-true $?"
  # shellcheck disable=SC2086 # SUDO_COMMANDS is a space-separated list of absolute paths
  for c in $SUDO_COMMANDS; do
    bounded sudo -n -l "$c" >/dev/null 2>&1
    echo "sudo-l $? $c"
  done
else
  unavailable "no sudo command on PATH"
fi

# `exit <status>`, then one `<name>|<status>|<stack>` line per container carrying the stack label.
section leftovers
if has docker; then
  out=$(bounded docker ps -a --filter "label=$LABEL_KEY" --format "{{.Names}}|{{.Status}}|{{.Label \"$LABEL_KEY\"}}" 2>&1)
  echo "exit $?"
  printf '%s\n' "$out"
else
  unavailable "no docker command on PATH"
fi

section end
