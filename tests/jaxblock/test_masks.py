"""The one mask convention (True = real / may attend) and its converters, including PyTorch's (True = ignore)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import masks

VALID = np.array([[True, True, False], [True, True, True]])


def test_key_mask_repeats_valid_keys_for_every_query():
    m = np.asarray(masks.attention_mask(jnp.asarray(VALID)))
    assert m.shape == (2, 1, 3, 3)  # [N, 1, L_query, L_key]
    np.testing.assert_array_equal(m[0, 0], [[True, True, False]] * 3)
    np.testing.assert_array_equal(m[1, 0], np.ones((3, 3), bool))


def test_causal_attn_mask_and_segments_combine_by_and():
    causal = np.asarray(masks.attention_mask(jnp.asarray(VALID), causal=True))
    np.testing.assert_array_equal(causal[1, 0], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(causal[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
    allow = np.array([[True, False, True], [True, True, True], [False, True, True]])
    per_row = np.asarray(masks.attention_mask(jnp.asarray(VALID), attn_mask=jnp.asarray(allow)))
    np.testing.assert_array_equal(per_row[1, 0], allow)
    np.testing.assert_array_equal(per_row[0, 0], allow & VALID[0][None, :])
    batch_allow = np.stack([allow, allow.T])
    per_example = np.asarray(masks.attention_mask(jnp.asarray(VALID), attn_mask=jnp.asarray(batch_allow)))
    np.testing.assert_array_equal(per_example[1, 0], allow.T)
    seg = jnp.array([[0, 0, 0], [0, 1, 1]], jnp.int32)
    segs = np.asarray(masks.attention_mask(jnp.asarray(VALID), segment_ids=seg))
    np.testing.assert_array_equal(segs[1, 0], [[1, 0, 0], [0, 1, 1], [0, 1, 1]])


def test_bad_extra_masks_are_rejected():
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        masks.attention_mask(jnp.asarray(VALID), attn_mask=jnp.zeros((3, 3)))
    with pytest.raises(AssertionError):
        masks.attention_mask(jnp.asarray(VALID), attn_mask=jnp.ones((2, 2), bool))
    with pytest.raises(AssertionError):
        masks.attention_mask(jnp.asarray(VALID), segment_ids=jnp.zeros((2, 4), jnp.int32))


def test_check_valid_tokens_messages_say_what_to_pass():
    with pytest.raises(TypeError, match=r"got int32: pass `tokens != pad_id`"):
        masks.check_valid_tokens(jnp.ones((2, 3), jnp.int32), (2, 3))
    with pytest.raises(ValueError, match=r"shape \(3, 2\) but x is \(2, 3\) \+ \[D\]"):
        masks.check_valid_tokens(jnp.ones((3, 2), bool), (2, 3))
    masks.check_valid_tokens(jnp.asarray(VALID), (2, 3))  # the right mask passes


def test_lengths_round_trip_and_left_alignment():
    valid = np.asarray(masks.lengths_to_valid_tokens([2, 3], 3))
    np.testing.assert_array_equal(valid, VALID)
    np.testing.assert_array_equal(np.asarray(masks.valid_tokens_to_lengths(jnp.asarray(VALID))), [2, 3])
    assert masks.is_left_aligned(VALID)
    assert not masks.is_left_aligned(np.array([[True, False, True]]))  # a real token after padding


def test_segment_positions_restart_at_each_segment():
    seg = jnp.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(masks.segment_positions(seg)), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    )


def test_pytorch_key_padding_mask_is_inverted_at_the_boundary():
    kpm = np.array([[False, False, True], [False, False, False]])  # PyTorch: True = ignore
    np.testing.assert_array_equal(masks.from_torch_key_padding_mask(kpm), VALID)
    np.testing.assert_array_equal(masks.to_torch_key_padding_mask(VALID), kpm)
    additive = np.where(kpm, -np.inf, 0.0).astype(np.float32)
    np.testing.assert_array_equal(masks.from_torch_key_padding_mask(additive), VALID)


def test_pytorch_attn_mask_conversions():
    src = np.triu(np.ones((3, 3), bool), k=1)  # PyTorch's causal src_mask: True above the diagonal = ignore
    causal = np.tril(np.ones((3, 3), bool))
    np.testing.assert_array_equal(masks.from_torch_attn_mask(src), causal)
    np.testing.assert_array_equal(masks.from_torch_attn_mask(np.where(src, -np.inf, 0.0)), causal)
    np.testing.assert_array_equal(masks.to_torch_attn_mask(causal), src)
    with pytest.raises(ValueError, match="additive values other than 0 and -inf") as info:
        masks.from_torch_attn_mask(np.array([[0.0, -1.0], [0.0, 0.0]]))
    assert "\n" not in str(info.value)
