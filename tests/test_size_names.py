"""Free dimension names of runtime tensors used in expressions: `input bias: float[L, H]` makes
`L` an int the runtime binds to bias's size, so a table of any length can be clamped to its
own last row. Checked against an eager float64 reference written from the program's meaning,
forward and backward, on the CPU and the CUDA emulator, padded, packed and paged."""

from __future__ import annotations

import pytest
import torch

import attncc
from attncc.errors import DslError, InputError
from attncc.ir.graph import print_graph
from attncc.runtime import check as checking
from attncc.runtime.inputs import Shape

# a relative-position bias table centred on the diagonal, as long as the caller makes it
CENTRED_BIAS = """attention centred_bias
input bias: float[L, H]
s = q @ k.T * scale
s = s + bias[min(max(j - i + L // 2, 0), L - 1), h]
p = softmax(s)
o = p @ v
output o
"""


def centred_bias_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias[clamp(j - i + L // 2, 0, L - 1), h]) v, GQA by repetition."""
    rows, cols, table = q.shape[-2], k.shape[-2], bias.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    offset = torch.arange(cols).view(1, -1) - torch.arange(rows).view(-1, 1) + table // 2
    added = bias[offset.clamp(0, table - 1)].permute(2, 0, 1)  # [H, N, M]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + added
    return torch.softmax(scores, -1) @ v


def gradients(out: torch.Tensor, wrt: tuple[torch.Tensor, ...], dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, wrt, dout)


def check(kern: attncc.Kernel, table: int, dtype: torch.dtype, tol: float, shape=(2, 4, 2, 17, 23, 48)) -> None:
    B, H, Hkv, N, M, D = shape
    gen = torch.Generator().manual_seed(table)
    exact = [
        torch.randn(size, generator=gen, dtype=torch.float64)
        for size in ((B, H, N, D), (B, Hkv, M, D), (B, Hkv, M, D), (table, H))
    ]
    exact[3] = exact[3] * 2  # (a bias that moves the softmax)
    low = [t.to(dtype).requires_grad_() for t in exact]
    exact = [t.to(dtype).double().requires_grad_() for t in exact]
    out = kern(*low[:3], bias=low[3])
    want = centred_bias_reference(*exact)
    assert (out.double() - want).abs().max().item() < tol
    dout = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    for name, got, expected in zip(
        ("dq", "dk", "dv", "dbias"), gradients(out, tuple(low), dout.to(dtype)), gradients(want, tuple(exact), dout)
    ):
        assert (got.double() - expected).abs().max().item() < tol * max(1.0, expected.abs().max().item()), name


@pytest.mark.parametrize("table", [1, 6, 64])
def test_a_free_dimension_name_is_its_tensor_s_size(table: int) -> None:
    check(attncc.compile(CENTRED_BIAS), table, torch.float32, 2e-5)


def test_a_free_dimension_name_in_bf16() -> None:
    check(attncc.compile(CENTRED_BIAS), 9, torch.bfloat16, 5e-2)


def test_a_free_dimension_name_on_the_cuda_emulator() -> None:
    check(attncc.compile(CENTRED_BIAS, target="sm80", emulate=True), 7, torch.bfloat16, 5e-2, (1, 2, 1, 17, 23, 32))


def test_a_free_dimension_name_in_packed_and_paged_calls() -> None:
    """b, i, j and the table are each sequence's own: packed offsets and pages in shuffled order."""
    kern = attncc.compile(CENTRED_BIAS)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(5, 2, generator=gen)
    q, k, v = (torch.randn(rows, 2, 16, generator=gen) for rows in (21, 19, 19))
    cu_q, cu_k = torch.tensor([0, 5, 21], dtype=torch.int32), torch.tensor([0, 9, 19], dtype=torch.int32)
    out = kern.varlen(q, k, v, cu_q, cu_k, bias=bias)
    for b in range(2):
        rows, cols = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq = [t[part].transpose(0, 1)[None].double() for t, part in ((q, rows), (k, cols), (v, cols))]
        want = centred_bias_reference(*seq, bias.double())
        assert (out[rows].transpose(0, 1)[None].double() - want).abs().max().item() < 2e-6

    k_cache, v_cache = torch.randn(8, 4, 2, 16, generator=gen), torch.randn(8, 4, 2, 16, generator=gen)
    block_table = torch.tensor([[3, 1, 5, 0], [2, 7, 6, 4]], dtype=torch.int32)
    cache_seqlens = torch.tensor([13, 9], dtype=torch.int32)
    new_q = torch.randn(2, 1, 2, 16, generator=gen)
    out = kern.paged(new_q, k_cache, v_cache, block_table, cache_seqlens, bias=bias)
    for b in range(2):
        held = int(cache_seqlens[b])
        keys, values = (
            c[block_table[b].long()].reshape(-1, 2, 16)[:held].transpose(0, 1)[None].double()
            for c in (k_cache, v_cache)
        )
        want = centred_bias_reference(new_q[b].transpose(0, 1)[None].double(), keys, values, bias.double())
        assert (out[b].transpose(0, 1)[None].double() - want).abs().max().item() < 2e-6


def test_a_given_size_must_be_the_tensor_s() -> None:
    kern = attncc.compile(CENTRED_BIAS)
    q = torch.randn(1, 2, 8, 16)
    bias = torch.randn(6, 2)
    with pytest.raises(InputError, match=r"L: the size of bias's dimension 0 \(6\), bound from its shape; given 5"):
        kern(q, q, q, bias=bias, L=5)
    torch.testing.assert_close(kern(q, q, q, bias=bias, L=6), kern(q, q, q, bias=bias))
    torch.testing.assert_close(kern(q, q, q, bias=bias, L=torch.tensor([6])), kern(q, q, q, bias=bias))
    with pytest.raises(
        InputError, match=r"L: the size of bias's dimension 0 \(6\), bound from its shape; given tensor"
    ):
        kern(q, q, q, bias=bias, L=torch.tensor([6, 6]))  # (a RuntimeError of torch's before)


def test_a_dimension_named_after_an_int_input_is_its_value() -> None:
    """`input L: int` with `float[L, H]`: a table of another length was taken, silently."""
    kern = attncc.compile(CENTRED_BIAS.replace("input bias: float[L, H]", "input L: int\ninput bias: float[L, H]"))
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(InputError, match=r"bias: expected shape float\[L, H\] with L=5, got \(6, 2\)"):
        kern(q, q, q, L=5, bias=torch.randn(6, 2))
    bias = torch.randn(6, 2)
    torch.testing.assert_close(kern(q, q, q, L=6, bias=bias), attncc.compile(CENTRED_BIAS)(q, q, q, bias=bias))
    assert checking.check(kern, Shape(1, 2, 1, 9, 9, 16), torch.float32).ok  # (its random inputs: a table of L rows)


def test_a_name_shared_by_two_tensors_binds_once() -> None:
    program = CENTRED_BIAS.replace("input bias: float[L, H]", "input bias: float[L, H]\ninput gate: float[L]").replace(
        "L - 1), h]", "L - 1), h] * gate[min(max(j - i, 0), L - 1)]"
    )
    kern = attncc.compile(program)
    assert "input L: scalar int = bias.shape[0]" in print_graph(kern.graph)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(InputError, match=r"gate: expected shape float\[L\] with L=6, got \(5,\)"):
        kern(q, q, q, bias=torch.randn(6, 2), gate=torch.randn(5))
    bias, gate = torch.randn(6, 2, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    out = kern(q, q, q, bias=bias.float(), gate=gate.float())
    offset = torch.arange(8).view(1, -1) - torch.arange(8).view(-1, 1)
    added = bias[(offset + 3).clamp(0, 5)].permute(2, 0, 1) * gate[offset.clamp(0, 5)]
    exact = q.double()
    want = torch.softmax(exact @ exact.transpose(-1, -2) / 4 + added, -1) @ exact
    assert (out.double() - want).abs().max().item() < 2e-6


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("s = s + bias[0, h] * W", "unknown name `W`"),
        ("s = s + bias[0, h]\ninput L: int", "`L` is already defined"),
        ("s = s + bias[0, h]\nconst c = L", "a `const` must be computable from numbers alone"),
    ],
)
def test_names_that_are_no_size(body: str, message: str) -> None:
    program = (
        f"attention t\ninput bias: float[L, H]\ns = q @ k.T * scale\n{body}\np = softmax(s)\no = p @ v\noutput o\n"
    )
    if "input L" in body:
        program = program.replace("s = s + bias[0, h]", "s = s + bias[0, h] * L")
    with pytest.raises(DslError, match=message):
        attncc.compile(program)
