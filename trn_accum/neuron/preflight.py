"""Neuron preflight: read a compiled HLO module and flag what the Neuron compiler rejects.

``preflight(hlo_text)`` reads an HLO module (``compiled.as_text()`` of a program compiled on
CPU, or the unoptimised ``lowered.as_text(dialect="hlo")``) with `trn_accum.analysis.hlo.module` and
reports, against the limitations listed on the Neuron docs page "JAX NeuronX Known Issues":

blockers
  ``conditional``      any ``conditional`` (``lax.cond``/``switch``, ``optax.apply_if_finite``,
                       ``optax.MultiSteps``)
  ``host-callback``    custom-calls to host callbacks (``jax.debug.print``, ``pure_callback``,
                       ``io_callback``, ``checkify``) and host send/recv/infeed/outfeed
  ``dynamic-loop``     a ``while`` without a static trip count (``lax.while_loop`` with a
                       data-dependent bound, ``fori_loop`` with traced bounds)
  ``complex``          a value of type c64/c128
  ``float64``          a value of type f64 (``jax_enable_x64``)
  ``integer-dot``      a ``dot``/``convolution`` on integer operands
warnings
  ``dus-in-loop``      ``dynamic-update-slice`` at a non-constant index inside a rolled loop
                       (``lax.scan`` stacking its outputs ``ys``, or a scanned layer stack saving
                       residuals); older compilers accepted only constant indices
  ``threefry``         Threefry PRNG ops while the configured PRNG is rbg (e.g. ``fold_in`` or
                       ``split`` of an rbg key, which JAX implements with Threefry)
  ``custom-call``      a custom-call to an unrecognised target (a CPU library kernel, say)
  ``reduce-precision`` a ``reduce-precision`` op (listed unsupported by Neuron) that changes its
                       operand; one that rounds a value to its own type's bits is the identity,
                       emitted by remat for every saved residual, and is not lowered for Neuron
                       (`trn_accum.neuron.lowering`), so it is not a finding

Static trip counts. In compiled HLO XLA annotates every loop whose trip count it can prove with
``backend_config={"known_trip_count":{"n":"5"}, ...}`` — a fixed-length ``lax.scan`` or a
``fori_loop`` with Python-int bounds gets it, a ``lax.while_loop`` whose condition reads data
does not. Unoptimised HLO has no such annotation, so a loop without it is also accepted when it
has the scan shape: the condition compares one tuple element (the induction variable) with a
constant, the body adds a constant to that element, and the loop starts it at a constant.

Threefry is recognised by its key-schedule constant 0x1BD11BDA (present whether or not the
threefry function was inlined), by computations named ``threefry*`` and by threefry custom-calls.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from trn_accum.analysis.hlo import module as hlo_lib
from trn_accum.neuron import lowering

BLOCKER = "blocker"
WARNING = "warning"

_THREEFRY_PARITY = 0x1BD11BDA  # 466688986: Threefry's key-schedule constant
_HOST_CALLBACK_TARGET = re.compile(r"callback|host_?transfer|outfeed|infeed", re.IGNORECASE)
# Custom-call targets that are partitioner/layout annotations, not kernels.
_BENIGN_CUSTOM_CALLS = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "LayoutConstraint",
        "X64Combine",
        "X64SplitLow",
        "X64SplitHigh",
        "AllocateBuffer",
        "annotate_device_placement",
        "xla.sdy.FuncResultSharding",
        "xla.sdy.GlobalToLocalShape",
        "xla.sdy.LocalToGlobalShape",
    }
)
_INT_TYPES = frozenset(
    {"s2", "s4", "s8", "s16", "s32", "s64", "u2", "u4", "u8", "u16", "u32", "u64"}
)
_COMPLEX_TYPES = frozenset({"c64", "c128"})
_PASS_THROUGH = frozenset({"copy", "bitcast", "reshape", "convert", "broadcast"})


@dataclasses.dataclass(frozen=True)
class Finding:
    """One preflight result. `source` is the JAX op path from the HLO metadata (op_name) when
    present; `count` how many instructions share this rule and source."""

    severity: str
    rule: str
    message: str
    instruction: str
    computation: str
    source: str | None = None
    count: int = 1

    def __str__(self) -> str:
        where = f" [{self.source}]" if self.source else ""
        many = f" (x{self.count})" if self.count > 1 else ""
        return f"{self.severity}: {self.rule}: {self.message}{where}{many}"


_MESSAGES = {
    "conditional": "conditional (lax.cond/switch, optax.apply_if_finite, optax.MultiSteps) is not "
    "supported by Neuron: select with jnp.where instead",
    "host-callback": "host callback {detail} is not supported by Neuron: remove jax.debug.print, "
    "pure_callback, io_callback and checkify from the step",
    "dynamic-loop": "while loop without a static trip count is not supported by Neuron: use "
    "lax.scan or fori_loop with Python-int bounds",
    "complex": "complex value ({detail}) is not supported by Neuron: keep computations real",
    "float64": "float64 value is not supported by Neuron: disable jax_enable_x64 or cast to "
    "float32",
    "integer-dot": "integer {detail} is not supported by Neuron: compute it in float",
    "dus-in-loop": "dynamic-update-slice at a loop index inside a rolled loop (scan outputs or "
    "saved residuals) may be rejected by the Neuron compiler: return a reduced carry instead, "
    "or unroll",
    "threefry": "Threefry PRNG ops while the configured PRNG is {detail}: Threefry is not fully "
    "supported by Neuron (fold_in/split of rbg keys use it); check the compile on Neuron",
    "custom-call": "custom-call {detail} may not exist on Neuron (a CPU library kernel?)",
    "reduce-precision": "reduce-precision is listed unsupported by Neuron",
}
_SEVERITY = {
    "conditional": BLOCKER,
    "host-callback": BLOCKER,
    "dynamic-loop": BLOCKER,
    "complex": BLOCKER,
    "float64": BLOCKER,
    "integer-dot": BLOCKER,
    "dus-in-loop": WARNING,
    "threefry": WARNING,
    "custom-call": WARNING,
    "reduce-precision": WARNING,
}


def _identity_rounding(ins: hlo_lib.Instruction, dtypes: set[str]) -> bool:
    """A reduce-precision to at least its own type's exponent and mantissa bits (remat's, on
    every residual): `trn_accum.neuron.lowering.is_identity`."""
    bits = (ins.attrs.get("exponent_bits"), ins.attrs.get("mantissa_bits"))
    if None in bits or len(dtypes) != 1:
        return False
    return lowering.is_identity(next(iter(dtypes)), int(bits[0]), int(bits[1]))


def _op_name(ins: hlo_lib.Instruction) -> str | None:
    meta = ins.attrs.get("metadata")
    if not meta:
        return None
    m = re.search(r'op_name="([^"]*)"', meta)
    return m.group(1) if m else None


class _Resolver:
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

    def origin(self, ins: hlo_lib.Instruction | None, depth: int = 0) -> hlo_lib.Instruction | None:
        """The instruction that produces `ins`'s value, looking through copies, fusion roots and
        fusion parameters (within one fusion nest; a loop parameter stops the walk)."""
        while ins is not None and depth < 64:
            depth += 1
            if ins.opcode in _PASS_THROUGH:
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
                src = self.origin(self.operand(ins, 0), depth)
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


def _static_trip_count(mod: hlo_lib.HloModule, res: _Resolver, w: hlo_lib.Instruction) -> bool:
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


def preflight(hlo_text: str | hlo_lib.HloModule, *, prng_impl: str | None = None) -> list[Finding]:
    """Neuron-compatibility findings for an HLO module (see the module docstring for rules).

    Args:
      hlo_text: HLO text (``compiled.as_text()`` preferred) or a parsed ``HloModule``.
      prng_impl: the PRNG the run is configured with ("rbg", "unsafe_rbg", "threefry2x32");
        None = JAX's current ``jax_default_prng_impl``. Threefry ops are reported only when it
        is rbg or unsafe_rbg.

    Returns findings, blockers first, one per (rule, JAX op path) with a count (instructions
    without an op path are counted in the first finding of their rule).
    """
    mod = hlo_text if isinstance(hlo_text, hlo_lib.HloModule) else hlo_lib.parse_hlo(hlo_text)
    if prng_impl is None:
        import jax

        prng_impl = str(jax.config.jax_default_prng_impl)
    res = _Resolver(mod)
    raw: list[tuple[str, str, hlo_lib.Instruction]] = []  # (rule, detail, instruction)
    threefry_seen: hlo_lib.Instruction | None = None

    for ins in mod.instructions():
        op = ins.opcode
        dtypes = ins.dtypes
        if op == "conditional":
            raw.append(("conditional", "", ins))
        elif op == "custom-call":
            target = ins.attr("custom_call_target") or ""
            if _HOST_CALLBACK_TARGET.search(target):
                raw.append(("host-callback", target, ins))
            elif "threefry" in target.lower():
                threefry_seen = threefry_seen or ins
            elif target not in _BENIGN_CUSTOM_CALLS:
                raw.append(("custom-call", target, ins))
        elif op in ("send", "recv", "send-done", "recv-done", "infeed", "outfeed"):
            if op in ("infeed", "outfeed") or "is_host_transfer=true" in ins.line:
                raw.append(("host-callback", op, ins))
        elif op == "while":
            if not _static_trip_count(mod, res, ins):
                raw.append(("dynamic-loop", "", ins))
        elif op in ("dot", "convolution"):
            operand_types = set()
            for i in range(len(ins.operands)):
                o = res.operand(ins, i)
                if o is not None:
                    operand_types |= o.dtypes
            if (dtypes | operand_types) & _INT_TYPES:
                raw.append(("integer-dot", op, ins))
        elif op == "dynamic-update-slice" and mod.in_loop(ins):
            if not all(res.is_constant(res.operand(ins, i)) for i in range(2, len(ins.operands))):
                raw.append(("dus-in-loop", "", ins))
        elif op == "reduce-precision" and not _identity_rounding(ins, dtypes):
            raw.append(("reduce-precision", "", ins))
        elif (
            op == "constant"
            and "u32" in dtypes
            and ins.operand_text.strip() == str(_THREEFRY_PARITY)
        ):
            threefry_seen = threefry_seen or ins
        if op not in ("tuple", "get-tuple-element", "parameter", "while", "call"):
            # tuples/loops only carry values produced elsewhere; report the producers
            if dtypes & _COMPLEX_TYPES:
                raw.append(("complex", "/".join(sorted(dtypes & _COMPLEX_TYPES)), ins))
            if "f64" in dtypes:
                raw.append(("float64", "", ins))
    if threefry_seen is None:
        for name in mod.computations:
            if "threefry" in name.lower() and name in mod.reachable:
                comp = mod.computations[name]
                threefry_seen = comp.root
                break
    if threefry_seen is not None and prng_impl in ("rbg", "unsafe_rbg"):
        raw.append(("threefry", prng_impl, threefry_seen))

    grouped: dict[tuple[str, str | None], Finding] = {}
    for rule, detail, ins in raw:
        source = _op_name(ins)
        key = (rule, source)
        if source is None:  # no JAX op path (XLA-made constants etc.): count with the rule
            key = next((k for k in grouped if k[0] == rule), key)
        if key in grouped:
            f = grouped[key]
            grouped[key] = dataclasses.replace(f, count=f.count + 1)
            continue
        grouped[key] = Finding(
            severity=_SEVERITY[rule],
            rule=rule,
            message=_MESSAGES[rule].format(detail=detail or _op_label(ins)),
            instruction=ins.name,
            computation=ins.computation,
            source=source,
        )
    order = {BLOCKER: 0, WARNING: 1}
    return sorted(grouped.values(), key=lambda f: (order[f.severity], f.rule))


def _op_label(ins: hlo_lib.Instruction) -> str:
    return f"{ins.opcode} %{ins.name}"


def blockers(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == BLOCKER]


def format_findings(findings: Sequence[Finding]) -> str:
    """One line per finding; "no Neuron preflight findings" when empty."""
    if not findings:
        return "no Neuron preflight findings"
    return "\n".join(str(f) for f in findings)
