"""attncc: a compiler from an attention DSL to IO-aware fused kernels, loaded as torch ops.

kern = attncc.compile("examples/causal.attn")          # or DSL source text
out = kern(q, k, v)                                     # autograd and torch.compile work
out, lse = kern(q, k, v, return_lse=True)
attncc.flex_program(score_mod, mask_mod).source         # FlexAttention's functions as a program
"""

from __future__ import annotations

import stat
from pathlib import Path

from attncc.errors import AttnccError, BuildError, DslError, FlexTraceError, InputError
from attncc.frontend.flex import FlexProgram, flex_program
from attncc.frontend.parser import decode_source
from attncc.passes import Stage, run_pipeline
from attncc.runtime.kernel import Kernel
from attncc.runtime.merge import merge_states
from attncc.runtime.philox import dropout_mask
from attncc.runtime.ragged import PagedPlan, VarlenPlan, plan_paged, plan_varlen
from attncc.targets import get_target

__all__ = [
    "AttnccError", "BuildError", "DslError", "FlexProgram", "FlexTraceError", "InputError", "Kernel", "PagedPlan",
    "VarlenPlan", "compile", "dropout_mask", "flex_program", "include_dir", "lower", "merge_states", "plan_paged",
    "plan_varlen",
]  # fmt: skip
__version__ = "0.1.0"


def include_dir() -> str:
    """Directory of attncc's C++/CUDA headers (pass as -I when compiling emitted sources)."""
    return str(Path(__file__).resolve().parent / "include")


def read_program(path_or_source: str | Path) -> tuple[str, str]:
    """(source text, display path): a path to an existing file, or DSL text itself. A program is
    several lines (`attention NAME`, the statements, `output`), so a one-line string is a path,
    whatever its suffix (`causal.txt` was parsed as a program whose first word is `causal`)."""
    if not isinstance(path_or_source, (str, Path)):
        raise AttnccError(
            f"expected a program's path or DSL text (str or pathlib.Path), got {type(path_or_source).__name__}"
        )
    text = str(path_or_source)
    if not text:
        raise AttnccError("expected a program's path or DSL text, got an empty string")
    if "\n" not in text:
        path = Path(text)
        if isinstance(path_or_source, str) and "\r" in text and not path.exists():
            return text, "<string>"  # (lines ended by \r alone: old Mac text)
        if path.is_dir():
            raise AttnccError(f"{text}: a directory, not a program file")
        if not path.exists():
            raise AttnccError(f"{text}: no such program file")
        if not (path.is_file() or stat.S_ISFIFO(path.stat().st_mode)):  # (a pipe: `attncc explain <(...)`)
            raise AttnccError(f"{text}: not a program file (a device or socket, not a regular file or a pipe)")
        return decode_source(path.read_bytes(), text), text
    return text, "<string>"


def lower(
    path_or_source: str | Path, target: str = "cpu", tiles: tuple[int, int] | None = None, warp_rows: int | None = None
) -> list[Stage]:
    """Run the pass pipeline; returns the IR after each pass (what `attncc explain` prints)."""
    source, path = read_program(path_or_source)
    return run_pipeline(source, path, get_target(target), tiles, warp_rows)


def compile(
    path_or_source: str | Path,
    target: str = "cpu",
    tiles: tuple[int, int] | None = None,
    emulate: bool = False,
    warp_rows: int | None = None,
) -> Kernel:
    """Compile a DSL program (a .attn path or its text) into a callable kernel.

    target "cpu" builds C++ kernels; "cuda" builds the CUDA kernels with nvcc for the current
    GPU; a GPU target (sm75, sm80, sm86, sm89, sm90) with emulate=True runs the generated CUDA kernels on
    the host CUDA emulator (CPU tensors). The library for each
    input dtype is generated, built and cached on first call. `warp_rows` (GPU targets): query
    rows per warp of the CUDA forward, 16 or 32 (FlashAttention-2's layout: each K/V fragment
    read from shared memory serves two mma row blocks, at the cost of registers); None (the
    default): 32 on sm90 unless the score map reads the positions i, j or the program has
    dropout or rotary embeddings, else 16 (passes/tiling.py `plan_gpu`, from the H100
    measurements of session 36).
    """
    if target == "cuda":
        from attncc.runtime.gpu import GpuKernel, device_target

        arch = device_target()
        return GpuKernel(lower(path_or_source, arch, tiles, warp_rows), arch)
    kind = get_target(target).kind
    if kind == "cpu":
        return Kernel(lower(path_or_source, target, tiles, warp_rows), target)
    if not emulate:
        raise AttnccError(
            f"target `{target}`: use target='cuda' to run on this machine's GPU, emulate=True to run the "
            "CUDA kernels on the host emulator (CPU tensors), or `attncc compile --target` to emit sources"
        )
    from attncc.runtime.emulate import EmulatedKernel

    return EmulatedKernel(lower(path_or_source, target, tiles, warp_rows), target)
