"""Reading the launch environment's values, each bad one a `LaunchError` of one line naming
the variable, the rule and a fix: integers, ports, ranks, host:port addresses, and Slurm host
lists (expanded without calling `scontrol show hostnames`). `trn_accum.cluster.distributed`
derives the launch plan from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from trn_accum.cluster import rootport
from trn_accum.errors import UserError

__all__ = [
    "RANGE",
    "LaunchError",
    "address_value",
    "check_rank",
    "expand_nodelist",
    "int_value",
    "port_value",
]


class LaunchError(UserError):
    """The launch environment is inconsistent; one line naming the value, the rule and a fix."""


def int_value(name: str, text: str | None, *, minimum: int = 0, maximum: int | None = None) -> int:
    """`text` (the value of `name`) as an int in [minimum, maximum], else a LaunchError."""
    rule = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    if text is None or not str(text).strip():
        raise LaunchError(f"{name} is not set: it must be an integer {rule}")
    try:
        n = int(str(text).strip())
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer ({rule} expected)") from None
    if n < minimum or (maximum is not None and n > maximum):
        raise LaunchError(f"{name}={n} must be {rule}")
    return n


def port_value(env: Mapping[str, str], name: str, default: int) -> int:
    return int_value(name, env.get(name) or str(default), minimum=1, maximum=65535)


def check_rank(name: str, process_id: int, world_name: str, num_processes: int) -> None:
    if process_id >= num_processes:
        raise LaunchError(
            f"{name}={process_id} is not below {world_name}={num_processes}: ranks are "
            f"0..{num_processes - 1}; fix the rank or the world size"
        )


def address_value(name: str, text: str) -> str:
    try:
        host, port = rootport.split_address(text)
        return f"{host}:{port}"
    except ValueError:
        raise LaunchError(
            f"{name}={text!r} is not host:port (port 1-65535), e.g. node001:55527"
        ) from None


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets ("a[1,2],b" -> ["a[1,2]", "b"])."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


_BRACKET = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")
RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_HOST = re.compile(r"^[A-Za-z0-9._-]+$")


def _expand_item(item: str) -> list[str]:
    m = _BRACKET.match(item)
    if m is None:
        if not _HOST.match(item):
            raise ValueError(item)
        return [item]
    prefix, body, rest = m.groups()
    if prefix and not _HOST.match(prefix):
        raise ValueError(item)
    numbers = []
    for part in body.split(","):
        r = RANGE.match(part.strip())
        if r is None:
            raise ValueError(item)
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ValueError(item)
        numbers += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]  # keeps "007"
    tails = _expand_item(rest) if rest else [""]
    return [prefix + n + t for n in numbers for t in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist without calling `scontrol show hostnames`.

    "trn2-[001-004,007],other5" -> ["trn2-001", ..., "trn2-004", "trn2-007", "other5"];
    zero padding is kept ("[08-10]" -> 08, 09, 10); several bracket groups in one name expand
    as a product ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2). Raises LaunchError otherwise.
    """
    text = (nodelist or "").strip()
    try:
        if not text or text.count("[") != text.count("]"):
            raise ValueError(text)
        hosts = []
        for item in _split_top_level(text):
            if not item:
                raise ValueError(item)
            hosts += _expand_item(item)
        return hosts
    except ValueError:
        raise LaunchError(
            f"SLURM_STEP_NODELIST={nodelist!r} is not a Slurm host list (e.g. "
            f"'trn2-[001-004,007],other5'); run under srun, or set TRN_ACCUM_COORDINATOR, "
            f"TRN_ACCUM_NUM_PROCESSES and TRN_ACCUM_PROCESS_ID explicitly"
        ) from None
