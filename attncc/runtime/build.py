"""JIT build of generated C++ with ninja, and an on-disk cache with a contract.

Contract: `build_library(source, name)` returns the path of a shared library compiled from
exactly `source` with `FLAGS`, the optimisation flags and the target's ISA flags, or raises
`BuildError` carrying the compiler output and the command to reproduce it. The cache directory
is keyed by a hash of the source, the package's headers, the flags, the compiler version, the
CPU and torch's version; several processes building the same variant take a file lock,
re-check the cache inside it, and build once.
Sources are rewritten only when they change, so ninja's own up-to-date check holds.

A source whose first lines end with codegen.PREAMBLE_END has a preamble (macro definitions and
includes only): from the second kernel with the same preamble, flags and compiler on, GCC reads
it from a precompiled header kept in the cache (`_precompiled_preamble`); a kernel built with it
is the same code as one built without. A CPU kernel's gemm register blocks and an emulated
kernel's emulator runtime, the same for every kernel of a preamble, are compiled once into the
preamble's instances object, which each library links (`_shared_instances`).

Prebuilt libraries (`attncc prebuild`, for servers that ship kernels and have no compiler) are
found first, in the read-only directories ATTNCC_PREBUILT_DIR lists, by a key without the
compiler's version or the machine's CPU flags (`portable_key`).
"""

from __future__ import annotations

import _ctypes
import ctypes
import errno
import fcntl
import glob
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager, suppress
from functools import cache, partial
from pathlib import Path

import torch

from attncc.codegen import PREAMBLE_END
from attncc.errors import BuildError
from attncc.runtime.locks import module_lock
from attncc.targets import NATIVE_FLAGS

INCLUDE_DIR = Path(__file__).resolve().parents[1] / "include"
# -march comes from the target's kernel ISA (targets.CPU_ISAS), passed as `isa_flags`; sources
# built without a target (tests' harnesses) get the machine's own (NATIVE_FLAGS).
FLAGS = (
    "-std=c++17",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-fno-math-errno",
)
# -O2 with -O3's vectoriser cost model, not -O3: the kernels' hot loops are written with vector
# types and intrinsics, so -O3's extra unrolling, cloning and peeling bought nothing measurable
# (AMX machine, alternating runs against -O3: fp32 and bf16 forwards and backwards at D = 64/128,
# softcap's score map, within -6%..+0.4% of -O3's time) and cost twice the compile time (causal
# bf16 backward object 3.7 -> 1.7 s, forward 2.2 -> 1.5 s). The cost model stays -O3's
# ("dynamic"; -O2's "very cheap" one leaves loops of unknown trip count scalar): the plain loops
# over score maps and tile loads are written to be vectorised (primitives.h).
OPTIMIZED_FLAGS = ("-O2", "-fvect-cost-model=dynamic")
# The CUDA emulator's host builds: it checks what kernels compute, not how fast, and its fiber
# switches gain little from -O3; -O1 built the emulated alibi kernel in 2.4 s instead of 7.4 s,
# and -Og (-O1 without the passes that cost compile time for speed) builds faster again: the
# forward object of an emulated vanilla sm90 kernel 1.78-1.94 -> 1.26-1.37 s; 24 emulated tests
# of test_cuda.py from an empty cache 209 -> 168 s, warm 29.3 -> 31.3 s (Zen 4, session 52).
EMULATOR_FLAGS = ("-Og",)
# ATTNCC_DEBUG_BUILD=1: host kernels (CPU and emulated CUDA) unoptimised with debug info, to
# step through generated code in gdb; they build ~5x faster (the fuzz tests build many programs).
DEBUG_BUILD_ENV = "ATTNCC_DEBUG_BUILD"
DEBUG_FLAGS = ("-O0", "-g")
PREBUILT_ENV = "ATTNCC_PREBUILT_DIR"
# A library's directory is its name (the program's, its dtype, ...) and key: names are cut to
# this many characters, so that the directory's stays within file systems' 255 bytes (a program
# named with 255 characters failed its first call with "File name too long").
LIBRARY_NAME_CHARS = 120
# A generated source's preamble (codegen.PREAMBLE_END) is read from a precompiled header: parsing
# it (<immintrin.h> and the STL, mostly) took 0.45 s of a 1.5 s CPU kernel object and 0.25 s of
# a 1.6 s emulator object (GCC 12, -O2 / -O1, AMX machine). The shared headers live here, in the
# cache directory.
PRECOMPILED_DIR = ".preambles"
#: The preamble lines of a CPU kernel's and of an emulated CUDA kernel's source: their objects
#: are compiled with SHARED_INSTANCES, so that they declare only what is the same in every
#: kernel of the preamble, and the library links it from the instances object compiled once per
#: preamble and flags (`_shared_instances`) rather than in each kernel's two objects: gemm's
#: register blocks (cpu/primitives.h; ~30% of a CPU kernel's cold build, 2.6 -> 1.8 s on two
#: cores), the bf16 levels' vdpbf16ps blocks and the buffer pool's take and give (a backward
#: object's code 69 -> 43 KB), and the emulator's runtime (cuda/emulator_runtime.h: scheduling,
#: collectives, the race check, counters; two thirds of an emulated kernel's object, 1.6-1.9 ->
#: 0.6 s a part). The source itself stays whole: built alone (`attncc compile -o`), it holds them.
CPU_PRIMITIVES = '#include "attncc/cpu/primitives.h"'
EMULATED_PRIMITIVES = '#include "attncc/cuda/primitives.cuh"'
SHARED_INSTANCES = "-DATTNCC_SHARED_INSTANCES"
#: The instances object (in a preamble's directory, and in a kernel's while it builds) and its
#: source, the preamble after ATTNCC_INSTANCES_SOURCE (cpu/primitives.h, cuda/emulator.h)
INSTANCES_OBJECT, INSTANCES_SOURCE = "instances.o", "instances.cpp"
_LOADED: dict[Path, ctypes.CDLL] = {}
#: How to write a cached library's sources and build it again, for the last REBUILDS_KEPT
#: libraries this process asked build_library for: load_library's rebuild of a damaged library
#: (its sources beside it may be damaged too: a rebuild from them alone failed once, a
#: BuildError). Each holds its source (~100 KB), so only the latest are kept: load_library
#: runs right after build_library.
_REBUILDS: OrderedDict[Path, Callable[[], None]] = OrderedDict()
REBUILDS_KEPT = 32


class _PrebuildTargets(threading.local):
    """This thread's `prebuilding_into` directories, innermost last. One list for the whole process
    sent the kernels that another thread built meanwhile into the prebuild directory, and
    `_built_in_cache`, clearing it for a moment, sent another thread's prebuild into the cache."""

    def __init__(self) -> None:
        self.directories: list[Path] = []


_PREBUILD_TARGETS = _PrebuildTargets()
_DAMAGED_PREBUILT: set[Path] = set()  # warned about once per process
_MISSING_PREBUILT_DIRS: set[Path] = set()  # warned about once per process
PREBUILT_MANIFEST = "prebuilt.txt"  # what a prebuilt library was built for (`_prebuilt_facts`)
_LOAD_LOCK = module_lock(__name__, "_LOAD_LOCK")


def cache_dir() -> Path:
    root = os.environ.get("ATTNCC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "attncc")
    # (absolute: a relative one made the precompiled preamble's compile, run in its directory,
    # miss its header, and every build ran without it)
    return Path(os.path.abspath(os.path.expanduser(root)))


#: A kernel's cache directory (`build_library`: name, a dash, its key) and a precompiled
#: preamble's (its key): what the cache's trimming and clearing may remove, and nothing else
#: (a cache directory set to a shared one, ~/.cache, held other programs' files).
KERNEL_ENTRY = re.compile(r"^.+-[0-9a-f]{20}$")
PREAMBLE_ENTRY = re.compile(r"^[0-9a-f]{20}$")


# ATTNCC_CACHE_LIMIT_MB=N: after each build the cache is trimmed to N MB, least recently used
# entries first (`trim_cache`; unset: no limit, as torch's and Triton's caches). A kernel's
# directory is marked used when a process loads its library, a precompiled preamble's when a
# build reads it.
CACHE_LIMIT_ENV = "ATTNCC_CACHE_LIMIT_MB"
#: Entries used this recently are kept whatever the limit: a build in progress (its directory is
#: written as it goes), a library another process has just built and is about to load.
TRIM_SPARES_SECONDS = 120.0


def _mark_used(directory: Path) -> None:
    try:
        os.utime(directory)
    except OSError:  # (a read-only cache, a directory trimmed by another process)
        pass


def cache_entries(root: Path | None = None) -> list[tuple[float, int, Path]]:
    """(last use, bytes, directory) of each entry of the cache: a kernel's directory (library,
    objects, sources) or a precompiled preamble's, oldest first."""
    root = root or cache_dir()
    if not root.is_dir():
        return []
    entries = []
    directories = [d for d in root.iterdir() if d.is_dir() and KERNEL_ENTRY.match(d.name)]
    if (root / PRECOMPILED_DIR).is_dir():
        directories += [d for d in (root / PRECOMPILED_DIR).iterdir() if d.is_dir() and PREAMBLE_ENTRY.match(d.name)]
    for directory in directories:
        size = 0
        for folder, _, files in os.walk(directory):
            for file in files:
                with suppress(OSError):  # (removed meanwhile by another process)
                    found = os.lstat(os.path.join(folder, file))
                    size += 0 if stat.S_ISLNK(found.st_mode) else found.st_size  # (a preamble's link)
        with suppress(OSError):
            entries.append((directory.stat().st_mtime, size, directory))
    return sorted(entries, key=lambda entry: entry[0])


def trim_cache(
    limit_bytes: int, root: Path | None = None, spare_seconds: float = TRIM_SPARES_SECONDS
) -> tuple[int, int]:
    """Remove the least recently used entries of the cache (`cache_entries`) until it holds at
    most `limit_bytes`, keeping those used in the last `spare_seconds`. Returns (entries
    removed, bytes freed), those actually gone (a read-only cache's stay). Safe beside running
    processes: a loaded library stays mapped, a removed kernel is rebuilt on its next call, and
    an entry a process builds into now (its lock held) is spared."""
    entries = cache_entries(root)
    total, removed, freed = sum(size for _, size, _ in entries), 0, 0
    spared_from = time.time() - spare_seconds
    for last_use, size, directory in entries:
        if total - freed <= limit_bytes or last_use >= spared_from:
            break
        with _lock_unless_held(directory / ".lock") as free:
            if free:
                shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed, freed = removed + 1, freed + size
    return removed, freed


def cache_limit_bytes() -> int | None:
    """ATTNCC_CACHE_LIMIT_MB in bytes, or None where it is unset."""
    given = os.environ.get(CACHE_LIMIT_ENV, "").strip()
    if not given:
        return None
    try:
        limit = float(given)
    except ValueError:
        limit = -1.0
    if not limit >= 0 or limit == float("inf"):
        raise BuildError(f"{CACHE_LIMIT_ENV}: expected a number of megabytes >= 0, got {given!r}")
    return int(limit * 1e6)


def optimization_flags(optimized: tuple[str, ...] = OPTIMIZED_FLAGS) -> tuple[str, ...]:
    """`optimized`, or DEBUG_FLAGS where ATTNCC_DEBUG_BUILD is on (1, true, yes, on); off: unset,
    0, false, no, off; anything else is an error (`false` built -O0 kernels, ~7x slower)."""
    given = os.environ.get(DEBUG_BUILD_ENV, "").strip()
    if given.lower() in ("", "0", "false", "no", "off"):
        return optimized
    if given.lower() in ("1", "true", "yes", "on"):
        return DEBUG_FLAGS
    raise BuildError(f"{DEBUG_BUILD_ENV}: expected 1, true, yes or on (or 0, false, no, off), got {given!r}")


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        where = f"CXX={cxx!r} is not an executable" if cxx else "no C++ compiler found"
        raise BuildError(f"{where}: install g++, set CXX, or point {PREBUILT_ENV} at kernels from `attncc prebuild`")
    return cxx


_ATTNCC_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"(attncc/[^"]+)"', re.MULTILINE)


@cache
def _header_text(name: str) -> str:
    path = INCLUDE_DIR / name
    return path.read_text() if path.is_file() else ""


def _included_headers(text: str) -> str:
    """attncc's headers that `text` includes, directly or through each other (by name, each
    with its text): what a build depends on of attncc/include. A CPU kernel's key follows
    cpu/primitives.h and the headers it includes, an emulated or GPU kernel's the CUDA ones, so
    an edit of one family's primitives leaves the other family's cached and prebuilt libraries
    alone (one edit of cpu/primitives.h made every emulated library rebuild: 467 of the 847
    builds of a cold suite run, session 31)."""
    names: set[str] = set()
    pending = _ATTNCC_INCLUDE.findall(text)
    while pending:
        name = pending.pop()
        if name not in names:
            names.add(name)
            pending += _ATTNCC_INCLUDE.findall(_header_text(name))
    return "".join(f"//--{name}\n{_header_text(name)}" for name in sorted(names))


@cache
def _headers_fingerprint(with_torch: bool = True) -> str:
    """The host flags and (`with_torch`) torch's version: what every library depends on besides
    its text and the headers it includes (`_included_headers`). A GPU library (nvcc, the CUDA
    runtime linked statically, called through ctypes) includes nothing of torch's, so its
    prebuilt key leaves torch's version out: libraries prebuilt here load on a GPU machine whose
    torch is another (CUDA) build."""
    return "\n".join([" ".join(FLAGS), *([torch.__version__] if with_torch else [])])


@cache
def _compiler_version() -> str:
    return subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=False).stdout


@cache
def _toolchain_fingerprint() -> str:
    version = _compiler_version()
    try:
        cpu_flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        cpu_flags = ""
    return "\n".join([version, cpu_flags, _headers_fingerprint()])  # (the headers: by each key's text)


@cache
def _compiler_is_gcc() -> bool:
    """GCC falls back to the header's text where a precompiled header does not fit the compile
    (other flags or macros, a missing file); other compilers stop with an error, so only GCC
    is given one."""
    version = _compiler_version()
    return "Free Software Foundation" in version and "clang" not in version


def _precompiled_preamble(preamble: str, flags: str) -> Path | None:
    """The shared precompiled header of `preamble` compiled with `flags` (the objects' flags),
    built the second time a kernel with this preamble is built (a single kernel's cold build
    does not wait for it: 1.4 s), None before that or where it cannot be built."""
    if not _compiler_is_gcc():
        return None
    directory = _preamble_directory(preamble, flags)
    header, precompiled = directory / "preamble.h", directory / "preamble.h.gch"
    if precompiled.exists() and _intact_shared(precompiled):
        _mark_used(directory)
        return precompiled
    with _file_lock(directory / ".lock"):  # (which makes the folder)
        if precompiled.exists():
            if _intact_shared(precompiled):
                return precompiled
            # (GCC crashed on a bit-flipped one, and on another looped for over 20 minutes: a
            # damaged header never reaches the compiler; the preamble's next kernel builds it again)
            recorded = _digest_path(precompiled)
            if recorded.exists():  # (one from before digests were kept: quietly)
                warnings.warn(f"attncc: precompiled preamble {precompiled} is unreadable; deleting it", stacklevel=5)
            precompiled.unlink(missing_ok=True)
            recorded.unlink(missing_ok=True)
            return None
        if not header.exists():  # its first kernel: remember the preamble, build without
            _write_if_changed(header, preamble)
            return None
        # (left by builds killed while GCC wrote them, ~60 MB each: under this lock none is live)
        for stale in directory.glob("preamble.h.gch.tmp*"):
            stale.unlink(missing_ok=True)
        unfinished = directory / f"preamble.h.gch.tmp{os.getpid()}"
        # (the flags' words as ninja's shell reads them: an install path with a space is one quoted word)
        words = shlex.split(flags.replace("$$", "$"))
        command = [compiler(), *words, "-x", "c++-header", str(header), "-o", str(unfinished)]
        if subprocess.run(command, cwd=directory, capture_output=True, check=False).returncode != 0:
            unfinished.unlink(missing_ok=True)
            return None  # the kernel's own compile reports what is wrong
        # (its digest first: the header never has its name without one)
        _write_if_changed(_digest_path(precompiled), _digest(unfinished))
        unfinished.replace(precompiled)
        return precompiled


_INTACT: dict[tuple[str, int, int], bool] = {}  # (files found intact)


def _intact_shared(shared: Path) -> bool:
    """Whether a file of a preamble's directory (its precompiled header, its instances object)
    holds the bytes recorded when it was built (its digest beside it; a header without one, from
    before digests were kept, is rebuilt once). Checked once per process for a file of unchanged
    size and time: ~0.1 s for a header's ~60 MB, which every kernel build hashed again while a
    later function of the same name (`_intact`, a library's check) stood in for this one."""
    try:
        info = shared.stat()
        key = (str(shared), info.st_mtime_ns, info.st_size)
        if key not in _INTACT:
            recorded = _digest_path(shared)
            if not (recorded.exists() and recorded.read_text().strip() == _digest(shared)):
                # (not kept: another process may be about to record its digest, and a kept False
                # made the check under the lock delete a sound header, session 72's review)
                return False
            _INTACT[key] = True
        return True
    except OSError:
        return False


def _preamble_of(source: str) -> str:
    """`source`'s preamble (codegen.PREAMBLE_END), its directives alone (comment lines, the
    variant's name, would part kernels that share it); "" where it has none."""
    before, end, _ = source.partition(PREAMBLE_END)
    if not end:
        return ""
    return "".join(line for line in before.splitlines(keepends=True) if not line.startswith("//")) + end + "\n"


def _preamble_directory(preamble: str, flags: str) -> Path:
    """Where what every kernel of `preamble` compiled with `flags` shares lives: its precompiled
    header and its instances object (`_shared_instances`)."""
    return cache_dir() / PRECOMPILED_DIR / cache_key(f"{preamble}\n//--flags {flags}\n//--include {INCLUDE_DIR}")


def _shared_instances(preamble: str, flags: str) -> Path | None:
    """The instances object of `preamble` compiled with `flags` (what a kernel's objects, compiled
    with SHARED_INSTANCES, declare only: cpu/primitives.h's register blocks and buffer pool,
    cuda/emulator.h's runtime), kept in the preamble's directory by the first kernel that built one
    (`_share_instances`); None before that. A damaged one is deleted with a warning (its next
    kernel builds and shares another): linked into a library, its bytes would be that library's code."""
    directory = _preamble_directory(preamble, flags)
    shared = directory / INSTANCES_OBJECT
    if not shared.exists():
        return None
    if _intact_shared(shared):
        _mark_used(directory)
        return shared
    with suppress(OSError), _file_lock(directory / ".lock"):  # (a cache that cannot be written: left there)
        if shared.exists() and not _intact_shared(shared):
            warnings.warn(f"attncc: shared instances object {shared} is damaged; deleting it", stacklevel=5)
            shared.unlink(missing_ok=True)
            _digest_path(shared).unlink(missing_ok=True)
    return None


def _share_instances(built: Path, preamble: str, flags: str) -> None:
    """Keep a kernel's own instances object `built` as its preamble's (`_shared_instances`),
    where that has none; its digest is recorded before it takes its name, so it is never there
    without one. Only a saving: a cache that cannot take it keeps building its own."""
    directory = _preamble_directory(preamble, flags)
    with suppress(OSError), _file_lock(directory / ".lock"):
        shared = directory / INSTANCES_OBJECT
        if shared.exists() and _intact_shared(shared):
            return
        for stale in directory.glob(f"{INSTANCES_OBJECT}.tmp*"):  # (left by killed builds: none is live)
            stale.unlink(missing_ok=True)
        unfinished = directory / f"{INSTANCES_OBJECT}.tmp{os.getpid()}"
        shutil.copyfile(built, unfinished)
        _write_if_changed(_digest_path(shared), _digest(unfinished))
        unfinished.replace(shared)


def _preamble_flag(directory: Path, preamble: str, flags: str) -> str:
    """The compile flag that reads a source's `preamble` (`_preamble_of`) precompiled, or "".
    The kernel's directory gets the preamble's text and, for this build (build_library removes
    it after), a link to the shared precompiled header beside it: without the link (a rebuild)
    or where the header does not fit, GCC reads the text, which the source repeats (identical
    macros, headers included once)."""
    try:  # (a prebuild's beside a kernel cache that cannot be written: built without it)
        precompiled = _precompiled_preamble(preamble, flags) if preamble else None
    except OSError:
        precompiled = None
    if precompiled is None:
        return ""
    _write_if_changed(directory / "preamble.h", preamble)
    link = directory / "preamble.h.gch"
    link.unlink(missing_ok=True)  # (one left by a build that was killed)
    link.symlink_to(precompiled)
    return "-include preamble.h "


def cache_key(key_text: str) -> str:
    """The JIT cache's key: the build's text (source, includes, target, flags) and the toolchain
    that builds it, so a compiler or machine change rebuilds."""
    text = _toolchain_fingerprint() + "\n" + _included_headers(key_text) + "\n" + key_text
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def portable_key(key_text: str, gpu: bool = False) -> str:
    """A prebuilt library's key: the build's text with attncc's headers and (host libraries)
    torch's version, not the compiler (the machine that loads it may have none). The source
    holds every machine fact the kernel was generated for (ISA level, vector width, tiles from
    the cache sizes, the GPU architecture), so another kind of machine looks for another key
    and builds its own."""
    text = _headers_fingerprint(not gpu) + "\n" + _included_headers(key_text) + "\n" + key_text
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def prebuilt_dirs() -> list[Path]:
    """The directories ATTNCC_PREBUILT_DIR lists (os.pathsep-separated), searched in order; one
    that does not exist is named in a warning, once (a typo built every kernel, silently)."""
    listed = [Path(p) for p in os.environ.get(PREBUILT_ENV, "").split(os.pathsep) if p.strip()]
    for missing in (d for d in listed if d not in _MISSING_PREBUILT_DIRS and not d.is_dir()):
        _MISSING_PREBUILT_DIRS.add(missing)
        warnings.warn(f"attncc: {PREBUILT_ENV} lists {missing}, which is not a directory", stacklevel=3)
    return listed


def _prebuilt_facts(host_flags: tuple[str, ...], cuda_arch: str | None) -> str:
    """What a prebuilt library was built for, as `attncc prebuild` records it beside the library
    (PREBUILT_MANIFEST): the machine it loads on is told which fact differs when it has no match."""
    isa_flags = (f for f in host_flags if f.startswith(("-march", "-mavx", "-mamx")))
    built_for = f"cuda {cuda_arch}" if cuda_arch else " ".join(isa_flags)
    # (the optimisation flags: ATTNCC_DEBUG_BUILD on one side only was "other sources or headers")
    built_with = "-" if cuda_arch else " ".join(f for f in host_flags if f.startswith(("-O", "-g")))
    return f"built for: {built_for}\nbuilt with: {built_with}\ntorch: {'-' if cuda_arch else torch.__version__}\n"


def _why_not_prebuilt(name: str, host_flags: tuple[str, ...]) -> str:
    """Why no prebuilt library matched this machine's host kernel `name`: none of that name, or
    the facts (ISA flags, torch version) of those there that differ from this machine's."""
    found = [d for root in prebuilt_dirs() if root.is_dir() for d in root.glob(f"{glob.escape(name)}-*") if d.is_dir()]
    if not found:
        return f"none named {name}: prebuild this program for this dtype"
    damaged = [d for d in found if d / "kernel.so" in _DAMAGED_PREBUILT]
    if damaged:  # (the one that would have matched: its digest differs or is missing)
        shown = ", ".join(str(d / "kernel.so") for d in damaged)
        return f"{shown} damaged (its digest differs or is missing): prebuild it again"
    wanted = dict(line.split(": ", 1) for line in _prebuilt_facts(host_flags, None).splitlines())
    differences, unrecorded = set(), 0
    for directory in found:
        try:
            facts = dict(line.split(": ", 1) for line in (directory / PREBUILT_MANIFEST).read_text().splitlines())
        except (OSError, ValueError):
            unrecorded += 1
            continue
        differences |= {  # (of the facts it recorded: an older attncc's manifest has no "built with")
            f"{k} {facts[k]!r}, this machine {wanted[k]!r}" for k in wanted if k in facts and facts[k] != wanted[k]
        }
    if differences:
        return f"{len(found)} named {name}, for another machine: " + "; ".join(sorted(differences))
    if unrecorded == len(found):
        return f"{len(found)} named {name}, prebuilt by an attncc that did not record what for ({PREBUILT_MANIFEST})"
    return f"{len(found)} named {name}, from other sources or headers: another attncc, or another machine's cache sizes"


@contextmanager
def prebuilding_into(directory: Path):  # noqa: ANN201 - context manager
    """Within it, build_library builds into `directory` under portable keys (`attncc prebuild`);
    in this thread only (a pool's workers each enter it: bench/gpu_prebuild.py)."""
    _PREBUILD_TARGETS.directories.append(Path(directory))
    try:
        yield
    finally:
        _PREBUILD_TARGETS.directories.pop()


def _find_prebuilt(name: str, key: str) -> Path | None:
    """The first complete, undamaged `name-key` library in the prebuilt directories; a damaged one
    is skipped with a warning (a read-only directory cannot be repaired in place)."""
    for root in prebuilt_dirs():
        library = root / f"{name}-{key}" / "kernel.so"
        if not _digest_path(library).exists() and not library.exists():
            continue
        if _intact(library):  # (a library without its digest: an unfinished or damaged prebuild)
            return library
        if library not in _DAMAGED_PREBUILT:
            _DAMAGED_PREBUILT.add(library)
            warnings.warn(f"attncc: prebuilt kernel {library} is damaged; ignoring it", stacklevel=3)
    return None


@contextmanager
def _file_lock(path: Path):  # noqa: ANN202 - context manager
    """The lock file `path` held, its folder made where `trim_cache` (`attncc cache --clear` in
    another process) removed it meanwhile: a lock taken on a removed file is taken again (a
    build waiting on the lock went on into a deleted folder: "can't create part1.o")."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            handle = open(path, "w")
        except FileNotFoundError:  # (its folder removed again since the mkdir)
            continue
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                try:
                    current = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    yield
                    return
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _lock_unless_held(path: Path):  # noqa: ANN202 - context manager
    """Yields True holding the lock file `path` where no process holds it, else False at once
    (a folder that cannot be written yields True: nothing in it can be removed either)."""
    try:
        handle = open(path, "a")
    except OSError:
        yield True
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ninja() -> str:
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError:
        found = shutil.which("ninja")
        if not found:
            raise BuildError("ninja not found: pip install ninja") from None
        return found


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


def build_library(
    source: str,
    name: str,
    includes: dict[str, str] | None = None,
    cuda_arch: str | None = None,
    isa_flags: tuple[str, ...] = NATIVE_FLAGS,
    optimized: tuple[str, ...] = OPTIMIZED_FLAGS,
    before_build: Callable[[], None] | None = None,
    parts: int = 1,
) -> Path:
    """Compile `source` (once per cache key) and return the shared library's path.

    `includes` are further files written beside it (name -> text) that the source includes,
    e.g. the exact generated `.cu` text that the CUDA emulator wraps. With `cuda_arch` (e.g.
    "sm90") the source is CUDA, compiled by nvcc for that architecture; otherwise C++ compiled
    with FLAGS, `isa_flags` and `optimized` (or DEBUG_FLAGS: `optimization_flags`).
    `before_build` runs before compiling (not for a prebuilt or cached library). With `parts`
    = 2 (C++ only) the source is compiled twice, with ATTNCC_PART=1 and 2, as two objects that
    ninja builds in parallel and links: a CPU (or emulated CUDA) kernel's forward and backward
    halves, which cuts the wall time of a cold build on two cores to its larger half's.
    """
    includes = includes or {}
    name = name[:LIBRARY_NAME_CHARS]  # (the key, not the name, tells libraries apart)
    limit = cache_limit_bytes()  # (checked at every build: a bad value failed a new build's call alone)
    key_text = source + "".join(f"\n//--{n}\n{t}" for n, t in sorted(includes.items())) + f"\n//--arch {cuda_arch}"
    host_flags = FLAGS + optimization_flags(optimized) + isa_flags
    key_text += "\n//--flags " + " ".join(host_flags)
    if cuda_arch:
        from attncc.runtime.nvcc import NVCC_FLAGS

        key_text += "\n//--nvcc-flags " + " ".join(NVCC_FLAGS)
    prebuilding = _PREBUILD_TARGETS.directories  # (this thread's; `_built_in_cache` empties it a while)
    if prebuilding:
        directory = prebuilding[-1] / f"{name}-{portable_key(key_text, gpu=bool(cuda_arch))}"
    else:
        prebuilt = _find_prebuilt(name, portable_key(key_text, gpu=bool(cuda_arch)))
        if prebuilt is not None:
            return prebuilt
        if not cuda_arch and prebuilt_dirs():
            try:
                compiler()
            except BuildError as missing:  # (which kernel a server's prebuilt set lacks, and why)
                where = os.pathsep.join(map(str, prebuilt_dirs()))
                raise BuildError(
                    f"kernel {name}: not among the prebuilt kernels in {where} ({_why_not_prebuilt(name, host_flags)}), "
                    f"and {missing}"
                ) from None
        if cuda_arch:
            from attncc.runtime.nvcc import nvcc_fingerprint

            key_text += "\n//--nvcc\n" + nvcc_fingerprint()
        directory = cache_dir() / f"{name}-{cache_key(key_text)}"
    library = directory / "kernel.so"
    if not prebuilding:
        with _LOAD_LOCK:
            _REBUILDS[library] = partial(
                _build_in, directory, name, source, includes, cuda_arch, host_flags, parts, before_build
            )
            _REBUILDS.move_to_end(library)
            if len(_REBUILDS) > REBUILDS_KEPT:
                _REBUILDS.popitem(last=False)  # (the oldest)

    # (the digest is written after the library: complete; a prebuild also repairs a damaged one,
    # which the runtime refuses, telling the user to prebuild again)
    def built() -> bool:
        return _intact(library) if prebuilding else _digest_path(library).exists()

    needs_build = not built()
    if needs_build:
        # (a prebuild's library: the kernel cache's, built there where it is not, copied; so one
        # build serves this machine's calls and every prebuild of it: a prebuild built each
        # library again, ~3 s of nvcc each, the test suite's 8 in every run)
        cached = None
        if prebuilding:
            cached = _built_in_cache(
                partial(build_library, source, name, includes, cuda_arch, isa_flags, optimized, before_build, parts)
            )
        with _writing_into_cache(directory, name):  # (the folder and the lock: `_file_lock`; the sources)
            with _file_lock(directory / ".lock"):
                if not built() and not (cached is not None and _copied(cached.parent, directory)):
                    _build_in(directory, name, source, includes, cuda_arch, host_flags, parts, before_build)
    if prebuilding:  # (also where prebuilt before, by an attncc that wrote no manifest, or it was lost)
        with _writing_into_cache(directory, name):
            _write_if_changed(directory / PREBUILT_MANIFEST, _prebuilt_facts(host_flags, cuda_arch))
    elif needs_build and limit is not None:
        trim_cache(limit)
    return library


class UnwritableCache(BuildError):
    """The kernel cache or a prebuild directory cannot be written: read-only, full, forbidden."""


def _built_in_cache(build: Callable[[], Path]) -> Path | None:
    """`build()` (a build_library call) as outside `prebuilding_into`: the library in the kernel
    cache (or a prebuilt directory), built there where it is not; None where the cache cannot
    be written, for a prebuild to build in its own directory."""
    targets = _PREBUILD_TARGETS.directories
    prebuilding = list(targets)
    targets.clear()
    try:
        return build()
    except UnwritableCache:
        return None
    finally:
        targets[:] = prebuilding


#: What a prebuilt library's directory takes of the cache's (`_copied`): the library and its
#: digest, and what it was built from (the source, its includes, the ninja file); not objects,
#: locks, ninja's logs or links.
COPIED_SUFFIXES = (".so", ".sha256", ".cpp", ".cu", ".h", ".cuh", ".ninja")


def _copied(built: Path, directory: Path) -> bool:
    """Whether the library in the cache directory `built` is now copied, intact, into the
    prebuild `directory` (its lock held), with its digest and sources. Read without the cache
    entry's lock (a read-only cache refused it, and the prebuild failed, session 72's review):
    the copy's digest is checked instead, so a library repaired meanwhile, or one that cannot
    be read, is no copy (the prebuild then builds it in `directory`)."""
    library = directory / "kernel.so"
    try:
        for file in sorted(built.iterdir(), key=lambda f: f.name == "kernel.so.sha256"):
            if file.is_file() and not file.is_symlink() and file.suffix in COPIED_SUFFIXES:
                unfinished = directory / f"{file.name}.tmp{os.getpid()}"
                shutil.copyfile(file, unfinished)
                unfinished.replace(directory / file.name)
    except OSError:
        pass
    if _intact(library):
        return True
    _digest_path(library).unlink(missing_ok=True)
    return False


#: What writing into a cache that is not ours to write fails with: read-only, not permitted, full.
UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST}


@contextmanager
def _writing_into_cache(directory: Path, name: str):  # noqa: ANN202 - context manager
    """Writes into a kernel's cache directory: a read-only, full or forbidden cache is a
    BuildError naming the settings to change (it was a bare OSError from pathlib)."""
    try:
        yield
    except OSError as error:
        if error.errno not in UNWRITABLE:
            raise
        if _PREBUILD_TARGETS.directories:
            raise UnwritableCache(
                f"kernel {name}: cannot write to the prebuild directory {directory.parent} ({error.strerror or error}): "
                "give `attncc prebuild -o` a writable directory"
            ) from None
        raise UnwritableCache(
            f"kernel {name}: cannot write to the kernel cache {directory.parent} ({error.strerror or error}): set "
            f"ATTNCC_CACHE_DIR to a writable directory, or ship the kernels prebuilt ({PREBUILT_ENV}, "
            "`attncc prebuild`)"
        ) from None


def _build_in(
    directory: Path,
    name: str,
    source: str,
    includes: dict[str, str],
    cuda_arch: str | None,
    host_flags: tuple[str, ...],
    parts: int,
    before_build: Callable[[], None] | None,
) -> None:
    """Write the sources and build.ninja into `directory` (its lock held) and build kernel.so.
    A kernel whose build with the precompiled preamble or the shared instances object fails is
    built again without them (its own instances object, compiled beside its parts); where the
    compiler named the header or crashed (PREAMBLE_FAILURES: truncated, from another compiler,
    damaged: GCC crashed on a bit-flipped one) the preamble is deleted, with a one-line
    warning: every later build of its dtype and ISA failed on it before. A kernel that built
    its own instances object leaves it to its preamble's next kernels (`_share_instances`)."""
    source_name = "kernel.cu" if cuda_arch else "kernel.cpp"
    # A library without its digest (written after a complete build) is unfinished or damaged:
    # ninja took a truncated one as up to date, its digest was recorded, and dlopen died of SIGBUS.
    for built in (directory / "kernel.so", directory / INSTANCES_OBJECT, *directory.glob("part*.o")):
        built.unlink(missing_ok=True)
    _write_if_changed(directory / source_name, source)
    for file_name, text in includes.items():
        _write_if_changed(directory / file_name, text)
    include = _command_word(INCLUDE_DIR)
    cxx = object_flags = preamble_flag = preamble = ""
    shares_instances = False
    if cuda_arch:
        from attncc.runtime.nvcc import NVCC_FLAGS, find_nvcc

        sm = "sm_" + cuda_arch.removeprefix("sm")
        command = f"{_command_word(find_nvcc())} -arch={sm} {' '.join(NVCC_FLAGS)} -shared -Xcompiler -fPIC -I{include} -I. $in -o $out.tmp"
    else:
        cxx = _command_word(compiler())
        preamble = _preamble_of(source)
        shares_instances = CPU_PRIMITIVES in preamble or EMULATED_PRIMITIVES in preamble
        object_flags = " ".join(f for f in host_flags if f != "-shared") + f" -I{include} -I."
        object_flags += f" {SHARED_INSTANCES}" if shares_instances else ""
        preamble_flag = _preamble_flag(directory, preamble, object_flags)
    instances = directory / INSTANCES_OBJECT
    shared_instances = None
    if shares_instances:
        _write_if_changed(directory / INSTANCES_SOURCE, "#define ATTNCC_INSTANCES_SOURCE 1\n" + preamble)
        shared_instances = _shared_instances(preamble, object_flags)
        if shared_instances is not None:  # (a copy, linked like the parts: the link reads no other directory)
            try:  # (under its lock: `attncc cache --clear` or a trim may remove it meanwhile)
                with _file_lock(shared_instances.parent / ".lock"):
                    shutil.copyfile(shared_instances, instances)
            except OSError:
                instances.unlink(missing_ok=True)
                shared_instances = None

    def ninja_file(preamble_flag: str, own_instances: bool) -> str:
        text = "ninja_required_version = 1.3\n"
        linked = f" {INSTANCES_OBJECT}" if shares_instances else ""
        if own_instances:
            text += (
                "rule compile_instances\n"
                f"  command = {cxx} {object_flags} -c $in -o $out\n"
                "  description = attncc: compiling $out\n"
                f"build {INSTANCES_OBJECT}: compile_instances {INSTANCES_SOURCE}\n"
            )
        if parts > 1 and not cuda_arch:
            objects = " ".join(f"part{n}.o" for n in range(1, parts + 1)) + linked
            text += (
                "rule compile_part\n"
                f"  command = {cxx} {object_flags} {preamble_flag}-DATTNCC_PART=$part -c $in -o $out\n"
                "  description = attncc: compiling $out\n"
                "rule link_shared\n"
                f"  command = {cxx} {' '.join(host_flags)} $in -o $out.tmp && mv $out.tmp $out\n"
                "  description = attncc: linking $out\n"
                + "".join(f"build part{n}.o: compile_part {source_name}\n  part = {n}\n" for n in range(1, parts + 1))
                + f"build kernel.so: link_shared {objects}\n"
            )
        else:
            # (with the instances object linked, the source declares what it defines: else both define it)
            sharing = f"{SHARED_INSTANCES} " if shares_instances else ""
            whole = (
                command
                if cuda_arch
                else f"{cxx} {' '.join(host_flags)} {sharing}{preamble_flag}-I{include} -I. $in -o $out.tmp"
            )
            text += (
                "rule compile_shared\n"
                f"  command = {whole} && mv $out.tmp $out\n"
                "  description = attncc: compiling $out\n"
                f"build kernel.so: compile_shared {source_name}{linked}\n"
            )
        return text + "default kernel.so\n"

    own_instances = shares_instances and shared_instances is None
    _write_if_changed(directory / "build.ninja", ninja_file(preamble_flag, own_instances))
    if before_build is not None:
        before_build()
    link = directory / "preamble.h.gch"
    try:
        _run_ninja(directory, name)
    except BuildError as error:
        if not preamble_flag and not shared_instances:
            raise
        shared_header = link.resolve() if preamble_flag else None
        link.unlink(missing_ok=True)
        instances.unlink(missing_ok=True)
        own_instances, preamble_flag = shares_instances, ""
        _write_if_changed(directory / "build.ninja", ninja_file("", own_instances))
        _run_ninja(directory, name)  # (its error where the kernel itself does not build)
        # (not a build killed for memory or interrupted: kept)
        if shared_header is not None and PREAMBLE_FAILURES.search(str(error)):
            warnings.warn(f"attncc: precompiled preamble {shared_header} is unreadable; deleting it", stacklevel=4)
            shared_header.unlink(missing_ok=True)
    finally:  # no link into the cache stays (prebuilt directories are shipped)
        link.unlink(missing_ok=True)
    if own_instances:
        _share_instances(instances, preamble, object_flags)
    if shares_instances:  # (linked into kernel.so; the preamble's directory keeps one)
        instances.unlink(missing_ok=True)
        # what `ninja -C` of the directory runs to build the library again (load_library's rebuild
        # where this process has not its sources, the reproduce line of a BuildError): its own
        # instances object too (one linked from the preamble's copy had no rule: review of session 72)
        _write_if_changed(directory / "build.ninja", ninja_file(preamble_flag, True))


#: What a build's output says where its precompiled preamble is at fault: GCC's complaint about the
#: header, or its crash reading it (a bit-flipped one)
PREAMBLE_FAILURES = re.compile(r"precompiled header|internal compiler error")


def _command_word(path: object) -> str:
    """A path as one word of a ninja command line: quoted for the shell that runs it (an
    install under `/home/me/my projects` split its -I flag in two) and `$` escaped for ninja."""
    return shlex.quote(str(path)).replace("$", "$$")


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether a library is the one built: there, with the digest recorded after its build."""
    try:
        return library.exists() and _digest_path(library).read_text().strip() == _digest(library)
    except OSError:
        return False


def _digest(path: Path) -> str:
    """A built file's sha256 (a library, a precompiled preamble of ~60 MB: read in chunks)."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _run_ninja(directory: Path, name: str) -> None:
    """Build kernel.so in `directory` (caller holds its lock) and record its digest, which
    load_library checks: a truncated library would crash dlopen (SIGBUS), not fail it."""
    cmd = [_ninja(), "-C", str(directory)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    library = directory / "kernel.so"
    if result.returncode != 0 or not library.exists():
        raise BuildError(
            f"building {name} failed (reproduce: {' '.join(cmd)}):\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    _write_if_changed(_digest_path(library), _digest(library))


def _open(path: Path, required_symbol: str | None) -> ctypes.CDLL:
    recorded = _digest_path(path)
    if not recorded.exists() or recorded.read_text().strip() != _digest(path):
        raise OSError("its contents differ from the library that was built")
    library = ctypes.CDLL(str(path))
    if required_symbol is not None and not hasattr(library, required_symbol):
        _ctypes.dlclose(library._handle)  # else the next dlopen of this path returns the same object
        raise OSError(f"{path}: not an attncc kernel library (no symbol {required_symbol})")
    return library


def load_library(path: Path, required_symbol: str | None = None) -> ctypes.CDLL:
    """dlopen a built kernel library once per process. A cached library that is not the one
    built (its digest differs: truncated, corrupted, replaced), fails to load or is foreign
    (without `required_symbol`) is rebuilt once, with a one-line warning: from the sources
    build_library was given for it (rewritten where they differ), else from those beside it; a
    second failure is a BuildError."""
    with _LOAD_LOCK:
        if path not in _LOADED:
            if path.parent.parent.resolve() == cache_dir().resolve():  # (not a shipped prebuilt directory)
                _mark_used(path.parent)  # (the cache's trimming keeps what is used)
            try:
                _LOADED[path] = _open(path, required_symbol)
            except OSError as exc:
                directory = path.parent
                if any(directory.parent.resolve() == root.resolve() for root in prebuilt_dirs()):
                    raise BuildError(
                        f"cannot load the prebuilt kernel {path} ({exc}): rebuild that directory with `attncc prebuild`"
                    ) from None
                # (rebuilt from the sources build_library was given, else from build.ninja: one
                # without either was refused even where this process had just made its source)
                if path not in _REBUILDS and not (directory / "build.ninja").exists():
                    raise BuildError(f"cannot load {path}: {exc}; delete {directory} to build it again") from None
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                warnings.warn(f"attncc: cached kernel {path} failed to load ({reason}); rebuilding it", stacklevel=2)
                with _writing_into_cache(directory, directory.name), _file_lock(directory / ".lock"):
                    # (its objects too: a damaged part*.o beside it was relinked as it was)
                    for built in (path, _digest_path(path), directory / INSTANCES_OBJECT, *directory.glob("part*.o")):
                        built.unlink(missing_ok=True)
                    _REBUILDS.get(path, partial(_run_ninja, directory, directory.name))()
                try:
                    _LOADED[path] = _open(path, required_symbol)
                except OSError as again:
                    raise BuildError(f"{path} failed to load after a rebuild: {again}") from None
        return _LOADED[path]
