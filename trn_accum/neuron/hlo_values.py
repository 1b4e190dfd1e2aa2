"""Following values through an HLO module: from a use to the instruction that produced it.

`Resolver(module).origin(ins)` looks through copies, bitcasts, reshapes, converts, broadcasts,
fusion and call boundaries (their roots and parameters) and tuple elements, so a rule of the
Neuron preflight (`trn_accum.neuron.preflight`) sees what a value is, whichever way XLA wrapped
it. `static_trip_count` tells a loop with a static trip count from one without.
"""

from __future__ import annotations

from trn_accum.analysis.hlo import module as hlo_lib

PASS_THROUGH = frozenset({"copy", "bitcast", "reshape", "convert", "broadcast"})


class Resolver:
    """Follows values through fusions, tuples and pass-through ops to their origin."""

    def __init__(self, mod: hlo_lib.HloModule):
        self.mod = mod
        self._callers: dict[str, list[hlo_lib.Instruction]] = {}
        for ins in mod.instructions():
            if ins.opcode in ("fusion", "call"):
                for c in ins.called_computations:
                    self._callers.setdefault(c, []).append(ins)
        self._local = {
            c.name: {i.name: i for i in c.instructions} for c in mod.computations.values()
        }

    def operand(self, ins: hlo_lib.Instruction, i: int) -> hlo_lib.Instruction | None:
        if i >= len(ins.operands):
            return None
        return self._local.get(ins.computation, {}).get(ins.operands[i])

    def origin(
        self,
        ins: hlo_lib.Instruction | None,
        depth: int = 0,
        through: frozenset[str] = PASS_THROUGH,
    ) -> hlo_lib.Instruction | None:
        """The instruction that produces `ins`'s value, looking through the ops of `through`
        (copies, converts, ...), fusion roots and fusion parameters (within one fusion nest; a
        loop parameter stops the walk)."""
        while ins is not None and depth < 64:
            depth += 1
            if ins.opcode in through:
                ins = self.operand(ins, 0)
            elif ins.opcode in ("fusion", "call"):
                callee = next(iter(ins.called_computations), None)
                comp = self.mod.computations.get(callee) if callee else None
                if comp is None or comp.root is None:
                    return ins
                ins = comp.root
            elif ins.opcode == "parameter":
                callers = self._callers.get(ins.computation)
                if not callers or len(callers) != 1:
                    return ins
                try:
                    index = int(ins.operand_text.strip())
                except ValueError:
                    return ins
                ins = self.operand(callers[0], index)
            elif ins.opcode == "get-tuple-element":
                src = self.origin(self.operand(ins, 0), depth, through)
                if src is not None and src.opcode == "tuple":
                    ins = self.operand(src, int(ins.attrs.get("index", "0")))
                else:
                    return ins
            else:
                return ins
        return ins

    def is_constant(self, ins: hlo_lib.Instruction | None) -> bool:
        o = self.origin(ins)
        return o is not None and (o.opcode == "constant" or o.opcode == "iota")

    def loop_element(self, ins: hlo_lib.Instruction | None) -> int | None:
        """Tuple index k when `ins` is get-tuple-element(loop parameter, k), else None."""
        o = self.origin(ins)
        if o is None or o.opcode != "get-tuple-element":
            return None
        src = self.origin(self.operand(o, 0))
        if src is None or src.opcode != "parameter":
            return None
        return int(o.attrs.get("index", "0"))


def static_trip_count(mod: hlo_lib.HloModule, res: Resolver, w: hlo_lib.Instruction) -> bool:
    """Whether the `while` `w` runs a static number of times: XLA proved its trip count, or it
    has the scan shape (see `trn_accum.neuron.preflight`)."""
    if w.trip_count is not None:
        return True
    cond = mod.computations.get(w.attrs.get("condition", "").strip().lstrip("%"))
    body = mod.computations.get(w.attrs.get("body", "").strip().lstrip("%"))
    if cond is None or body is None or cond.root is None or body.root is None:
        return False
    cmp = res.origin(cond.root)
    if cmp is None or cmp.opcode != "compare" or len(cmp.operands) != 2:
        return False
    a, b = res.operand(cmp, 0), res.operand(cmp, 1)
    k = res.loop_element(a) if res.is_constant(b) else res.loop_element(b)
    if k is None or not (res.is_constant(a) or res.is_constant(b)):
        return False
    root = res.origin(body.root)
    if root is None or root.opcode != "tuple":
        return False
    step = res.origin(res.operand(root, k))
    if step is None or step.opcode not in ("add", "subtract"):
        return False
    x, y = res.operand(step, 0), res.operand(step, 1)
    if not (
        (res.loop_element(x) == k and res.is_constant(y))
        or (res.loop_element(y) == k and res.is_constant(x))
    ):
        return False
    init = res.origin(res.operand(w, 0))
    if init is None or init.opcode != "tuple":
        return False
    return res.is_constant(res.operand(init, k))
