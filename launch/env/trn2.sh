# shellcheck shell=bash
# Neuron runtime, compiler and EFA environment for training on trn2.48xlarge nodes.
# Sourced by launch/slurm/fuji-3b-trn2.sbatch and by the EKS pods (trn-accum render-eks).
# Every variable keeps a value that is already set, so any of them can be overridden by
# exporting it before this file is sourced. Documented settings only (Neuron SDK docs);
# the per-process multi-node variables (NEURON_PJRT_PROCESSES_NUM_DEVICES,
# NEURON_PJRT_PROCESS_INDEX, NEURON_RT_ROOT_COMM_ID) are derived at start-up by
# trn_accum.distributed from the Slurm step or the Kubernetes Indexed Job, not here.
#
# Compile caches live on storage every node sees, so one node's compilation serves all and
# a restarted job does not compile again:
#   TRN_ACCUM_SHARED_DIR   shared file system root (FSx for Lustre, EFS, NFS home; default:
#                          $SLURM_SUBMIT_DIR/runs or ./runs)
#   TRN_ACCUM_CACHE_DIR    default $TRN_ACCUM_SHARED_DIR/cache
#   NEURON_COMPILE_CACHE_URL  default $TRN_ACCUM_CACHE_DIR/neuron (a path or s3://bucket/prefix)
#   JAX_COMPILATION_CACHE_DIR default $TRN_ACCUM_CACHE_DIR/jax

: "${TRN_ACCUM_SHARED_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/runs}"
: "${TRN_ACCUM_CACHE_DIR:=$TRN_ACCUM_SHARED_DIR/cache}"
export TRN_ACCUM_SHARED_DIR TRN_ACCUM_CACHE_DIR

# JAX: the Neuron PJRT plugin first (CPU kept for host-side work).
export JAX_PLATFORMS="${JAX_PLATFORMS:-neuron,cpu}"

# neuronx-cc flags for transformer training on trn2 (FACTS.md §3); mixed-precision
# accumulation is the compiler's default.
export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:---target=trn2 --model-type=transformer --distribution-strategy=llm-training -O1}"

# Neuron runtime: logical NeuronCore size 2 = 64 JAX devices per trn2.48xlarge (24 GiB each);
# scalar bookkeeping computations run on the host CPU instead of being compiled for Neuron.
export NEURON_LOGICAL_NC_CONFIG="${NEURON_LOGICAL_NC_CONFIG:-2}"
export NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU="${NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU:-1}"

# Compile caches on shared storage.
export NEURON_COMPILE_CACHE_URL="${NEURON_COMPILE_CACHE_URL:-$TRN_ACCUM_CACHE_DIR/neuron}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$TRN_ACCUM_CACHE_DIR/jax}"
for _trn_dir in "$NEURON_COMPILE_CACHE_URL" "$JAX_COMPILATION_CACHE_DIR"; do
  case "$_trn_dir" in
    *://*) ;;  # s3:// and other URLs: nothing to create
    *) mkdir -p "$_trn_dir" ;;
  esac
done
unset _trn_dir

# EFA (libfabric) for the collectives between nodes. FI_EFA_FORK_SAFE is needed only on
# kernels older than 5.15.
export FI_PROVIDER="${FI_PROVIDER:-efa}"
export FI_EFA_USE_DEVICE_RDMA="${FI_EFA_USE_DEVICE_RDMA:-1}"
if [[ -z "${FI_EFA_FORK_SAFE:-}" ]]; then
  _trn_kernel="$(uname -r)"
  _trn_major="${_trn_kernel%%.*}"
  _trn_minor="${_trn_kernel#*.}"
  _trn_minor="${_trn_minor%%.*}"
  if [[ "$_trn_major" =~ ^[0-9]+$ && "$_trn_minor" =~ ^[0-9]+$ ]] &&
    ((_trn_major < 5 || (_trn_major == 5 && _trn_minor < 15))); then
    export FI_EFA_FORK_SAFE=1
  fi
  unset _trn_kernel _trn_major _trn_minor
fi
