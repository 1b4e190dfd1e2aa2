# shellcheck shell=bash
# The trn2 environment for `trn-accum train`: sourced by launch/slurm/fuji-3b-trn2.sbatch and
# by the EKS pods (trn-accum render-eks). The values come from Python, so Slurm, EKS and the
# trainer cannot drift apart: `trn-accum neuron-env` prints them (trn_accum.neuron.platform.
# trn2_env: Neuron compiler flags, logical core size, EFA, JAX_PLATFORMS=neuron,cpu, and the
# compile caches on shared storage under TRN_ACCUM_SHARED_DIR). A variable that is already
# set keeps its value, so export any of them before sourcing this file to override it.
# What only a shell can do stays here: export into this shell, and create the cache folders.

_trn_env="$(trn-accum neuron-env)" || {
  echo "launch/env/trn2.sh: \`trn-accum neuron-env\` failed: install trn_accum in this" \
    "environment (pip install -e .)" >&2
  return 2 2>/dev/null || exit 2
}
eval "$_trn_env"
unset _trn_env
for _trn_dir in "$NEURON_COMPILE_CACHE_URL" "$JAX_COMPILATION_CACHE_DIR"; do
  case "$_trn_dir" in
    *://*) ;; # s3:// and other URLs: nothing to create
    *) mkdir -p "$_trn_dir" ;;
  esac
done
unset _trn_dir
