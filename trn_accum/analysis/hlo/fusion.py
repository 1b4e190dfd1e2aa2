"""What an accelerator compiler fuses, as the memory estimate (`trn_accum.analysis.live_bytes`)
and the step-time pricing (`roofline`, `pricing`) model it: an elementwise-like instruction
read only by instructions that take fused inputs has no buffer of its own, and its work is
done inside its readers.

Readers are counted after call inlining (XLA's `CallInliner` runs before fusion in every
pipeline): an instruction a `call` reads is read by what the callee does with that parameter,
so the mask and the fill of a `jnp.where` (a call of a `select`) fuse into the select, and a
callee's result tuple is a name: an element is read where the caller reads it (a forward's
elementwise residual, read by the backward's dots, fuses into them).
"""

from __future__ import annotations

from collections.abc import Sequence

from trn_accum.analysis.hlo.ir import Computation, Instruction
from trn_accum.analysis.hlo.module import HloModule
from trn_accum.analysis.hlo.text import tuple_arity

__all__ = [
    "CONSUMERS",
    "FUSIBLE",
    "add_root_readers",
    "call_result_readers",
    "fused_into_users",
    "reader_opcodes",
]

FUSIBLE = frozenset(
    """abs add and atan2 broadcast cbrt ceil clamp compare concatenate constant convert cosine
    divide dynamic-slice erf exponential exponential-minus-one floor iota is-finite log
    log-plus-one logistic maximum minimum multiply negate not or pad power reduce-precision
    remainder reverse round-nearest-afz round-nearest-even rsqrt select sign sine slice sqrt
    subtract tan tanh transpose xor bitcast-convert shift-left shift-right-arithmetic
    shift-right-logical""".split()
)
CONSUMERS = FUSIBLE | {"reduce", "dot", "dynamic-update-slice", "reshape", "bitcast"}


def fused_into_users(ins: Instruction, user_opcodes: Sequence[str]) -> bool:
    """Whether a backend fuses `ins` into its users: elementwise-like and read only by ops that
    take fused inputs."""
    return ins.opcode in FUSIBLE and bool(user_opcodes) and set(user_opcodes) <= CONSUMERS


def reader_opcodes(
    module: HloModule, name: str, memo: dict | None = None
) -> dict[str, tuple[str, ...]]:
    """The opcodes that read each instruction of computation `name` of `module`, by name; for
    a `call`, those that read the callee's parameter in its place. `memo`: computations done
    (a dict the caller keeps to share work between calls)."""
    memo = {} if memo is None else memo
    if name in memo:
        return memo[name]
    comps = module.computations
    readers: dict[str, list[str]] = {}
    for ins in comps[name].instructions:
        callee = ins.attr("to_apply", "").lstrip("%") if ins.opcode == "call" else ""
        if callee not in comps:
            for op in ins.operands:
                readers.setdefault(op.split("#")[0], []).append(ins.opcode)
            continue
        inner = reader_opcodes(module, callee, memo)
        params = {
            int(x.operand_text.strip() or 0): x.name
            for x in comps[callee].instructions
            if x.opcode == "parameter"
        }
        for j, op in enumerate(ins.operands):
            readers.setdefault(op.split("#")[0], []).extend(inner.get(params.get(j, ""), ()))
    memo[name] = {k: tuple(v) for k, v in readers.items()}
    return memo[name]


def call_result_readers(comp: Computation, call: Instruction, readers) -> list | tuple:
    """What reads the result of `call` in `comp` (`readers`: `reader_opcodes` of `comp`): per
    element for a tuple (the readers of each get-tuple-element, or of `%call#i`), else its
    readers."""
    if not call.is_tuple:
        return tuple(readers.get(call.name, ()))
    out: list[list[str]] = [[] for _ in range(tuple_arity(call.type_text))]
    for x in comp.instructions:
        if x.opcode == "get-tuple-element" and x.operands == (call.name,):
            out[int(x.attrs["index"])].extend(readers.get(x.name, ()))
            continue
        for op in x.operands:
            base, sep, i = op.rpartition("#")
            if sep and base == call.name:
                out[int(i)].append(x.opcode)
            elif op == call.name:
                for r in out:
                    r.append(x.opcode)
    return [tuple(r) for r in out]


def add_root_readers(readers: dict, root: Instruction, root_readers) -> dict:
    """`readers` of a called computation with its caller's readers of the result added
    (`call_result_readers`): to a root tuple's elements, each its own, in place of the tuple."""
    out = dict(readers)
    if isinstance(root_readers, list) and root.opcode == "tuple":
        for j, op in enumerate(root.operands):
            name = op.split("#")[0]
            own = list(out.get(name, ()))
            own.remove("tuple")
            out[name] = (*own, *root_readers[j])
        return out
    flat = [o for r in root_readers for o in r] if isinstance(root_readers, list) else root_readers
    out[root.name] = (*out.get(root.name, ()), *flat)
    return out
