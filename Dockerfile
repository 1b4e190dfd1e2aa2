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
# The supported Neuron SDKs and their JAX (Neuron release notes, "JAX NeuronX", and the
# announcements "Neuron now supports JAX 0.11.2 starting with Neuron 2.34" and "Neuron no
# longer supports JAX versions earlier than 0.10.0 starting with Neuron 2.34"):
#   2.32  jax-neuronx 0.10.0.x                JAX up to 0.10.0   Ubuntu 24.04, Python 3.13
#   2.33  jax-neuronx 0.10.0.1.0.14198        JAX up to 0.10.0   Ubuntu 26.04, Python 3.14
#   2.34                                      JAX 0.10.0-0.11.2  Ubuntu 26.04, Python 3.14
# The image pinned here is SDK 2.32.0's: the newest JAX training container the AWS Neuron DLC
# repository (github.com/aws-neuron/deep-learning-containers, README, jax-training-neuronx)
# lists. No 2.33 or 2.34 jax-training-neuronx tag is published there yet (from 2.33 the tags end
# in -py314-sdk2.3x.y-ubuntu26.04). Its JAX, 0.10.0, is the one all three SDKs support and the
# one constraints.txt pins. To move to a newer image, change FROM and constraints.txt together
# (the RUN below refuses an image whose JAX differs from constraints.txt).
FROM public.ecr.aws/neuron/jax-training-neuronx:0.10.0-neuronx-py313-sdk2.32.0-ubuntu24.04 AS neuron
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The test extra's torch (the Hugging Face reference Llama) is PyTorch's CPU build: PyPI's Linux
# wheel of the same version is the CUDA one, several GB; the CPU index's 2.13.0+cpu satisfies
# the pin `torch==2.13.0` and sorts above it.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/trn_accum
COPY . .
# The Python that has the image's JAX: `python` on PATH in the 2.32 image; the 2.33+ images
# (Python 3.14) may keep their packages in a virtual environment instead, so the first of
# `python3`, `python` and /opt/*/bin/python3 that imports jax is `python` below, and the
# `trn-accum` it installs is linked into /usr/local/bin for the image's CMD.
# Then pin the image's JAX/Neuron packages as constraints: pip installs only what is missing
# (optax, orbax-checkpoint, ...) and fails instead of replacing JAX. The image's JAX must be
# the one constraints.txt pins (the JAX the CPU test suite runs on), and the current NKI
# namespace (`import nki`) must be there (neuronxcc's is gone from 2.34).
RUN for cand in python3 python /opt/*/bin/python3 /opt/*/*/bin/python3; do \
      if command -v "$cand" > /dev/null && "$cand" -c "import jax" 2> /dev/null; then \
        py="$(command -v "$cand")" && break; \
      fi; \
    done \
 && if [ -z "${py:-}" ]; then echo "no python in the image imports jax" >&2; exit 1; fi \
 && scripts="$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')" \
 && python() { "$py" "$@"; } \
 && python -m pip freeze \
      | grep -iE '^(jax|jaxlib|jax[-_]neuronx|libneuronxla|neuronx[-_]cc|nki|numpy)==' \
      > /tmp/neuron-constraints.txt \
 && grep -iE '^(jax|jaxlib)==' /tmp/neuron-constraints.txt | sort > /tmp/jax-image.txt \
 && grep -iE '^(jax|jaxlib)==' constraints.txt | sort | diff - /tmp/jax-image.txt \
 && python -m pip install -c /tmp/neuron-constraints.txt -e . \
 && python -m pip freeze | grep -iE '^(jax|jaxlib)==' | sort | diff /tmp/jax-image.txt - \
 && python -c "import nki" \
 && ln -sf "$scripts/trn-accum" /usr/local/bin/trn-accum \
 && trn-accum --help > /dev/null
# On the first trn2 node: docker run ... trn-accum:neuron trn-accum neuron-check
CMD ["trn-accum", "neuron-check"]

# ----------------------------------------------------------------------------- cpu (default)
FROM python:3.11-slim-bookworm AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The test extra's torch (the Hugging Face reference Llama) is PyTorch's CPU build: PyPI's Linux
# wheel of the same version is the CUDA one, several GB; the CPU index's 2.13.0+cpu satisfies
# the pin `torch==2.13.0` and sorts above it.
ENV PIP_NO_CACHE_DIR=1 \
    UV_NO_CACHE=1 \
    UV_COMPILE_BYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/trn_accum
COPY . .
# make and slurm-wlm (what `make test` installs itself when it can), then the README's install
# command: .venv with the package and its test extra.
RUN bash launch/local/install-system-deps.sh \
 && rm -rf /var/lib/apt/lists/* \
 && make install
CMD ["make", "test"]
