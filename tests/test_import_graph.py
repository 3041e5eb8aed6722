"""The package's Python modules import each other without a circle.

Every ``import`` / ``from ... import`` of a ``torch_marlin`` module, at module level or inside a
function (a deferred import hides a circle from the interpreter, not from a reader), is an edge
from the importing file to the module it names: a submodule when the imported name is one, else
the package's ``__init__``. A circle is a strongly connected set of two or more modules.
"""

import ast
import os

PACKAGE = "torch_marlin"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


EXTENSION = f"{PACKAGE}._C"  # the compiled ops: imports nothing of the package


def module_files():
    """Module name -> file path of every .py file of the package."""
    files = {}
    for directory, _, names in os.walk(ROOT):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def imports_of(module: str, path: str, known: set) -> set:
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in known else source)
    return {t for t in targets if t in known and t != module}


def circles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_checker_reads_relative_and_deferred_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from .. import top\n    from ..sub import leaf\n")
    (pkg / "top.py").write_text("import torch_marlin.sub.leaf\nimport os\n")
    known = {PACKAGE, f"{PACKAGE}.sub", f"{PACKAGE}.sub.leaf", f"{PACKAGE}.top"}
    assert imports_of(f"{PACKAGE}.sub", str(pkg / "sub" / "__init__.py"), known) == {f"{PACKAGE}.sub.leaf"}
    assert imports_of(f"{PACKAGE}.sub.leaf", str(pkg / "sub" / "leaf.py"), known) == {f"{PACKAGE}.top"}
    assert imports_of(f"{PACKAGE}.top", str(pkg / "top.py"), known) == {f"{PACKAGE}.sub.leaf"}


def test_no_import_circle():
    files = module_files()
    known = set(files) | {EXTENSION}
    graph = {m: imports_of(m, p, known) for m, p in files.items()}
    graph[EXTENSION] = set()
    assert f"{PACKAGE}.registry" in graph[f"{PACKAGE}.patching"]  # the walk sees the package's own imports
    assert circles(graph) == []
