"""`trn-accum eval`: the mean next-token cross-entropy of a run's newest checkpoint.

The run's config (its record) decides the model, mesh and minibatching; the loss is the
trainer's held-out evaluation (`trn_accum.train.step.make_eval_step`: a sum of per-token losses
and a count of target tokens over the config's k minibatches), so a figure here and the
trainer's `eval_loss` are the same computation.

- `--data TOKEN_DIR` (a `trn-accum prepare-data` directory): the held-out split's first
  `data.eval_batches` batches of the run's `data.global_batch` x `data.seq_len`, as the trainer
  evaluates them.
- `--tokens FILE.npy` (an integer array [N, S]): row r predicts tokens[r, 1:] from
  tokens[r, :-1], every position (N x (S - 1) targets). A negative id is padding: it may only
  end a row (right padding; causal attention makes earlier positions blind to it), and is
  neither an input nor a target. Rows go through in groups of `data.global_batch` (the last
  group filled with empty rows, which weigh nothing).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from trn_accum.interop.convert import restore_params
from trn_accum.interop.llama import InteropError
from trn_accum.train import step as train_step
from trn_accum.train.trainer import Trainer

NPY_MAGIC = b"\x93NUMPY"  # what every file np.save writes starts with


def _what_instead(head: bytes) -> str:
    """What a file starting with `head` is, when not a .npy file."""
    if not head:
        return "an empty file (0 bytes)"
    if head.startswith(b"PK"):
        return "a zip archive (an .npz of np.savez?)"
    return f"not a .npy file (it starts with {head!r})"


def load_npy(path: str) -> np.ndarray:
    """The array in the .npy file `path`; InteropError (one line) for what np.save did not
    write whole: unreadable, empty, another format (.npz, text, pickle), a cut header or data,
    an object array."""
    fix = "save token ids as np.save(path, ids), one integer array [N, S]"
    try:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
            if head != NPY_MAGIC:
                raise InteropError(f"--tokens {path}: {_what_instead(head)}: {fix}")
            f.seek(0)
            return np.lib.format.read_array(f, allow_pickle=False)
    except OSError as e:
        raise InteropError(f"--tokens {path}: cannot be read ({e.strerror or e}): {fix}") from None
    except (ValueError, EOFError) as e:  # a cut header or data, an object array
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise InteropError(f"--tokens {path}: not a readable .npy file ({why}): {fix}") from None


def read_tokens(path: str, vocab_size: int) -> np.ndarray:
    """The int64 [N, S] array of `path` (.npy), checked: S >= 2, ids < vocab_size (in the
    file's own dtype, before any cast: a uint64 id past int64's range is an id, not padding),
    negative ids (padding) only at the end of a row, at least one target (a row of 2
    tokens)."""
    tokens = load_npy(path)
    if tokens.ndim != 2 or tokens.shape[1] < 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise InteropError(
            f"--tokens {path}: an integer array [N, S] with S >= 2 is needed, got "
            f"{tokens.dtype} {list(tokens.shape)}: save token ids as np.save(path, ids)"
        )
    too_big = tokens >= vocab_size  # numpy compares any integer dtype with an int exactly
    if too_big.any():
        r, c = np.argwhere(too_big)[0]
        raise InteropError(
            f"--tokens {path}: id {tokens[r, c]} at row {r}, column {c} is >= the model's "
            f"vocabulary ({vocab_size}): tokenize with the model's tokenizer"
        )
    tokens = tokens.astype(np.int64)  # every id now fits: < vocab_size, or negative padding
    pad = tokens < 0
    inner = pad[:, :-1] & ~pad[:, 1:]
    if inner.any():
        r, c = np.argwhere(inner)[0]
        raise InteropError(
            f"--tokens {path}: row {r} has padding (a negative id) at column {c} before a token: "
            f"padding may only end a row (pad on the right)"
        )
    if not (~pad[:, 1:]).any():
        raise InteropError(
            f"--tokens {path}: no row has a target ({tokens.shape[0]} rows, each empty, all "
            f"padding or one token): give rows of at least 2 tokens"
        )
    return tokens


def token_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The trainer's batch (`trn_accum.data.datasets`) of next-token targets of tokens [N, S]:
    arrays [N, S - 1]; padding (negative ids) is input 0 with target mask 0."""
    pad = tokens < 0
    return {
        "input_ids": np.where(pad, 0, tokens)[:, :-1].astype(np.int32),
        "target_labels": np.where(pad, 0, tokens)[:, 1:].astype(np.int32),
        "target_mask": (~pad[:, 1:]).astype(np.float32),
    }


def _mean_over(eval_fn, params, batches, mesh, what: str) -> tuple[float, int]:
    """(mean loss, target tokens) over `batches`; InteropError when they hold no target
    (a mean over nothing is no loss), naming `what` was evaluated."""
    total = count = 0.0
    for batch in batches:
        with jax.set_mesh(mesh):
            t, c = eval_fn(params, batch)
        total += float(t)
        count += float(c)
    if count == 0:
        raise InteropError(f"{what} holds no target tokens: there is nothing to evaluate")
    return total / count, int(count)


def _placed(batch: dict[str, np.ndarray], sharding) -> dict:
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
        for k, v in batch.items()
    }


def eval_tokens(run_dir: str, tokens_path: str) -> tuple[float, int]:
    """(mean loss, target tokens) of the run's newest checkpoint over the rows of the file."""
    cfg, mesh, params, _ = restore_params(run_dir)
    tokens = read_tokens(tokens_path, cfg.model.vocab_size)
    if tokens.shape[1] - 1 > cfg.model.max_seq_len:
        raise InteropError(
            f"--tokens {tokens_path}: rows of {tokens.shape[1]} tokens make sequences of "
            f"{tokens.shape[1] - 1} > model.max_seq_len {cfg.model.max_seq_len}: cut the rows"
        )
    group = cfg.data.global_batch
    n = -(-tokens.shape[0] // group) * group
    padded = np.full((n, tokens.shape[1]), -1, np.int64)
    padded[: tokens.shape[0]] = tokens
    batch = token_batch(padded)
    sharding = train_step.batch_sharding(mesh)
    batches = (
        _placed({k: v[i : i + group] for k, v in batch.items()}, sharding)
        for i in range(0, n, group)
    )
    shardings = jax.tree.map(lambda x: x.sharding, params)
    eval_fn = train_step.make_eval_step(cfg, mesh, shardings)
    return _mean_over(eval_fn, params, batches, mesh, f"--tokens {tokens_path}")


def eval_data(run_dir: str, data_dir: str) -> tuple[float, int]:
    """(mean loss, target tokens) of the run's newest checkpoint on the held-out split of a
    prepared token directory, as the trainer evaluates it (`data.eval_batches` batches)."""
    cfg, _, params, _ = restore_params(run_dir)
    data = dataclasses.replace(cfg.data, kind="tokens", path=data_dir)
    trainer = Trainer.build(dataclasses.replace(cfg, data=data))
    batches = (trainer.batch(i, "eval") for i in range(cfg.data.eval_batches))
    what = f"the held-out split of {data_dir} ({cfg.data.eval_batches} batches)"
    return _mean_over(trainer.eval_fn, params, batches, trainer.mesh, what)
