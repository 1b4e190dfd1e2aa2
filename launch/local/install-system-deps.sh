#!/usr/bin/env bash
# Installs the Debian packages the test suite uses when they are missing and this machine can:
# root with apt-get. `make` (to run `make test`) and a real Slurm (slurm-wlm: slurmctld, slurmd
# and the clients) for the Slurm tests. Elsewhere it says why it skips; the Slurm tests then
# skip with that reason, except under CI=true, where they fail. Used by `make test`
# (system-deps) and by the Dockerfile's CPU image.
set -euo pipefail

need=()
command -v make >/dev/null || need+=(make)
if ! { command -v slurmctld && command -v slurmd && command -v sbatch; } >/dev/null; then
  need+=(slurm-wlm)
fi
((${#need[@]})) || exit 0

if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: not root with apt-get; skipping ${need[*]} (Slurm tests will skip)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "install-system-deps: installed ${need[*]}" \
  "($(slurmctld -V 2>/dev/null || echo 'no slurm'))"
