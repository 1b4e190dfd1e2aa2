# Two images from one Dockerfile (see README, "Docker"):
#
#   docker build -t trn-accum . && docker run --rm trn-accum
#       the default target, `cpu` (the last stage): the package with its test extra, Debian's
#       slurm-wlm for the Slurm tests, and the test suite (`make test`) as the command.
#   docker build --target neuron -t trn-accum:neuron .
#       for trn2: the AWS Neuron JAX training container (JAX, jax-neuronx, libneuronxla,
#       neuronx-cc, nki, EFA) with this package added without replacing the image's JAX
#       stack, whose jax/jaxlib must equal constraints.txt's pins; its command is
#       `trn-accum neuron-check`.
#       Run it with the Neuron devices passed in (EKS: launch/eks/, `trn-accum render-eks`).

# ----------------------------------------------------------------------------- neuron
# Neuron SDK 2.32.0: jax-neuronx 0.10.0.x, JAX 0.10.0, Python 3.13, Ubuntu 24.04.
FROM public.ecr.aws/neuron/jax-training-neuronx:0.10.0-neuronx-py313-sdk2.32.0-ubuntu24.04 AS neuron
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/trn_accum
COPY . .
# Pin the image's JAX/Neuron packages as constraints: pip then installs only what is missing
# (optax, orbax-checkpoint, ...) and fails instead of replacing JAX.
# The image's JAX must be the one constraints.txt pins (the JAX the CPU test suite runs on),
# and the current NKI namespace (`import nki`) must be there (neuronxcc's is gone from 2.34).
RUN python -m pip freeze \
      | grep -iE '^(jax|jaxlib|jax[-_]neuronx|libneuronxla|neuronx[-_]cc|nki|numpy)==' \
      > /tmp/neuron-constraints.txt \
 && grep -iE '^(jax|jaxlib)==' /tmp/neuron-constraints.txt | sort > /tmp/jax-image.txt \
 && grep -iE '^(jax|jaxlib)==' constraints.txt | sort | diff - /tmp/jax-image.txt \
 && python -m pip install -c /tmp/neuron-constraints.txt -e . \
 && python -m pip freeze | grep -iE '^(jax|jaxlib)==' | sort | diff /tmp/jax-image.txt - \
 && python -c "import nki" \
 && trn-accum --help > /dev/null
# On the first trn2 node: docker run ... trn-accum:neuron trn-accum neuron-check
CMD ["trn-accum", "neuron-check"]

# ----------------------------------------------------------------------------- cpu (default)
FROM python:3.11-slim-bookworm AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/trn_accum
COPY . .
# make and slurm-wlm (what `make test` installs itself when it can), then the README's install
# command: .venv with the package and its test extra.
RUN bash launch/local/install-system-deps.sh \
 && rm -rf /var/lib/apt/lists/* \
 && make install
CMD ["make", "test"]
