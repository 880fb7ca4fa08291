"""Activation rows on the wire: exact f32, f16 and bf16 as MLX rounds them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from meshd.crdt.views import Instance, InstanceSpec, Stage
from meshd.node.supervisor import send_dtype
from meshd.transport.tensors import TensorError, decode_rows, encode_rows

floats = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 4), st.integers(1, 16)),
    elements=st.floats(width=32, allow_nan=False),
)  # fmt: skip


@given(floats)
@settings(max_examples=200, deadline=None)
def test_f32_is_exact_and_bf16_matches_mlx_rounding(x: np.ndarray) -> None:
    mx = pytest.importorskip("mlx.core")
    rows, hidden = x.shape
    assert np.array_equal(decode_rows(encode_rows(x, "f32").tobytes(), "f32", rows, hidden), x)
    got = decode_rows(encode_rows(x, "bf16").tobytes(), "bf16", rows, hidden)
    want = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(got, want)
    with np.errstate(over="ignore"):
        half = decode_rows(encode_rows(x, "f16").tobytes(), "f16", rows, hidden)
        assert np.array_equal(half, x.astype(np.float16).astype(np.float32))


def test_nan_and_inf_survive_bf16() -> None:
    x = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0]], np.float32)
    got = decode_rows(encode_rows(x, "bf16").tobytes(), "bf16", 1, 5)
    assert np.isnan(got[0, 0]) and got[0, 1] == np.inf and got[0, 2] == -np.inf
    assert np.signbit(got[0, 4])


@pytest.mark.parametrize("dtype,size", [("f32", 4), ("f16", 2), ("bf16", 2)])
def test_a_frame_of_the_wrong_size_or_type_is_refused(dtype: str, size: int) -> None:
    with pytest.raises(TensorError):
        decode_rows(b"\0" * (3 * 8 * size - 1), dtype, 3, 8)
    with pytest.raises(TensorError):
        decode_rows(b"\0" * 8, "f8", 1, 1)


def _inst(engines: list[str], activations: str, exact: bool = False) -> Instance:
    stages = [Stage(node=f"n{i}", start=i, end=i + 1, engine=e) for i, e in enumerate(engines)]
    spec = InstanceSpec(model="m", activations=activations, exact=exact)
    return Instance(id="i", spec=spec, generation=1, stages=stages)


def test_every_hop_narrows_unless_the_instance_is_exact() -> None:
    inst = _inst(["mlx", "mlx", "llama_cpp", "mlx"], "bf16")
    assert [send_dtype(inst, i) for i in range(4)] == ["bf16", "bf16", "bf16", "f32"]
    assert InstanceSpec(model="m").activations == "f16"
    assert send_dtype(_inst(["llama_cpp", "llama_cpp"], "f16"), 0) == "f16"
    assert send_dtype(_inst(["llama_cpp", "llama_cpp"], "f16", exact=True), 0) == "f32"
    assert send_dtype(_inst(["mlx", "mlx"], "f32"), 0) == "f32"
