"""Peak live bytes of an HLO module in its own dtypes: a target's footprint read from the module
the SPMD partitioner hands every backend (`trn_accum.analysis.hlo.partitioned`), before XLA:CPU's
float normalization widens bf16 arithmetic to float32.

The model, per computation (calls inlined, as XLA inlines them before fusing), in the order
of a memory-minimizing list scheduler (XLA's ListMemoryScheduler's rule: of the ready
instructions, the one that frees the most bytes net of what it allocates):

- each instruction's result is a buffer, allocated when it is computed and freed after its last
  use; a computation's root stays to its end; entry parameters stay to the end unless donated
  (the header's `input_output_alias`), then they are freed after their last use;
- no bytes of their own: tuple, get-tuple-element, bitcast, reshape, opt-barrier, the
  partitioner's sharding custom-calls (they name buffers, not new ones), and a
  dynamic-update-slice (written in place into its first operand);
- fusion as an accelerator compiler does it: an elementwise-like instruction (arithmetic,
  convert, broadcast, iota, constant, slices, transpose, pad, concatenate) all of whose users
  consume fused inputs (elementwise-like, reduce, dot, dynamic-update-slice) has no buffer; its
  inputs stay alive until those users run;
- a `while` adds its body's peak above the loop state (a body frees a state element once it
  is dead); loop state XLA takes out of a loop has no buffer: an element the body only hands
  back and nothing reads, a broadcast of a constant the body only hands back (constant
  sinking), any initial broadcast of a loop that runs once (the loop is inlined; a zero
  accumulator fuses into its first sum); a conditional adds its largest branch's peak;
- work a loop body does on loop state it hands back unchanged is done once, before the loop
  (`trn_accum.analysis.hlo.loop_invariant`: XLA's loop-invariant code motion), and its results
  that work left in the loop reads live through the whole loop (a k > 1 step holds the
  bfloat16 copy of the weights through its accumulation loop);
- calls are inlined first (`trn_accum.analysis.hlo.fusion`): what a `call` reads is read by what
  its callee does with it, and an element of a callee's result tuple by what the caller does
  with it (a `jnp.where`'s mask fuses into its select; a forward's elementwise residual into
  the backward's dots that read it).

It is an estimate, not a schedule: a compiler may reorder, rematerialize or keep more. It is
checked against the TPU compiler's own figure (benchmarks/target_memory.py, docs/dry-run.md).
Imports nothing but the HLO parser.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

from trn_accum.analysis.hlo import loop_invariant as licm
from trn_accum.analysis.hlo.fusion import (
    CONSUMERS,
    FUSIBLE,
    add_root_readers,
    call_result_readers,
    fused_into_users,
    reader_opcodes,
)
from trn_accum.analysis.hlo.ir import Computation, Instruction
from trn_accum.analysis.hlo.module import HloModule, parse_hlo
from trn_accum.analysis.hlo.text import parse_type, split_top_level, tuple_arity

__all__ = ["donated_parameters", "peak_live_bytes"]

_ALIAS = frozenset({"tuple", "get-tuple-element", "bitcast", "reshape", "opt-barrier"})
_SINKABLE = frozenset({"broadcast", "constant", "iota"})


def donated_parameters(module: HloModule) -> frozenset[int]:
    """Entry parameter numbers the header's `input_output_alias` gives to outputs."""
    alias = module.header.get("input_output_alias", "")
    return frozenset(int(n) for n in re.findall(r"\(\s*(\d+)\s*,\s*\{[^}]*\}", alias))


def peak_live_bytes(module: HloModule | str) -> int:
    """Peak bytes live at once in the entry computation of `module` (parsed, or HLO text), with
    everything it calls (see the module docstring). Per device for a partitioned module."""
    if isinstance(module, str):
        module = parse_hlo(module)
    donated = donated_parameters(module)
    return _Walker(module).peak(module.entry, donated)[0]


class _Walker:
    """Peaks of the computations of one module, each computed once."""

    def __init__(self, module: HloModule):
        self.module = module
        self.peak = functools.cache(self._peak)
        self.invariant = functools.cache(self._invariant)
        self.runs_once = functools.cache(self._runs_once)
        self.users = functools.partial(reader_opcodes, module, memo={})

    def _find(self, name: str) -> Instruction | None:
        try:
            return self.module.instruction(name)
        except KeyError:
            return None

    def _runs_once(self, cond: str) -> bool:
        """Whether a loop of condition `cond` runs once: `counter < 1` (a scan of length 1;
        its counter starts at 0)."""
        root = self.module.computations[cond].root
        if root is None or root.opcode != "compare" or root.attr("direction") != "LT":
            return False
        bound = self._find(root.operands[-1].split("#")[0])
        return bound is not None and bound.opcode == "constant" and bound.operand_text == "1"

    def _invariant(self, body: str) -> tuple[frozenset[int], frozenset[int]]:
        """(loop state elements `body` hands back unchanged at the same index, those of them
        it reads)."""
        comp = self.module.computations[body]
        root = comp.root
        if root is None or root.opcode != "tuple":
            return frozenset(), frozenset()
        param = next((x.name for x in comp.instructions if x.opcode == "parameter"), None)
        carried = set()
        for i, op in enumerate(root.operands):
            src = self._find(op)
            if src is not None and src.opcode == "get-tuple-element" and src.operands == (param,):
                if int(src.attrs["index"]) == i:
                    carried.add(i)
        arity = len(root.operands)
        return frozenset(carried), frozenset(_read(comp, param, arity) & carried)

    def _peak(self, name: str, freeable: frozenset[int] | bool, hoists: bool = False):
        """(peak bytes including the parameters, parameter bytes) of computation `name`.
        `freeable`: parameter numbers freed after their last use (True: all). `hoists`: `name`
        is the body of a loop that runs more than once, whose invariant work is hoisted."""
        comp = self.module.computations[name]
        carried = self.invariant(name)[0] if hoists else None
        return _Sweep(self, comp, freeable, carried).run()


class _Sweep:
    """One pass over one computation, calls inlined (XLA inlines them before fusing): buffers,
    their lives, and each step's extra peak (a loop body's)."""

    def __init__(self, walker: _Walker, comp: Computation, freeable, carried=None):
        self.walker, self.comp, self.freeable = walker, comp, freeable
        self.carried = carried  # a loop body's unchanged state elements; None: no hoisting
        self.keys = licm.Keys()
        self.hoisted: dict[int, frozenset] = {}  # a hoisted result's key -> its value
        self.hoisted_fusible: dict[int, bool] = {}  # its buffers -> fused where only hoisted
        self.read_in_loop: set[int] = set()  # buffers read by work left in the loop
        self.size: list[int] = []
        self.born: list[int] = []
        self.last: list[int] = []
        self.pinned: set[int] = set()
        self.extra: list[int] = []
        self.param_bytes = 0
        self._param = False
        self.origin: list[str] = []  # the opcode that made each buffer
        self._opcode = ""

    def run(self) -> tuple[int, int]:
        root, _ = self._inline(self.comp, None, ())
        self.pinned.update(_leaves(root))
        for b, fusible in self.hoisted_fusible.items():
            if b in self.read_in_loop:  # an input of the loop: live all through it
                self.born[b] = 0
                self.pinned.add(b)
            elif fusible:  # fused into the hoisted work that reads it
                self.size[b] = 0
        n = len(self.extra)
        delta = [0] * (n + 1)
        for b, s in enumerate(self.size):
            delta[self.born[b]] += s
            if b not in self.pinned:
                delta[self.last[b] + 1] -= s
        live, peak = 0, 0
        for i in range(n):
            live += delta[i]
            peak = max(peak, live + self.extra[i])
        return peak, self.param_bytes

    def _inline(self, comp: Computation, args, root_users: Sequence[str], args_inv=None):
        """Walk `comp` (its parameters bound to `args`, of invariance `args_inv`; None: this
        sweep's own parameters); returns its root's (value, invariance). `root_users`: the
        opcodes that use the root (the call's)."""
        values: dict[str, object] = {}
        invs: dict[str, object] = {}
        hoisting = self.carried is not None  # invariance matters only in a hoisting body
        sizes = {x.name: x.result_bytes for x in comp.instructions} if hoisting else {}
        users = self.walker.users(comp.name)
        root = comp.root
        if root is not None:
            users = add_root_readers(users, root, root_users)
        for ins in _schedule(comp, users):
            names = [] if ins.opcode == "constant" else ins.operands
            ops = [_lookup(values, o) for o in names]
            inv_ops = [_lookup(invs, o) for o in names] if hoisting else []
            inv = self._invariance(ins, inv_ops, args_inv, sizes) if hoisting else None
            invs[ins.name] = inv
            hoisted = hoisting and licm.is_hoisted(ins, inv)
            if hoisted and inv[1] in self.hoisted:  # the same work, hoisted once
                values[ins.name] = self.hoisted[inv[1]]
                continue
            i = len(self.extra)
            self.extra.append(0)
            for v in ops:
                for b in _leaves(v):
                    self.last[b] = max(self.last[b], i)
                    if not hoisted:
                        self.read_in_loop.add(b)
            fused = bool(users.get(ins.name)) and set(users[ins.name]) <= CONSUMERS
            if ins.opcode == "parameter" and args is not None:
                values[ins.name] = args[int(ins.operand_text.strip() or 0)]
            elif ins.opcode == "while":
                self._unmaterialize(ins, ops[0], comp)
                values[ins.name], self.extra[i] = self._value(ins, ops, i, False)
            elif ins.opcode == "call":
                callee = self.walker.module.computations[ins.attr("to_apply").lstrip("%")]
                values[ins.name], invs[ins.name] = self._inline(
                    callee,
                    ops,
                    call_result_readers(comp, ins, users),
                    [_lookup(invs, o) for o in names],
                )
            elif hoisted:  # a result of its own before the loop
                self._opcode = ins.opcode
                values[ins.name] = self.hoisted[inv[1]] = self._new(ins.type_text, i)
                for b in values[ins.name]:
                    self.hoisted_fusible[b] = fused and ins.opcode in FUSIBLE
            else:
                fused = fused and (ins is not root or args is not None)
                values[ins.name], self.extra[i] = self._value(ins, ops, i, fused)
        if root is None:
            return frozenset(), None
        return values[root.name], invs[root.name]

    def _invariance(self, ins: Instruction, operands: list, args_inv, sizes: dict):
        """`licm.invariance` of `ins` in this sweep; a parameter's from the caller (`args_inv`)
        or, for this sweep's own, from the loop's unchanged state (None outside a loop body)."""
        if ins.opcode == "parameter":
            if args_inv is not None:
                return args_inv[int(ins.operand_text.strip() or 0)]
            if self.carried is None:
                return None
            return licm.parameter_invariance(tuple_arity(ins.type_text), self.carried)
        if ins.opcode == "call":
            return None  # the callee's root's, set by `_inline`
        return licm.invariance(ins, operands, licm.operand_bytes(ins, sizes), self.keys)

    def _unmaterialize(self, loop: Instruction, state, comp: Computation) -> None:
        """Loop state that XLA takes out of a loop has no buffer: an element the body hands
        back unchanged and nothing reads (the while-loop simplifier drops it), or a
        broadcast of a constant the body hands back unchanged (constant sinking moves it into
        the body, where it fuses into its users)."""
        if not isinstance(state, list):
            return
        carried, read = self.walker.invariant(loop.attr("body").lstrip("%"))
        dead = carried - read - _read(comp, loop.name, tuple_arity(loop.type_text))
        if self.walker.runs_once(loop.attr("condition").lstrip("%")):
            carried = frozenset(range(len(state)))  # inlined: an initial broadcast fuses
        for e in carried:
            for b in _leaves(state[e]) if e < len(state) else ():
                if self.origin[b] == "parameter":  # the caller's: live outside the loop anyway
                    continue
                if e in dead or self.origin[b] in _SINKABLE:
                    self.size[b] = 0

    def _new(self, type_text: str, i: int, pinned: bool = False):
        """Fresh buffers for a result of `type_text` (a tuple type: one value per element)."""
        t = re.sub(r"/\*.*?\*/", "", type_text).strip()
        if t.startswith("("):
            return [self._new(e, i, pinned) for e in split_top_level(t[1:-1]) if e.strip()]
        b = len(self.size)
        self.size.append(sum(a.nbytes for a in parse_type(t)))
        self.born.append(0 if self._param else i)
        self.origin.append(self._opcode)
        self.last.append(i)
        if pinned:
            self.pinned.add(b)
        return frozenset({b})

    def _value(self, ins: Instruction, ops: Sequence, i: int, fused: bool):
        """(the value `ins` defines, its extra bytes above the live set while it runs)."""
        op = self._opcode = ins.opcode
        if op == "parameter":
            num = int(ins.operand_text.strip() or 0)
            free = self.freeable is True or (self.freeable is not False and num in self.freeable)
            self._param = True  # a parameter is live from the start, wherever it is listed
            value = self._new(ins.type_text, i, pinned=not free)
            self._param = False
            self.param_bytes += sum(self.size[b] for b in _leaves(value))
            return value, 0
        if op == "get-tuple-element":
            v = ops[0]
            return (v[int(ins.attrs["index"])] if isinstance(v, list) else v), 0
        if op == "tuple":
            return list(ops), 0
        if op in _ALIAS or op == "dynamic-update-slice" or ins.names_sharding_only:
            return ops[0], 0
        if op == "while":
            once = self.walker.runs_once(ins.attr("condition").lstrip("%"))
            hoists = not once and self.carried is None  # an inner loop's goes on out of this
            body = self.walker.peak(ins.attr("body").lstrip("%"), True, hoists)
            return ops[0], body[0] - body[1]
        if op == "conditional":
            called = [c for c in ins.called_computations if c in self.walker.module.computations]
            inner = [self.walker.peak(c, False) for c in called]
            return self._new(ins.type_text, i), max((p - q for p, q in inner), default=0)
        if op in FUSIBLE and fused:
            return frozenset(b for v in ops for b in _leaves(v)), 0
        return self._new(ins.type_text, i), 0


def _schedule(comp: Computation, users: Mapping[str, Sequence[str]]) -> list[Instruction]:
    """`comp`'s instructions in the order of a list scheduler that minimizes memory (XLA's
    ListMemoryScheduler's rule): of the instructions whose operands are computed, the one that
    frees the most bytes net of what it allocates, first listed on a tie. A recomputed layer
    (remat) allocates and frees nothing, so it waits until the backward op that needs it.
    `users`: the opcodes that read each instruction (`_Walker.users`)."""
    ins_list = comp.instructions
    by_name = {ins.name: ins for ins in ins_list}
    pos = {ins.name: i for i, ins in enumerate(ins_list)}
    operands = {ins.name: _operands(ins, by_name) for ins in ins_list}
    user_ops: dict[str, list[str]] = {}
    for ins in ins_list:
        for o in operands[ins.name]:
            user_ops.setdefault(o, []).append(ins.opcode)
    own = {ins.name: _own_bytes(ins, users.get(ins.name, ())) for ins in ins_list}
    users_left = {name: len(u) for name, u in user_ops.items()}
    deps_left = {name: len(ops) for name, ops in operands.items()}
    users_of: dict[str, list[str]] = {}
    for name, ops in operands.items():
        for o in ops:
            users_of.setdefault(o, []).append(name)
    ready = {name for name, n in deps_left.items() if n == 0}
    out = []
    while ready:

        def gain(name):
            freed = sum(own[o] for o in operands[name] if users_left[o] == 1)
            return (freed - own[name], -pos[name])

        name = max(ready, key=gain)
        ready.remove(name)
        out.append(by_name[name])
        for o in operands[name]:
            users_left[o] -= 1
        for u in users_of.get(name, []):
            deps_left[u] -= 1
            if deps_left[u] == 0:
                ready.add(u)
    return out


def _operands(ins: Instruction, defined: Mapping[str, Instruction]) -> list[str]:
    """The distinct instructions `ins` reads, by name (`%t#i` read as `t`), among `defined`."""
    if ins.opcode == "constant":  # its literal is not an operand
        return []
    names = (o.split("#")[0] for o in ins.operands)
    return list(dict.fromkeys(n for n in names if n in defined))


def _own_bytes(ins: Instruction, user_opcodes: Sequence[str]) -> int:
    """Bytes `ins` allocates for the scheduler: none for names of other buffers and for a
    fused elementwise op (see the module docstring), else its result."""
    op = ins.opcode
    if op in _ALIAS or op in ("parameter", "dynamic-update-slice", "while"):
        return 0
    if ins.names_sharding_only or fused_into_users(ins, user_opcodes):
        return 0
    return ins.result_bytes


def _read(comp: Computation, name: str, arity: int) -> set[int]:
    """Elements of the tuple `name` (of `arity` elements) that `comp` reads other than to hand
    them back unchanged at the same index of its root tuple (all, if it uses the tuple whole)."""
    root = comp.root
    index: dict[str, int] = {}  # reads of one element, by name
    for x in comp.instructions:
        if x.opcode == "get-tuple-element" and x.operands == (name,):
            index[x.name] = int(x.attrs["index"])
    read: set[int] = set()
    for x in comp.instructions:
        for j, op in enumerate(x.operands):
            base, sep, i = op.rpartition("#")  # jaxlib >= 0.11: `%t#i` reads element i
            if sep and base == name:
                index[op] = int(i)
            elif op == name and x.opcode != "get-tuple-element":
                return set(range(arity))
            if op in index and not (x is root and x.opcode == "tuple" and j == index[op]):
                read.add(index[op])
    return read


def _lookup(values: dict, operand: str):
    if operand in values:
        return values[operand]
    base, _, index = operand.rpartition("#")  # jaxlib >= 0.11 prints `%t#i` for a GTE
    v = values[base]
    return v[int(index)] if isinstance(v, list) else v


def _leaves(value) -> list[int]:
    if isinstance(value, list):
        return [b for v in value for b in _leaves(v)]
    return list(value)
