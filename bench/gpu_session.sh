#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in as few device calls as possible.
#
# The device image has torch, jinja2, networkx, ninja, pytest and nvcc, but not lark: carry its
# wheel. Once, here:   echo /.whl/ >> .git/info/exclude
#                      python3 -m pip download --no-deps --only-binary=:all: lark -d .whl
# Then, with the device tool (each under its 10-minute limit):
#   run(command="bash bench/gpu_session.sh check", carry=[".whl"])       probe, prebuild, golden tests
#   run(command="bash bench/gpu_session.sh bench 64", carry=[".whl"])    benchmark at d=64
#   run(command="bash bench/gpu_session.sh bench 128", carry=[".whl"])   benchmark at d=128
# Results land in $OUT (JSON with the device name and versions): commit them under bench/results/.
set -uo pipefail
OUT=${OUT:-/tmp/attncc-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ATTNCC_CACHE_DIR=/tmp/attncc-cache
if [ -d /usr/local/cuda/bin ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
device=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 1

case "${1:-check}" in
  check)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
    python3 -c "import torch; print(torch.__version__, torch.version.cuda)" | tee -a "$OUT/device.txt"
    python3 bench/probe_primitives.py --json "$OUT/probe-$device.json" 2>&1 | tee "$OUT/probe.log"
    # Build every library the golden tests need in parallel (nvcc is single-threaded).
    python3 - <<'PY' 2>&1 | tee "$OUT/prebuild.log"
import time
from concurrent.futures import ThreadPoolExecutor
import attncc
from tests.conftest import EXAMPLES, ROOT
start = time.time()
kernels = [attncc.compile(ROOT / "examples" / f"{n}.attn", target="cuda") for n in EXAMPLES]
jobs = [(k, dt, d) for k in kernels for dt in ("float16", "bfloat16") for d in (64, 128, 256)]
with ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda job: job[0].emulated_library(job[1], job[2]), jobs))
print(f"prebuilt {len(jobs)} libraries in {time.time() - start:.0f} s")
PY
    CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
    ;;
  bench)
    dims=${2:-64}
    python3 bench/bench_cuda.py --dims "$dims" $([ "$dims" = 128 ] && echo --decode) --json "$OUT/cuda-$device-d$dims.json" 2>&1 | tee "$OUT/bench-d$dims.log"
    ;;
esac
