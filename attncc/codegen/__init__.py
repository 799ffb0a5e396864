"""Code generation: one Jinja environment and one render helper for every template."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates"


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
