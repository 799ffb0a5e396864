"""A built wheel carries the top-level templates/ and the package data, and loads templates from itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = sorted(p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy of the working tree (uncommitted and new files included, ignored ones not),
    # so that the build/ and *.egg-info a build leaves behind never land in the checkout.
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    copy = tmp_path_factory.mktemp("source")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # tracked but deleted in the working tree: not part of it
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # offline: the build uses the installed setuptools and fetches nothing
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]
    pip = [sys.executable, "-m", "pip", "wheel", ".", *offline, "-q", "-w", str(out)]
    subprocess.run(pip, cwd=source, check=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (built,) = out.glob("attncc-*.whl")
    return built


def test_wheel_carries_templates_and_package_data(wheel: Path, source: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert TEMPLATES, "the checkout has no templates/"
    assert {f"attncc/_templates/{t}" for t in TEMPLATES} <= names
    assert {
        "attncc/frontend/attn.lark",
        "attncc/include/attncc/philox.h",
        "attncc/include/attncc/cuda/primitives.cuh",
    } <= names
    # pyproject.toml lists the packages by hand: a subpackage missing from that list loses its modules
    modules = {p.relative_to(source).as_posix() for p in (source / "attncc").rglob("*.py")}
    assert modules <= names, sorted(modules - names)


def test_unpacked_wheel_loads_its_own_templates(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = f"""
import pathlib, attncc.codegen as c
site = pathlib.Path({str(site)!r}).resolve()
assert pathlib.Path(c.__file__).resolve().is_relative_to(site), c.__file__
assert c.TEMPLATE_DIR == site / "attncc" / "_templates", c.TEMPLATE_DIR
for name in {TEMPLATES!r}:
    c.environment().get_template(name)
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_install_under_a_path_with_spaces_and_dollars_builds_its_kernels(wheel: Path, tmp_path: Path) -> None:
    """The build commands quote the include directory: `-I/home/me/my projects/...` was split
    in two by the shell that ninja runs (every kernel build failed)."""
    site = tmp_path / "my site $HOME ü"
    zipfile.ZipFile(wheel).extractall(site)
    probe = """
import torch, torch.nn.functional as F, attncc
q = torch.randn(1, 2, 20, 16, dtype=torch.float64)
kern = attncc.compile("attention v\\ns = q @ k.T * scale\\np = softmax(s)\\no = p @ v\\noutput o\\n")
assert torch.allclose(kern(q, q, q), F.scaled_dot_product_attention(q, q, q))
"""
    env = {**os.environ, "PYTHONPATH": str(site), "ATTNCC_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
