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
  ``sort-comparator``  a ``sort`` whose comparator is not one LT/GT/LE/GE ``compare`` (a
                       multi-key ``lax.sort``: its comparator ORs compares); JAX's float
                       ordering (NaN and -0.0 canonicalised before one LT) is a plain compare
  ``philox``           a Philox PRNG (``rng-bit-generator`` with ``algorithm=rng_philox``, a
                       Philox multiplier constant, a ``philox`` custom-call): a blocker under
                       JAX 0.11.x (Neuron 2.34's JAX), a warning under others. XLA:CPU
                       expands every ``rng-bit-generator`` (rbg's ``rng_default`` too) into
                       Philox arithmetic: constants of an ``rng_bit_generator`` op path are
                       not counted, so read the module before optimization (the dry-run's)
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
  ``float-to-int``     a ``convert`` from a float to an integer type: Neuron rounds to nearest
                       where JAX truncates toward zero (``jnp.trunc`` before the cast restores
                       it); a value already whole (floor, ceil, round, trunc, an integer made
                       float) is not a finding
  ``top-k``            a ``topk`` op (or XLA's ``TopK`` custom-call): it fails on Neuron while
                       ``NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU=1`` is set

Static trip counts. In compiled HLO XLA annotates every loop whose trip count it can prove with
``backend_config={"known_trip_count":{"n":"5"}, ...}`` — a fixed-length ``lax.scan`` or a
``fori_loop`` with Python-int bounds gets it, a ``lax.while_loop`` whose condition reads data
does not. Unoptimised HLO has no such annotation, so a loop without it is also accepted when it
has the scan shape: the condition compares one tuple element (the induction variable) with a
constant, the body adds a constant to that element, and the loop starts it at a constant.

Neuron SDK 2.34's page (2026-11-13) adds the last four rules and the mesh-connectivity check of
`neuron-check` (`trn_accum.neuron.topology`).

Threefry is recognised by its key-schedule constant 0x1BD11BDA (present whether or not the
threefry function was inlined), by computations named ``threefry*`` and by threefry custom-calls.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from trn_accum.analysis.hlo import module as hlo_lib
from trn_accum.neuron import lowering
from trn_accum.neuron.hlo_values import PASS_THROUGH, Resolver, static_trip_count

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
# Philox's round multipliers (4x32: two; 2x32: one), absent from Threefry and rbg
_PHILOX_MULTIPLIERS = frozenset({str(0xD2511F53), str(0xCD9E8D57), str(0xD256D193)})
_PLAIN_DIRECTIONS = frozenset({"LT", "GT", "LE", "GE"})
_WHOLE_NUMBER_OPS = frozenset({"floor", "ceil", "round-nearest-even", "round-nearest-afz"})
_KEEP_VALUE = PASS_THROUGH - {"convert"}  # ops that move a value without changing it


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
    "float-to-int": "float -> integer convert ({detail}) rounds to nearest on Neuron where JAX "
    "truncates toward zero: apply jnp.trunc before the cast (jnp.trunc(x).astype(...))",
    "philox": "Philox PRNG ({detail}) is not supported by Neuron with JAX 0.11.x: use the rbg "
    'PRNG (jax.config.update("jax_default_prng_impl", "rbg"))',
    "sort-comparator": "sort comparator {detail} is not one LT/GT/LE/GE compare, the only "
    "comparators Neuron's sort takes: sort by one key (combine keys into one, or sort stably "
    "by each key in turn)",
    "top-k": "top_k ({detail}) fails on Neuron while NEURON_RUN_TRIVIAL_COMPUTATION_ON_CPU=1 is "
    "set: leave that variable unset for this program",
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
    "float-to-int": WARNING,
    "philox": BLOCKER,  # under JAX 0.11.x (`_severity`)
    "sort-comparator": BLOCKER,
    "top-k": WARNING,
}


def _severity(rule: str, jax_version: str) -> str:
    """A rule's severity; Philox is listed unsupported with JAX 0.11.x only."""
    if rule == "philox" and not jax_version.startswith("0.11."):
        return WARNING
    return _SEVERITY[rule]


def _whole(res: Resolver, ins: hlo_lib.Instruction | None, depth: int = 0) -> bool:
    """Whether the float value `ins` holds whole numbers by construction: a floor, ceil or
    round, an integer (or bool) made float, or a select between such values (jnp.trunc)."""
    o = res.origin(ins, through=_KEEP_VALUE)
    if o is None or depth > 8:
        return False
    if o.opcode in _WHOLE_NUMBER_OPS:
        return True
    if o.opcode == "convert":  # from an integer, or from another float that is whole
        src = res.operand(o, 0)
        if src is not None and src.dtypes and src.dtypes <= _INT_TYPES | {"pred"}:
            return True
        return _whole(res, src, depth + 1)
    if o.opcode == "select" and len(o.operands) == 3:
        return all(_whole(res, res.operand(o, i), depth + 1) for i in (1, 2))
    return False


def _plain_comparator(mod: hlo_lib.HloModule, res: Resolver, sort: hlo_lib.Instruction) -> str:
    """'' when the comparator of `sort` returns one LT/GT/LE/GE compare; else what it is."""
    name = (sort.attr("to_apply") or "").strip().lstrip("%")
    comp = mod.computations.get(name)
    if comp is None or comp.root is None:
        return ""  # not printed: nothing to judge
    root = res.origin(comp.root)
    direction = (root.attr("direction") or "") if root is not None else ""
    if root is not None and root.opcode == "compare" and direction in _PLAIN_DIRECTIONS:
        return ""
    what = f"compare {direction}" if direction else (root.opcode if root else "?")
    return f"%{name} (returns {what})"


def _neuron_234(
    mod: hlo_lib.HloModule, res: Resolver, ins: hlo_lib.Instruction
) -> tuple[str, str] | None:
    """(rule, detail) when `ins` is one of the known issues Neuron SDK 2.34 lists (the
    float-to-int, philox, sort-comparator and top-k rules), else None."""
    op = ins.opcode
    if op == "convert" and ins.dtypes and ins.dtypes <= _INT_TYPES:
        src = res.operand(ins, 0)
        floats = sorted(t for t in (src.dtypes if src else ()) if t.startswith(("f", "bf")))
        if floats and not _whole(res, src):
            return "float-to-int", f"{'/'.join(floats)} -> {'/'.join(sorted(ins.dtypes))}"
    elif op == "sort":
        detail = _plain_comparator(mod, res, ins)
        if detail:
            return "sort-comparator", detail
    elif op == "topk" or (op == "custom-call" and ins.attr("custom_call_target") == "TopK"):
        k = ins.attr("k") or (str(ins.shapes[0].dims[-1]) if ins.shapes else "?")
        return "top-k", f"k={k}"
    elif op == "rng-bit-generator" and "rng_philox" in (ins.attr("algorithm") or ""):
        return "philox", "rng-bit-generator algorithm=rng_philox"
    elif op == "custom-call" and "philox" in (ins.attr("custom_call_target") or "").lower():
        return "philox", f"custom-call {ins.attr('custom_call_target')}"
    elif op == "constant" and ins.operand_text.strip() in _PHILOX_MULTIPLIERS:
        if not (_op_name(ins) or "").endswith("rng_bit_generator"):  # XLA:CPU's expansion
            return "philox", f"multiplier constant {int(ins.operand_text.strip()):#x}"
    return None


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


def preflight(
    hlo_text: str | hlo_lib.HloModule,
    *,
    prng_impl: str | None = None,
    jax_version: str | None = None,
) -> list[Finding]:
    """Neuron-compatibility findings for an HLO module (see the module docstring for rules).

    Args:
      hlo_text: HLO text (``compiled.as_text()`` preferred) or a parsed ``HloModule``.
      prng_impl: the PRNG the run is configured with ("rbg", "unsafe_rbg", "threefry2x32");
        None = JAX's current ``jax_default_prng_impl``. Threefry ops are reported only when it
        is rbg or unsafe_rbg.
      jax_version: the JAX the program runs under on Neuron; None = this process's. Philox is
        a blocker under 0.11.x.

    Returns findings, blockers first, one per (rule, JAX op path) with a count (instructions
    without an op path are counted in the first finding of their rule).
    """
    mod = hlo_text if isinstance(hlo_text, hlo_lib.HloModule) else hlo_lib.parse_hlo(hlo_text)
    if prng_impl is None or jax_version is None:
        import jax

        prng_impl = prng_impl or str(jax.config.jax_default_prng_impl)
        jax_version = jax_version or jax.__version__
    res = Resolver(mod)
    raw: list[tuple[str, str, hlo_lib.Instruction]] = []  # (rule, detail, instruction)
    threefry_seen: hlo_lib.Instruction | None = None

    for ins in mod.instructions():
        op = ins.opcode
        dtypes = ins.dtypes
        known = _neuron_234(mod, res, ins)
        if known is not None:
            raw.append((*known, ins))
        elif op == "conditional":
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
            if not static_trip_count(mod, res, ins):
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
            severity=_severity(rule, jax_version),
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
