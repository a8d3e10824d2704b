#!/usr/bin/env bash
# Note [Step checkpoint leftovers]: strata-bench step removes the checkpoint directory a
# killed run left ($TMPDIR/strata-bench-step-ckpt-<pid of a process that is gone>), and
# never one whose process lives. Usage: step_leftovers.sh STRATA_BENCH NVME_DIR
set -euo pipefail
bench=$1 dir=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR=$tmp
dead=$(( $(cat /proc/sys/kernel/pid_max) + 1 ))  # no process has it
mkdir "$tmp/strata-bench-step-ckpt-$dead" "$tmp/strata-bench-step-ckpt-$$"
head -c 4096 /dev/zero > "$tmp/strata-bench-step-ckpt-$dead/leftover.bin"
"$bench" step --json --states 16MiB --host-budget 64MiB --gpu-budget 8MiB --runs 1 --steps 1 --tokens 256 \
  --dir "$dir" > /dev/null
if [[ -e "$tmp/strata-bench-step-ckpt-$dead" ]]; then
  echo "step_leftovers: the dead run's directory is still there" >&2; exit 1
fi
if [[ ! -d "$tmp/strata-bench-step-ckpt-$$" ]]; then
  echo "step_leftovers: a live process's directory was removed" >&2; exit 1
fi
echo "step_leftovers: ok"
