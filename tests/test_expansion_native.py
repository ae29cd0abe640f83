"""The fused CPU kernel of the low-rank view expansion (`kvprof.kernels.expansion`) against the expansion written out
in torch: K = K_base + RoPE(F·B) with the model's own `Rope.rotate`, V = V_base + F·B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvprof.kernels import expansion
from kvprof.kernels.attention import EXPAND, SHORT
from kvprof.kernels.expansion import expand_into, native_library
from kvprof.model.rope import Rope
from kvprof.replay.setting import attention_path
from kvprof.report.replay import cost_table
from kvprof.results.replay import FUSED_EXPANSION

RECORDED_REPLAY = Path(__file__).parent / "data" / "results" / "replay.json"

needs_library = pytest.mark.skipif(native_library() is None, reason="no C compiler to build the kernel")


def inputs(heads: int, length: int, dim: int, rank: int, capacity: int, seed: int = 0):
    """Base and output as views of longer buffers (the store's layout), factors of a longer LR cache."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(1, heads, capacity, dim, generator=generator)[:, :, :length]
    factors = torch.randn(1, capacity, rank, generator=generator)[:, :length]
    up = torch.randn(heads, rank, dim, generator=generator)
    out = torch.full((1, heads, capacity, dim), float("nan"))[:, :, :length]
    return base, factors, up, out


def rope_of(dim: int, rotary: int, interleaved: bool) -> Rope:
    return Rope(1.0 / 10000 ** (torch.arange(0, rotary, 2).float() / rotary), interleaved=interleaved)


@needs_library
@pytest.mark.parametrize(
    ("dim", "rank", "rotary", "interleaved", "length", "begin"),
    [(64, 8, 64, False, 37, 0), (128, 16, 128, False, 1029, 500), (64, 8, 32, False, 300, 7), (64, 4, 64, True, 5, 3)],
)
def test_keys_are_base_plus_rotated_low_rank_term(dim, rank, rotary, interleaved, length, begin):
    """Full, partial (32 of 64 channels) and interleaved RoPE; lengths not a multiple of the kernel's 4 tokens;
    tokens from `begin` (their own cos/sin rows); more tokens than one thread's share at 1029."""
    base, factors, up, out = inputs(2, length, dim, rank, length + 9)
    rope = rope_of(dim, rotary, interleaved)
    cos, sin = rope.tables(torch.arange(begin + length))
    assert expand_into(base, factors, up, rope.swap(up), cos[begin:], sin[begin:], out)
    term = rope.rotate(factors[:, None] @ up, cos[begin:], sin[begin:])
    torch.testing.assert_close(out, base + term, atol=1e-5, rtol=1e-5)


@needs_library
def test_values_are_base_plus_low_rank_term():
    base, factors, up, out = inputs(4, 70, 64, 8, 80)
    assert expand_into(base, factors, up, None, None, None, out)
    torch.testing.assert_close(out, base + factors[:, None] @ up, atol=1e-5, rtol=1e-5)


@needs_library
def test_threads_split_the_tokens_without_changing_a_value():
    base, factors, up, out = inputs(2, 2051, 64, 8, 2051)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert expand_into(base, factors, up, None, None, None, out)
        alone = out.clone()
        torch.set_num_threads(4)
        out.fill_(float("nan"))
        assert expand_into(base, factors, up, None, None, None, out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, alone)


@pytest.mark.parametrize("case", ["bfloat16", "head_dim_40", "strided_channels"])
def test_inputs_the_kernel_cannot_take_are_left_to_torch(case):
    base, factors, up, out = inputs(2, 12, 64, 8, 12)
    if case == "bfloat16":
        base, out = base.bfloat16(), out.bfloat16()
    elif case == "head_dim_40":
        base, factors, up, out = inputs(2, 12, 40, 8, 12)
    else:
        base = torch.randn(1, 2, 12, 128)[..., ::2]
    before = out.clone()
    assert not expand_into(base, factors, up, None, None, None, out)
    assert torch.equal(out.isnan(), before.isnan())


def test_without_a_compiler_or_when_disabled_there_is_no_library(monkeypatch, tmp_path):
    """No compiler, one that fails every build (`false`: no partial file left), or KVPROF_NATIVE=0: no library."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    failing = ("CC", "false")
    try:
        for variable, value in (("CC", str(tmp_path / "no-such-compiler")), failing, ("KVPROF_NATIVE", "0")):
            with monkeypatch.context() as patched:
                patched.setenv(variable, value)
                native_library.cache_clear()
                assert native_library() is None
                base, factors, up, out = inputs(2, 8, 64, 8, 8)
                assert not expand_into(base, factors, up, None, None, None, out)
        assert not any(path.is_file() for path in tmp_path.rglob("*"))
    finally:
        native_library.cache_clear()


@needs_library
def test_the_build_is_cached_by_source_compiler_and_cpu(monkeypatch, tmp_path):
    """A fresh cache directory gets one library; a second build in a new process state loads it, not a new one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        native_library.cache_clear()
        assert native_library() is not None
        built = sorted(tmp_path.rglob("*.so"))
        assert len(built) == 1 and built[0].parent == expansion.cache_dir()
        stamp = built[0].stat().st_mtime_ns
        native_library.cache_clear()
        assert native_library() is not None
        assert sorted(tmp_path.rglob("*.so")) == built and built[0].stat().st_mtime_ns == stamp
    finally:
        native_library.cache_clear()


@pytest.mark.parametrize("stored", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_the_cost_table_says_when_views_were_expanded_by_the_kernel(fused, stored):
    """A replay records how its low-rank views were expanded and whether short forwards attended stored values
    (`lora_attention`); the cost table's title names each only when it ran."""
    result = json.loads(RECORDED_REPLAY.read_text())
    result["lora_attention"] = attention_path(SHORT, fused, stored)
    title = cost_table(result).title
    assert (FUSED_EXPANSION in title) is fused
    assert ("short forwards attend the rank-r values as stored" in title) is stored
    result["lora_attention"] = attention_path(EXPAND, fused, stored)
    assert "short forwards" not in cost_table(result).title
