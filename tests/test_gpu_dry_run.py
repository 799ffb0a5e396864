"""tests/test_gpu.py runs only where torch sees a GPU, a few minutes per lease: here its code runs
on the sm90 emulator (`ATTNCC_GPU_DRY_RUN=1`), so that it cannot rot unnoticed between leases.
The golden test of every example (`test_gpu_forward_backward_match_fp64`) is left out: the
emulator's own golden tests cover those kernels (tests/test_cuda.py), and it takes minutes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs tests/test_gpu.py itself")
def test_the_gpu_golden_tests_run_on_the_emulator() -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    command += ["-k", "not forward_backward_match"]
    env = {**os.environ, "ATTNCC_GPU_DRY_RUN": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
