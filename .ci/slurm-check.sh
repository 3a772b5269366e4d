#!/usr/bin/env bash
# .ci/slurm-check.sh — scripts/slurm/batch-generate.sbatch on a real Slurm:
# a one-node cluster on this machine (munged, slurmctld and slurmd with their
# config, key, sockets, state and logs in a temporary folder, on ports of
# their own), the README's job array submitted with the script's own
# #SBATCH requests (so they must fit a small node), and the merged shards
# compared byte for byte with one unsharded run. Every daemon is stopped at
# the end, on failure too.
#
#   .ci/slurm-check.sh [MODEL.gguf]       (default: SmolLM2, scripts/fetch-models.sh)
#
# Installs Debian's slurm-wlm and munge when missing (as root, or through
# sudo); needs the checkout's build/ (or $KVLUA_BUILD). The daemons run as
# root, without cgroups (proctrack/linuxproc, task/none) or accounting.
# SLURM_CHECK_TIMEOUT (seconds, default 600) bounds the wait for the array.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=${1:-$(scripts/fetch-models.sh smollm2)}
[ -f "$model" ] || { echo "slurm-check: no model at '$model'" >&2; exit 2; }
model=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
wait_s=${SLURM_CHECK_TIMEOUT:-600}
export KVLUA_BUILD=${KVLUA_BUILD:-build}
case "$KVLUA_BUILD" in /*) ;; *) KVLUA_BUILD=$root/$KVLUA_BUILD ;; esac
[ -f "$KVLUA_BUILD/kvlua.so" ] || { echo "slurm-check: no kvlua.so in $KVLUA_BUILD (build first)" >&2; exit 2; }

missing=()
for p in slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "slurm-check: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ "$(id -u)" -eq 0 ] || { echo "slurm-check: the daemons run as root (run as root)" >&2; exit 2; }

tmp=$(mktemp -d)
chmod 700 "$tmp"
stop() {
  local rc=$? f pid
  for f in slurmd slurmctld munged; do
    [ -s "$tmp/$f.pid" ] || continue
    pid=$(cat "$tmp/$f.pid")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ "$rc" -ne 0 ]; then
    for f in "$tmp"/slurmctld.log "$tmp"/slurmd.log "$tmp"/logs/*; do
      [ -f "$f" ] && { echo "--- $f" >&2; tail -20 "$f" >&2; }
    done
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap stop EXIT
trap 'exit 130' INT TERM

# munge: a key and a socket of this run's own
mkdir -p "$tmp/munge"
chmod 700 "$tmp/munge"
mungekey --create --keyfile "$tmp/munge/munge.key" 2>/dev/null \
  || dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$tmp/munge/munge.key"
munged --force --key-file "$tmp/munge/munge.key" --socket "$tmp/munge/munge.socket" \
  --pid-file "$tmp/munged.pid" --log-file "$tmp/munged.log" --seed-file "$tmp/munge/munge.seed"

# one node: this machine's CPUs and most of its memory (Slurm drains a node
# that has less than its configuration says)
cpus=$(nproc)
mem_mb=$(awk '/^MemTotal:/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
port=$((20000 + RANDOM % 20000))
mkdir -p "$tmp/state" "$tmp/spool" "$tmp/logs" "$tmp/out"
cat > "$tmp/slurm.conf" <<EOF
ClusterName=kvlua-check
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=check Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$tmp/slurm.conf
slurmctld -i
slurmd -N localhost

# the node takes a few seconds to register
for _ in $(seq 60); do
  state=$(sinfo -h -n localhost -o %t 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) break ;; esac
  sleep 1
done
case "$state" in idle*|mix*|alloc*) ;; *) echo "slurm-check: the node is '$state', not idle" >&2; exit 1 ;; esac
echo "slurm-check: one node, $cpus CPUs, $mem_mb MB (port $port)"

# a few of the example prompts, with few tokens each (an item's max_tokens
# wins over the command line's)
head -n 5 scripts/examples/prompts.jsonl | sed 's/"max_tokens": *[0-9]*/"max_tokens": 6/' > "$tmp/prompts.jsonl"
opts=(--model "$model" --backend cpu --max-tokens 6 --no-timings --quiet)

# the README's array (3 tasks); the logs go to the temporary folder, not the checkout
n=3
job=$(sbatch --parsable --array=0-$((n - 1)) --output="$tmp/logs/%x-%A_%a.log" \
  scripts/slurm/batch-generate.sbatch "$tmp/prompts.jsonl" "$tmp/out" "${opts[@]}")
job=${job%%;*}
echo "slurm-check: submitted job array $job"
deadline=$((SECONDS + wait_s))
# a request that no node of the partition can meet pends for ever
# (reason PartitionConfig and the like): that fails at once
while [ -n "$(squeue -h -j "$job" 2>/dev/null)" ]; do
  reasons=$(squeue -h -j "$job" -t PENDING -o %r 2>/dev/null | sort -u | tr '\n' ' ')
  case "$reasons" in
    *PartitionConfig*|*BadConstraints*|*PartitionNodeLimit*|*ReqNodeNotAvail*)
      echo "slurm-check: the array can never run here: $reasons" >&2
      squeue -j "$job" -o '%i %T %r %C %m' >&2 || true
      scancel "$job" || true
      exit 1 ;;
  esac
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "slurm-check: the array did not finish in ${wait_s} s:" >&2
    squeue -j "$job" -o '%i %T %r' >&2 || true
    scancel "$job" || true
    exit 1
  fi
  sleep 2
done
scontrol -o show job "$job" | grep -o 'ArrayTaskId=[^ ]* .*JobState=[^ ]*\|ExitCode=[^ ]*' | paste -d' ' - - \
  | sed 's/ .*JobState=/ JobState=/; s/^/slurm-check: /'
bad=$(scontrol -o show job "$job" | grep -v 'JobState=COMPLETED' || true)
[ -z "$bad" ] || { echo "slurm-check: not every task completed" >&2; exit 1; }

shards=("$tmp"/out/shard-*-of-"$(printf %04d "$n")".jsonl)
[ "${#shards[@]}" -eq "$n" ] || { echo "slurm-check: ${#shards[@]} shard files, not $n" >&2; exit 1; }
cat "${shards[@]}" > "$tmp/merged.jsonl"
lua5.4 scripts/batch-generate.lua --file "$tmp/prompts.jsonl" --output "$tmp/unsharded.jsonl" --threads 2 "${opts[@]}"
[ -s "$tmp/unsharded.jsonl" ] || { echo "slurm-check: the unsharded run wrote nothing" >&2; exit 1; }
cmp "$tmp/merged.jsonl" "$tmp/unsharded.jsonl" \
  || { diff "$tmp/merged.jsonl" "$tmp/unsharded.jsonl" >&2 || true; echo "slurm-check: merged shards differ" >&2; exit 1; }
echo "slurm-check: $n shards merged = the unsharded run ($(wc -l < "$tmp/merged.jsonl") lines, byte for byte)"
