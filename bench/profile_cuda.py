"""One dense bf16 forward and backward (B=4 H=16 N=4096 d=128) for Nsight Compute:

ncu --kernel-name regex:attncc --launch-count 3 --section SpeedOfLight ... python3 bench/profile_cuda.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402

kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda")
q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = kern(q, k, v)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("profiled", kern.plan(q, k, None))
