"""Progress of `prepare-data`: a tqdm bar on a terminal, one line per interval in a log file.

    bar = Progress(total_bytes, sys.stderr)
    bar.update(disk_bytes, documents, tokens)   # the input read since the last update
    bar.close()

The bar (tqdm, within the terminal's width) counts input bytes on disk, so it shows MB/s and
the ETA, with the documents and tokens so far. When the stream is not a terminal (or tqdm is
not installed), a line like `progress_line`'s is written every `interval_s` seconds.
"""

from __future__ import annotations

import time
from datetime import timedelta

#: seconds between two progress lines in a log file
LOG_INTERVAL_S = 30.0


def progress_line(done: int, total: int, documents: int, tokens: int, elapsed_s: float) -> str:
    """One line: bytes read of `total`, documents, tokens, MB/s and the ETA."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = timedelta(seconds=round((total - done) / rate)) if rate > 0 else "?"
    share = done / total if total else 1.0
    return (
        f"prepare-data: {done / 1e6:,.1f} of {total / 1e6:,.1f} MB ({share:.0%}), "
        f"{documents:,} documents, {tokens:,} tokens, {rate / 1e6:.1f} MB/s, ETA {eta}"
    )


class Progress:
    def __init__(self, total_bytes: int, stream, *, interval_s: float = LOG_INTERVAL_S, clock=None):
        self.total, self.stream, self.interval_s = int(total_bytes), stream, interval_s
        self.clock = clock or time.monotonic
        self.start = self.last_line = self.clock()
        self.done = self.documents = self.tokens = 0
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
                    desc="prepare-data",
                )

    def update(self, disk_bytes: int, documents: int, tokens: int) -> None:
        self.done += disk_bytes
        self.documents += documents
        self.tokens += tokens
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.documents:,} docs, {self.tokens:,} tokens", False)
            self.bar.update(disk_bytes)
            return
        now = self.clock()
        if now - self.last_line >= self.interval_s:
            self.last_line = now
            line = progress_line(
                self.done, self.total, self.documents, self.tokens, now - self.start
            )
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
