"""The platforms the step-time model prices a train step on (`trn-accum dry-run --platform`).

One `Platform` per name: per JAX device its peak dense BF16 FLOP/s, HBM bandwidth and memory,
how devices sit in chips and nodes, the peak links (the `floor`: every byte at the link's
published rate) and the achieved links (what collectives reach: bus bandwidths and per-hop
latencies from the vendor's collective benchmarks, plus a fixed cost per collective), and the
op efficiencies of `trn_accum.analysis.pricing` (fitted on measured steps:
benchmarks/calibration.json says which rows fitted which constants).

trn2 facts stay in `trn_accum.neuron.platform` (their one home, sources there); this module
adds trn1 and TPU v5e and the achieved figures, each with its public source.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from trn_accum.analysis.pricing import Efficiency
from trn_accum.analysis.rates import Rates
from trn_accum.neuron import platform as neuron

__all__ = ["DEFAULT", "PLATFORMS", "Platform", "get"]

Links = Mapping[str, Mapping[str, float]]

# Achieved collective figures on Neuron (AWS Neuron documentation):
# - nccom-test user guide, tools/neuron-sys-tools/nccom-test
#   (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-sys-tools/nccom-test.html):
#   its example tables give bus bandwidths of about 53 GB/s with 2 ranks and 104 GB/s with 16
#   ranks within one instance, about 47 GB/s across 2 instances, and a floor of 58 us (within an
#   instance) to 520 us (across instances) per collective at small sizes;
# - per-hop latencies (about 1-2 us within a node, about 15 us over EFA: the Neuron collectives
#   deep dives) are `trn_accum.neuron.platform`'s HOP_* figures, shared with the peak links.
# Bus bandwidth is what one rank's ring moves per second (nccl-tests' definition, which
# nccom-test follows), i.e. `steptime.ring_time`'s bytes_per_s; a level never gets more than
# its peak share (min with the peak link).
NEURON_BUSBW_CHIP = 53e9
NEURON_BUSBW_NODE = 104e9
NEURON_BUSBW_EFA = 47e9
NEURON_FIXED_NODE_S = 58e-6
NEURON_FIXED_EFA_S = 520e-6


def _achieved(peak: Links, busbw: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Neuron's achieved links: min(peak, bus bandwidth), per-hop latency, fixed cost."""
    hop = {
        neuron.LINK_CHIP: neuron.HOP_CHIP_S,
        neuron.LINK_NODE: neuron.HOP_NODE_S,
        neuron.LINK_EFA: neuron.HOP_EFA_S,
    }
    fixed = {
        neuron.LINK_CHIP: NEURON_FIXED_NODE_S,
        neuron.LINK_NODE: NEURON_FIXED_NODE_S,
        neuron.LINK_EFA: NEURON_FIXED_EFA_S,
    }
    return {
        lk: {
            "bytes_per_s": min(peak[lk]["bytes_per_s"], busbw[lk]),
            "latency_s": hop[lk],
            "fixed_s": fixed[lk],
        }
        for lk in peak
    }


@dataclasses.dataclass(frozen=True)
class Platform:
    """One device kind. Figures per JAX device; `links` peak (the floor), `achieved_links`
    what collectives reach (with "fixed_s" per run); `efficiency`: `pricing.Efficiency`;
    `overlap`: how much of the shorter of ops and collectives runs hidden behind the other
    (`stepsummary.summarize`)."""

    name: str
    peak_flops: float
    hbm_bytes_s: float
    memory_gib: float
    devices_per_node: int
    devices_per_chip: int
    links: Links
    achieved_links: Links
    efficiency: Efficiency
    source: str
    overlap: float = 0.0  # share of min(ops, collectives) hidden behind the other

    def budget_gib(self, configured: float) -> float:
        """The fit budget: the config's trainer.memory_budget_gib, at most the device's memory."""
        return min(float(configured), self.memory_gib)


# What single ops reach on one TPU v5e chip, measured (`python3 benchmarks/op_rates.py --out
# benchmarks/op-rates-tpu-v5e.json`, TPU v5 lite, jax 0.10.2, 2026-12-07; tests/test_rates.py
# checks these against that file): a bf16 dot's share of the 197 TFLOP/s peak at each
# (M, N, K) of 128, 512, 2048, 8192 (TPU_V5E_DOT_TABLE[i][j][l]: M = grid[i], N = grid[j],
# K = grid[l]); an elementwise pass over 512 MiB reaches 0.731 of the 819 GB/s; a loop
# iteration costs 40.7 ns.
TPU_V5E_DOT_TABLE = (
    (
        (0.024, 0.063, 0.125, 0.171),
        (0.087, 0.170, 0.235, 0.305),
        (0.269, 0.257, 0.343, 0.413),
        (0.556, 0.315, 0.436, 0.465),
    ),
    (
        (0.082, 0.164, 0.230, 0.306),
        (0.413, 0.453, 0.501, 0.724),
        (0.702, 0.708, 0.807, 0.865),
        (0.676, 0.789, 0.853, 0.901),
    ),
    (
        (0.216, 0.235, 0.342, 0.415),
        (0.607, 0.717, 0.777, 0.867),
        (0.665, 0.861, 0.839, 0.910),
        (0.638, 0.873, 0.915, 0.910),
    ),
    (
        (0.379, 0.371, 0.436, 0.461),
        (0.657, 0.828, 0.871, 0.922),
        (0.663, 0.875, 0.931, 0.908),
        (0.205, 0.810, 0.919, 0.852),
    ),
)
TPU_V5E_RATES = Rates(
    dot_grid=(128, 512, 2048, 8192),
    dot_table=TPU_V5E_DOT_TABLE,
    bandwidth=0.731,
    loop_iter_s=4.07e-8,
    source="benchmarks/op-rates-tpu-v5e.json (benchmarks/op_rates.py on a TPU v5e, 2026-12-07)",
)

# The TPU v5e's prices: dots at the measured efficiency of their shape, the kernels no backend
# fuses at the measured bandwidth, loop iterations at their measured cost (TPU_V5E_RATES;
# `dot` and `memory` are not used with rates); two elementwise constants fitted
# (benchmarks/calibrate.py --fit tpu-v5e --free
# elementwise_bytes+loop_elementwise_bytes,offchip_elementwise_bytes, on the rows marked fitted
# in benchmarks/calibration.json): one for elementwise result bytes in and out of loops (a
# multiple of the HBM bandwidth, above 1 where fusion keeps bytes from HBM), and the extra for
# results too large for the core's on-chip memory. One rate in and out of loops, not two: the
# bytes outside loops are nearly the same in every row of a family (the optimizer update), so
# a rate of their own acted as a fitted intercept per family (19.37x the bandwidth on the same
# rows: --free elementwise_bytes,loop_elementwise_bytes,offchip_elementwise_bytes).
# The v5e core's vector memory (VMEM), where its compiler keeps buffers between kernels
# (memory space S(1) in the compiled HLO): 128 MiB ("How to Think About TPUs", the JAX scaling
# book, https://jax-ml.github.io/scaling-book/tpus/; memory spaces:
# https://openxla.org/xla/shapes#memory_space_identifiers).
TPU_V5E_VMEM_BYTES = 128 * 2**20
TPU_V5E_EFFICIENCY = Efficiency(
    dot=1.0,
    memory=math.inf,
    elementwise=3.762,
    loop_elementwise=3.762,
    kernel_s=0.0,
    loop_iter_s=TPU_V5E_RATES.loop_iter_s,
    rates=TPU_V5E_RATES,
    onchip_bytes=TPU_V5E_VMEM_BYTES,
    offchip_elementwise=3.546,
    source="dots, unfused kernels and loops measured on a TPU v5e (TPU_V5E_RATES); the elementwise "
    "rate and the off-chip extra fitted on the TPU v5e rows marked fitted in "
    "benchmarks/calibration.json",
)


# ---------------------------------------------------------------------------- trn2 (LNC=2)
_TRN2_PEAK_LINKS = neuron.trn2_links()
TRN2 = Platform(
    name="trn2",
    peak_flops=neuron.device_peak_flops(),
    hbm_bytes_s=neuron.TRN2_CHIP_HBM_BYTES_S / neuron.devices_per_chip(),
    memory_gib=neuron.device_memory_gib(),
    devices_per_node=neuron.devices_per_node(),
    devices_per_chip=neuron.devices_per_chip(),
    links=_TRN2_PEAK_LINKS,
    achieved_links=_achieved(
        _TRN2_PEAK_LINKS,
        {
            neuron.LINK_CHIP: NEURON_BUSBW_CHIP,
            neuron.LINK_NODE: NEURON_BUSBW_NODE,
            neuron.LINK_EFA: NEURON_BUSBW_EFA,
        },
    ),
    # No trn2 op profile is published. Dots: 33.08 % of peak, fitted on the AXLearn Llama-2
    # 70B row of benchmarks/calibration.json (benchmarks/calibrate.py --fit trn2 --free
    # dot_flops); its 7B row and the trn1 row are predicted. The other op efficiencies are the TPU
    # v5e's fit of 2026-12-06 (the fusion of elementwise bytes, fitted with dots at peak, before
    # the TPU's op rates were measured; kept as they were). Overlap 1: collectives run behind
    # compute (the Neuron runtime's compute-communication overlap,
    # https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/explore/compute-comm-overlap.html),
    # an assumption, not a fit.
    efficiency=Efficiency(
        dot=0.3308,
        memory=math.inf,
        elementwise=11.6,
        loop_elementwise=1.388,
        kernel_s=0.0,
        loop_iter_s=0.0,
        source="dot fitted on the AXLearn 70B trn2 row, the rest the TPU v5e's fit of 2026-12-06",
    ),
    overlap=1.0,
    source="trn_accum/neuron/platform.py (Trainium2 and Trn2 architecture pages)",
)

# ---------------------------------------------------------------------------- trn1
# Trainium architecture page (about-neuron/arch/neuron-hardware/trainium,
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html):
# a chip has 2 NeuronCore-v2, 190 dense BF16 TFLOP/s, 32 GiB at 820 GiB/s; Trn1 architecture
# page (trn1-arch): 16 chips per trn1.32xlarge, EFA 800 Gbps (trn1n: 1,600). One JAX device is
# one NeuronCore-v2. No NeuronLink-v2 bandwidth is published: the node link is the nccom-test
# bus bandwidth for both the floor and the achieved figure. Per-hop latencies: the achieved
# links use the Neuron collectives pages' figures (the HOP_* of `trn_accum.neuron.platform`;
# those pages cover Trn1 too); the floor's 2 / 5 / 20 us below are older assumptions, not cited.
# Calibration: the Trn1 training performance page's Llama-3.1-8B run (47.95 sequences/s on 32
# nodes, 21.36 s per step) is a predicted row of benchmarks/calibration.json; nothing is fitted
# on trn1.
TRN1_CHIP_PEAK_FLOPS = 190e12
TRN1_CHIP_HBM_BYTES_S = 820 * 2**30
TRN1_CHIP_HBM_GIB = 32.0
TRN1_CORES_PER_CHIP = 2
TRN1_CHIPS_PER_NODE = 16
TRN1_NODE_EFA_BYTES_S = 800e9 / 8
_TRN1_DEVICES = TRN1_CORES_PER_CHIP * TRN1_CHIPS_PER_NODE
_TRN1_PEAK_LINKS = {
    neuron.LINK_CHIP: {
        "bytes_per_s": TRN1_CHIP_HBM_BYTES_S / 2 / TRN1_CORES_PER_CHIP,
        "latency_s": 2e-6,
    },
    neuron.LINK_NODE: {"bytes_per_s": NEURON_BUSBW_NODE, "latency_s": 5e-6},
    neuron.LINK_EFA: {"bytes_per_s": TRN1_NODE_EFA_BYTES_S / _TRN1_DEVICES, "latency_s": 20e-6},
}
TRN1 = Platform(
    name="trn1",
    peak_flops=TRN1_CHIP_PEAK_FLOPS / TRN1_CORES_PER_CHIP,
    hbm_bytes_s=TRN1_CHIP_HBM_BYTES_S / TRN1_CORES_PER_CHIP,
    memory_gib=TRN1_CHIP_HBM_GIB / TRN1_CORES_PER_CHIP,
    devices_per_node=_TRN1_DEVICES,
    devices_per_chip=TRN1_CORES_PER_CHIP,
    links=_TRN1_PEAK_LINKS,
    achieved_links=_achieved(
        _TRN1_PEAK_LINKS,
        {
            neuron.LINK_CHIP: NEURON_BUSBW_CHIP,
            neuron.LINK_NODE: NEURON_BUSBW_NODE,
            neuron.LINK_EFA: NEURON_BUSBW_EFA,
        },
    ),
    efficiency=dataclasses.replace(TRN2.efficiency, source="trn2's (nothing fitted on trn1)"),
    overlap=TRN2.overlap,
    source="Trainium and Trn1 architecture pages (AWS Neuron documentation)",
)

# ---------------------------------------------------------------------------- TPU v5e
# Cloud TPU v5e page (https://cloud.google.com/tpu/docs/v5e): per chip 197 BF16 TFLOP/s,
# 16 GB of HBM2 at 819 GB/s, one TensorCore (one JAX device per chip), 8 chips per host,
# inter-chip interconnect 1,600 Gbps (200 GB/s), 2 x 100 Gbps NICs per host for the
# data-centre network between hosts. Usable on one chip: 16,909,336,064 B (15.75 GiB), what JAX
# reports (jax.local_devices()[0].memory_stats()["bytes_limit"], the rows of
# benchmarks/measured-tpu-v5e.json) and what the TPU compiler's refusals name ("of 15.75G
# hbm"). A single device needs no links.
TPU_V5E_PEAK_FLOPS = 197e12
TPU_V5E_HBM_BYTES_S = 819e9
TPU_V5E_MEMORY_GIB = 16_909_336_064 / 2**30
TPU_V5E_CHIPS_PER_HOST = 8
_TPU_LINKS = {
    neuron.LINK_CHIP: {"bytes_per_s": TPU_V5E_HBM_BYTES_S / 2, "latency_s": 1e-6},
    neuron.LINK_NODE: {"bytes_per_s": 1600e9 / 8, "latency_s": 2e-6},
    neuron.LINK_EFA: {"bytes_per_s": 2 * 100e9 / 8 / TPU_V5E_CHIPS_PER_HOST, "latency_s": 15e-6},
}
TPU_V5E = Platform(
    name="tpu-v5e",
    peak_flops=TPU_V5E_PEAK_FLOPS,
    hbm_bytes_s=TPU_V5E_HBM_BYTES_S,
    memory_gib=TPU_V5E_MEMORY_GIB,
    devices_per_node=TPU_V5E_CHIPS_PER_HOST,
    devices_per_chip=1,
    links=_TPU_LINKS,
    achieved_links=_TPU_LINKS,
    efficiency=TPU_V5E_EFFICIENCY,
    source="https://cloud.google.com/tpu/docs/v5e",
)

PLATFORMS = {p.name: p for p in (TRN2, TRN1, TPU_V5E)}
DEFAULT = TRN2.name


def get(name: str) -> Platform:
    """The platform called `name`; ValueError naming the known ones otherwise."""
    try:
        return PLATFORMS[name]
    except KeyError:
        raise ValueError(f"platform {name!r}: known platforms are {', '.join(PLATFORMS)}") from None
