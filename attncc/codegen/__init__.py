"""Code generation: one Jinja environment and one render helper for every template."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2


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
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,  # a missing decision is an error, not empty text
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **values: object) -> str:
    return environment().get_template(template).render(**values)
