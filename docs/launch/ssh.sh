#!/usr/bin/env bash
# One meshtrain process per host over ssh; the first host runs the coordinator.
# Every host needs this repository at the same path, with .venv installed, and
# config.workdir on a shared file system (checkpoints are written by all hosts).
#
#   docs/launch/ssh.sh host0 host1 -- train --config configs/hsdp.py:llama_1b \
#     --config.mesh.data=2 --config.mesh.fsdp=8 --config.workdir=/shared/runs/a
set -euo pipefail
hosts=()
while [[ $# -gt 0 && $1 != -- ]]; do hosts+=("$1"); shift; done
[[ $# -gt 1 && ${#hosts[@]} -gt 0 ]] || { echo "usage: $0 HOST... -- COMMAND [FLAGS]" >&2; exit 2; }
shift
port=${MESHTRAIN_PORT:-12355}
command=$(printf '%q ' "$@")
pids=()
for i in "${!hosts[@]}"; do
  ssh -tt "${hosts[$i]}" "cd $(printf '%q' "$PWD") && exec .venv/bin/meshtrain $command \
    --config.distributed.num_processes=${#hosts[@]} --config.distributed.process_id=$i \
    --config.distributed.coordinator_address=${hosts[0]}:$port" 2>&1 | sed -u "s/^/[$i] /" &
  pids+=($!)
done
trap 'kill 0' INT TERM  # ssh -tt: the remote processes end with their connections
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
