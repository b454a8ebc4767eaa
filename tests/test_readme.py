"""The README stays a newcomer's short read and its layout table names every module."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 12_000  # characters


def modules(root: Path = ROOT) -> list[str]:
    """Every .py file under eagle/, train/, infer/ and scripts/ (packages' __init__.py aside), as a path."""
    return sorted(str(p.relative_to(root)) for folder in ("eagle", "train", "infer", "scripts")
                  for p in (root / folder).rglob("*.py") if p.name != "__init__.py")


def unlisted(readme: str, paths: list[str]) -> list[str]:
    """The paths no row of the README's layout table names (a row: ``| `PATH` | what it is |``)."""
    return [p for p in paths if f"| `{p}` |" not in readme]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text()) <= LIMIT


def test_the_layout_table_lists_every_module():
    readme = (ROOT / "README.md").read_text()
    assert modules() and unlisted(readme, modules()) == []
    assert unlisted(readme, modules() + ["eagle/not_a_module.py"]) == ["eagle/not_a_module.py"]  # it can fail
