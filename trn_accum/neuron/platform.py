"""The Neuron platform, without any Neuron package: detection, the trn2 environment, the PRNG,
and the trn2 hardware figures. The one home of trn2 facts: every other module reads them here.

Importing this module imports no Neuron package and no JAX (JAX only inside the functions that
need it) and initialises no backend.

Sources of the figures (AWS Neuron documentation):
- Trainium2 architecture (about-neuron/arch/neuron-hardware/trainium2): a chip has 8
  NeuronCore-v3, 96 GiB of HBM and 667 dense BF16 TFLOP/s;
- Trn2 instances (about-neuron/arch/neuron-hardware/trn2-arch): a trn2.48xlarge has 16 chips;
- Logical NeuronCore configuration (about-neuron/arch/neuron-features/logical-neuroncore-config):
  LNC=2 (the trn2 default) makes one logical core of two physical ones, so a trn2.48xlarge
  shows 64 JAX devices with 24 GiB each; `NEURON_LOGICAL_NC_CONFIG` sets it;
- JAX NeuronX known issues (frameworks/jax/.../known-issues): Threefry is not fully supported,
  use `jax_default_prng_impl = "rbg"`;
- neuronx-cc command-line reference: `--target=trn2 --model-type=transformer
  --distribution-strategy=llm-training -O1` for transformer training (flags starting
  `--internal-` are undocumented and refused here).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence

# ---------------------------------------------------------------------- trn2 figures

TRN2_INSTANCE_TYPE = "trn2.48xlarge"
TRN2_CHIPS_PER_NODE = 16
TRN2_CORES_PER_CHIP = 8  # physical NeuronCore-v3
TRN2_PHYSICAL_CORES_PER_NODE = TRN2_CHIPS_PER_NODE * TRN2_CORES_PER_CHIP  # 128
# Peak: the one figure this package uses is the Trainium2 architecture page's 667 dense BF16
# TFLOP/s per chip (the chip-level figure, the one AWS quotes for instances and the unit MFU is
# stated in). The NeuronCore-v3 page (about-neuron/arch/neuron-hardware/neuron-core-v3) gives
# 79 dense BF16 TFLOP/s per core, 8 x 79 = 632 per chip, 5.2 % lower; the dry-run shows both.
TRN2_CHIP_PEAK_FLOPS = 667e12  # dense BF16 FLOP/s of one chip (Trainium2 page)
TRN2_CORE_PEAK_FLOPS_ALT = 79e12  # dense BF16 FLOP/s of one NeuronCore-v3 (its own page)
TRN2_CHIP_HBM_GIB = 96.0
DEFAULT_LNC = 2  # logical NeuronCore size: physical cores per JAX device
LNC_VALUES = (1, 2)

#: Documented neuronx-cc flags for transformer training on trn2.
NEURON_CC_FLAGS = "--target=trn2 --model-type=transformer --distribution-strategy=llm-training -O1"
DEFAULT_COMPILE_CACHE = "/var/tmp/neuron-compile-cache"


def check_lnc(lnc) -> int:
    """`lnc` as an int; ValueError unless it is 1 or 2 (the logical core sizes of trn2)."""
    try:
        value = int(lnc)
    except (TypeError, ValueError):
        value = None
    if value not in LNC_VALUES:
        raise ValueError(f"lnc={lnc} must be 1 or 2 (logical NeuronCore size on trn2)")
    return value


def devices_per_node(lnc: int = DEFAULT_LNC) -> int:
    """JAX devices of one trn2.48xlarge: 128 physical cores / LNC (64 at LNC=2)."""
    return TRN2_PHYSICAL_CORES_PER_NODE // check_lnc(lnc)


def device_memory_gib(lnc: int = DEFAULT_LNC) -> float:
    """HBM of one JAX device: 96 GiB per chip shared by 8 / LNC devices (24 GiB at LNC=2)."""
    return TRN2_CHIP_HBM_GIB * check_lnc(lnc) / TRN2_CORES_PER_CHIP


def device_peak_flops(lnc: int = DEFAULT_LNC) -> float:
    """Dense BF16 FLOP/s of one JAX device: 667e12 * LNC / 8 (166.75e12 at LNC=2)."""
    return TRN2_CHIP_PEAK_FLOPS * check_lnc(lnc) / TRN2_CORES_PER_CHIP


#: The per-device memory budget the fit checks use (trn2 at the default LNC).
DEVICE_BUDGET_GIB = device_memory_gib(DEFAULT_LNC)


# ---------------------------------------------------------------------- detection


def neuron_plugin_installed() -> bool:
    """Whether a Neuron PJRT plugin for JAX is installed (nothing is imported or initialised).

    Looks for a ``jax_plugins`` entry point or ``jax_plugins.*`` module naming neuron, or the
    ``libneuronxla`` distribution at a real version (the PyPI placeholder of that name is
    version 0.x and raises on import; the real one is on the AWS Neuron pip repository).
    """
    try:
        for ep in importlib.metadata.entry_points(group="jax_plugins"):
            if "neuron" in ep.name.lower() or "neuron" in ep.value.lower():
                return True
    except Exception:  # malformed metadata of some unrelated distribution
        pass
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if glob.glob(os.path.join(loc, "*neuron*")):
                return True
    try:
        version = importlib.metadata.version("libneuronxla")
    except importlib.metadata.PackageNotFoundError:
        return False
    return not version.startswith("0.")


def _platforms_setting() -> str:
    """The platforms JAX may start: `jax.config.jax_platforms` once JAX is imported (a value set
    with `jax.config.update` wins), else ``JAX_PLATFORMS``; "" allows any."""
    jax = sys.modules.get("jax")
    setting = jax.config.jax_platforms if jax is not None else None
    return setting if setting is not None else os.environ.get("JAX_PLATFORMS", "")


def neuron_available() -> bool:
    """Whether JAX can (or does) use the ``neuron`` platform in this process, without starting
    any backend: the plugin is installed, Neuron devices exist (``/dev/neuron*``) and the
    platform setting (`jax.config.jax_platforms`, else ``JAX_PLATFORMS``), if set, allows
    ``neuron``.
    """
    platforms = _platforms_setting().strip()
    if platforms and "neuron" not in [p.strip() for p in platforms.split(",")]:
        return False
    return neuron_plugin_installed() and bool(glob.glob("/dev/neuron[0-9]*"))


def current_platform() -> str:
    """``jax.default_backend()`` ("cpu", "neuron", ...). This initialises JAX's backends."""
    import jax

    return jax.default_backend()


# ---------------------------------------------------------------------- environment


def neuron_env(
    lnc: int = DEFAULT_LNC,
    *,
    compile_cache: str | None = DEFAULT_COMPILE_CACHE,
    extra_cc_flags: Sequence[str] = (),
    efa: bool = True,
    root_comm_id: str | None = None,
    visible_cores: str | None = None,
) -> dict[str, str]:
    """The Neuron compiler/runtime variables of a trn2 training process (before JAX starts).

    Args:
      lnc: logical NeuronCore size, 1 or 2 (2 = default: 64 JAX devices per trn2.48xlarge).
      compile_cache: NEURON_COMPILE_CACHE_URL (a local path or s3://...); None to leave unset.
      extra_cc_flags: appended to NEURON_CC_FLAGS; undocumented ``--internal-*`` flags rejected.
      efa: set ``FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1`` for multi-node collectives.
      root_comm_id: NEURON_RT_ROOT_COMM_ID (``host:port`` of rank 0), needed with collectives
        across processes; `trn_accum.cluster.distributed` derives it from the launcher.
      visible_cores: NEURON_RT_VISIBLE_CORES (e.g. "0-63"), to restrict this process's cores.

    ``NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS`` is not set: from Neuron 2.31 it no longer
    enables asynchronous execution and emits a deprecation warning (the announcement "Neuron no
    longer supports implicit asynchronous mode starting with Neuron 2.31.0",
    about-neuron/announcements/neuron2.x/announce-no-support-implicit-async-mode); the framework
    uses the explicit async APIs (neuron-runtime/guides/how-to-migrate-async-apis).
    """
    lnc = check_lnc(lnc)
    flags = NEURON_CC_FLAGS.split()
    for f in extra_cc_flags:
        if f.startswith("--internal-"):
            raise ValueError(
                f"compiler flag {f} is undocumented (--internal-*): use documented neuronx-cc flags"
            )
        flags.append(f)
    explicit = cc_flags_lnc(" ".join(flags))
    if explicit is not None and explicit != str(lnc):
        raise ValueError(
            f"compiler flag --lnc={explicit} disagrees with lnc={lnc}: the compiler and the "
            "runtime must use the same logical NeuronCore size"
        )
    env = {
        "NEURON_CC_FLAGS": " ".join(flags),
        "NEURON_LOGICAL_NC_CONFIG": str(lnc),
        "NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU": "1",
    }
    if compile_cache:
        env["NEURON_COMPILE_CACHE_URL"] = compile_cache
    if efa:
        env["FI_PROVIDER"] = "efa"
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    if root_comm_id:
        env["NEURON_RT_ROOT_COMM_ID"] = root_comm_id
    if visible_cores:
        env["NEURON_RT_VISIBLE_CORES"] = visible_cores
    return env


# Every spelling of the compiler's LNC flag, with `=` or a space: ``--lnc``,
# ``--logical-nc-config`` and ``-lnc`` (the neuronx-cc command-line reference documents
# ``--logical-nc-config <n>`` / ``-lnc <n>``; ``--lnc`` is the spelling this package wrote
# before and that users' NEURON_CC_FLAGS may still carry, so it is read and rewritten too).
_LNC_FLAG = re.compile(r"(?:^|(?<=\s))(?:--lnc|--logical-nc-config|-lnc)(?:=|\s+)(\S+)")


def cc_flags_lnc(flags: str) -> str | None:
    """The value of an explicit LNC flag in a NEURON_CC_FLAGS string (last one wins), or None.

    Any of ``--lnc``, ``--logical-nc-config``, ``-lnc``, with ``=`` or a space (`_LNC_FLAG`).
    A bad value is compiler error NCC_EARG001; through the framework the runtime's
    ``NEURON_LOGICAL_NC_CONFIG`` decides, and the two must agree.
    """
    found = _LNC_FLAG.findall(flags or "")
    return found[-1] if found else None


def with_cc_lnc(flags: str, lnc: int) -> str:
    """`flags` with every explicit LNC flag (any spelling) set to `lnc`; others unchanged."""

    def _set(m: re.Match) -> str:
        start = m.start(1) - m.start(0)
        return m.group(0)[:start] + str(lnc)

    return _LNC_FLAG.sub(_set, flags)


def lnc_setting(environ: Mapping[str, str] | None = None) -> int:
    """The one logical-core size of this job, from `environ` (default ``os.environ``).

    ``NEURON_LOGICAL_NC_CONFIG`` when set; else an explicit ``--lnc`` in ``NEURON_CC_FLAGS``;
    else 2, the trn2 default (Neuron docs, "Logical NeuronCore configuration"). ValueError in one
    line when both are set and disagree: a program compiled for one core size does not run on
    the other.
    """
    env = os.environ if environ is None else environ
    runtime = (env.get("NEURON_LOGICAL_NC_CONFIG") or "").strip()
    compiler = cc_flags_lnc(env.get("NEURON_CC_FLAGS", ""))
    if runtime and compiler is not None and runtime != compiler:
        written = list(_LNC_FLAG.finditer(env.get("NEURON_CC_FLAGS", "")))[-1].group(0).strip()
        raise ValueError(
            f"NEURON_LOGICAL_NC_CONFIG={runtime} but NEURON_CC_FLAGS has {written}: the "
            "compiler and the runtime must use the same logical NeuronCore size; set one of "
            "them (trn-accum neuron-env sets both from NEURON_LOGICAL_NC_CONFIG)"
        )
    value = runtime or compiler or str(DEFAULT_LNC)
    try:
        return check_lnc(value)
    except ValueError:
        source = "NEURON_LOGICAL_NC_CONFIG" if runtime else "the LNC flag in NEURON_CC_FLAGS"
        raise ValueError(
            f"{source}={value}: must be 1 or 2 (logical NeuronCore size on trn2)"
        ) from None


def _kernel_older_than(release: str, major: int, minor: int) -> bool:
    parts = release.split(".")
    try:
        return (int(parts[0]), int(parts[1].split("-")[0])) < (major, minor)
    except (IndexError, ValueError):
        return False


def trn2_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Everything a trn2 job exports before `trn-accum train` starts: the Neuron variables of
    `neuron_env`, `JAX_PLATFORMS=neuron,cpu`, and the compile caches on shared storage. A value
    already in `environ` (default `os.environ`) wins, so any of them can be overridden.

    `trn-accum neuron-env` prints this as shell `export` lines; `launch/env/trn2.sh` (Slurm and
    the EKS pods) evaluates them, and `trn_accum.cluster.distributed.initialize` applies the
    same values on Neuron, so the three cannot drift apart. Shared storage:
    `TRN_ACCUM_SHARED_DIR` (default `$SLURM_SUBMIT_DIR/runs`, else `./runs`), caches under
    `TRN_ACCUM_CACHE_DIR` (default `<shared>/cache`): `NEURON_COMPILE_CACHE_URL` =
    `<cache>/neuron` (a path or s3://...), `JAX_COMPILATION_CACHE_DIR` = `<cache>/jax`.
    `FI_EFA_FORK_SAFE=1` only on kernels older than 5.15 (EFA docs).
    """
    env = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}

    def keep(key: str, default: str) -> str:
        out[key] = env.get(key) or default
        return out[key]

    base = env.get("SLURM_SUBMIT_DIR") or os.getcwd()
    shared = keep("TRN_ACCUM_SHARED_DIR", os.path.join(base, "runs"))
    cache = keep("TRN_ACCUM_CACHE_DIR", os.path.join(shared, "cache"))
    keep("JAX_PLATFORMS", "neuron,cpu")
    lnc = lnc_setting(env)
    for key, value in neuron_env(lnc, compile_cache=None).items():
        keep(key, value)
    # One setting drives both: an explicit --lnc the user put in NEURON_CC_FLAGS follows it.
    out["NEURON_LOGICAL_NC_CONFIG"] = str(lnc)
    out["NEURON_CC_FLAGS"] = with_cc_lnc(out["NEURON_CC_FLAGS"], lnc)
    keep("NEURON_COMPILE_CACHE_URL", os.path.join(cache, "neuron"))
    keep("JAX_COMPILATION_CACHE_DIR", os.path.join(cache, "jax"))
    if env.get("FI_EFA_FORK_SAFE"):
        out["FI_EFA_FORK_SAFE"] = env["FI_EFA_FORK_SAFE"]
    elif _kernel_older_than(os.uname().release, 5, 15):
        out["FI_EFA_FORK_SAFE"] = "1"
    return out


def apply_env(env: Mapping[str, str], *, overwrite: bool = False) -> dict[str, str]:
    """Set `env` in ``os.environ``; values the user already set win unless `overwrite`.

    Returns what was set. Call before JAX initialises its backends.
    """
    applied = {}
    for k, v in env.items():
        if overwrite or k not in os.environ:
            os.environ[k] = v
            applied[k] = v
    return applied


def configure_prng(platform: str | None = None) -> str:
    """Select the PRNG for `platform` (default: "neuron" if ``neuron_available()``) and return
    JAX's default PRNG implementation name afterwards.

    On Neuron: ``rbg`` (Threefry is not fully supported there: JAX NeuronX known issues).
    Elsewhere the current setting is left alone (``threefry2x32`` unless the user changed it).
    """
    import jax

    if platform is None:
        platform = "neuron" if neuron_available() else "other"
    if platform == "neuron":
        jax.config.update("jax_default_prng_impl", "rbg")
    return str(jax.config.jax_default_prng_impl)


def peak_flops_per_device(platform: str | None = None, lnc: int | None = None) -> float | None:
    """Dense BF16 peak FLOP/s of one JAX device (`device_peak_flops`), or None when unknown
    (CPU, GPU, ...). `platform` None = ``jax.default_backend()`` (initialises JAX's backends);
    "neuron" or "trn2" count; `lnc` None = `lnc_setting()` (the one reader of the LNC)."""
    if platform is None:
        platform = current_platform()
    if platform.lower() not in ("neuron", "trn2"):
        return None
    if lnc is None:
        lnc = lnc_setting()
    return device_peak_flops(lnc)


# ---------------------------------------------------------------------- trn2 links
#
# The three link classes a collective on trn2 can cross, slowest last, with the bandwidth one
# JAX device gets in one direction when every device of the chip / node communicates at once
# (what the rings of a sharded training step do) and a per-hop latency. One convention for all
# three: a published link figure is the bandwidth of each direction (a ring step sends and
# receives at once, each at that rate), shared by the devices behind the link; memory is the
# exception only in what it counts: a byte moved through HBM is read once and written once.
# Sources (AWS):
# - Trainium2 architecture (about-neuron/arch/neuron-hardware/trainium2): 2.9 TB/s of HBM per
#   chip (the trn2 instance table: 46.4 TB/s for 16 chips); the logical cores of one chip
#   exchange data through that memory: one read and one write per byte moved (so /2), shared
#   by the chip's 8 / LNC devices.
# - Amazon EC2 Trn2 architecture (about-neuron/arch/neuron-hardware/trn2-arch): 16 chips in a
#   4x4 2D torus, "Intra-instance NeuronLink-v3 bandwidth" 1,024 GB/s per chip, taken per
#   direction, shared by the chip's devices.
# - The same table: "EFAv3 bandwidth" 3,200 Gbps per trn2.48xlarge (400 GB/s), taken per
#   direction, shared by the node's 64 devices (128 / LNC).
# - Training best practices (training/best-practices): keep tensor parallelism (TP4) within a
#   chip, FSDP over NeuronLink between chips, EFA between instances: the three classes here.
# - Per-hop latencies, from the Neuron collectives deep dives: a Ring/KangaRing hop within a
#   node costs about 1-2 us, depending on HBM load ("Intra-node Collective Communications",
#   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/explore/intranode-collective-comm.html),
#   taken as 1 us between the cores of a chip and 2 us over NeuronLink; a hop over EFA costs
#   about 15 us ("Inter-node Collective Communications",
#   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/explore/internode-collective-comm.html).
#   They matter only for small messages. The floor and the achieved links
#   (`trn_accum.analysis.platforms`) use the same ones.

LINK_CHIP = "chip"  # logical cores of one Trainium2 chip (the `model` axis at LNC=2)
LINK_NODE = "node"  # NeuronLink-v3 between the 16 chips of one trn2.48xlarge
LINK_EFA = "efa"  # EFAv3 between trn2.48xlarge instances
LINK_CLASSES = (LINK_CHIP, LINK_NODE, LINK_EFA)  # fastest to slowest

TRN2_CHIP_HBM_BYTES_S = 2.9e12
TRN2_CHIP_NEURONLINK_BYTES_S = 1024e9
TRN2_NODE_EFA_BYTES_S = 3200e9 / 8
HOP_CHIP_S = 1e-6  # per ring hop between the logical cores of one chip
HOP_NODE_S = 2e-6  # per ring hop over NeuronLink
HOP_EFA_S = 15e-6  # per ring hop over EFA


def devices_per_chip(lnc: int = DEFAULT_LNC) -> int:
    """JAX devices of one Trainium2 chip: 8 physical cores / LNC (4 at LNC=2)."""
    return TRN2_CORES_PER_CHIP // check_lnc(lnc)


def trn2_links(lnc: int = DEFAULT_LNC) -> dict[str, dict[str, float]]:
    """{link class: {"bytes_per_s": per device and direction, "latency_s": per hop}}."""
    per_chip, per_node = devices_per_chip(lnc), devices_per_node(lnc)
    return {
        LINK_CHIP: {"bytes_per_s": TRN2_CHIP_HBM_BYTES_S / 2 / per_chip, "latency_s": HOP_CHIP_S},
        LINK_NODE: {
            "bytes_per_s": TRN2_CHIP_NEURONLINK_BYTES_S / per_chip,
            "latency_s": HOP_NODE_S,
        },
        LINK_EFA: {"bytes_per_s": TRN2_NODE_EFA_BYTES_S / per_node, "latency_s": HOP_EFA_S},
    }
