"""The code stays a house a newcomer can live in (docs/architecture.md, docs/layout.md):

- imports go one way between packages, down the floors of ``FLOORS`` (``lowmem.utils`` at the bottom, then
  ``config``, ``data``, each ``lowmem`` subpackage, ``trainer_low_mem``, ``train_low_mem``): no exemptions, so no
  two packages import each other;
- no import cycle between the project's modules (imports inside functions count);
- no product module over 400 lines, no class over 400, no function over 60, except today's offenders in
  ``OVER_THE_LIMIT``, each at most its recorded size: the list only shrinks;
- no product function takes more than 6 parameters (self and cls not counted; ``*args`` and ``**kwargs`` count);
- every package ``install_requires`` names is imported by product code;
- no product module outside ``lowmem/parallel/`` compares an engine's name: it asks the engine object
  (``lowmem.parallel.engines``) or the planner's layout (``lowmem.parallel.layouts``); none but
  ``lowmem.hardware.precision`` compares a precision's name, none but ``lowmem.utils.frozen_forms`` a frozen form's.

Every ``.py`` file at the top level and under ``data/`` and ``lowmem/``, subpackages included, is a product module.
"""

from __future__ import annotations

import ast
import configparser
import re
from functools import cache
from pathlib import Path

from conftest import REPO

IMPORT_NAMES = {"PyYAML": "yaml", "protobuf": "google.protobuf"}  # distribution -> module, where they differ

# The floors, bottom first (docs/architecture.md): a module imports its own package and the floors below it.
FLOORS = ("lowmem.utils", "config", "data", "lowmem.hardware", "lowmem.model", "lowmem.checkpointing",
          "lowmem.monitoring", "lowmem.parallel", "lowmem.memory", "lowmem.training", "lowmem.runs", "lowmem.cli",
          "lowmem", "trainer_low_mem", "train_low_mem")

MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 400, 400, 60
PARAMETERS = 6  # a function's most (self and cls not counted; *args and **kwargs count one each)

# Today's offenders and their sizes in lines (a module: its lines; a function: from `def` to its last line).
# Split by concern, then lower or remove the entry: the test fails when one grows, when a new one appears
# and when an entry is larger than what it counts (so that the list follows each split down).
OVER_THE_LIMIT: dict[str, int] = {}


def product_files() -> list[Path]:
    """The top level's ``.py`` files and every one under data/ and lowmem/, at any depth."""
    files = [*REPO.glob("*.py"), *REPO.glob("data/**/*.py"), *REPO.glob("lowmem/**/*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


@cache
def product_modules() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in product_files()}


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


@cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's ``__init__`` under the package's name)."""
    modules = product_modules()
    return {name: (imported_names(tree, name) & set(modules)) - {name} for name, (_, tree) in modules.items()}


def floor(name: str) -> int:
    """The floor of module ``name``: its package's place in FLOORS (``lowmem``'s own modules: the ``lowmem`` floor)."""
    parts = name.split(".")
    package = ".".join(parts[:2]) if parts[0] == "lowmem" and ".".join(parts[:2]) in FLOORS else parts[0]
    return FLOORS.index(package)


def test_every_subpackage_is_walked():
    # The walk finds modules at any depth: a file in a subpackage cannot escape the checks below
    names = set(product_modules())
    for folder in ("data", "lowmem"):
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert module_name(path) in names, path
    assert {"config", "train_low_mem", "trainer_low_mem", "data.pipeline", "lowmem.utils.presets"} <= names


def test_each_package_docstring_maps_its_modules():
    # A package's __init__ docstring is its map: every module and subpackage in it is named there
    for init in [*(REPO / "data").rglob("__init__.py"), *(REPO / "lowmem").rglob("__init__.py")]:
        if "__pycache__" in init.parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        here = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
        here += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
        unnamed = [name for name in here if f"``{name}``" not in doc and f"{name}.py" not in doc
                   and not re.search(rf"``[\w.]*\b{name}``", doc)]
        assert not unnamed, f"{init.relative_to(REPO)}'s docstring does not name {unnamed}"


def test_every_package_is_on_a_floor():
    packages = {".".join(name.split(".")[:2]) if name.startswith("lowmem.") and "." in name else name.split(".")[0]
                for name in product_modules()}
    packages = {p if p in FLOORS else p.split(".")[0] for p in packages}
    assert packages == set(FLOORS), sorted(packages ^ set(FLOORS))


def test_imports_go_down_the_floors_between_packages():
    graph = import_graph()
    upward = [f"{name} -> {dep}" for name, deps in sorted(graph.items()) for dep in sorted(deps)
              if floor(dep) > floor(name)]
    assert not upward, f"imports against the floors {' <- '.join(FLOORS)}: {upward}"
    # so no two packages import each other
    pairs = {(floor(name), floor(dep)) for name, deps in graph.items() for dep in deps if floor(name) != floor(dep)}
    assert not {(a, b) for a, b in pairs if (b, a) in pairs}


def test_the_floor_check_finds_an_upward_import():
    assert floor("lowmem.utils.ownership") < floor("config") < floor("lowmem.model.build") < floor("lowmem.runs.x")
    assert floor("lowmem.memory.planner") > floor("lowmem.parallel.engines")


def test_no_import_cycle_between_the_projects_modules():
    graph = import_graph()
    cycles = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(graph[name]):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not cycles, [" -> ".join(c) for c in cycles]


def sizes_over_the_limits() -> dict[str, int]:
    """``{"module NAME" | "class QUALNAME" | "function QUALNAME": lines}`` of everything past its limit."""
    over = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname, size = f"{prefix}.{child.name}", child.end_lineno - child.lineno + 1
                kind, limit = (("class", CLASS_LINES) if isinstance(child, ast.ClassDef)
                               else ("function", FUNCTION_LINES))
                if size > limit:
                    over[f"{kind} {qualname}"] = size
                visit(child, qualname)
            else:
                visit(child, prefix)

    for name, (path, tree) in product_modules().items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MODULE_LINES:
            over[f"module {name}"] = lines
        visit(tree, name)
    return over


def test_no_module_class_or_function_past_its_size_but_todays_offenders_which_only_shrink():
    over = sizes_over_the_limits()
    new = {k: v for k, v in over.items() if k not in OVER_THE_LIMIT}
    grown = {k: f"{OVER_THE_LIMIT[k]} -> {v}" for k, v in over.items() if k in OVER_THE_LIMIT and v > OVER_THE_LIMIT[k]}
    assert not new, f"past the limits (module {MODULE_LINES}, class {CLASS_LINES}, function {FUNCTION_LINES} " \
                    f"lines; split it by concern): {new}"
    assert not grown, f"grew past its recorded size (split it by concern): {grown}"
    smaller = {k: over.get(k, "within the limit: remove the entry") for k, v in OVER_THE_LIMIT.items()
               if over.get(k) != v}
    assert not smaller, f"shrank: lower (or remove) its entry in OVER_THE_LIMIT: {smaller}"


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters: positional-only, positional and keyword-only ones but self and cls, and
    ``*args`` and ``**kwargs`` one each."""
    args = function.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def test_no_product_function_takes_more_than_six_parameters():
    """Parameters that travel together are one object (a run context, a stream's spec), values derivable from
    ``cfg`` are derived inside, and shared state lives on a class."""
    over = {f"{name}.{node.name} (line {node.lineno})": parameter_count(node)
            for name, (_, tree) in product_modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameter_count(node) > PARAMETERS}
    assert not over, f"more than {PARAMETERS} parameters (pass one object for those that travel together): {over}"


# Names of engines and sharded layouts, and what holds one: compared anywhere but lowmem/parallel/, they are a
# branch on an engine the engine object should answer (docs/architecture.md, "Adding an engine")
ENGINE_NAMES = {"fsdp", "deepspeed", "ddp", "zero2", "zero3"}
ENGINE_HOLDERS = {"engine", "sharding"}


def name_comparisons(tree: ast.AST, names: set[str], holders: set[str]) -> list[int]:
    """Lines of ``tree`` comparing a kind's name: a string in ``names`` on either side (alone or in a tuple, list
    or set), or any string against a name or attribute called one of ``holders`` (or a dict's value read under that
    key: ``saved["mixed_precision"]``, ``saved.get("mixed_precision")``)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        values = [v for side in sides for v in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set))
                                                 else [side])]
        strings = {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
        if strings & names or (strings and {holder_name(side) for side in sides} & holders):
            lines.append(node.lineno)
    return lines


def holder_name(node: ast.AST) -> str | None:
    """What a compared value is called: a name's, an attribute's, or the string key a dict is read under."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    key = node.slice if isinstance(node, ast.Subscript) else (
        node.args[0] if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args
        else None)
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def engine_name_comparisons(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` comparing an engine's name (``name_comparisons``: ENGINE_NAMES, ENGINE_HOLDERS)."""
    return name_comparisons(tree, ENGINE_NAMES, ENGINE_HOLDERS)


def test_no_module_outside_the_parallel_package_compares_an_engines_name():
    old = 'if engine == "deepspeed": pass\nif self.engine != "x": pass\nif s in ("zero2", "zero3"): pass\n'
    assert engine_name_comparisons(ast.parse(old)) == [1, 2, 3]  # the check finds the branches it replaced
    found = [f"{path.relative_to(REPO)}:{line}" for name, (path, tree) in product_modules().items()
             if not name.startswith("lowmem.parallel.") for line in engine_name_comparisons(tree)]
    assert not found, f"engine names compared outside lowmem/parallel/ (ask the engine object instead): {found}"


# --mixed_precision's and --frozen_dtype's names. "no", "float32" and "bfloat16" are other flags' values too
# (--cache_dtype, --encoder_cache_dtype, a checkpoint's dtype) and words of every kind: they count only against
# what holds a precision or a frozen form; "bf16", "fp16", "int8" and "float8" name nothing else here, so they count
# on either side of any comparison
PRECISION_NAMES, PRECISION_HOLDERS = {"bf16", "fp16"}, {"mixed_precision", "precision"}
FROZEN_FORM_NAMES, FROZEN_FORM_HOLDERS = {"int8", "float8"}, {"frozen_dtype"}


def test_no_module_but_their_own_compares_a_precisions_or_a_frozen_forms_name():
    """A precision is asked (``PRECISIONS[cfg.mixed_precision].half``, ``.width``, ``.dtype``, ...) outside
    ``lowmem.hardware.precision``, and a frozen form (``FROZEN_FORMS[cfg.frozen_dtype].quantized``, ``.narrow``, ...)
    outside ``lowmem.utils.frozen_forms``: no other product module compares their names (docs/architecture.md).
    Found as the engine's are (``name_comparisons``): a name in PRECISION_NAMES / FROZEN_FORM_NAMES anywhere in a
    comparison, or any string compared with what PRECISION_HOLDERS / FROZEN_FORM_HOLDERS call a value."""
    old = ('if cfg.mixed_precision == "bf16": pass\nif precision != "no": pass\nif s in ("bf16", "x"): pass\n'
           'if cfg.frozen_dtype in ("int8", "y"): pass\nif x == "float8": pass\n'
           'if saved["mixed_precision"] != "no": pass\nif cfg.get("frozen_dtype") == "float32": pass\n'
           'if cfg.cache_dtype == "bfloat16": pass\n')
    tree = ast.parse(old)  # the check finds the branches it replaced, and leaves a cache's dtype alone
    assert name_comparisons(tree, PRECISION_NAMES, PRECISION_HOLDERS) == [1, 2, 3, 6]
    assert name_comparisons(tree, FROZEN_FORM_NAMES, FROZEN_FORM_HOLDERS) == [4, 5, 7]
    found = []
    for own, names, holders in (("lowmem.hardware.precision", PRECISION_NAMES, PRECISION_HOLDERS),
                                ("lowmem.utils.frozen_forms", FROZEN_FORM_NAMES, FROZEN_FORM_HOLDERS)):
        found += [f"{path.relative_to(REPO)}:{line}" for name, (path, tree) in product_modules().items()
                  if name != own for line in name_comparisons(tree, names, holders)]
    assert not found, f"precision or frozen-form names compared outside their modules (ask the object): {found}"


def test_every_required_package_is_imported_by_product_code():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    required = [re.split(r"[<>=!~ ;\[]", line.strip())[0] for line in
                setup["options"]["install_requires"].strip().splitlines() if line.strip()]
    imported = set().union(*(imported_names(tree, name) for name, (_, tree) in product_modules().items()))
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
