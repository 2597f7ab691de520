"""BlockConfig / StackConfig / EncoderConfig: frozen, validated, one-line errors naming the field."""

import pytest
from pydantic import ValidationError

from jaxblock import BlockConfig, EncoderConfig, StackConfig
from jaxblock.config import format_validation_error


def _error_line(**kwargs) -> str:
    """Build an EncoderConfig/BlockConfig from kwargs and return its formatted one-line error."""
    cls = kwargs.pop("cls", BlockConfig)
    with pytest.raises(ValidationError) as info:
        cls(**kwargs)
    line = format_validation_error(info.value)
    assert "\n" not in line, line
    return line


def test_defaults_are_pytorch_compatible_and_derived_sizes_follow():
    cfg = BlockConfig(model_dim=64, num_heads=8, ffn_dim=256)
    assert (cfg.head_dim, cfg.kv_heads) == (8, 8)
    assert cfg.norm_eps == 1e-5 and cfg.activation == "gelu"  # PyTorch's eps and exact-erf GELU
    assert cfg.norm == "pre" and cfg.use_bias
    assert BlockConfig(model_dim=64, num_heads=8, num_kv_heads=2).kv_heads == 2
    assert BlockConfig(activation="swiglu").is_glu and not BlockConfig(activation="gelu_tanh").is_glu


def test_config_is_frozen_and_varied_with_model_copy():
    cfg = BlockConfig(model_dim=16, num_heads=2, ffn_dim=32)
    with pytest.raises(ValidationError):
        cfg.model_dim = 32  # type: ignore[misc]
    post = cfg.model_copy(update={"norm": "post"})
    assert (post.norm, cfg.norm) == ("post", "pre")
    assert post.model_dim == 16


def test_heads_must_divide_width_and_the_message_names_both_fields():
    line = _error_line(model_dim=10, num_heads=4)
    assert "model_dim=10" in line and "num_heads=4" in line and "pick num_heads" in line


def test_kv_heads_must_divide_heads():
    line = _error_line(model_dim=16, num_heads=4, num_kv_heads=3)
    assert "num_kv_heads=3" in line and "divide num_heads=4" in line


def test_unknown_key_is_named_with_the_fix():
    assert _error_line(model_dimm=8) == "unknown key 'model_dimm': remove it or check its spelling"


@pytest.mark.parametrize("field", ["attn_dropout", "ffn_dropout", "residual_dropout"])
def test_negative_dropout_names_the_field_and_the_bad_value(field):
    line = _error_line(**{field: -0.1})
    assert line.startswith(f"{field}:") and "greater than or equal to 0" in line and "-0.1" in line


def test_dropout_of_one_and_zero_eps_are_rejected():
    assert _error_line(ffn_dropout=1.0).startswith("ffn_dropout:")
    assert _error_line(norm_eps=0.0).startswith("norm_eps:")  # eps sits inside the sqrt; never drop it


def test_bad_literal_names_the_field():
    line = _error_line(activation="swish")
    assert line.startswith("activation:") and "'swish'" in line


def test_nested_block_error_is_located_under_block():
    line = _error_line(cls=EncoderConfig, num_layers=2, block=dict(model_dim=8, num_heads=3))
    assert line.startswith("block:") and "num_heads=3" in line
    assert _error_line(cls=EncoderConfig, block=dict(model_dim=8, typo=1)).startswith("unknown key 'block.typo'")


def test_rope_follows_positions_and_a_stray_block_rope_is_rejected():
    cfg = EncoderConfig(positions="rope", block=dict(model_dim=16, num_heads=2, ffn_dim=32))
    assert cfg.block.rope
    # The block given as a model, not a dict, is updated the same way.
    cfg2 = EncoderConfig(positions="rope", block=BlockConfig(model_dim=16, num_heads=2, ffn_dim=32))
    assert cfg2.block.rope
    line = _error_line(cls=EncoderConfig, block=dict(model_dim=16, num_heads=2, rope=True))
    assert "positions='learned'" in line and "set positions='rope'" in line
    line = _error_line(cls=EncoderConfig, positions="rope", block=dict(model_dim=6, num_heads=2))
    assert "even head width" in line and "got model_dim/num_heads=3" in line


def test_final_norm_default_follows_the_placement():
    assert StackConfig(block=dict(norm="pre")).has_final_norm
    assert not StackConfig(block=dict(norm="post")).has_final_norm
    assert StackConfig(block=dict(norm="post"), final_norm=True).has_final_norm
    assert not StackConfig(block=dict(norm="pre"), final_norm=False).has_final_norm


def test_dtype_names_map_to_jax_dtypes():
    import jax.numpy as jnp

    cfg = BlockConfig(dtype="bfloat16")
    assert cfg.compute_dtype == jnp.bfloat16 and cfg.params_dtype == jnp.float32
