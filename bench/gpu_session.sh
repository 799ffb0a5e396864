#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in as few device calls as possible.
#
# A lease is 15 minutes of device time, the machine's start (1-2 minutes) included: one call of
# `lease` (under 9.5 minutes) and give_back. Before it, here (nvcc runs without a GPU):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 lark -d .whl          # the device image has no lark
#   python3 bench/gpu_prebuild.py                             # .gpu/prebuilt.tar.xz: the sm90 libraries
#   ATTNCC_GPU_DRY_RUN=1 python3 -m pytest -q tests/test_gpu.py  # the golden tests' own code, on the emulator
# Then with the device tool:
#   run(command="bash bench/gpu_session.sh lease", carry=[".whl", ".gpu"], timeout_s=590)
# `lease` runs, in this order, each stage bounded so that the call returns what it measured:
# the golden tests (tests/test_gpu.py), the decoding sweep (split counts; the 64-row and the
# key-split forwards, padded and paged at pages of 16, 64, 256), host time per decoding call, decoding (padded and paged, planned) against SDPA,
# packed batches, fp8 K/V, dense and causal d=128 at the default warps and at 16 rows against
# SDPA-flash (no FlexAttention: its compiles cost minutes; session 19 measured it), and, with
# the time left, the backward tile sweep. The other modes are for a lease with minutes left, one call each:
#   run(command="bash bench/gpu_session.sh check", carry=[".whl", ".gpu"])        probe, prebuild, golden tests
#   run(command="bash bench/gpu_session.sh decode", carry=[".whl", ".gpu"])       GPU tests, decoding sweep and bench
#   run(command="bash bench/gpu_session.sh serving", carry=[".whl", ".gpu"])      GPU tests, decoding sweep, host, serving, fwd+bwd
#   run(command="bash bench/gpu_session.sh host", carry=[".whl", ".gpu"])         host us per decoding call, profiled
#   run(command="bash bench/gpu_session.sh rows", carry=[".whl", ".gpu"])         GPU tests, every grid case at 16 and 32 rows/warp
#   run(command="bash bench/gpu_session.sh defaults", carry=[".whl", ".gpu"])     GPU tests, host, default warps vs 16, varlen
#   run(command="bash bench/gpu_session.sh backward", carry=[".whl", ".gpu"])     GPU tests, the backward's tiles, fwd+bwd grid
#   run(command="bash bench/gpu_session.sh bench 128", carry=[".whl", ".gpu"])    dense, causal at d=128, decoding, varlen, fp8
#   run(command="bash bench/gpu_session.sh masks 128", carry=[".whl", ".gpu"])    sliding window, ALiBi, softcap
#   run(command="bash bench/gpu_session.sh sanitize", carry=[".whl", ".gpu"])     racecheck, synccheck, memcheck logs
#   run(command="bash bench/gpu_session.sh sweep", carry=[".whl", ".gpu"])        forward tiles, decoding splits
#   run(command="bash bench/gpu_session.sh ncu", carry=[".whl", ".gpu"])          Nsight Compute, dense d=128
#   run(command="bash bench/gpu_session.sh ncu --decode", carry=[".whl", ".gpu"]) Nsight Compute, decoding
#   run(command="bash bench/gpu_session.sh stalls", carry=[".whl", ".gpu"])       the backward's stall reasons per SASS line
#   run(command="bash bench/gpu_session.sh cpu", carry=[".whl"])                  issue 9's AMX rows on the host's Xeon, 2 cores
#   run(command="bash bench/gpu_session.sh tests-cpu", carry=[".whl", ".gpu"])    GPU tests, then `cpu` with the time left
# Results land in $OUT (JSON with the device name and versions; the forwards with the roofline
# estimate beside them; at most 8 files come back): commit them under bench/results/ with the
# device name.
set -uo pipefail
OUT=${OUT:-/tmp/attncc-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ATTNCC_CACHE_DIR=/tmp/attncc-cache
if [ -d /usr/local/cuda/bin ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
if [ -f .gpu/prebuilt.tar.xz ]; then  # from bench/gpu_prebuild.py: found before anything is built
  python3 -c "import tarfile; tarfile.open('.gpu/prebuilt.tar.xz').extractall('/tmp/attncc-prebuilt', filter='data')" \
    && export ATTNCC_PREBUILT_DIR=/tmp/attncc-prebuilt
  echo "prebuilt: $(ls /tmp/attncc-prebuilt | wc -l) libraries"
fi
device=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 1

device_and_gpu_tests() {  # the device and versions, then all of tests/test_gpu.py (~100 s on an H100)
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; } 2>&1 | tee "$OUT/device.txt"
  OMP_NUM_THREADS=2 CUDA_LAUNCH_BLOCKING=1 timeout -k 5 200 python3 -m pytest -v -n 8 --timeout=150 -p no:cacheprovider \
    -rfE --durations=10 -W ignore tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" | tail -25
}

case "${1:-lease}" in
  lease)
    deadline=${2:-540}  # seconds after the script began (bash SECONDS): the unpacking above counts
    left() { echo $((deadline - SECONDS)); }
    { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
      python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; } 2>&1 | tee "$OUT/device.txt"
    # Two OpenMP threads per worker: 8 workers of 16 threads each on 16 cores made every golden
    # test take ~55 s on the H200 of session 23 (the float64 references run on the CPU; 0.2 s
    # here), 272 s in all, past the stage's cap. -v names each test as it ends, so a stage cut
    # off still says which passed; the per-example golden tests run second.
    tests_until=$((SECONDS + 210))
    export OMP_NUM_THREADS=2
    CUDA_LAUNCH_BLOCKING=1 timeout -k 5 90 python3 -m pytest -v -n 8 --timeout=80 -p no:cacheprovider -rfE \
      --durations=10 -W ignore tests/test_gpu.py -k "not forward_backward_match" 2>&1 | tee "$OUT/test_gpu.log" | tail -25
    CUDA_LAUNCH_BLOCKING=1 timeout -k 5 $((tests_until - SECONDS > 10 ? tests_until - SECONDS : 10)) python3 -m pytest -v -n 8 --timeout=150 \
      -p no:cacheprovider -rfE --durations=10 -W ignore tests/test_gpu.py -k forward_backward_match 2>&1 \
      | tee -a "$OUT/test_gpu.log" | tail -25
    unset OMP_NUM_THREADS
    echo "tests done, $(left) s left"
    # the decoding sweep first (the key-split forward against the 64-row one, padded and paged:
    # not yet timed anywhere), then the benchmark the earlier leases ran
    timeout -k 5 150 python3 bench/sweep_tiles_cuda.py --decode 2>&1 | tee "$OUT/sweep-decode.log"
    echo "decoding sweep done, $(left) s left"
    timeout -k 5 60 python3 bench/bench_host.py --cuda --profile --json "$OUT/host-$device.json" 2>&1 | tee "$OUT/host.log"
    timeout -k 5 $(( $(left) - 30 )) python3 bench/bench_cuda.py --dims 128 --sizes 4096 16384 --warp-rows default 16 \
      --decode --serving --fp8 --no-flex --budget-s $(( $(left) - 90 )) --repeats 15 \
      --json "$OUT/cuda-$device-lease.json" 2>&1 | tee "$OUT/bench.log"
    echo "bench done, $(left) s left"
    if [ "$(left)" -gt 30 ]; then  # (the forward's tiles were swept in sessions 19 and 36; the backward's never)
      timeout -k 5 "$(left)" python3 bench/sweep_tiles_cuda.py --backward --dims 64 128 2>&1 | tee "$OUT/sweep-backward.log"
    fi
    ;;
  rows)
    # Warps of 16 against 32 query rows across programs before 32 may become the default: the
    # GPU tests (every example at 32 rows against float64 among them), then every grid case at
    # both, d = 64 and 128, then the host time per call with the unplanned paged call profiled.
    deadline=${2:-500}
    left() { echo $((deadline - SECONDS)); }
    device_and_gpu_tests
    echo "tests done, $(left) s left"
    timeout -k 5 $(( $(left) - 45 )) python3 bench/bench_cuda.py --dims 64 128 --sizes 4096 16384 --warp-rows 16 32 \
      --cases dense causal sliding_window alibi softcap --no-flex --budget-s $(( $(left) - 90 )) --repeats 10 \
      --json "$OUT/cuda-$device-rows.json" 2>&1 | tee "$OUT/bench-rows.log"
    timeout -k 5 40 python3 bench/bench_host.py --cuda --profile 2 --json "$OUT/host-$device.json" 2>&1 | tee "$OUT/host.log"
    ;;
  defaults)
    # After a change of defaults: the GPU tests, host time per call, then dense and causal at
    # the default warps against 16 rows (d = 64, 128) and packed batches.
    deadline=${2:-420}
    left() { echo $((deadline - SECONDS)); }
    device_and_gpu_tests
    echo "tests done, $(left) s left"
    timeout -k 5 40 python3 bench/bench_host.py --cuda --json "$OUT/host-$device.json" 2>&1 | tee "$OUT/host.log"
    timeout -k 5 $(( $(left) - 15 )) python3 bench/bench_cuda.py --dims 64 128 --sizes 4096 16384 --warp-rows default 16 \
      --serving --no-flex --budget-s $(( $(left) - 60 )) --repeats 10 \
      --json "$OUT/cuda-$device-defaults.json" 2>&1 | tee "$OUT/bench-defaults.log"
    ;;
  backward)
    # After a change to the backward kernel (session 37: its Q/dO copies whole-tile at 6 warps,
    # dQ's atomics at fixed offsets, P in one FFMA; not yet run on a GPU): the GPU tests, then
    # the backward's tiles against each other and SDPA-flash's backward (its plans were never
    # timed against each other), then dense and causal fwd+bwd at the defaults.
    deadline=${2:-500}
    left() { echo $((deadline - SECONDS)); }
    device_and_gpu_tests
    echo "tests done, $(left) s left"
    timeout -k 5 $(( $(left) - 100 )) python3 bench/sweep_tiles_cuda.py --backward --dims 64 128 2>&1 \
      | tee "$OUT/sweep-backward.log"
    echo "backward sweep done, $(left) s left"
    timeout -k 5 $(( $(left) - 10 )) python3 bench/bench_cuda.py --dims 64 128 --sizes 4096 16384 --warp-rows default \
      --no-flex --budget-s $(( $(left) - 50 )) --repeats 10 --json "$OUT/cuda-$device-backward.json" 2>&1 \
      | tee "$OUT/bench-backward.log"
    ;;
  serving)
    # After a change to the paged forward or the backward (session 46: the backward's measured
    # tiles; session 47: each 16-row group of a paged key tile copied from its page, the
    # backward's lse/delta by cp.async and two barriers per query tile; session 48: the
    # decoding forwards' third K/V buffer, timed against two in the sweep; session 49: the
    # backward's mma-accumulated register columns, unmasked whole tiles without per-score
    # tests, division-free pairs, light programs' 64 x 128 plan, wide light plans in the
    # sweep, paged pages by shift and mask): the GPU tests, the
    # decoding sweep (paged at pages of 16, 64, 256 against in place), host time per call
    # (profiled), decoding, paged, packed and fp8 against SDPA, the backward's tiles (light
    # plans among them), dense and causal fwd+bwd. Then, with time left, `sanitize`.
    deadline=${2:-400}
    left() { echo $((deadline - SECONDS)); }
    device_and_gpu_tests
    echo "tests done, $(left) s left"
    timeout -k 5 120 python3 bench/sweep_tiles_cuda.py --decode 2>&1 | tee "$OUT/sweep-decode.log"
    # (case 3: the planned paged call with an appended key, ~2x a padded decoding call's host time in session 46)
    # (at most 8 files come back from $OUT: the host table goes after the sweep's, the fwd+bwd grid
    # after the serving bench; session 49's serving call wrote 10 and lost the tests' and sweep's logs)
    timeout -k 5 40 python3 bench/bench_host.py --cuda --profile 3 --json "$OUT/host-$device.json" 2>&1 \
      | tee -a "$OUT/sweep-decode.log"
    echo "decoding sweep and host done, $(left) s left"
    timeout -k 5 $(( $(left) / 2 )) python3 bench/bench_cuda.py --dims 128 --sizes 4096 --cases dense causal --decode \
      --serving --fp8 --no-flex --budget-s $(( $(left) / 2 - 40 )) --repeats 15 --json "$OUT/cuda-$device-serving.json" 2>&1 \
      | tee "$OUT/bench-serving.log"
    # the backward's tiles again, with the light-only plans (more dK/dV columns in registers) never timed
    timeout -k 5 90 python3 bench/sweep_tiles_cuda.py --backward --dims 64 128 2>&1 | tee "$OUT/sweep-backward.log"
    timeout -k 5 $(( $(left) - 5 )) python3 bench/bench_cuda.py --dims 64 128 --sizes 4096 16384 --warp-rows default \
      --no-flex --budget-s $(( $(left) - 45 )) --repeats 10 --json "$OUT/cuda-$device-backward.json" 2>&1 \
      | tee -a "$OUT/bench-serving.log"
    ;;
  decode)
    # the decoding forwards after a change to their choice: the GPU tests but the per-example
    # golden tests (which decoding does not reach), the decoding sweep, decoding against SDPA
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
    OMP_NUM_THREADS=2 CUDA_LAUNCH_BLOCKING=1 timeout -k 5 150 python3 -m pytest -v -n 8 --timeout=120 -p no:cacheprovider \
      -rfE --durations=5 -W ignore tests/test_gpu.py -k "not forward_backward_match" 2>&1 | tee "$OUT/test_gpu.log" | tail -15
    timeout -k 5 150 python3 bench/sweep_tiles_cuda.py --decode 2>&1 | tee "$OUT/sweep-decode.log"
    timeout -k 5 150 python3 bench/bench_cuda.py --decode --cases dense --dims 128 --sizes 4096 --budget-s 0 \
      --no-flex --repeats 15 --json "$OUT/cuda-$device-decode.json" 2>&1 | tee "$OUT/bench-decode.log"
    ;;
  tests-cpu)
    # A lease after changes to the runtime but not the CUDA templates (session 64): the GPU
    # tests, then issue 9's AMX rows (`cpu`, below) with the time left.
    deadline=${2:-540}
    device_and_gpu_tests
    echo "GPU tests done at $SECONDS s"
    # (at most 8 files come back and `cpu` writes 7: the GPU tests' two files become one)
    cat "$OUT/device.txt" "$OUT/test_gpu.log" >"$OUT/gpu-tests.txt" && rm "$OUT/device.txt" "$OUT/test_gpu.log"
    exec bash "$0" cpu $((deadline - SECONDS))
    ;;
  cpu)
    # Issue 9's AMX rows, which no development machine since session 34 could measure: the
    # device machine's host is an Intel Xeon with AMX-BF16 and AVX512-FP16 (family 6 model 207,
    # session 59's host-h200.json). The CPU ISA tests on its 16 cores (the AMX golden tests
    # skip on AMD machines), then the benchmark on two cores pinned, as the development
    # machines have: the dense grid to N = 4K (fwd+bwd to 2K), then decoding and the masked
    # variants. torch there is 2.11 (+cu130), not the 2.13 CPU build: SDPA / attncc ratios of
    # one process hold; times are not comparable with another machine's.
    deadline=${2:-540}
    left() { echo $((deadline - SECONDS)); }
    lscpu | grep -E "Model name|Flags" | cut -c1-300 | tee "$OUT/cpu.txt"
    OMP_NUM_THREADS=2 timeout -k 5 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rfEs -W ignore \
      tests/test_cpu_isa.py 2>&1 | tee "$OUT/test_cpu_isa.log" | tail -15
    echo "tests done, $(left) s left"
    timeout -k 5 $(( $(left) * 2 / 3 )) taskset -c 0,1 python3 bench/bench_cpu.py --grid --grid-part dense \
      --max-n 4096 --max-n-backward 2048 --repeats 3 --no-flex --json "$OUT/cpu-emr-amx-dense.json" 2>&1 \
      | tee "$OUT/bench-cpu-dense.log"
    timeout -k 5 $(( $(left) - 5 )) taskset -c 0,1 python3 bench/bench_cpu.py --grid --grid-part extra \
      --repeats 3 --no-flex --json "$OUT/cpu-emr-amx-extra.json" 2>&1 | tee "$OUT/bench-cpu-extra.log"
    ;;
  host)  # host time per decoding call on the real kernels (launches included), cProfile's top functions
    python3 bench/bench_host.py --cuda --profile --json "$OUT/host-$device.json" 2>&1 | tee "$OUT/host.log"
    ;;
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
    # the tests beyond the examples (rope, fp8, Dv != D, packed, paged) build their own libraries:
    # 8 workers (pytest-xdist, in the device image) build them side by side
    CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -n 8 --maxfail=8 --timeout=300 tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
    ;;
  bench)
    dims=${2:-64}
    python3 bench/bench_cuda.py --dims "$dims" --budget-s 450 $([ "$dims" = 128 ] && echo --decode --serving --fp8) \
      --json "$OUT/cuda-$device-d$dims.json" 2>&1 | tee "$OUT/bench-d$dims.log"
    ;;
  masks)
    dims=${2:-128}
    python3 bench/bench_cuda.py --dims "$dims" --budget-s 480 --cases sliding_window alibi softcap \
      --sizes 1024 4096 16384 --json "$OUT/cuda-$device-masks-d$dims.json" 2>&1 | tee "$OUT/bench-masks-d$dims.log"
    ;;
  sweep)
    python3 bench/sweep_tiles_cuda.py --dims 64 128 2>&1 | tee "$OUT/sweep-tiles.log"
    python3 bench/sweep_tiles_cuda.py --decode 2>&1 | tee "$OUT/sweep-decode.log"
    ;;
  ncu)  # `ncu` (dense d=128 forward and backward) or `ncu --decode` (bench/profile_cuda.py)
    python3 bench/profile_cuda.py ${2:-}  # build outside the profiler
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis python3 bench/profile_cuda.py ${2:-} > "$OUT/ncu${2:+-decode}.txt" 2>&1
    grep -E "profiled|attention_|combine_splits|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued" \
      "$OUT/ncu${2:+-decode}.txt"
    ;;
  stalls)
    # Where the backward's warps wait (session 49's H200: 36% of issue slots busy with 2 warps
    # per scheduler, ~950 instructions per warp and query tile at d = 64, 12% of them HMMA; the
    # changes made from it are in bench/results/cuda-h200-session49.md): the dense d = 64 and
    # d = 128 backward at the default plans (the sweep's problem) under Nsight Compute's full
    # set, its warp stall reasons per SASS instruction (source page, CSV) summarised by region
    # (bench/ncu_sass_summary.py), and the paged key-split decoding forward's stall sections.
    # Built outside the profiler first.
    python3 bench/profile_cuda.py --backward
    ncu --clock-control none --profile-from-start off -k regex:'attention_backward$' --set full \
      --import-source no -o /tmp/ncu-backward python3 bench/profile_cuda.py --backward 2>&1 | tail -5
    ncu -i /tmp/ncu-backward.ncu-rep --print-details all > "$OUT/ncu-backward.txt" 2>&1
    ncu -i /tmp/ncu-backward.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-backward-sass.csv" 2>&1
    grep -E "attention_backward|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued" \
      "$OUT/ncu-backward.txt" | head -30
    # regions (lines executed equally often: loop body, per-pair prologue, dQ), stall reasons, hot lines
    python3 bench/ncu_sass_summary.py "$OUT/ncu-backward-sass.csv" --top 12 | tee "$OUT/ncu-backward-summary.txt"
    timeout -k 5 120 ncu --clock-control none --profile-from-start off -k regex:'attention_forward' \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
      --print-details all python3 bench/profile_cuda.py --decode > "$OUT/ncu-decode-stalls.txt" 2>&1
    grep -E "profiled|attention_|Duration|DRAM Throughput|Warp Cycles Per Issued" "$OUT/ncu-decode-stalls.txt"
    ;;
  sanitize)
    # A causal backward (N=64 queries, M=1024 keys: key blocks no query sees), a sliding-window
    # forward, a dense d = 128 backward with query and key tails, and key-split decoding (in
    # place and paged) under racecheck (shared-memory hazards), synccheck (barrier misuse) and
    # memcheck (out-of-bounds accesses).
    cat > /tmp/sanitize_case.py <<'PY'
import torch
import attncc
torch.manual_seed(0)
# (d = 128: the backward's 6 warps copy Q and dO tiles whose last pass is partial, session 37)
cases = (("causal", 64, 1024, 64, True), ("sliding_window", 1024, 1024, 64, False), ("vanilla", 200, 300, 128, True))
for name, n, m, d, backward in cases:
    kern = attncc.compile(f"examples/{name}.attn", target="cuda")
    q = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    k, v = (torch.randn(1, 2, m, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(2))
    out = kern(q, k, v)
    if backward:
        out.float().sum().backward()
    torch.cuda.synchronize()
    print(name, "ran")
# decoding on the key-split forwards (a GPU's default for <= 32 rows): GQA 8/2 folded, one query
# (16-row blocks, split-KV and its merge) and 8 (32-row blocks), and a paged cache
from bench.bench_cuda import paged_decode_operands
kern = attncc.compile("examples/vanilla.attn", target="cuda")
for n in (1, 8):
    q = torch.randn(2, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kern(q, k, v)
q, k_cache, v_cache, table, lengths, _, _ = paged_decode_operands(2, 1024)
kern.paged(q, k_cache, v_cache, table, lengths)
torch.cuda.synchronize()
print("key-split decoding ran")
PY
    python3 /tmp/sanitize_case.py  # build outside the sanitizer
    for tool in racecheck synccheck memcheck; do
      compute-sanitizer --tool "$tool" python3 /tmp/sanitize_case.py 2>&1 | tee "$OUT/sanitize-$tool.log" | tail -5
    done
    ;;
esac
