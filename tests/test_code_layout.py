"""The code stays a house a newcomer can live in: no product module over 500 lines, no class over 400,
no function over 80, no import cycle between the project's modules (imports inside functions count),
and every package ``install_requires`` names is imported by product code."""

from __future__ import annotations

import ast
import configparser
import re
import sys

from conftest import REPO

IMPORT_NAMES = {"PyYAML": "yaml", "protobuf": "google.protobuf"}  # distribution -> module, where they differ


def product_modules() -> dict[str, ast.Module]:
    files = [*REPO.glob("*.py"), *REPO.glob("data/*.py"), *REPO.glob("lowmem/*.py")]
    modules = {}
    for path in files:
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = ast.parse(path.read_text(encoding="utf-8"))
    return modules


def imported_names(tree: ast.Module, module: str) -> set[str]:
    """Every module name ``tree`` imports, at any depth, relative imports made absolute."""
    names = set()
    package = module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(p for p in (package, base) if p)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_module_class_or_function_past_its_size():
    too_long = []
    for name, tree in product_modules().items():
        lines = max((getattr(n, "end_lineno", 0) or 0) for n in ast.walk(tree))
        if lines > 500:
            too_long.append(f"module {name}: {lines} lines")
        for node in ast.walk(tree):
            size = (node.end_lineno - node.lineno + 1) if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef) and size > 400:
                too_long.append(f"class {name}.{node.name}: {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                too_long.append(f"function {name}.{node.name}: {size} lines")
    assert not too_long, too_long


def test_no_import_cycle_between_the_projects_modules():
    modules = product_modules()
    graph = {name: {m for m in modules if m != name and m in imported_names(tree, name)}
             for name, tree in modules.items()}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for nxt in graph[name]:
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(name)

    done: set[str] = set()
    sys.setrecursionlimit(10_000)
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_every_required_package_is_imported_by_product_code():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    required = [re.split(r"[<>=!~ ;\[]", line.strip())[0] for line in
                setup["options"]["install_requires"].strip().splitlines() if line.strip()]
    imported = set().union(*(imported_names(tree, name) for name, tree in product_modules().items()))
    roots = imported | {n.split(".")[0] for n in imported}
    unused = [dist for dist in required if IMPORT_NAMES.get(dist, dist.lower().replace("-", "_")) not in roots]
    assert required and not unused, unused


def test_every_name_the_benchmarks_and_tests_import_from_the_project_exists():
    # No test runs most of bench/: a function moved between modules broke bench/encoder_cache_speed.py
    # at its first import, found only by running it
    import importlib

    project = ("config", "data", "lowmem", "train_low_mem", "trainer_low_mem")
    missing = []
    for path in [*REPO.glob("bench/*.py"), *REPO.glob("tests/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in project:
                module = importlib.import_module(node.module)
                package = hasattr(module, "__path__")  # its names may be submodules
                missing += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name)
                            and not (package and importlib.util.find_spec(f"{node.module}.{alias.name}"))]
    assert not missing, missing
