"""Code generation: one Jinja environment and one render helper for every template."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import NamedTuple

import jinja2

from attncc.errors import AttnccError

#: The line that ends a host source's preamble (macro definitions and includes only, the same
#: for every kernel of a dtype and ISA or emulated architecture), which runtime/build.py
#: precompiles once and shares between kernels.
PREAMBLE_END = "// attncc: end of preamble"

#: fp8 K/V element types (torch dtype name) -> the decoder include/attncc/fp8bits.h gives them.
KV_FORMATS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


class LibraryDtype(NamedTuple):
    """What a library's dtype name says: q's dtype (the storage of the products), the fp8 K/V
    format if any, whether the products run on fp8 tensor cores (CUDA sm_89+), and whether its
    forward reads K/V through a page table (CUDA: a paged call's own forward-only library)."""

    storage: str
    kv_format: str | None = None
    fp8_mma: bool = False
    paged: bool = False


#: The suffix of a library dtype whose fp8 K/V products run on fp8 tensor cores.
FP8_MMA_SUFFIX = "+mma"
#: The suffix (last) of a CUDA library dtype whose forward reads K/V through a page table.
PAGED_SUFFIX = "+paged"


def split_dtype(dtype: str) -> LibraryDtype:
    """A library's dtype name -> its parts: "bfloat16" -> ("bfloat16", None, False, False);
    "bfloat16+float8_e4m3fn" (k and v fp8) -> ("bfloat16", "e4m3", False, False); with "+mma"
    the products on fp8 tensor cores; with "+paged" (after it) K/V read through a page table."""
    paged = dtype.endswith(PAGED_SUFFIX)
    dtype = dtype.removesuffix(PAGED_SUFFIX)
    fp8_mma = dtype.endswith(FP8_MMA_SUFFIX)
    storage, _, kv = dtype.removesuffix(FP8_MMA_SUFFIX).partition("+")
    if kv and kv not in KV_FORMATS:
        raise AttnccError(f"fp8 K/V take {' or '.join(KV_FORMATS)}, not {kv}")
    if fp8_mma and not kv:
        raise AttnccError(f"`{dtype}`: fp8 products need fp8 K/V")
    return LibraryDtype(storage, KV_FORMATS[kv] if kv else None, fp8_mma, paged)


def _template_dir() -> Path:
    # The templates have one home, the repository's top-level templates/, so a checkout or an
    # editable install renders the files being edited. A wheel can only carry files inside a package,
    # so pyproject.toml ships templates/ as attncc/_templates. The checkout is recognised by its
    # pyproject.toml too, not by a bare templates/ folder that site-packages may hold for another
    # distribution.
    package = Path(__file__).resolve().parents[1]
    root = package.parent
    if (root / "templates").is_dir() and (root / "pyproject.toml").is_file():
        return root / "templates"
    return package / "_templates"


TEMPLATE_DIR: Path = _template_dir()


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,  # a missing decision is an error, not empty text
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["preamble_end"] = PREAMBLE_END
    return env


def render(template: str, **values: object) -> str:
    return environment().get_template(template).render(**values)
