"""train/loop/state.py: which parameters take weight decay, the learning-rate schedules (values computed by
hand at chosen steps), and the one abstract init that gives both parameter shapes and logical specs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from jaxblock.config import EncoderConfig
from jaxblock.model import Classifier
from train.config import OptimConfig
from train.loop.state import abstract_init, create_state, decay_mask, init_params, make_schedule

MODEL = EncoderConfig(vocab_size=20, max_len=8, num_layers=1, num_classes=2,
                      block={"model_dim": 16, "num_heads": 2, "ffn_dim": 32})
LAYER = "encoder/stack/layers_0"
# Every matrix of the model: attention projections, FFN and the classifier head.
KERNELS = {f"{LAYER}/self_attn/{p}/kernel" for p in ("query", "key", "value", "out")} | {
    f"{LAYER}/ffn/linear1/kernel", f"{LAYER}/ffn/linear2/kernel", "head/kernel"}
EMBEDDINGS = {"encoder/embedding", "encoder/pos_embedding"}


@pytest.fixture(scope="module")
def params():
    # One compiled init rather than every initializer's primitives compiled one by one (the values agree).
    return jax.jit(lambda: init_params(Classifier(MODEL), 0, 8))()


def flat(tree) -> dict[str, object]:
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_decay_mask_decays_matrices_only(params):
    mask = flat(decay_mask(params, decay_embeddings=False))
    assert set(mask) == set(flat(params))
    assert {name for name, decayed in mask.items() if decayed} == KERNELS
    # Never decayed: biases, norm scales and biases (and embeddings unless asked).
    assert all(not mask[name] for name in mask if name.endswith(("/bias", "/scale")))
    assert not any(mask[name] for name in EMBEDDINGS)


def test_decay_mask_with_decay_embeddings(params):
    mask = flat(decay_mask(params, decay_embeddings=True))
    assert {name for name, decayed in mask.items() if decayed} == KERNELS | EMBEDDINGS


def test_weight_decay_reaches_only_the_masked_leaves(params):
    """AdamW with a zero gradient moves exactly the decayed leaves, by lr * weight_decay * value."""
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, schedule="constant", warmup_steps=0, clip_norm=None)
    state = create_state(Classifier(MODEL), params, cfg, 10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    after = flat(jax.jit(lambda s: s.apply_gradients(grads=zeros).params)(state))
    before, mask = flat(params), flat(decay_mask(params, False))
    for name, value in before.items():
        expected = np.asarray(value) * (1 - 0.1 * 0.5) if mask[name] else np.asarray(value)
        np.testing.assert_allclose(after[name], expected, rtol=1e-6, err_msg=name)


def lr_at(schedule: optax.Schedule, step: int) -> float:
    return float(schedule(step))


def test_warmup_then_cosine():
    # total 110, warmup 10: 0 -> 1e-2 linearly over steps 0..10, then cosine over the remaining 100 steps to
    # end_lr_ratio * peak = 1e-3: lr(10 + t) = 1e-3 + (1e-2 - 1e-3) * (1 + cos(pi * t / 100)) / 2.
    s = make_schedule(OptimConfig(lr=1e-2, warmup_steps=10, schedule="cosine", end_lr_ratio=0.1), 110)
    assert lr_at(s, 0) == 0.0
    assert lr_at(s, 5) == pytest.approx(5e-3)
    assert lr_at(s, 10) == pytest.approx(1e-2)
    assert lr_at(s, 35) == pytest.approx(1e-3 + 9e-3 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(s, 60) == pytest.approx(5.5e-3)  # halfway: the midpoint of peak and end
    assert lr_at(s, 110) == pytest.approx(1e-3)


def test_warmup_then_linear():
    # total 100, warmup 20, linear from 2e-3 down to 0 over 80 steps.
    s = make_schedule(OptimConfig(lr=2e-3, warmup_steps=20, schedule="linear"), 100)
    assert lr_at(s, 1) == pytest.approx(1e-4)
    assert lr_at(s, 20) == pytest.approx(2e-3)
    assert lr_at(s, 40) == pytest.approx(1.5e-3)
    assert lr_at(s, 80) == pytest.approx(5e-4)
    assert lr_at(s, 100) == pytest.approx(0.0, abs=1e-12)


def test_constant_with_and_without_warmup():
    warm = make_schedule(OptimConfig(lr=3e-4, warmup_steps=4, schedule="constant"), 50)
    assert [lr_at(warm, t) for t in (0, 1, 2, 4, 49)] == pytest.approx([0.0, 7.5e-5, 1.5e-4, 3e-4, 3e-4])
    cold = make_schedule(OptimConfig(lr=3e-4, warmup_steps=0, schedule="constant"), 50)
    assert lr_at(cold, 0) == pytest.approx(3e-4)


def test_warmup_longer_than_the_run_is_cut_to_leave_a_last_step():
    # warmup_steps=100 of a 10-step run: warm up over 9 steps, so step 9 runs at the peak.
    s = make_schedule(OptimConfig(lr=1e-2, warmup_steps=100, schedule="linear"), 10)
    assert lr_at(s, 3) == pytest.approx(1e-2 * 3 / 9)
    assert lr_at(s, 9) == pytest.approx(1e-2)


def test_the_state_reports_the_schedule(params):
    cfg = OptimConfig(lr=1e-2, warmup_steps=10, schedule="linear")
    state = create_state(Classifier(MODEL), params, cfg, 30)
    assert float(state.lr_schedule(5)) == pytest.approx(5e-3)


def test_abstract_init_gives_shapes_and_logical_specs_from_one_tree(params):
    shapes, specs = abstract_init(Classifier(MODEL), 8)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), params)
    flat_specs = flat(jax.tree.map(lambda s: s, specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
    assert set(flat_specs) == set(flat(params))
    assert flat_specs[f"{LAYER}/ffn/linear1/kernel"] == PartitionSpec("embed", "mlp")
