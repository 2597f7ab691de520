"""No import circles between the modules of train/: every import (module level or inside a function) is an
edge, and the graph must have no cycle. A package's `__init__` is the module named by the package; an
import of a submodule is an edge to that submodule only (Python runs the package's `__init__` first, but
an `__init__` importing its own submodules is the ordinary layout, not a circle), while `from pkg import
name` of a name that is not a submodule is an edge to the package itself."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def module_names(package_dir: Path) -> dict[str, Path]:
    """{dotted module name: file} for every module under `package_dir` (packages by their __init__)."""
    base = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` (defined in `path`) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in (or is)
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                target = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif target in modules:
                    found.add(target)
    found.discard(name)
    return found


def import_graph(package_dir: Path) -> nx.DiGraph:
    modules = module_names(package_dir)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in imports_of(name, path, modules))
    return graph


def cycles(package_dir: Path) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(import_graph(package_dir)) if len(c) > 1]


def test_train_has_no_import_circles():
    found = cycles(ROOT / "train")
    assert not found, f"import circles in train/: {found}"


def test_the_graph_sees_function_level_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import leaf\nVALUE = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from pkg import VALUE\n    return VALUE\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("import pkg.sub.leaf\n")
    graph = import_graph(pkg)
    assert set(graph.edges) == {("pkg", "pkg.sub.leaf"), ("pkg.sub.leaf", "pkg"), ("pkg.a", "pkg.b"),
                                ("pkg.b", "pkg.sub.leaf")}
    assert cycles(pkg) == [["pkg", "pkg.sub.leaf"]]  # a name taken from a package whose __init__ imports you
    (pkg / "sub" / "leaf.py").write_text("from pkg import a\n")  # a submodule: an edge to it, not to pkg
    assert set(import_graph(pkg).successors("pkg.sub.leaf")) == {"pkg.a"}
    assert cycles(pkg) == [["pkg.a", "pkg.b", "pkg.sub.leaf"]]


def test_loading_a_trained_run_imports_neither_the_loop_nor_the_run():
    reached = nx.descendants(import_graph(ROOT / "train"), "train.inference")
    assert "train.evaluation" in reached
    assert not reached & {"train.loop.trainer", "train.run"}, sorted(reached)
