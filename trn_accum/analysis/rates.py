"""What a chip achieves per op, measured: a dot's share of peak by its shape, the share of the
HBM bandwidth an elementwise pass reaches, and the fixed cost of a loop iteration
(`benchmarks/op_rates.py` measures them; `trn_accum.analysis.platforms` holds a platform's).

Stdlib only.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from trn_accum.analysis.hlo.module import HloModule, Instruction

__all__ = ["Rates", "dot_efficiency", "dot_shape"]


@dataclasses.dataclass(frozen=True)
class Rates:
    """What a platform achieves, measured: `dot_grid` the sizes (M, N and K alike) at which
    `dot_table[i][j][l]` (share of peak for M = grid[i], N = grid[j], K = grid[l]) was measured;
    `bandwidth` the share of the HBM bandwidth an elementwise pass reaches; `loop_iter_s` the
    fixed cost of one `while` iteration; `tile` the matrix unit's side; `source`."""

    dot_grid: tuple[int, ...]
    dot_table: tuple[tuple[tuple[float, ...], ...], ...]
    bandwidth: float
    loop_iter_s: float
    tile: int = 128
    source: str = ""

    def __post_init__(self):
        n = len(self.dot_grid)
        if (
            any(len(a) != n or any(len(b) != n for b in a) for a in self.dot_table)
            or len(self.dot_table) != n
        ):
            raise ValueError(f"dot_table must be {n} x {n} x {n} for a grid of {n} sizes")


def _bracket(grid: Sequence[int], x: float) -> tuple[int, int, float]:
    """(i, j, w): x between grid[i] and grid[j] at weight w of grid[j], in log2, clamped."""
    lx = math.log2(min(max(x, grid[0]), grid[-1]))
    j = min(max(bisect.bisect_left(grid, 2**lx), 1), len(grid) - 1)
    i = j - 1
    lo, hi = math.log2(grid[i]), math.log2(grid[j])
    return i, j, (lx - lo) / (hi - lo)


def dot_efficiency(rates: Rates, batch: int, m: int, n: int, k: int) -> float:
    """Share of peak of a dot of this shape: the measured table interpolated in log2 of each
    size (clamped to the grid), the batch folded into M (a batched product runs its matrices
    one after the other; `benchmarks/op_rates.py` measures attention's to check this)."""
    g = rates.dot_grid
    (i0, i1, wi), (j0, j1, wj), (l0, l1, wl) = (
        _bracket(g, max(1, batch) * m),
        _bracket(g, n),
        _bracket(g, k),
    )
    t = rates.dot_table
    out = 0.0
    for i, a in ((i0, 1 - wi), (i1, wi)):
        for j, b in ((j0, 1 - wj), (j1, wj)):
            for l, c in ((l0, 1 - wl), (l1, wl)):
                out += a * b * c * t[i][j][l]
    return out


def dot_shape(module: HloModule, ins: Instruction) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot: batch and contracting sizes from its dimension numbers, m
    the rest of the left operand, n the rest of the result (zeros if the shapes are unknown)."""
    ops = module.operand_instructions(ins)
    if not ops or not ops[0].shapes or not ins.shapes:
        return (0, 0, 0, 0)
    lhs = ops[0].shapes[0].dims

    def dims(key):
        return [int(x) for x in ins.attrs.get(key, "").strip("{}").split(",") if x.strip()]

    batch = math.prod(lhs[i] for i in dims("lhs_batch_dims") if i < len(lhs))
    k = math.prod(lhs[i] for i in dims("lhs_contracting_dims") if i < len(lhs))
    m = math.prod(lhs) // max(1, batch * k)
    n = ins.shapes[0].size // max(1, batch * m)
    return (batch, m, n, k)
