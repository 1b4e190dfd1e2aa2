"""reduce_dtype="bfloat16" (`reduce_once.psum_grads_narrow`): under reduce="once" the one
cross-replica gradient reduction per step runs in bf16 (cast down before, back to float32
after). Gradients within bf16 rounding of the float32 reduction and not equal to it; the
program's data-axis reductions in bf16 (before optimisation) and, compiled for XLA:CPU, over
widened bf16 values; the config refusal; the tiny Fuji trained through the trainer with both.

Tolerance of the gradients: u = 2^-9 is bf16's unit roundoff (8 significant bits). Each
replica's float32 partial sum g_j is rounded to bf16 (<= u |g_j| an element), XLA:CPU adds the
bf16 values in float32 (it widens the all-reduce, `collectives.native_bytes`) and rounds the
total g once more (<= u |g|): |error| <= u (sum_j |g_j| + |g|). With partial sums of one sign
that is 2u |g|; 4u (7.8e-3, in 2-norm per leaf) leaves room for partial sums that cancel in
part. Measured 2.0e-3 to 2.7e-3 (about u: the two roundings are not both worst case). On trn2
a ring all-reduce in bf16 also rounds at each hop: (J - 1) u more for J replicas.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_gather_once import SHAPE, SPECS, _loss, _mesh, _mlp
from test_reduce_once import BATCH_SPEC, MESHES, PARAM_SPECS, mlp_problem
from test_train import TINY, _losses

from trn_accum import Strategy, accumulate_gradients
from trn_accum.analysis import collectives as coll
from trn_accum.analysis.hlo import module as hlo

U = 2.0**-9  # bf16 unit roundoff
DTYPES = ("float32", "bfloat16")


def _problem(gather):
    """(mesh, axis sizes, loss_fn, params, batch, accumulate_gradients kwargs): gather
    "per_minibatch" on test_reduce_once's MLP (data 4, fsdp 2), the gather modes on
    test_gather_once's (data 2, fsdp 2, model 2)."""
    if gather == "per_minibatch":
        mesh, loss_fn, params, batch = mlp_problem("data4_fsdp2")
        kw = dict(
            batch_spec=BATCH_SPEC, param_specs=PARAM_SPECS, weight_fn=lambda b: b["mask"].sum()
        )
        return mesh, MESHES["data4_fsdp2"], loss_fn, params, batch, kw
    mesh = _mesh()
    params, batch = _mlp(mesh)
    kw = dict(batch_spec=P(("data", "fsdp")), param_specs=SPECS, weight_fn=lambda b: b["m"].sum())
    return mesh, SHAPE, _loss, params, batch, kw


@functools.cache
def _mlp_compiled(gather, reduce_dtype):
    """(pre-optimisation HLO text, compiled, (loss, grads)) of the MLP at k=2, reduce="once"."""
    mesh, _, loss_fn, params, batch, kw = _problem(gather)
    fn = accumulate_gradients(
        loss_fn,
        steps=2,
        mesh=mesh,
        **kw,
        strategy=Strategy(reduce="once", gather=gather, reduce_dtype=reduce_dtype),
    )
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn).lower(params, batch)
        compiled = lowered.compile()
        out = compiled(params, batch)
    return lowered.as_text(dialect="hlo"), compiled, jax.device_get(out)


def _rel_norm_errors(actual, expected):
    out = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(actual)
    for (path, a), e in zip(flat, jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        out[jax.tree_util.keystr(path)] = float(np.linalg.norm(a - e) / np.linalg.norm(e))
    return out


@pytest.mark.parametrize("gather", ["per_minibatch", "once", "once_unsharded"])
def test_bf16_reduction_within_bf16_rounding_and_not_identical(gather):
    _, _, (loss32, g32) = _mlp_compiled(gather, "float32")
    _, _, (loss16, g16) = _mlp_compiled(gather, "bfloat16")
    assert loss16 == loss32  # the loss and weight sums stay float32: bit for bit
    assert jax.tree.structure(g16) == jax.tree.structure(g32)
    assert {x.dtype for x in jax.tree.leaves((g16, g32))} == {np.dtype(np.float32)}
    errors = _rel_norm_errors(g16, g32)
    print(f"gather={gather}: relative 2-norm error per leaf, bf16 vs f32 reduction: {errors}")
    for leaf, err in errors.items():
        assert err <= 4 * U, (leaf, err)  # the module docstring's bound
        assert err >= 1e-4, (leaf, err)  # bf16 rounding, not float32 reordering (~1e-7)


# ----------------------------------------------------------------------------- the program


def _data_reductions(module, sizes):
    """Collectives after the loop that reduce over groups spanning "data" (all-reduce,
    reduce-scatter), and the fsdp reduce-scatters there (gather="once_unsharded")."""
    out = []
    for c in coll.collectives(module):
        axes = coll.group_axes(c.replica_groups, sizes) or ()
        if c.kind in ("all-reduce", "reduce-scatter") and not c.in_loop:
            if "data" in axes or (c.kind == "reduce-scatter" and "fsdp" in axes):
                out.append(c)
    return out


def _arrays(c):
    """The non-scalar arrays of a collective's result (the gradients; scalars: the loss and
    weight sums, which stay float32)."""
    return [a for a in c.instruction.shapes if a.dims]


def check_program(pre_text, compiled_text, sizes, reduce_dtype):
    """Before optimisation (the collectives JAX wrote): the gradient reductions over data are
    bf16 with "bfloat16", and no collective is bf16 with "float32". Compiled for XLA:CPU: the
    same reductions run in float32 on values widened from bf16 (a convert of a bf16 value;
    a reduction of its own may get a `*promoted*` reducer, or is merged with the float32 sums
    into one tuple all-reduce), and on no such value with "float32". Returns the compiled
    reductions."""
    pre = _data_reductions(hlo.parse_hlo(pre_text), sizes)
    grads_pre = [a.dtype for c in pre for a in _arrays(c)]
    assert grads_pre, [c.instruction.line for c in pre]
    want = "bf16" if reduce_dtype == "bfloat16" else "f32"
    assert set(grads_pre) == {want}, [c.instruction.line for c in pre]
    if reduce_dtype == "float32":
        assert "bf16" not in {a.dtype for c in pre for a in c.instruction.shapes}
    module = hlo.parse_hlo(compiled_text)
    post = [c for c in _data_reductions(module, sizes) if _arrays(c)]  # with gradients
    assert post
    for c in post:
        ops = module.operand_instructions(c.instruction)
        widened = [coll.converted_from_narrow(module, o) for o in ops if o.shapes[0].dims]
        narrow = all(widened) if reduce_dtype == "bfloat16" else not any(widened)
        assert narrow, c.instruction.line
        assert c.instruction.dtypes == {"f32"} or reduce_dtype == "float32", c.instruction.line
        if reduce_dtype == "float32":
            assert c.native_bytes == c.bytes, c.instruction.line
    return post


@pytest.mark.parametrize("gather", ["per_minibatch", "once_unsharded"])
def test_mlp_program_reduces_the_gradients_in_bf16(gather):
    """The MLP's programs. once_unsharded: its fsdp reduce-scatters and data all-reduce are
    separate reductions of widened bf16 values, each with a `*promoted*` reducer, which
    `native_bytes` prices at 2 bytes an element (half the float32 program's)."""
    sizes = _problem(gather)[1]
    for reduce_dtype in DTYPES:
        pre_text, compiled, _ = _mlp_compiled(gather, reduce_dtype)
        post = check_program(pre_text, compiled.as_text(), sizes, reduce_dtype)
        if gather == "once_unsharded" and reduce_dtype == "bfloat16":
            grads = [c for c in post if all(a.dims for a in c.instruction.shapes)]
            assert grads and all(c.native_bytes == c.bytes // 2 for c in grads), grads


# ----------------------------------------------------------------------------- the config


def test_config_refuses_bf16_with_per_minibatch(capsys):
    """One line, no traceback, naming the key, the value, the rule and the fix; the core's own
    ValueError says the same in its words; an unknown dtype is a choice error."""
    from trn_accum import cli as trn_cli
    from trn_accum.config.load import ConfigError, load_config

    argv = ["--config", TINY, "--set", "trainer.reduce_dtype=bfloat16"]  # tiny: per_minibatch
    assert trn_cli.main(["check-config", "--", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in (
        "trn-accum: error: trainer.reduce_dtype = 'bfloat16' needs trainer.reduce = \"once\"",
        "got 'per_minibatch'",
        'set trainer.reduce = "once" or trainer.reduce_dtype = "float32"',
    ):
        assert needle in err, (needle, err)
    cfg = load_config(TINY, ["trainer.reduce_dtype=bfloat16", "trainer.reduce=once"])
    assert cfg.trainer.reduce_dtype == "bfloat16"
    assert load_config(TINY).trainer.reduce_dtype == "float32"
    with pytest.raises(ConfigError, match="trainer.reduce_dtype = 'float16': must be one of"):
        load_config(TINY, ["trainer.reduce_dtype=float16", "trainer.reduce=once"])
    with pytest.raises(ValueError, match="reduce_dtype='bfloat16'\\) needs reduce=\"once\""):
        accumulate_gradients(_loss, steps=2, strategy=Strategy(reduce_dtype="bfloat16"))
    with pytest.raises(
        ValueError, match=r"reduce_dtype='float16'\): reduce_dtype must be one of \('float32'"
    ):
        accumulate_gradients(
            _loss, steps=2, weight_fn=len, strategy=Strategy(reduce="once", reduce_dtype="float16")
        )


# ----------------------------------------------------------------------------- the trainer

STEPS = 10


@functools.cache
def _trainer(reduce_dtype):
    from trn_accum.config.load import load_config
    from trn_accum.train import loop

    sets = ["trainer.reduce=once", "trainer.accum_steps=4", f"trainer.reduce_dtype={reduce_dtype}"]
    return loop.Trainer.build(load_config(TINY, sets))  # (data 4, fsdp 2), bf16 compute


@pytest.mark.slow
def test_tiny_fuji_trains_the_same_with_bf16_reduction():
    """configs/fuji-tiny.toml through the trainer, reduce="once", k=4, 10 steps, float32 vs
    bfloat16 reduction. The step's program passes `check_program`. Losses: step 1 the same
    (same parameters; the loss is reduced in float32); after it the parameters differ by
    updates from gradients off by ~u relative (Adam normalises each update, so an update moves
    by about that fraction of itself); the loss falls 0.1-0.25 a step here, so each step's
    loss should move by well under 1e-3 (measured max 9.6e-5 here; 1.3e-4 over 20 steps)."""
    runs = {}
    for reduce_dtype in DTYPES:
        trainer = _trainer(reduce_dtype)
        program = trainer.program
        check_program(
            program.lowered.as_text(dialect="hlo"),
            program.compiled.as_text(),
            dict(trainer.mesh.shape),
            reduce_dtype,
        )
        runs[reduce_dtype] = _losses(trainer, STEPS)[1]
    f32, bf16 = (np.array([m["loss"] for m in runs[d]]) for d in DTYPES)
    diff = np.abs(f32 - bf16)
    print(f"max |loss difference| over {STEPS} steps, bf16 vs f32 reduction: {diff.max():.3g}")
    print(f"losses f32 {f32.round(5).tolist()}\nlosses bf16 {bf16.round(5).tolist()}")
    assert diff[0] == 0.0
    assert diff.max() <= 1e-3, diff
    assert diff.max() > 0.0  # the option changed the trajectory
    assert f32[-1] < f32[0] - 0.5 and bf16[-1] < bf16[0] - 0.5  # both really trained
