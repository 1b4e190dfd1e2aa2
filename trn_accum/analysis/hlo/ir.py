"""One parsed HLO instruction and one computation (a named list of them): the records
`trn_accum.analysis.hlo.module.parse_hlo` builds and `HloModule` holds."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping

from trn_accum.analysis.hlo.text import ArrayType, names_in, unquote

# Attributes whose values name called computations.
_CALL_ATTRS = (
    "to_apply",
    "body",
    "condition",
    "calls",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
    "select",
    "scatter",
    "async_wrapped_computation",
)


#: Custom-call targets that only name a sharding (`Instruction.names_sharding_only`).
NAMING_CALLS = ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "xla.sdy.")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction. `attrs` holds the raw attribute text by key (e.g.
    attrs["replica_groups"], attrs["to_apply"], attrs["custom_call_target"])."""

    name: str
    opcode: str
    computation: str
    type_text: str
    shapes: tuple[ArrayType, ...]
    operands: tuple[str, ...]
    operand_text: str
    attrs: Mapping[str, str]
    is_root: bool
    line: str

    @property
    def dtypes(self) -> frozenset[str]:
        return frozenset(a.dtype for a in self.shapes)

    @property
    def is_tuple(self) -> bool:
        return self.type_text.lstrip().startswith("(")

    @property
    def result_bytes(self) -> int:
        return sum(a.nbytes for a in self.shapes)

    @property
    def called_computations(self) -> tuple[str, ...]:
        """Computations this instruction calls (to_apply, body, condition, calls, branches...)."""
        names: list[str] = []
        for key, value in self.attrs.items():
            if key in _CALL_ATTRS:
                names.extend(names_in(value, bare_ok=True))
            elif key not in ("metadata", "backend_config", "frontend_attributes", "sharding"):
                names.extend(names_in(value, bare_ok=False))
        return tuple(dict.fromkeys(names))

    @property
    def names_sharding_only(self) -> bool:
        """A custom-call that only names its operand's sharding (no buffer, no work of its own:
        the SPMD partitioner removes it)."""
        target = self.attr("custom_call_target") or ""
        return self.opcode == "custom-call" and target.startswith(NAMING_CALLS)

    def attr(self, key: str, default: str | None = None) -> str | None:
        """An attribute's value with surrounding double quotes removed (e.g.
        `custom_call_target`)."""
        value = self.attrs.get(key)
        if value is None:
            return default
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1]
        return value

    @property
    def trip_count(self) -> int | None:
        """Known trip count of a `while` (from its backend_config), else None."""
        cfg = self.attrs.get("backend_config")
        if self.opcode != "while" or not cfg:
            return None
        try:
            data = json.loads(unquote(cfg))
            return int(data["known_trip_count"]["n"])
        except (ValueError, KeyError, TypeError):
            m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', cfg)
            return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]

    @property
    def root(self) -> Instruction | None:
        for ins in self.instructions:
            if ins.is_root:
                return ins
        return self.instructions[-1] if self.instructions else None
