#!/bin/sh
# The rank container's entrypoint (spec.container_entrypoint): raises its own OOM score, checks the node's
# MemAvailable against the preflight's floor, then execs vLLM with the container's command as its argv.
# Every start of the container runs it: the first `pulumi up`, a supervisor restart, a start after a reboot.
#
# The score: the kernel's OOM killer scores by RSS, and on GB10 the weights are in no RSS; without it the killer
# takes sshd or dockerd instead of vLLM. Raising one's own score needs no privilege.
# The memory: the preflight measured MemAvailable before staging wrote 387 GiB on the head, and the GB10 driver
# allocates from free memory without reclaiming page cache. Staging drops its files' pages, and this checks
# again, on the node, just before vLLM would allocate. A container without its own /proc/meminfo view (no lxcfs,
# no --memory) reads the host's: on GB10, the pool the GPU allocates from.
#
# Header values (spec.container_entrypoint):
#   NODE           the node's name in the cluster config
#   MIN_MEM_KIB    the node's floor, KiB (what the preflight checks: Settings.min_mem_available_gib_of)
#   MIN_MEM_GIB    the same floor in GiB, as the preflight prints it
#   FLOOR          what the floor is made of, naming the key (preflight.minMemAvailableGiB ...)
#   OOM_SCORE_ADJ  the score written to /proc/self/oom_score_adj
#   KEY_FILE       the head with an API key: the file holding it (mounted read-only); empty: no key
# Arguments: vLLM's argv (`serve /model ...`).
# Environment: DSV41_MEMINFO replaces /proc/meminfo (tests, and a simulated node's own figures).
echo "$OOM_SCORE_ADJ" > /proc/self/oom_score_adj ||
  fail "${LINENO:-}" "dsv41-exl3: cannot write /proc/self/oom_score_adj; refusing to start vLLM without it"

meminfo=${DSV41_MEMINFO:-/proc/meminfo}
avail=''
total=''
if [ -r "$meminfo" ]; then
  while read -r key value _unit; do
    case $key in
      MemAvailable:) avail=$value ;;
      MemTotal:) total=$value ;;
    esac
  done < "$meminfo"
fi
case $avail in
  '' | *[!0-9]*)
    fail "${LINENO:-}" "dsv41-exl3: rank not started on node $NODE: cannot read MemAvailable from $meminfo\
 (read: '$avail'); the memory check before vLLM needs a Linux /proc/meminfo" ;;
esac
case $total in
  '' | *[!0-9]*) total=0 ;;
esac
gib() {  # KiB -> GiB with two decimals, truncated (a figure shown below the floor is below it)
  printf '%d.%02d' $(($1 / 1048576)) $(($1 % 1048576 * 100 / 1048576))
}
if [ "$avail" -lt "$MIN_MEM_KIB" ]; then
  fail "${LINENO:-}" "dsv41-exl3: rank not started on node $NODE: MemAvailable $(gib "$avail") GiB\
 (MemTotal $(gib "$total") GiB) is below the floor of $MIN_MEM_GIB GiB ($FLOOR); fix: free memory on $NODE\
 (ps aux --sort=-rss | head; docker ps), drop its page cache (sync; echo 3 | sudo tee /proc/sys/vm/drop_caches),\
 or lower preflight.minMemAvailableGiB"
fi
if [ -n "$KEY_FILE" ]; then
  # vLLM reads VLLM_API_KEY from its own environment; the container's configured env (docker inspect) never has it.
  [ -r "$KEY_FILE" ] || fail "${LINENO:-}" "dsv41-exl3: rank not started on node $NODE: the API key file $KEY_FILE\
 is not readable; fix: run pulumi up again (it rewrites the key file on the head)"
  VLLM_API_KEY=$(cat "$KEY_FILE") || fail "${LINENO:-}" "dsv41-exl3: cannot read $KEY_FILE on node $NODE"
  [ -n "$VLLM_API_KEY" ] || fail "${LINENO:-}" "dsv41-exl3: rank not started on node $NODE: $KEY_FILE is empty;\
 fix: run pulumi up again (it rewrites the key file on the head)"
  export VLLM_API_KEY
fi
echo "dsv41-exl3: node $NODE: MemAvailable $(gib "$avail") GiB of $(gib "$total") GiB, floor $MIN_MEM_GIB GiB: starting vLLM" >&2
exec vllm "$@"
