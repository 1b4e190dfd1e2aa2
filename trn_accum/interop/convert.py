"""Run directories from Hugging Face Llama checkpoints, and back.

`import_hf` writes what the trainer's first checkpoint would be (`trn_accum.train.loop`): a
step-0 state (`step`, `skipped`, the parameters, a fresh optimizer state) in
`RUN_DIR/checkpoints/0` with the run record in its metadata and in `RUN_DIR/config.json`, so
`trn-accum train --config C --run-dir R` resumes from it at step 0. Everything is checked
before the run dir is touched: a refused import writes nothing there. Each parameter is
assembled on the host (one at a time, float32) and placed in its sharding; the optimizer state
is created on the devices.

`export_hf` restores only the parameters of the newest committed checkpoint, read-only
(`trn_accum.checkpoint.reader`: beside a live trainer, on a run dir it cannot write), sharded
into the run's mesh (orbax reads each shard into place; the optimizer state is skipped), then
writes one parameter at a time: gathered to the host once, cut into per-layer HF tensors in
the output dtype, written shard by shard into a directory that replaces OUT_DIR whole
(`trn_accum.interop.out_dir`), with what generation needs (`trn_accum.interop.generation`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from safetensors import SafetensorError

from trn_accum.checkpoint import reader as ckpt_reader
from trn_accum.checkpoint import rundir
from trn_accum.checkpoint.checkpointer import Checkpointer, make_writable_dir
from trn_accum.config import drift
from trn_accum.config.auto import layout_config
from trn_accum.config.load import Config, config_from_dict, load_config
from trn_accum.data.progress import Meter, size_text
from trn_accum.errors import EXIT_SAVE_FAILED, listed
from trn_accum.interop import generation, hf_io, llama, validate
from trn_accum.interop.llama import InteropError
from trn_accum.model import fuji
from trn_accum.train import step as train_step
from trn_accum.train.trainer import Trainer


def _leaf(tree: dict, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def hf_shapes(cfg: fuji.ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape our config needs (no arrays)."""
    shapes = fuji.param_shapes(cfg)
    out = {}
    for name, (path, layer) in llama.tensor_names(cfg.num_layers).items():
        shape = _leaf(shapes, path).shape
        out[name] = llama.hf_shape(path, shape[1:] if layer is not None else shape)
    return out


def unused_tensors(files: dict[str, str], model_cfg: fuji.ModelConfig) -> list[str]:
    """The tensors stored in the files of `files` (listed by the index or not) that an import
    under `model_cfg` does not read: not one of `hf_shapes`, nor the LM head (which
    `check_checkpoint` requires to equal the embedding)."""
    used = {*hf_shapes(model_cfg), validate.LM_HEAD}
    return sorted(n for n in hf_io.stored_names(files) if n not in used)


def _refuse_unused(hf_dir: str, unused: list[str]) -> None:
    raise InteropError(
        f"checkpoint {hf_dir} holds {len(unused)} tensor(s) the model does not use, which the "
        f"import would drop ({listed(unused, sep=', ')}): check that config.json describes "
        f"the checkpoint (num_hidden_layers, attention_bias, mlp_bias), or pass "
        f"--allow-unused-tensors to import without them"
    )


def check_checkpoint(
    hf_dir: str,
    model_cfg: fuji.ModelConfig,
    allow_unused: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """The tensor files of the HF checkpoint in `hf_dir` after checking that it holds float
    weights (`validate`: no quantization, an LM head that is the embedding), that its
    config.json and tensor shapes are those of `model_cfg`, and that it holds no tensor the
    import would not read (`unused_tensors`; with `allow_unused` they are named through
    `say` and dropped); InteropError naming every difference. Only headers are read, and the
    LM head when the checkpoint holds one."""
    hf = hf_io.read_config(hf_dir)
    validate.refuse_quantized_config(hf, hf_dir)
    fields = llama.model_fields(hf)
    differ = llama.mismatches(fields, model_cfg)
    if differ:
        keys = [d.split(":")[0] for d in differ]
        sets = " ".join(f"--set model.{k}={fields[k]}" for k in keys)
        raise InteropError(
            f"checkpoint {hf_dir} does not match the config: {'; '.join(differ)}: use a "
            f"config with the checkpoint's values ({sets})"
        )
    files = hf_io.tensor_files(hf_dir)
    headers = hf_io.tensor_headers(files)
    validate.refuse_quantized_tensors({n: dtype for n, (dtype, _) in headers.items()}, hf_dir)
    shapes = {n: shape for n, (_, shape) in headers.items()}
    bad = hf_io.missing_or_misshapen(shapes, hf_shapes(model_cfg).items())
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise InteropError(
            f"checkpoint {hf_dir}'s tensors do not match its config.json: "
            f"{'; '.join(bad[:3])}{more}: the checkpoint is incomplete or damaged"
        )
    if validate.LM_HEAD in files:
        embed = llama.TOP_TENSORS["embed"]
        validate.refuse_untied_head(hf_io.tensors_equal(files, validate.LM_HEAD, embed), hf_dir)
    unused = unused_tensors(files, model_cfg)
    if unused and not allow_unused:
        _refuse_unused(hf_dir, unused)
    if unused and say is not None:
        say(
            f"import-hf: --allow-unused-tensors: dropping {len(unused)} tensor(s) of {hf_dir} "
            f"the model does not use: {', '.join(unused)}"
        )
    return files


def read_param(
    files: dict[str, str],
    path: str,
    cfg: fuji.ModelConfig,
    read: Callable[[str], None] = lambda name: None,
) -> np.ndarray:
    """Our parameter `path` (e.g. "layers/q") as a float32 host array, from the HF tensors;
    `read` gets the name of each HF tensor once it is read."""
    shape = _leaf(fuji.param_shapes(cfg), path).shape
    names = {p_l: n for n, p_l in llama.tensor_names(cfg.num_layers).items()}
    if not path.startswith("layers/"):
        hf = hf_io.read_tensor(files, names[(path, None)])
        read(names[(path, None)])
        return llama.to_ours(path, hf, shape, cfg.rope)
    out = np.empty(shape, np.float32)
    for layer in range(cfg.num_layers):
        hf = hf_io.read_tensor(files, names[(path, layer)])
        read(names[(path, layer)])
        out[layer] = llama.to_ours(path, hf, shape[1:], cfg.rope)
    return out


def _keypath(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _param_paths(cfg: fuji.ModelConfig) -> list[str]:
    return [_keypath(p) for p, _ in jax.tree.leaves_with_path(fuji.param_shapes(cfg))]


def _place(host: np.ndarray, sharding) -> jax.Array:
    """The global array of `host` (the same on every process) in `sharding`: each process
    puts its own devices' shards."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _refuse_existing(run_dir: str) -> None:
    """InteropError when `run_dir` holds a committed checkpoint (`ckpt_reader.committed_steps`,
    the trainer's listing rule). The leftovers of a killed save (`<step>.orbax-checkpoint-tmp*`)
    do not count: the `Checkpointer` that saves the import removes them, as for `train`."""
    steps = ckpt_reader.committed_steps(os.path.join(run_dir, "checkpoints"))
    if steps:
        raise InteropError(
            f"run dir {run_dir} already holds checkpoints (steps {', '.join(map(str, steps))}): "
            f"import into a new --run-dir (an import starts a run at step 0)"
        )


def import_hf(
    hf_dir: str,
    config_path: str,
    overrides: Sequence[str],
    run_dir: str,
    allow_unused: bool = False,
    say: Callable[[str], None] = print,
    progress: TextIO | None = None,
) -> int:
    """Writes RUN_DIR's step-0 checkpoint from the HF checkpoint in `hf_dir` under the config
    file (with `--set` overrides); tensors the model does not use are refused, or with
    `allow_unused` dropped and named through `say`. Process 0 shows its progress on the
    stream `progress` (`Meter`: the tensors read, then the save). Returns the number of
    parameters imported."""
    cfg = load_config(config_path, overrides)
    files = check_checkpoint(hf_dir, cfg.model, allow_unused, say)
    gen = generation.from_hf(hf_dir, cfg.model.vocab_size)  # for export-hf: token ids
    _refuse_existing(run_dir)
    # the mesh, data and state layout the trainer uses ("auto" settings do not change it)
    trainer = Trainer.build(layout_config(cfg))  # no compile: seconds, and its refusals
    shardings = trainer.state_shardings
    sizes = hf_io.stored_bytes(files, hf_shapes(cfg.model))
    total, shards = sum(sizes.values()), len({files[n] for n in sizes})
    meter = Meter(
        "import-hf",
        total,
        progress if jax.process_index() == 0 else None,
        items=len(sizes),
        item="tensors",
        first=f"reading {len(sizes)} tensors ({size_text(total)}) from {hf_dir} "
        f"({shards} file{'s' if shards > 1 else ''}) into {run_dir}",
    )
    with meter:
        params = jax.tree_util.tree_map_with_path(
            lambda p, sharding: _place(
                read_param(files, _keypath(p), cfg.model, lambda n: meter.update(sizes[n])),
                sharding,
            ),
            shardings["params"],
        )
        read_s = meter.elapsed_s()
        meter.close(
            f"read {len(sizes)} tensors ({size_text(total)}) in {read_s:.1f} s; saving step 0 "
            f"(the parameters and a fresh optimizer state) to "
            f"{os.path.join(run_dir, 'checkpoints', '0')}"
        )
    tx = trainer.program.tx
    with jax.set_mesh(trainer.mesh):
        opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
    zero = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    state = {"step": zero, "skipped": zero, "params": params, "opt_state": opt_state}
    try:
        make_writable_dir(run_dir)
    except OSError as e:
        why = f"run dir {run_dir} is not writable ({e.strerror})"
        raise InteropError(f"{why}: pass a writable --run-dir") from None
    claim = rundir.claim_for_job(run_dir, say=lambda _: None)
    try:
        with Checkpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.checkpoint.keep) as ck:
            ck.save(0, state, metadata={"config": trainer.record}, force=True)
            ck.wait_until_finished()
        if jax.process_index() == 0:
            generation.save(run_dir, gen)
            text = json.dumps(trainer.record, indent=2)
            rundir.write_atomic(os.path.join(run_dir, drift.CONFIG_FILE), text)
    finally:
        if claim is not None:
            claim.release()
    meter.say(
        f"done: saved in {meter.elapsed_s() - read_s:.1f} s ({meter.elapsed_s():.1f} s in all)"
    )
    return fuji.num_params(cfg.model)


# ---------------------------------------------------------------------------------------------
# Reading a run


def run_config(run_dir: str, meta: dict | None) -> Config:
    """The config a checkpoint of the run was trained with: its record, from the checkpoint's
    metadata `meta` (else RUN_DIR/config.json)."""
    record, where = drift.recorded_config(run_dir, meta)
    if record is None:
        raise InteropError(f"run dir {run_dir} has no readable config record ({where})")
    record = {k: dict(v) for k, v in record.items()}
    for key in drift.RECORD_KEYS:  # not config keys
        section, name = key.split(".")
        record.get(section, {}).pop(name, None)
    return config_from_dict(record)


def _read_params(run_dir: str, step_dir: str) -> tuple[Config, jax.sharding.Mesh, dict]:
    """(the config of the committed checkpoint in `step_dir`, its mesh on these devices, its
    "params" subtree sharded as in training): an orbax partial restore, so the optimizer
    state is never read."""
    cfg = run_config(run_dir, ckpt_reader.read_metadata(step_dir))
    mesh = train_step.make_mesh(cfg)
    shardings = train_step.named(mesh, train_step.param_specs(cfg, mesh))
    target = train_step.restore_target(fuji.param_shapes(cfg.model), shardings)
    return cfg, mesh, ckpt_reader.read_state(step_dir, {"params": target})["params"]


def restore_params(run_dir: str) -> tuple[Config, jax.sharding.Mesh, dict, int]:
    """(the run's config, its mesh on these devices, the newest committed checkpoint's
    parameters sharded as in training, that step). Read-only (`trn_accum.checkpoint.reader`):
    safe beside a trainer that is writing the run, and on a run dir it cannot write."""
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        raise InteropError(f"run dir {run_dir} has no checkpoints/: train or import-hf first")
    step, (cfg, mesh, params) = ckpt_reader.read_newest(
        directory,
        lambda step_dir: _read_params(run_dir, step_dir),
        "its files are damaged: train or import the run again",
    )
    return cfg, mesh, params, step


def export_hf(
    run_dir: str,
    out_dir: str,
    dtype: str = "bfloat16",
    tokens: dict | None = None,
    progress: TextIO | None = None,
) -> list[str]:
    """Writes the run's newest committed checkpoint into `out_dir` as a Hugging Face Llama
    checkpoint (process 0 writes): config.json with what generation needs (`generation`: the
    import's token ids and context length, `tokens` (key -> id) over them),
    generation_config.json, the tensors in `dtype`. The directory is replaced whole
    (`hf_io.write_checkpoint`). Process 0 shows its progress on the stream `progress`
    (`Meter`: the restore, then the tensors written). Returns the files written."""
    if jax.process_index() == 0:
        hf_io.check_out_dir(out_dir)
        try:
            make_writable_dir(os.path.dirname(os.path.abspath(out_dir)))
        except OSError as e:
            raise InteropError(
                f"export dir {out_dir}: its parent directory cannot be written ({e.strerror}): "
                f"pass an OUT_DIR in a writable directory",
                exit_code=EXIT_SAVE_FAILED,
            ) from None
    stream = progress if jax.process_index() == 0 else None
    if stream is not None:
        print(
            f"export-hf: restoring the parameters of the newest checkpoint in {run_dir}",
            file=stream,
            flush=True,
        )
    cfg, _, params, step = restore_params(run_dir)
    m = cfg.model
    config, gen_config = generation.export_fields(
        generation.load(run_dir), tokens or {}, m.vocab_size, m.max_seq_len
    )
    np_dtype = hf_io.DTYPES[dtype]
    names = llama.tensor_names(m.num_layers)
    paths = _param_paths(m)  # parameter by parameter: each gathered once
    order = sorted(names, key=lambda n: (paths.index(names[n][0]), names[n][1] or 0))
    shapes = hf_shapes(m)
    sizes = {n: int(np.prod(shapes[n])) * np.dtype(np_dtype).itemsize for n in order}
    host: dict[str, np.ndarray] = {}  # one parameter on the host at a time

    def tensor(name: str) -> np.ndarray:
        path, layer = names[name]
        if path not in host:
            host.clear()
            host[path] = np.asarray(
                multihost_utils.process_allgather(_leaf(params, path), tiled=True)
            )
        value = host[path] if layer is None else host[path][layer]
        out = np.ascontiguousarray(llama.to_hf(path, value, m.rope).astype(np_dtype))
        meter.update(sizes[name])
        return out

    if jax.process_index() != 0:
        for path in paths:  # the gathers are collective: every process joins
            multihost_utils.process_allgather(_leaf(params, path), tiled=True)
        return []
    config = {**llama.hf_config(m, dtype), **config}
    extra = {hf_io.GENERATION_CONFIG: gen_config} if gen_config else {}
    total = sum(sizes.values())
    what = f"{len(sizes)} tensors ({size_text(total)}, {dtype})"
    meter = Meter(
        "export-hf",
        total,
        stream,
        items=len(sizes),
        item="tensors",
        first=f"writing {what} of step {step} to {out_dir}",
    )
    try:
        with meter:
            written = hf_io.write_checkpoint(out_dir, config, sizes, tensor, extra=extra)
            meter.close(f"done: wrote {what} in {meter.elapsed_s():.1f} s")
        return written
    except (OSError, SafetensorError) as e:
        raise InteropError(
            f"export to {out_dir} failed ({e}): free space or fix the storage, then export "
            f"again (the previous content of {out_dir} is intact)",
            exit_code=EXIT_SAVE_FAILED,
        ) from None
