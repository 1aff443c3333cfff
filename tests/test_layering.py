"""DESIGN.md's import rules, enforced per MODULE and counting imports inside functions
(a lazy import still couples two modules; hiding one in a function only hides a cycle):

1. kiln's modules form a DAG: no import cycles;
2. a stage imports only earlier stages: ir/target/errors (base) <- frontend <- graph <-
   parallel <- dispatch <- codegen <- runtime <- artifact <- explain <- api <- models <-
   bench <- cli; modules of one stage may import each other (rule 1 keeps that acyclic);
3. kiln/models/ is a user of kiln: it imports only the public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parent.parent / "kiln"
# Lower number = earlier. Base modules (ir, target, errors, pipeline, progress, settings,
# ops) are 0. compiled_module, arguments (compile's keyword checks) and lazy_module
# (kiln.compile without example args) serve api.
LEVEL = {
    "ir": 0, "target": 0, "errors": 0, "pipeline": 0, "progress": 0, "version": 0,
    "settings": 0, "ops": 0, "frontend": 1, "graph": 2, "parallel": 3, "dispatch": 4,
    "codegen": 5, "runtime": 6, "artifact": 7, "explain": 8, "compiled_module": 9,
    "arguments": 9, "lazy_module": 9, "api": 10,
    "models": 11, "bench": 12, "cli": 13, "__init__": 14,
}
# Users of kiln's public API may import the package itself.
PUBLIC_USERS = {"models", "bench", "cli"}
# What kiln/models/ may import besides kiln.models.* (kiln.ops: a planned public module).
PUBLIC_API = {"kiln", "kiln.errors", "kiln.target", "kiln.progress", "kiln.ops"}


def _module_files() -> dict[str, Path]:
    mods = {}
    for path in sorted(KILN.rglob("*.py")):
        parts = list(path.relative_to(KILN.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _module_files()


def _resolve(name: str) -> str | None:
    """The kiln module `name` loads: itself, or the package holding it (for an imported
    attribute such as kiln.ir.graph.KilnGraph, or a future module kiln.ops -> kiln)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, str, int]]:
    path = MODULES[module]
    return _scan(path.read_text(), module, is_package=path.name == "__init__.py")


def _scan(source: str, module: str, is_package: bool) -> list[tuple[str, str, int]]:
    """(imported name, kiln module it resolves to, line) for every kiln import anywhere in
    `source` (module `module`), relative imports made absolute. `from pkg import name`
    imports pkg, and pkg.name too when that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                keep = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(keep + ([base] if base else []))
            # the package's __init__ runs first, so it is imported too
            names = [base] + [f"{base}.{a.name}" for a in node.names
                              if f"{base}.{a.name}" in MODULES]
        else:
            continue
        for name in dict.fromkeys(names):
            target = _resolve(name) if name.split(".")[0] == "kiln" else None
            if target is not None and target != module:
                found.append((name, target, node.lineno))
    return found


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(KILN.parent)}:{line}"


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return sorted(found)


def _graph() -> dict[str, set[str]]:
    """Module -> the kiln modules it imports. A package's __init__ runs before any of its
    submodules, so a submodule importing its own package (or an ancestor) is no edge."""
    return {m: {t for _, t, _ in _imports(m) if not m.startswith(t + ".")} for m in MODULES}


def test_kiln_modules_have_no_import_cycles():
    edges = _graph()
    report = []
    for scc in _cycles(edges):
        members = set(scc)
        report.append("cycle: " + ", ".join(scc))
        for m in scc:
            report += [f"  {_where(m, line)} {m} imports {name}"
                       for name, t, line in _imports(m) if t in members and t in edges[m]]
    assert not report, "import cycles among kiln's modules:\n" + "\n".join(report)


def test_stages_import_downward_only():
    wrong = []
    for m in MODULES:
        me = _stage(m)
        for name, target, line in _imports(m):
            unit = _stage(target)
            if unit == me or (unit == "__init__" and me in PUBLIC_USERS):
                continue
            if LEVEL[unit] > LEVEL[me] or (LEVEL[unit] == LEVEL[me] and LEVEL[me] != 0):
                wrong.append(f"{_where(m, line)} {m} ({me}) imports {name} ({unit})")
    assert not wrong, "imports against DESIGN.md's direction:\n" + "\n".join(wrong)


# Inside codegen the layers import downward too: build <- expr <- templates <- autotune
# <- select_kernels (kiln/codegen/__init__.py says what each answers). Modules directly in
# codegen/ other than select_kernels (kernel_plan, torch_kernel, integer_products,
# size_switch) sit with build.
CODEGEN_LAYER = {"build": 0, "kernel_plan": 0, "torch_kernel": 0, "torch_program": 0,
                 "integer_products": 0, "size_switch": 0,
                 "expr": 1, "templates": 2,
                 "autotune": 3, "select_kernels": 4}


def _codegen_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["kiln", "codegen"] or len(parts) < 3:
        return None
    return CODEGEN_LAYER[parts[2]]


def test_codegen_layers_import_downward_only():
    wrong = []
    for m in MODULES:
        mine = _codegen_layer(m)
        if mine is None:
            continue
        for name, target, line in _imports(m):
            theirs = _codegen_layer(target)
            if theirs is not None and theirs > mine:
                wrong.append(f"{_where(m, line)} {m} imports {name}")
    assert not wrong, "codegen layers import against build <- expr <- templates <- " \
        "autotune <- select_kernels:\n" + "\n".join(wrong)


def test_models_and_bench_use_only_the_public_api():
    """kiln/models/ and kiln/bench/ are kiln's users: what they need, users can reach."""
    wrong = []
    for m in MODULES:
        stage = _stage(m)
        if stage not in ("models", "bench"):
            continue
        own = f"kiln.{stage}"
        for name, _, line in _imports(m):
            if not (name in PUBLIC_API or name == own or name.startswith(own + ".")):
                wrong.append(f"{_where(m, line)} {m} imports {name}")
    assert not wrong, "kiln/models/ and kiln/bench/ must use kiln's public API only:\n" + \
        "\n".join(wrong)


def test_the_checks_see_lazy_relative_and_cyclic_imports():
    """The rules above are only as good as the import scan and the cycle finder."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [
        ["a", "b", "c"]]
    source = (
        "import torch\n"
        "from . import split\n"                      # kiln.dispatch.split (a module)
        "def f():\n"
        "    from ..ir.graph import KilnGraph\n"     # kiln.ir.graph, inside a function
        "    from ..codegen import select_kernels\n"
        "    import kiln.errors\n"
    )
    assert _scan(source, "kiln.dispatch.cost", is_package=False) == [
        ("kiln.dispatch", "kiln.dispatch", 2),
        ("kiln.dispatch.split", "kiln.dispatch.split", 2),
        ("kiln.ir.graph", "kiln.ir.graph", 4),
        ("kiln.codegen", "kiln.codegen", 5),
        ("kiln.codegen.select_kernels", "kiln.codegen.select_kernels", 5),
        ("kiln.errors", "kiln.errors", 6),
    ]
    # a package's own "from . import x" is relative to the package itself
    assert _scan("from .llama import tiny_llama", "kiln.models", is_package=True) == [
        ("kiln.models.llama", "kiln.models.llama", 1)]
    # an ancestor package is no edge (it runs first anyway), and neither is the module itself
    assert _graph()["kiln.models.hf"] >= {"kiln.errors", "kiln.models.llama"}
    assert "kiln.models" not in _graph()["kiln.models.hf"]
