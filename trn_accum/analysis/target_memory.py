"""A step's per-device memory on the platform it is planned for, not on XLA:CPU.

XLA:CPU's `memory_analysis()` (the dry-run's emulated devices) keeps bf16 temporaries in
float32 (its float normalization widens bf16 arithmetic) and moves with the jaxlib version.
The fit check reads, in this order:

1. The platform's own compiler where it is at hand. For a TPU that is libtpu: with the `libtpu`
   package installed, `jax.experimental.topologies` describes a TPU slice without a chip, and
   the step lowered on that slice's devices compiles with the TPU compiler on this host
   (deviceless ahead-of-time compilation). Its `memory_analysis()` gives the chip's figures,
   and of them the compiler's peak (`compiled_peak`) is the footprint; where the step does
   not fit, the compiler refuses it and its message gives the bytes it asked ("Used 20.41G of
   15.75G hbm"), taken as the footprint.
2. Elsewhere (trn2: the Neuron compiler runs on a trn2 host only; a TPU without libtpu): the
   peak live bytes of the module the SPMD partitioner hands the backend, in the program's own
   dtypes (`trn_accum.analysis.live_bytes`).

Nothing here builds a step: `tpu_footprint` takes a function that lowers one on given devices.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Sequence
from typing import Any

from trn_accum.analysis.hlo.module import HloModule
from trn_accum.analysis.live_bytes import peak_live_bytes
from trn_accum.analysis.memory import compiled_memory, footprint

__all__ = [
    "backend_peak",
    "compiled_peak",
    "estimate",
    "refused_bytes",
    "tpu_devices",
    "tpu_footprint",
]

#: TPU v5e slices by chip count: (topology name, chips per host), one host each.
V5E_SLICES = {1: ("v5e:1x1", (1, 1, 1)), 4: ("v5e:2x2", (2, 2, 1)), 8: ("v5e:2x4", (2, 4, 1))}

SOURCE_TPU = "TPU compiler (libtpu, compiled without a chip)"
SOURCE_ESTIMATE = "estimate: peak live bytes of the partitioned module, its own dtypes"

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_ASKED = (  # the two forms of libtpu's refusal: what it asked, then what the chip has
    re.compile(r"Used\s+([\d.]+)([KMGT]?)\s+of\s+[\d.]+[KMGT]?\s+hbm"),
    re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM"),
)


def refused_bytes(message: str) -> int | None:
    """The bytes a TPU compiler's out-of-memory refusal asked for, None if `message` is not
    one. Its two forms: "Ran out of memory in memory space hbm. Used 20.41G of 15.75G hbm"
    and (libtpu 0.0.42) "Ran out of memory on HBM, the total memory required for HLO
    temporaries (19.27G) exceeds available HBM (15.75G)" (binary units: G = 2**30 bytes).
    The second counts temporaries only: a lower bound of the footprint."""
    for pattern in _ASKED:
        m = pattern.search(message)
        if m is not None:
            return round(float(m.group(1)) * _UNITS[m.group(2)])
    return None


def tpu_devices(platform_name: str, n_devices: int) -> Sequence[Any] | None:
    """Devices of a TPU slice of `n_devices` chips described without a chip, or None where
    that is not at hand here: not a TPU platform, no libtpu installed, a chip count with no
    one-host slice (`V5E_SLICES`), or libtpu refusing the description."""
    if platform_name != "tpu-v5e" or n_devices not in V5E_SLICES:
        return None
    if importlib.util.find_spec("libtpu") is None:
        return None
    from jax.experimental import topologies

    name, per_host = V5E_SLICES[n_devices]
    try:
        topo = topologies.get_topology_desc(
            topology_name=name, platform="tpu", chips_per_host_bounds=list(per_host)
        )
    except Exception:  # libtpu present but not usable on this host: fall back to the estimate
        return None
    return list(topo.devices)


def tpu_footprint(lower: Callable[[Sequence[Any]], Any], devices: Sequence[Any]) -> int:
    """Per-device bytes of the step the TPU compiler makes: `lower(devices)` returns the step
    lowered on `devices` (`tpu_devices`); the compiler's own peak (`compiled_peak`), or the
    bytes its out-of-memory refusal asked for. Any other compile error is raised."""
    lowered = lower(devices)
    try:
        compiled = lowered.compile()
    except Exception as e:
        asked = refused_bytes(str(e))
        if asked is None:
            raise
        return asked
    return backend_peak(compiled)


def compiled_peak(stats: Any, mem: dict[str, int] | None) -> int | None:
    """The peak bytes a compiled program holds at once: the compiler's own figure
    (`peak_memory_in_bytes` of its memory analysis, where it reports one), else arguments +
    outputs - aliased + temporaries (`memory.footprint`), which takes every temporary as live
    at once with the arguments. The TPU compiler's peak is what the chip's limit holds: the
    chip ran three steps whose sum is above its 16,909,336,064 bytes (docs/dry-run.md)."""
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0) if stats is not None else 0
    return peak if peak > 0 else footprint(mem)


def backend_peak(compiled: Any) -> int | None:
    """`compiled_peak` of a compiled program on the backend that compiled it (None where it
    reports no memory analysis): the TPU compiler's peak on a TPU, the sum on XLA:CPU (whose
    analysis has no peak)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # a backend without memory analysis
        stats = None
    return compiled_peak(stats, compiled_memory(compiled))


def estimate(
    platform_name: str,
    partitioned: str | HloModule,
    lower: Callable[[Sequence[Any]], Any] | None = None,
    n_devices: int = 1,
) -> dict[str, Any]:
    """{"bytes", "source"}: the platform's compiler's figure where `tpu_devices` finds one
    (and `lower` is given), else the peak live bytes of `partitioned` (the module after the
    SPMD partitioner, `trn_accum.analysis.hlo.partitioned`: its text, or parsed)."""
    devices = tpu_devices(platform_name, n_devices) if lower is not None else None
    if devices is not None:
        return {"bytes": tpu_footprint(lower, devices), "source": SOURCE_TPU}
    return {"bytes": peak_live_bytes(partitioned), "source": SOURCE_ESTIMATE}
