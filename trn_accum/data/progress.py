"""Progress of a long command: a tqdm bar on a terminal, one line per interval in a log file.

    meter = Meter("export-hf", total_bytes, sys.stderr, items=20, item="tensors",
                  first="writing 20 tensors (1.2 MB) to out/")
    with meter:                                     # an error ends the bar
        meter.update(tensor_bytes)                  # one item of that many bytes done
        meter.close("done: wrote 20 tensors ...")   # the last line

The bar (tqdm, within the terminal's width) counts bytes, so it shows MB/s and the ETA, with
the items so far. When the stream is not a terminal (or tqdm is not installed), a line like
`count_line`'s is written every `interval_s` seconds; `first` and the line given to `close`
are written either way ("LABEL: ..."), and nothing at all when the stream is None (the other
processes of a multi-process job). tqdm is optional.

`Progress` is prepare-data's: input bytes on disk, with the documents and tokens encoded.
import-hf and export-hf (`trn_accum.interop.convert`) count tensors with a `Meter`.
"""

from __future__ import annotations

import time
from datetime import timedelta

#: seconds between two progress lines in a log file
LOG_INTERVAL_S = 30.0


def size_text(n: int) -> str:
    """A byte count for people: "512 B", "12.3 kB", "1.2 MB", "16.1 GB" (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def count_line(label: str, done: int, total: int, notes: str, elapsed_s: float) -> str:
    """One line: `label`, bytes done of `total`, the `notes` (if any), MB/s and the ETA."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = timedelta(seconds=round((total - done) / rate)) if rate > 0 else "?"
    share = done / total if total else 1.0
    notes = f"{notes}, " if notes else ""
    return (
        f"{label}: {done / 1e6:,.1f} of {total / 1e6:,.1f} MB ({share:.0%}), "
        f"{notes}{rate / 1e6:.1f} MB/s, ETA {eta}"
    )


def progress_line(done: int, total: int, documents: int, tokens: int, elapsed_s: float) -> str:
    """prepare-data's line: bytes read of `total`, documents, tokens, MB/s and the ETA."""
    notes = f"{documents:,} documents, {tokens:,} tokens"
    return count_line("prepare-data", done, total, notes, elapsed_s)


class Meter:
    """`label`'s progress through `total_bytes` (and `items` things named `item`, if given)."""

    def __init__(
        self,
        label: str,
        total_bytes: int,
        stream,
        *,
        items: int = 0,
        item: str = "",
        first: str = "",
        interval_s: float = LOG_INTERVAL_S,
        clock=None,
    ):
        self.label, self.total, self.stream, self.interval_s = (
            label,
            int(total_bytes),
            stream,
            interval_s,
        )
        self.items, self.item = int(items), item
        self.clock = clock or time.monotonic
        self.done = self.items_done = 0
        if first:
            self.say(first)
        self.start = self.last_line = self.clock()
        self.bar = None
        isatty = getattr(stream, "isatty", None)
        if isatty is not None and isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(
                    total=self.total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1000,
                    file=stream,
                    dynamic_ncols=True,
                    desc=label,
                )

    def notes(self, short: bool) -> str:
        """What the bar (`short`) and a line show beside the bytes: the items done."""
        return f"{self.items_done:,} of {self.items:,} {self.item}" if self.item else ""

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def say(self, text: str) -> None:
        """`LABEL: text` on its own line (nothing when the stream is None)."""
        if self.stream is not None:
            print(f"{self.label}: {text}", file=self.stream, flush=True)

    def update(self, n_bytes: int, n_items: int = 1) -> None:
        self.items_done += n_items
        self._advance(n_bytes)

    def _advance(self, n_bytes: int) -> None:
        self.done += n_bytes
        if self.bar is not None:
            notes = self.notes(short=True)
            if notes:
                self.bar.set_postfix_str(notes, False)
            self.bar.update(n_bytes)
            return
        now = self.clock()
        if self.stream is not None and now - self.last_line >= self.interval_s:
            self.last_line = now
            line = count_line(
                self.label, self.done, self.total, self.notes(False), now - self.start
            )
            print(line, file=self.stream, flush=True)

    def close(self, last: str = "") -> None:
        """Ends the bar, then writes `last` (if any) on its own line."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if last:
            self.say(last)

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *exc) -> None:
        """Ends the bar (an error's line then starts on a line of its own)."""
        self.close()


class Progress(Meter):
    """prepare-data's: `update(disk_bytes, documents, tokens)` with the input read since the
    last update; no first or last line."""

    def __init__(self, total_bytes: int, stream, *, interval_s: float = LOG_INTERVAL_S, clock=None):
        self.documents = self.tokens = 0
        super().__init__("prepare-data", total_bytes, stream, interval_s=interval_s, clock=clock)

    def notes(self, short: bool) -> str:
        docs = "docs" if short else "documents"
        return f"{self.documents:,} {docs}, {self.tokens:,} tokens"

    def update(self, disk_bytes: int, documents: int, tokens: int) -> None:  # type: ignore[override]
        self.documents += documents
        self.tokens += tokens
        self._advance(disk_bytes)
