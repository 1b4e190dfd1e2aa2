"""`trn-accum prepare-data` against `tokenizers`' own `encode_batch`, on the same input and cores.

    .venv/bin/python benchmarks/prepare.py --mb 60                    # JSONL, a 32,000 BPE
    .venv/bin/python benchmarks/prepare.py --mb 60 --format txt
    .venv/bin/python benchmarks/prepare.py --mb 2000 --format txt --tokenizer bytes --no-baseline

Generates a corpus of pseudo-words (Zipf-distributed, so a BPE vocabulary of 32,000 fills up)
under --dir, trains a byte-level BPE `tokenizer.json` of --vocab entries on its first 8 MB
with `tokenizers`' BpeTrainer (or takes --tokenizer), then prints:

- prepare-data: `prepare_data(..., workers=N)` in a fresh process (the interpreter's and the
  package's import excluded, printed apart as `startup`): seconds, tokens/s, and its peak
  memory, sampled every 0.5 s with psutil: the largest single process's RSS and the peak of
  the process tree's summed RSS (an upper bound: the forked workers share pages that each
  one's RSS counts). Not getrusage: a child's maxrss counts this process's pages between its
  fork and exec.
- encode_batch: the same documents (a JSONL record; for text, the pieces prepare-data cuts),
  1 MiB of text a core per `Tokenizer.encode_batch` call, in this process with the tokenizers' own
  thread pool on all cores: the encoding alone, no reading or parsing.
- each --repeat times, alternated, then the best rate of each and their ratio; the load
  average with every line (the machine may be shared).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN = """
import json, sys, time
from trn_accum.data.prepare import prepare_data
start = time.perf_counter()
meta = prepare_data(sys.argv[1:2], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]))
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": meta["num_tokens"],
                  "documents": meta["num_documents"]}))
"""


def _words(rng: random.Random, n: int) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    return ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(n)]


#: generated text beyond this many MB repeats what was generated (a memory test needs size)
UNIQUE_MB = 64


def write_corpus(path: str, mb: float, fmt: str, seed: int = 0) -> None:
    """About `mb` MB of documents of 2-8 KB of Zipf-distributed pseudo-words; JSONL records
    {"text": ...}, or text with documents separated by a blank line. Past UNIQUE_MB, the
    first UNIQUE_MB again and again (whole copies: up to UNIQUE_MB over)."""
    rng = random.Random(seed)
    words = _words(rng, 60_000)
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(len(words))))
    target, written = int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < min(target, UNIQUE_MB * 1e6):
            doc = []
            for _ in range(rng.randint(4, 16)):
                sentence = " ".join(rng.choices(words, cum_weights=cum, k=rng.randint(6, 24)))
                doc.append(sentence.capitalize() + rng.choice([".", ".", "?", ", 1984."]))
            text = "\n".join(doc)
            line = json.dumps({"text": text}) + "\n" if fmt == "jsonl" else text + "\n\n"
            f.write(line)
            written += len(line.encode())
    unique = written
    with open(path, "ab") as f, open(path, "rb") as src:
        while written < target:  # whole copies: no record is cut
            src.seek(0)
            f.write(src.read(unique))
            written += unique


def train_tokenizer(corpus: str, out: str, vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus, encoding="utf-8") as f:
        sample = f.read(8_000_000)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample.splitlines(), trainer)
    tok.save(out)
    return out


def run_prepare(corpus: str, out: str, tokenizer: str, workers: int) -> dict:
    """prepare_data in a fresh process: its result, startup seconds and peak memory."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN, corpus, out, tokenizer, str(workers)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    peak_rss = max_rss = 0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            rss = [p.memory_info().rss for p in tree]
            peak_rss, max_rss = max(peak_rss, sum(rss)), max(max_rss, *rss)
        except psutil.Error:  # a process ended between the listing and the read
            pass
        time.sleep(0.5)
    wall = time.perf_counter() - start
    out_text = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"prepare-data failed ({proc.returncode})")
    result = json.loads(out_text.strip().splitlines()[-1])
    result["startup"] = wall - result["seconds"]
    result["peak_rss"] = peak_rss
    result["max_rss"] = max_rss
    return result


def baseline_documents(corpus: str, fmt: str):
    """The documents prepare-data encodes: JSONL records, or the text pieces it cuts."""
    if fmt == "jsonl":
        with open(corpus, encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]
    from trn_accum.data.corpus_read import chunks

    return [c.payload.decode("utf-8") for c, _ in chunks(corpus)]


def run_encode_batch(tokenizer: str, docs: list[str]) -> tuple[float, int]:
    """Seconds and tokens of `encode_batch` over `docs`, about 1 MiB of text a core per call
    (a text file's 256 KiB pieces: four a core)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    batches, batch, size = [], [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= (1 << 20) * os.cpu_count():
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    tokens, start = 0, time.perf_counter()
    for b in batches:
        tokens += sum(len(e.ids) for e in tok.encode_batch(b, add_special_tokens=False))
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=60.0, help="input size in MB")
    ap.add_argument("--format", choices=("jsonl", "txt"), default="jsonl")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json, or 'bytes'")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dir", default="/tmp/trn-accum-prepare-bench")
    ap.add_argument("--no-baseline", action="store_true", help="skip encode_batch")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each, alternated")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    corpus = os.path.join(args.dir, f"corpus.{args.format}")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    start = time.perf_counter()
    write_corpus(corpus, args.mb, args.format)
    size = os.path.getsize(corpus)
    print(f"input: {corpus}, {size / 1e6:.1f} MB ({time.perf_counter() - start:.1f} s to write)")
    tokenizer = args.tokenizer
    if tokenizer is None:
        start = time.perf_counter()
        tokenizer = train_tokenizer(corpus, os.path.join(args.dir, "tokenizer.json"), args.vocab)
        print(f"tokenizer: trained a BPE in {time.perf_counter() - start:.1f} s")
    if tokenizer != "bytes":
        from tokenizers import Tokenizer

        print(f"tokenizer: {Tokenizer.from_file(tokenizer).get_vocab_size():,} entries")
    baseline = not args.no_baseline and tokenizer != "bytes"
    docs = baseline_documents(corpus, args.format) if baseline else []
    best_prepare, best_base = 0.0, 0.0
    for rep in range(1, args.repeat + 1):  # alternated: a shared machine's load hits both
        r = run_prepare(corpus, os.path.join(args.dir, "tok"), tokenizer, args.workers)
        rate = r["tokens"] / r["seconds"]
        best_prepare = max(best_prepare, rate)
        print(
            f"[{rep}] prepare-data ({args.workers} workers): {r['tokens']:,} tokens, "
            f"{r['documents']:,} documents in {r['seconds']:.1f} s = {rate / 1e3:,.0f} k "
            f"tokens/s, {size / r['seconds'] / 1e6:.2f} MB/s (startup {r['startup']:.1f} s "
            f"apart); peak memory: process tree RSS {r['peak_rss'] / 1e9:.2f} GB, largest "
            f"process RSS {r['max_rss'] / 1e9:.2f} GB; load {os.getloadavg()[0]:.1f}"
        )
        if baseline:
            seconds, tokens = run_encode_batch(tokenizer, docs)
            best_base = max(best_base, tokens / seconds)
            print(
                f"[{rep}] encode_batch (tokenizers' threads on {os.cpu_count()} cores): "
                f"{tokens:,} tokens in {seconds:.1f} s = {tokens / seconds / 1e3:,.0f} k "
                f"tokens/s; load {os.getloadavg()[0]:.1f}"
            )
    if baseline:
        print(
            f"best of {args.repeat}: prepare-data {best_prepare / 1e3:,.0f} k tokens/s, "
            f"encode_batch {best_base / 1e3:,.0f} k tokens/s: {best_prepare / best_base:.2f}x"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
