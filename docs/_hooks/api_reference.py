"""MkDocs hook: the API reference, one page per top-level package of `rpegjax`, generated from the source tree at
build time (mkdocstrings renders each module's docstrings), so that a module moved, added or removed needs no edit
of the site. The pages go under `api/`, and the nav's "API reference" entry lists them in package order."""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rpegjax"
NAV_TITLE = "API reference"


def _packages() -> list[str]:
    """The top-level packages (directories with an `__init__.py`), in name order."""
    return sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))


def _modules(package: str) -> list[str]:
    """Dotted names of `rpegjax.<package>` and every module and subpackage under it, the package first."""
    base = PACKAGE / package
    names = []
    for path in sorted(base.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(set(names), key=lambda name: (name != f"rpegjax.{package}", name))


def _page(package: str) -> str:
    """The package's docstring (its re-exported names are documented where they are defined), then each module."""
    lines = [f"# rpegjax.{package}", ""]
    for name in _modules(package):
        lines += [f"::: {name}", "    options:", "      heading_level: 2"]
        if PACKAGE.parent.joinpath(*name.split(".")).is_dir():
            lines.append("      members: false")
        lines.append("")
    return "\n".join(lines)


def _index() -> str:
    lines = ["# API reference", "", "Generated from the docstrings of the source tree, one page per package.", "",
             "::: rpegjax", "    options:", "      heading_level: 2", "      members: false", "", "## Packages", ""]
    lines += [f"- [rpegjax.{package}]({package}.md)" for package in _packages()]
    return "\n".join(lines) + "\n"


def on_config(config):
    """Fills the nav's "API reference" entry with one page per package."""
    pages = ["api/index.md", *({f"rpegjax.{package}": f"api/{package}.md"} for package in _packages())]
    for index, item in enumerate(config["nav"] or []):
        if isinstance(item, dict) and NAV_TITLE in item:
            config["nav"][index] = {NAV_TITLE: pages}
            return config
    raise ValueError(f"mkdocs.yml: the nav has no {NAV_TITLE!r} entry for the generated pages")


def on_files(files, config):
    files.append(File.generated(config, "api/index.md", content=_index()))
    for package in _packages():
        files.append(File.generated(config, f"api/{package}.md", content=_page(package)))
    return files
