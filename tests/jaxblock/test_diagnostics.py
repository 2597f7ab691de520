"""jaxblock.diagnostics: every check passes on the library's models and catches the defect it is for.

Broken variants are built here, in the test code: a block that ignores the key mask, a Pre-LN stack
without its final norm, a norm after a Pre-LN add, one norm instance shared by both sublayers, and a
NaN in block 3's FFN. Every model uses the same small shapes so that eager op compilation is shared.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxblock import (
    Classifier,
    EncoderBlock,
    EncoderConfig,
    EncoderStack,
    StackConfig,
    stack_layer_params,
    unstack_layer_params,
)
from jaxblock import diagnostics as dg
from jaxblock.norms import make_norm

# The shapes of configs/tiny.yaml diagnosed with --batch-size 4: eager op compilations are shared.
N, L, D, F, B, V, C = 4, 16, 32, 64, 4, 259, 2
BLOCK = dict(model_dim=D, num_heads=2, ffn_dim=F)


def classification_loss(logits: jax.Array, batch: Any) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def projection_loss(out: jax.Array, batch: Any) -> jax.Array:
    """A loss on a stack's [N, L, D] output that weighs every real feature differently."""
    w = jnp.linspace(-1.0, 1.0, D)[None, None, :]  # [1, 1, D]
    return jnp.sum(out * w * batch["valid_tokens"][..., None]) / N


def token_batch(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    lengths = np.array([L, 9, 3, L])
    return {
        "tokens": jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32),
        "valid_tokens": jnp.asarray(np.arange(L)[None, :] < lengths[:, None]),
        "labels": jnp.asarray([0, 1, 1, 0], jnp.int32),
    }


def float_batch(seed: int = 0) -> dict[str, jax.Array]:
    b = token_batch(seed)
    x = np.random.default_rng(seed + 1).normal(size=(N, L, D)).astype(np.float32)
    return {"x": jnp.asarray(x), "valid_tokens": b["valid_tokens"]}


def classifier(norm: str = "pre", **stack: Any) -> Classifier:
    return Classifier(EncoderConfig(num_layers=B, vocab_size=V, max_len=L, num_classes=C,
                                    block=dict(BLOCK, norm=norm), **stack))


def init(model: nn.Module, batch: dict[str, jax.Array], seed: int = 0) -> Any:
    x = batch["x"] if "x" in batch else batch["tokens"]
    return nn.unbox(model.init(jax.random.key(seed), x, batch["valid_tokens"]))


@functools.cache
def _shared_variables(kind: str) -> Any:
    model = stack() if kind == "stack" else classifier()
    return init(model, float_batch() if kind == "stack" else token_batch())


def stack() -> EncoderStack:
    return EncoderStack(StackConfig(num_layers=B, block=BLOCK))


def stack_variables() -> Any:
    """Variables of stack() (and of every variant with its parameter tree: VariantStack has EncoderStack's
    layout) on float_batch(), initialised once: a fresh copy of the containers, for tests that edit them."""
    return jax.tree.map(lambda a: a, _shared_variables("stack"))


def classifier_variables() -> Any:
    """Variables of classifier() on token_batch(), initialised once (a fresh copy of the containers)."""
    return jax.tree.map(lambda a: a, _shared_variables("classifier"))


# --- variants: the defects users actually write ---------------------------------------------------


class VariantStack(nn.Module):
    """EncoderStack's layout (layers_i + final_norm) around any block class: the test harness."""

    config: StackConfig
    block: type = EncoderBlock

    @nn.compact
    def __call__(self, x: jax.Array, valid_tokens: jax.Array, *, train: bool = False) -> jax.Array:
        for i in range(self.config.num_layers):
            x = self.block(self.config.block, name=f"layers_{i}")(x, valid_tokens, train=train)
        if self.config.has_final_norm:
            x = make_norm(self.config.block, "final_norm")(x)
        return x


class NoKeyMaskBlock(EncoderBlock):
    """Attention ignores valid_tokens: padded keys are attended to."""

    def __call__(self, x: jax.Array, valid_tokens: jax.Array, **kw: Any) -> jax.Array:  # type: ignore[override]
        return super().__call__(x, jnp.ones_like(valid_tokens), **kw)


class ExtraNormBlock(EncoderBlock):
    """Pre-LN with a norm after the attention add: a third architecture, not Pre-LN."""

    def setup(self) -> None:
        super().setup()
        self.extra_norm = make_norm(self.config)

    def __call__(self, x: jax.Array, valid_tokens: jax.Array, *, train: bool = False) -> jax.Array:  # type: ignore[override]
        a = self._record("attn_branch", self.self_attn(self._record("norm1", self.attn_norm(x)), valid_tokens))
        u = self.extra_norm(self._record("after_attn", x + a))
        f = self._record("ffn_branch", self.ffn(self._record("norm2", self.ffn_norm(u))))
        return self._record("after_ffn", u + f)


class SharedNormBlock(EncoderBlock):
    """Pre-LN that normalizes both sublayers with the one attn_norm instance."""

    def __call__(self, x: jax.Array, valid_tokens: jax.Array, *, train: bool = False) -> jax.Array:  # type: ignore[override]
        a = self._record("attn_branch", self.self_attn(self._record("norm1", self.attn_norm(x)), valid_tokens))
        u = self._record("after_attn", x + a)
        f = self._record("ffn_branch", self.ffn(self._record("norm2", self.attn_norm(u))))
        return self._record("after_ffn", u + f)


def variant(block: type, **stack: Any) -> VariantStack:
    return VariantStack(StackConfig(num_layers=B, block=BLOCK, **stack), block)


def checks(model: nn.Module, variables: Any, batch: Any) -> dict[str, dg.CheckResult]:
    return {r.name: r for r in (dg.padding_invariance(model, variables, batch),
                                dg.sublayer_ablation(model, variables, batch),
                                dg.structure(model, variables, batch))}


# --- every check passes on correct models ---------------------------------------------------------


@pytest.mark.parametrize("norm", ["pre", pytest.param("post", marks=pytest.mark.slow)])
def test_all_checks_pass_on_the_classifier(norm: str) -> None:
    model = classifier(norm, embedding=dict(dropout=0.1))
    batch = token_batch()
    d = dg.run_all(model, model.init(jax.random.key(0), batch["tokens"], batch["valid_tokens"]), batch,
                   classification_loss)
    assert d.failed == [], "\n".join(str(r) for r in d.results)
    assert len(d.ratios.attn) == len(d.grads.input_grad) == B
    assert all(0.0 < r < 10.0 for r in d.ratios.attn + d.ratios.ffn)
    assert set(d.ratios.as_metrics()) == {f"residual_ratio/{s}/layer_{i}" for s in ("attn", "ffn") for i in range(B)}
    determinism = d.checks[-1]
    assert [p[0] for p in determinism.parts][-2:] == ["train differs between dropout keys", "train differs from eval"]


@pytest.mark.slow
def test_all_checks_pass_on_a_scanned_stack_and_match_the_unrolled_one() -> None:
    batch = float_batch()
    scanned = EncoderStack(StackConfig(num_layers=B, scan_layers=True, block=BLOCK))
    unrolled = stack()
    # A stacked tree (leading [B] axis), made without compiling the scanned init.
    variables = stack_layer_params(stack_variables())
    assert variables["params"]["layers"]["ffn"]["linear2"]["kernel"].shape == (B, F, D)
    results: list[Any] = [*checks(scanned, variables, batch).values(),
                          dg.train_eval_determinism(scanned, variables, batch),
                          dg.first_nonfinite(scanned, variables, batch)]
    assert all(r.passed for r in results), "\n".join(map(str, results))
    # No dropout configured: training must equal eval.
    assert results[3].parts[-1][0] == "no dropout configured: train equals eval"
    ratios = dg.residual_ratios(scanned, variables, batch)
    ref = dg.residual_ratios(unrolled, unstack_layer_params(variables), batch)
    np.testing.assert_allclose(ratios.attn + ratios.ffn, ref.attn + ref.ffn, rtol=1e-6)


def test_the_variant_harness_itself_is_correct() -> None:
    """The unmodified block in the test harness passes: the failures below come from the defects."""
    batch = float_batch()
    model = variant(EncoderBlock)
    results = checks(model, stack_variables(), batch)
    assert all(r.passed for r in results.values()), "\n".join(map(str, results.values()))


# --- each defect is reported by the check that is for it ------------------------------------------


def test_padding_invariance_catches_a_removed_key_mask() -> None:
    batch = float_batch()
    model = variant(NoKeyMaskBlock)
    results = checks(model, stack_variables(), batch)
    assert not results["padding_invariance"].passed
    assert results["sublayer_ablation"].passed and results["structure"].passed
    failed = [name for name, ok, _ in results["padding_invariance"].parts if not ok]
    assert failed[0] == "layer 0 real positions"  # the leak starts in the first block


def test_padding_invariance_catches_it_in_pooled_logits_too() -> None:
    """Same defect seen through a classifier: the pooled logits move."""
    batch = token_batch()
    good = classifier()
    variables = classifier_variables()

    def no_mask(next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        if ctx.module.name == "self_attn" and ctx.method_name == "__call__":
            args = (args[0], jnp.ones_like(args[1]), *args[2:])
        return next_fun(*args, **kwargs)

    assert dg.padding_invariance(good, variables, batch).passed
    with nn.intercept_methods(no_mask):
        result = dg.padding_invariance(good, variables, batch)
    assert not result.passed
    assert not dict((n, ok) for n, ok, _ in result.parts)["pooled logits"]


def test_structure_catches_a_missing_final_norm() -> None:
    batch = float_batch()
    model = EncoderStack(StackConfig(num_layers=B, final_norm=False, block=BLOCK))
    results = checks(model, init(model, batch), batch)
    assert results["padding_invariance"].passed and results["sublayer_ablation"].passed
    assert not results["structure"].passed
    assert "no final_norm" in results["structure"].summary()


def test_structure_catches_a_norm_after_the_pre_ln_add() -> None:
    batch = float_batch()
    model = variant(ExtraNormBlock)
    results = checks(model, init(model, batch), batch)
    assert results["padding_invariance"].passed
    parts = {n: ok for n, ok, _ in results["structure"].parts}
    assert not parts["both branches zeroed: each Pre-LN block is the identity"]
    assert not results["sublayer_ablation"].passed  # y = LN(x) + FFN, not x + FFN


def test_structure_catches_one_norm_shared_by_both_sublayers() -> None:
    batch = float_batch()
    model = variant(SharedNormBlock)
    results = checks(model, init(model, batch), batch)  # its own tree: no ffn_norm parameters
    assert results["padding_invariance"].passed and results["sublayer_ablation"].passed
    assert not results["structure"].passed
    assert "ffn_norm missing" in results["structure"].summary()


def test_structure_catches_a_norm_instance_applied_to_the_wrong_sublayer() -> None:
    """Both instances exist (same param tree as the library's), but ffn_norm normalizes attention's input."""

    class SwappedNormBlock(EncoderBlock):
        def __call__(self, x: jax.Array, valid_tokens: jax.Array, *, train: bool = False) -> jax.Array:  # type: ignore[override]
            a = self._record("attn_branch", self.self_attn(self._record("norm1", self.ffn_norm(x)), valid_tokens))
            u = self._record("after_attn", x + a)
            f = self._record("ffn_branch", self.ffn(self._record("norm2", self.attn_norm(u))))
            return self._record("after_ffn", u + f)

    batch = float_batch()
    model = variant(SwappedNormBlock)
    variables = init(model, batch)
    assert set(variables["params"]["layers_0"]) >= {"attn_norm", "ffn_norm"}
    result = dg.structure(model, variables, batch)
    assert not dict((n, ok) for n, ok, _ in result.parts)["norm1 = attn_norm(x), norm2 = ffn_norm(after_attn)"]


class FFNNormReadsInputBlock(EncoderBlock):
    """Re-wired, nothing renamed: Pre-LN whose FFN norm reads the block input X instead of U."""

    def __call__(self, x: jax.Array, valid_tokens: jax.Array, *, train: bool = False) -> jax.Array:  # type: ignore[override]
        a = self._record("attn_branch", self.self_attn(self._record("norm1", self.attn_norm(x)), valid_tokens))
        u = self._record("after_attn", x + a)
        f = self._record("ffn_branch", self.ffn(self._record("norm2", self.ffn_norm(x))))
        return self._record("after_ffn", u + f)


class PostWiredBlock(EncoderBlock):
    """Re-wired, nothing renamed: the Post-LN equations run under a Pre-LN config."""

    def __call__(self, x: jax.Array, valid_tokens: jax.Array, *, train: bool = False) -> jax.Array:  # type: ignore[override]
        a = self._record("attn_branch", self.self_attn(x, valid_tokens))
        u = self._record("norm1", self.attn_norm(self._record("after_attn", x + a)))
        f = self._record("ffn_branch", self.ffn(u))
        return self._record("norm2", self.ffn_norm(self._record("after_ffn", u + f)))


@pytest.mark.parametrize(("block", "ablation_fails"), [(FFNNormReadsInputBlock, False), (PostWiredBlock, True)])
def test_a_rewired_block_with_the_same_names_fails_the_wiring_checks(block: type, ablation_fails: bool) -> None:
    """Same submodules, same parameter tree, same recorded names: only the wiring differs, and the
    checks that replay the shared wiring description (jaxblock.wiring.PRE_LN) catch it."""
    batch = float_batch()
    model = variant(block)
    variables = init(model, batch)
    reference = stack_variables()  # the library's stack: the unmodified block's tree
    assert jax.tree.structure(variables) == jax.tree.structure(reference)
    result = dg.structure(model, variables, batch)
    parts = {n: ok for n, ok, _ in result.parts}
    assert not parts["every recorded value and the output follow the Pre-LN wiring"], str(result)
    assert not parts["norm1 = attn_norm(x), norm2 = ffn_norm(after_attn)"], str(result)
    # Ablation replays the wiring from the recorded branches: only a change of the add/norm order shows there.
    assert dg.sublayer_ablation(model, variables, batch).passed is not ablation_fails


def test_first_nonfinite_names_block_3_ffn() -> None:
    batch = token_batch()
    model = classifier()
    variables = classifier_variables()
    assert dg.first_nonfinite(model, variables, batch).passed
    kernel = variables["params"]["encoder"]["stack"]["layers_3"]["ffn"]["linear1"]["kernel"]
    variables["params"]["encoder"]["stack"]["layers_3"]["ffn"]["linear1"]["kernel"] = kernel.at[2, 5].set(jnp.nan)
    result = dg.first_nonfinite(model, variables, batch)
    assert (result.passed, result.layer, result.sublayer, result.site) == (False, 3, "FFN", "ffn_branch")
    assert result.count == N * L * D  # one NaN hidden unit reaches every output feature of every token
    assert result.input_stats is not None and result.input_stats.nonfinite == 0
    assert np.isfinite(result.input_stats.absmax) and result.input_stats.absmax > 0
    # The other checks still run; the gradient check reports the non-finite loss.
    assert not dg.grad_norms_by_depth(model, variables, batch, classification_loss).passed


def test_first_nonfinite_follows_the_post_ln_execution_order() -> None:
    """Post-LN runs attention on the raw block input: a NaN in layer 1's query names layer 1's attention."""
    batch = float_batch()
    model = EncoderStack(StackConfig(num_layers=B, block=dict(BLOCK, norm="post")))
    variables = init(model, batch)
    q = variables["params"]["layers_1"]["self_attn"]["query"]["kernel"]
    variables["params"]["layers_1"]["self_attn"]["query"]["kernel"] = q.at[0, 0, 0].set(jnp.inf)
    result = dg.first_nonfinite(model, variables, batch)
    assert (result.layer, result.sublayer, result.site) == (1, "attention", "attn_branch")
    bad_input = {**batch, "x": batch["x"].at[0, 0, 0].set(jnp.nan)}
    result = dg.first_nonfinite(model, init(model, batch), bad_input)
    assert (result.layer, result.sublayer) == (None, "embedding")


# --- measurements: real values --------------------------------------------------------------------


def test_residual_ratio_scales_with_the_branch_and_fails_above_the_limit() -> None:
    """Scaling layer 1's attention out projection by 10 scales exactly its attention ratio by 10."""
    batch = float_batch()
    model = stack()
    variables = stack_variables()
    base = dg.residual_ratios(model, variables, batch)
    out = variables["params"]["layers_1"]["self_attn"]["out"]
    scaled = jax.tree.map(lambda p: p * 10.0, out)
    variables["params"]["layers_1"]["self_attn"]["out"] = scaled
    big = dg.residual_ratios(model, variables, batch, limit=5.0 * base.attn[1])
    np.testing.assert_allclose(big.attn[1], 10.0 * base.attn[1], rtol=1e-5)
    np.testing.assert_allclose(big.attn[0], base.attn[0], rtol=1e-6)
    np.testing.assert_allclose(big.ffn[0], base.ffn[0], rtol=1e-6)
    assert base.passed and not big.passed
    # By hand for layer 0: ||attn_branch|| / ||x|| over real tokens, with x the stack input.
    _, state = model.apply(variables, batch["x"], batch["valid_tokens"], mutable=["intermediates"])
    branch = np.asarray(state["intermediates"]["layers_0"]["attn_branch"][0])[np.asarray(batch["valid_tokens"])]
    x = np.asarray(batch["x"])[np.asarray(batch["valid_tokens"])]
    np.testing.assert_allclose(big.attn[0], np.linalg.norm(branch) / np.linalg.norm(x), rtol=1e-5)


def test_grad_norms_match_direct_gradients() -> None:
    batch = float_batch()
    model = stack()
    variables = stack_variables()
    g = dg.grad_norms_by_depth(model, variables, batch, projection_loss)

    def loss(params: Any, x: jax.Array) -> jax.Array:
        out: Any = model.apply({"params": params}, x, batch["valid_tokens"])
        return projection_loss(out, batch)

    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], batch["x"])  # one compile, not ~100
    np.testing.assert_allclose(g.input_grad[0], np.linalg.norm(gx), rtol=1e-5)
    for i in range(B):
        leaves = jax.tree.leaves(gp[f"layers_{i}"])
        np.testing.assert_allclose(g.param_grad[i], np.sqrt(sum(np.sum(np.square(x)) for x in leaves)), rtol=1e-5)
        kernel = gp[f"layers_{i}"]["ffn"]["linear2"]["kernel"]
        np.testing.assert_allclose(g.ffn_out_kernel_grad[i], np.linalg.norm(kernel), rtol=1e-5)
    assert g.passed and g.input_grad[B - 1] > 0
    assert set(g.as_metrics()) == {f"grad_norm/{s}/layer_{i}" for s in ("input", "params") for i in range(B)}


# --- python -m train diagnose ---------------------------------------------------------------------


@pytest.mark.slow  # the CLI end to end
def test_diagnose_on_the_tiny_config_writes_the_report_and_plots(tmp_path: Any, capsys: Any) -> None:
    from pathlib import Path

    from train import diagnose

    config = Path(__file__).parents[2] / "configs" / "tiny.yaml"
    out = tmp_path / "report"
    assert diagnose.main(["--config", str(config), "--out", str(out), "--batch-size", "4"]) == 0
    assert "all 7 checks passed" in capsys.readouterr().out
    text = (out / "report.md").read_text()
    for name in ("first_nonfinite", "padding_invariance", "sublayer_ablation", "structure",
                 "train_eval_determinism", "residual_ratios", "grad_norms_by_depth"):
        assert f"| `{name}` | PASS |" in text
    assert "![residual ratios by layer](residual_ratios.png)" in text
    for png in ("residual_ratios.png", "grad_norms.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diagnose_exits_1_naming_the_failed_check(tmp_path: Any, capsys: Any) -> None:
    from train import diagnose

    batch = token_batch()
    model = classifier(final_norm=False)  # a Pre-LN stack without its final norm
    assert diagnose.diagnose(model, init(model, batch), batch, tmp_path, title="broken") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diagnose: check 'structure' failed: ")
    assert "no final_norm" in err[0]
    assert "| `structure` | **FAIL** |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    ([], "needs --config C"),
    (["--config", "no/such.yaml"], "not found"),
    (["--config", "configs/tiny.yaml", "model.block.num_heads=3"], "model.block"),
    (["--workdir", "no/such/run"], "does not exist"),
    (["--bogus"], "unrecognized arguments"),
])
def test_diagnose_bad_input_exits_2_with_one_line_and_writes_nothing(
    argv: list[str], message: str, tmp_path: Any, capsys: Any, monkeypatch: Any
) -> None:
    from pathlib import Path

    from train import diagnose

    monkeypatch.chdir(Path(__file__).parents[2])
    out = tmp_path / "out"
    assert diagnose.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.slow
def test_diagnose_a_trained_checkpoint(tmp_path: Any) -> None:
    """Train the tiny config, then diagnose its checkpoint (--workdir): every check passes."""
    from pathlib import Path

    from train import diagnose
    from train.__main__ import main as train_main

    config = Path(__file__).parents[2] / "configs" / "tiny.yaml"
    workdir = tmp_path / "run"
    assert train_main(["--config", str(config), "--workdir", str(workdir), "train.progress=false"]) == 0
    assert diagnose.main(["--workdir", str(workdir)]) == 0
    assert "checkpoint in" in (workdir / "diagnose" / "report.md").read_text()


def test_checks_run_on_an_encoder_too() -> None:
    """Encoder (embedding + stack, output [N, L, D]): the stack output is found inside it."""
    from jaxblock import Encoder

    batch = token_batch()
    model = Encoder(EncoderConfig(num_layers=B, vocab_size=V, max_len=L, block=BLOCK))
    variables = init(model, batch)
    results = checks(model, variables, batch)
    assert all(r.passed for r in results.values()), "\n".join(map(str, results.values()))
    assert "Pre-LN stack output normalized per token" in [n for n, _, _ in results["structure"].parts]


def test_the_compiled_measures_see_an_ambient_interceptor_after_a_call_without_it() -> None:
    """residual_ratios compiles per model; a caller's nn.intercept_methods is not in jit's cache key, so
    under one the measure must run the model again rather than replay the program compiled before."""
    batch = float_batch()
    model = EncoderStack(StackConfig(num_layers=B, block=BLOCK))
    variables = init(model, batch)
    plain = dg.residual_ratios(model, variables, batch).attn

    def double_attention(next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        out = next_fun(*args, **kwargs)
        return out * 2 if ctx.module.name == "self_attn" and ctx.method_name == "__call__" else out

    with nn.intercept_methods(double_attention):
        doubled = dg.residual_ratios(model, variables, batch).attn
    np.testing.assert_allclose(doubled[0], 2 * plain[0], rtol=1e-5)  # the first block's stream is unchanged
    assert all(abs(d - p) > 1e-3 for d, p in zip(doubled, plain, strict=True))
