"""The packages' layers, read from the source's import statements (ast; imports inside functions count too):
no import circle among eagle/, train/ and infer/ modules; eagle/ never imports train/, infer/, deepspeed or wandb;
train/ never imports infer/; eagle/runtime never imports eagle/decoding or eagle/drafting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle", "train", "infer")

# runtime -> drafting edges that remain until the drafter's graph code moves into the runtime; each must still
# exist (so that the list only shrinks)
PENDING = {
    ("eagle.runtime.pooled", "eagle.drafting.drafter"),
    ("eagle.runtime.cuda_graphs", "eagle.drafting.drafter"),
}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (a package is its __init__.py)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name ``module``'s source imports (relative imports resolved; ``from a import b`` gives
    ``a.b`` and ``a``)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the project modules it imports, module -> every top-level package it imports)."""
    files = module_files(root)
    graph, tops = {}, {}
    for module, path in files.items():
        names = imported_names(module, path)
        tops[module] = {name.split(".")[0] for name in names if name}
        graph[module] = {name for name in names if name in files and name != module and name not in PACKAGES}
    return graph, tops


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert cycles(import_graph()[0]) == []


def test_cycles_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_eagle_imports_neither_train_infer_deepspeed_nor_wandb():
    _, tops = import_graph()
    bad = {m: sorted(t & {"train", "infer", "deepspeed", "wandb"}) for m, t in tops.items() if m.startswith("eagle")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_train_never_imports_infer():
    _, tops = import_graph()
    assert sorted(m for m, t in tops.items() if m.startswith("train") and "infer" in t) == []


def test_runtime_imports_neither_decoding_nor_drafting():
    graph, _ = import_graph()
    edges = {(m, d) for m, deps in graph.items() if m.startswith("eagle.runtime") for d in deps
             if d.startswith(("eagle.decoding", "eagle.drafting"))}
    assert edges - PENDING == set()
    assert PENDING - edges == set(), "an edge left PENDING is gone: drop it from the list"


if __name__ == "__main__":  # print the graph
    for module, deps in sorted(import_graph()[0].items()):
        print(module, "->", ", ".join(sorted(deps)) or "-")
