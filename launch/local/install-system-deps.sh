#!/usr/bin/env bash
# Installs the Debian packages the test suite uses (a real Slurm for the Slurm tests) when this
# machine can: root with apt-get. Elsewhere it says why it skips; the Slurm tests then skip with
# that reason, except under CI=true, where they fail.
set -euo pipefail

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
  exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: not root with apt-get; skipping slurm-wlm (Slurm tests will skip)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null
echo "install-system-deps: installed slurm-wlm ($(slurmctld -V))"
