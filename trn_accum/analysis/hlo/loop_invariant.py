"""Loop-invariant work a compiler moves out of a loop, for the memory estimate
(`trn_accum.analysis.live_bytes`): what it computes once before the loop, whose results then
live through the whole loop beside the loop state.

The rule is XLA's while-loop-invariant code motion (openxla/xla,
`WhileLoopInvariantCodeMotion`, a pass of the TPU and GPU pipelines). An instruction of a loop
body is invariant when every operand is: loop state the body hands back unchanged at the same
index, a constant, or an invariant instruction. An invariant instruction is hoisted unless

- it is not worth hoisting on its own (`NOT_WORTH_HOISTING`): it stays in the loop, still
  invariant for the instructions that read it;
- its result is larger than its operands together (the pass's size-inflation limit): then
  neither it nor anything that reads it is invariant;
- it communicates, draws random numbers or calls out (`VARIES`).

What the TPU compiler did with the trainer's step (libtpu 0.0.42.1, `xla_dump_to` of the
compile of `benchmarks/target_memory.py`'s rows): in a k > 1 step the bfloat16 copy of every
float32 weight is made once, before the accumulation loop, and held through it (for the
vocab-131072 step, `convert(state.params.embed)` is an element of the loop state), and the
float32 copy of a bfloat16 value is not hoisted. A loop that runs once has no loop left to
hoist out of (XLA removes it), so the caller asks only for loops that run more than once.
Identical hoisted instructions are one result (common-subexpression elimination).

A limit of the estimate: it hoists out of the outermost loop that runs more than once only.
Work an inner loop would hoist is, where it reads the outer loop's unchanged state too,
hoisted on out of the outer one and merged there with the outer loop's own copy (the loss
chunk loop's bfloat16 copy of the embedding table is the accumulation loop's); work invariant
in an inner loop alone is counted in it, each iteration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trn_accum.analysis.hlo.ir import Instruction

__all__ = [
    "NOT_WORTH_HOISTING",
    "STATE",
    "VARIES",
    "Keys",
    "invariance",
    "is_hoisted",
    "operand_bytes",
    "parameter_invariance",
]

#: Invariant instructions the pass leaves in the loop (`NotWorthHoistingIndividually`): moving
#: them alone would only keep them from fusing into the work in the loop.
NOT_WORTH_HOISTING = frozenset(
    "constant reshape bitcast broadcast iota reverse slice transpose tuple".split()
)
#: Never invariant: collectives, random numbers, host transfers, nested control flow.
VARIES = frozenset(
    """all-reduce all-gather reduce-scatter all-to-all collective-permute rng rng-bit-generator
    rng-get-and-update-state infeed outfeed send recv while conditional""".split()
)
#: Names of buffers, not work: they pass their operand's invariance through. A `copy` in the
#: module the partitioner hands on changes no layout (none is assigned yet), and XLA's algebraic
#: simplifier replaces such a copy by its operand.
_NAMES = frozenset({"bitcast", "reshape", "opt-barrier", "get-tuple-element", "tuple", "copy"})
STATE, CONSTANT = 2, 1


class Keys:
    """One small number per distinct invariant computation (opcode, type, attributes, the
    operands' numbers), so that the same work reached twice (a layer's forward and its
    recomputation under remat, through two calls) is hoisted once."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def of(self, ins: Instruction, operands: Sequence[int]) -> int:
        attrs = tuple(sorted((k, v) for k, v in ins.attrs.items() if k != "metadata"))
        literal = ins.operand_text if ins.opcode == "constant" else ""
        key = (ins.opcode, ins.type_text.split("{")[0], attrs, literal, tuple(operands))
        return self._ids.setdefault(key, len(self._ids))


def invariance(
    ins: Instruction,
    operands: Sequence,
    operand_bytes: int,
    keys: Keys,
):
    """The invariance of `ins` given its operands' (`operands`, in order; `operand_bytes`: the
    bytes of its operands): None where it varies from one iteration to the next, else
    (kind, key) with kind STATE (reads loop state) or CONSTANT (constants only) and key its
    `Keys` number; a list of those for a tuple. A loop body's parameter and a called
    computation's parameters are the caller's to give (`parameter_invariance`)."""
    op = ins.opcode
    if op == "get-tuple-element":
        value = operands[0]
        return value[int(ins.attrs["index"])] if isinstance(value, list) else value
    if op == "tuple":
        return list(operands)
    if op in _NAMES or ins.names_sharding_only:
        return operands[0]
    if op in VARIES or op == "custom-call":
        return None
    flat = _flat(operands)
    if any(x is None for x in flat):
        return None
    if op != "constant" and ins.result_bytes > operand_bytes:
        return None  # size-inflating: left in the loop, and so is what reads it
    kind = max((x[0] for x in flat), default=CONSTANT)
    return (kind, keys.of(ins, [x[1] for x in flat]))


def parameter_invariance(arity: int, carried: frozenset[int]) -> list:
    """A loop body's parameter (a tuple of `arity` elements): the elements in `carried` (handed
    back unchanged at the same index) are loop state, the rest vary."""
    return [(STATE, -1 - e) if e in carried else None for e in range(arity)]


def is_hoisted(ins: Instruction, inv) -> bool:
    """Whether the pass computes `ins` (of invariance `inv`) once before the loop: it reads loop
    state only through invariant work and is worth hoisting on its own."""
    if not isinstance(inv, tuple) or inv[0] != STATE:
        return False
    return ins.opcode not in NOT_WORTH_HOISTING and ins.opcode not in _NAMES


def operand_bytes(ins: Instruction, sizes: Mapping[str, int]) -> int:
    """The bytes of the operands of `ins` (`sizes`: result bytes by instruction name)."""
    return sum(sizes.get(o.split("#")[0], 0) for o in ins.operands)


def _flat(value) -> list:
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [value]
