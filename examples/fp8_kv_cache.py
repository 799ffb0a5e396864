"""Decoding over an fp8 paged KV cache with a descale factor per cached token and head.

    python examples/fp8_kv_cache.py

Keys and values are quantised to float8_e4m3fn as they are written (each row scaled so that its
largest element maps to e4m3's 448), the factors kept beside the cache in the same page layout;
the kernel widens each row times its factor as it reads it (runtime/fp8.py). The script appends
a step's k/v, decodes one query per sequence with GQA over shuffled pages, and prints the
difference to the same attention over the bf16 cache and the cache's size in both formats.
"""

from __future__ import annotations

import torch

import attncc

E4M3_MAX = 448.0
PROGRAM = """attention decode
s = q @ k.T * scale
mask j <= i + (M - N)
p = softmax(s)
o = p @ v
output o
"""


def quantise(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., D] -> (fp8 rows, descale factors [...]) with rows ~= fp8 * factor."""
    factor = rows.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    return (rows / factor.unsqueeze(-1)).to(torch.float8_e4m3fn), factor


def main(batch: int = 4, held: int = 1000, heads: int = 16, kv_heads: int = 4, head_dim: int = 128) -> float:
    torch.manual_seed(0)
    page_size = 16
    pages_per_sequence = -(-(held + 1) // page_size)
    num_pages = batch * pages_per_sequence
    table = torch.randperm(num_pages).view(batch, pages_per_sequence).int()
    lengths = torch.full((batch,), held, dtype=torch.int32)
    k_rows, v_rows = (torch.randn(num_pages, page_size, kv_heads, head_dim) for _ in range(2))
    (k_cache, k_descale), (v_cache, v_descale) = quantise(k_rows), quantise(v_rows)
    # this step's keys and values, quantised into the cache by the call (their factors first)
    k_new, v_new = (torch.randn(batch, 1, kv_heads, head_dim) for _ in range(2))
    (k_new8, k_new_descale), (v_new8, v_new_descale) = quantise(k_new), quantise(v_new)
    slot = table[torch.arange(batch), held // page_size].long()
    k_descale[slot, held % page_size] = k_new_descale[:, 0]
    v_descale[slot, held % page_size] = v_new_descale[:, 0]
    q = torch.randn(batch, 1, heads, head_dim).bfloat16()

    kern = attncc.compile(PROGRAM)
    with torch.no_grad():
        out = kern.paged(
            q, k_cache, v_cache, table, lengths, k_new=k_new8, v_new=v_new8, k_descale=k_descale, v_descale=v_descale
        )
        # the same attention over the bf16 cache of the dequantised rows
        k16 = (k_cache.float() * k_descale.unsqueeze(-1)).bfloat16()
        v16 = (v_cache.float() * v_descale.unsqueeze(-1)).bfloat16()
        want = kern.paged(q, k16, v16, table, lengths + 1)
        # and over the unquantised fp32 rows: what quantisation costs
        k_rows[slot, held % page_size], v_rows[slot, held % page_size] = k_new[:, 0], v_new[:, 0]
        exact = kern.paged(q.float(), k_rows, v_rows, table, lengths + 1)
    error = float((out.float() - want.float()).abs().max())
    fp8_bytes = k_cache.numel() + v_cache.numel() + 4 * (k_descale.numel() + v_descale.numel())
    print(
        f"fp8 e4m3 cache {fp8_bytes / 2**20:.1f} MiB (bf16: {2 * (k16.numel() + v16.numel()) / 2**20:.1f} MiB); "
        f"decode output max |fp8 - bf16 cache of the same values| = {error:.2e}, "
        f"|fp8 - unquantised fp32| = {float((out.float() - exact).abs().max()):.2e}"
    )
    return error


if __name__ == "__main__":
    main()
