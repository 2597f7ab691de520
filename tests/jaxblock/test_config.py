"""BlockConfig / StackConfig / EncoderConfig: frozen, validated, one-line errors naming the field."""

import pytest
from pydantic import ValidationError

from jaxblock import BlockConfig, EncoderConfig, StackConfig
from jaxblock.config import (
    RENAMED,
    AttentionConfig,
    EmbeddingConfig,
    PoolerConfig,
    format_validation_error,
    migrate_model,
    renamed,
)


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


@pytest.mark.parametrize("field", ["attention.dropout", "ffn_dropout", "residual_dropout"])
def test_negative_dropout_names_the_field_and_the_bad_value(field):
    group, _, name = field.rpartition(".")
    line = _error_line(**({group: {name: -0.1}} if group else {name: -0.1}))
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


def test_rope_is_said_once_in_the_attention_and_added_positions_are_refused_beside_it():
    rope = dict(model_dim=16, num_heads=2, ffn_dim=32, attention=dict(rope=True))
    cfg = EncoderConfig(block=rope, embedding=dict(positions="none"))
    assert cfg.block.attention.rope and cfg.embedding.positions == "none"
    line = _error_line(cls=EncoderConfig, block=rope)  # the default learned table would add positions too
    assert "embedding.positions='learned'" in line and "set embedding.positions=none" in line
    line = _error_line(cls=EncoderConfig, embedding=dict(positions="rope"))
    assert line == "embedding.positions='rope' is now embedding.positions=none and block.attention.rope=true"
    line = _error_line(attention=dict(rope=True), model_dim=6, num_heads=2)
    assert "even head width" in line and "got model_dim/num_heads=3" in line


def test_every_group_is_optional_and_takes_dicts():
    cfg = EncoderConfig(block=dict(model_dim=32, attention=dict(dropout=0.1)), pooler=dict(pooling="cls"))
    assert cfg.block.attention.dropout == 0.1 and cfg.block.num_heads == 4 and cfg.pooler.has_dense
    assert cfg.embedding == EmbeddingConfig() and cfg.layers.per_layer == {}
    assert BlockConfig(attention=AttentionConfig(kernel="xla")).with_kernel("dense").attention.kernel == "dense"
    assert not PoolerConfig(pooling="cls", dense=False).has_dense and PoolerConfig(dense=True).has_dense


@pytest.mark.parametrize(("kwargs", "cls", "line"), [
    (dict(block=dict(attn_dropout=0.1)), EncoderConfig,
     "unknown key 'block.attn_dropout': it is now block.attention.dropout"),
    (dict(attn_dropout=0.1), BlockConfig, "unknown key 'attn_dropout': it is now attention.dropout"),
    (dict(attention="xla"), BlockConfig, "unknown key 'attention': it is now attention.kernel"),
    (dict(pooling="cls"), EncoderConfig, "unknown key 'pooling': it is now pooler.pooling"),
    (dict(pooler="dense"), EncoderConfig, "unknown key 'pooler': it is now pooler.dense=true"),
    (dict(positions="rope"), EncoderConfig,
     "unknown key 'positions': it is now embedding.positions=none and block.attention.rope=true"),
    (dict(layer_windows=(1, None)), EncoderConfig, "unknown key 'layer_windows': it is now layers.window"),
    (dict(embed_dim=8), EncoderConfig, "unknown key 'embed_dim': it is now embedding.dim"),
])
def test_a_key_of_the_flat_layout_is_refused_with_its_new_key(kwargs, cls, line):
    assert _error_line(cls=cls, **kwargs) == line


def test_every_old_key_has_a_new_home_that_exists():
    for old in RENAMED:
        for new, _ in renamed(old, "rope" if old == "positions" else "dense" if old == "pooler" else 1):
            *groups, name = new.split(".")
            cls: type = EncoderConfig
            for group in groups:
                cls = cls.model_fields[group].annotation
            assert name in cls.model_fields, (old, new)


def test_a_dumped_config_of_the_flat_layout_migrates_to_the_same_config():
    old = {"num_layers": 2, "positions": "rope", "pooler": "none", "pooling": "cls", "embed_dropout": 0.1,
           "layer_windows": [2, None], "block": {"model_dim": 16, "num_heads": 2, "rope": True, "causal": True,
                                                 "attention": "chunked", "attn_chunk_size": 4}}
    cfg = EncoderConfig.model_validate(migrate_model(old))
    assert cfg == EncoderConfig(
        num_layers=2, embedding=dict(positions="none", dropout=0.1), pooler=dict(pooling="cls", dense=False),
        layers=dict(window=(2, None)),
        block=dict(model_dim=16, num_heads=2, attention=dict(rope=True, causal=True, kernel="chunked", chunk_size=4)))
    assert migrate_model(cfg.model_dump(mode="json")) == cfg.model_dump(mode="json")  # the new layout stays


def test_final_norm_default_follows_the_placement():
    assert StackConfig(block=dict(norm="pre")).has_final_norm
    assert not StackConfig(block=dict(norm="post")).has_final_norm
    assert StackConfig(block=dict(norm="post"), final_norm=True).has_final_norm
    assert not StackConfig(block=dict(norm="pre"), final_norm=False).has_final_norm


def test_dtype_names_map_to_jax_dtypes():
    import jax.numpy as jnp

    cfg = BlockConfig(dtype="bfloat16")
    assert cfg.compute_dtype == jnp.bfloat16 and cfg.params_dtype == jnp.float32
