"""Train a tiny transformers Llama for a few steps on the CPU with its attention written in the DSL.

    pip install 'attncc[transformers]'
    python examples/train_transformers.py [--steps 30]

Every attention layer runs this program through attncc (forward and backward kernels): causal
attention with a per-head linear distance penalty (ALiBi-like slopes 1/16, 2/16, ...) on top of
the model's rotary embeddings, padding from the batch's attention mask. The task is to continue
an arithmetic sequence (token t + 1 = token t + stride mod vocab), so the loss falls quickly.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from attncc.integrations.transformers import register

PROGRAM = """
attention linear_bias_causal
input kv_start: int[B]          # filled by the integration from the attention mask
input kv_end: int[B]

s = q @ k.T * scale
s = s - 0.0625 * (h + 1) * (i + M - N - j)   # query i is key column i + M - N (bottom-right)
mask j >= kv_start[b] and j < kv_end[b] and j <= i + M - N
p = softmax(s)
o = p @ v
output o
"""

VOCAB = 64


def sequences(batch: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod VOCAB, the second half of the batch left-padded by a few tokens."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    ids = (start + stride * torch.arange(length)) % VOCAB
    mask = torch.ones_like(ids)
    mask[batch // 2 :, :3] = 0
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    register("attncc-linear-bias", PROGRAM)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attncc-linear-bias").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, mask = sequences(8, 48, gen)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
