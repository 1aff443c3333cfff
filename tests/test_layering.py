"""DESIGN.md's import rule, enforced: cli -> api -> stages -> ir/target/errors, and a
stage never imports a later stage (frontend, graph, parallel, dispatch, codegen,
runtime, artifact, in that order). models sit on top of api like any user."""

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parent.parent / "kiln"
# Lower number = earlier. Base modules (ir, target, errors, pipeline, progress, settings,
# ops) are 0.
LEVEL = {
    "ir": 0, "target": 0, "errors": 0, "pipeline": 0, "progress": 0, "version": 0,
    "settings": 0, "ops": 0, "frontend": 1, "graph": 2, "parallel": 3, "dispatch": 4,
    "codegen": 5, "runtime": 6, "artifact": 7, "explain": 8, "compiled_module": 9, "api": 10,
    "models": 11, "cli": 12, "__init__": 13,
}
# Users of kiln's public API may import the package itself.
PUBLIC_USERS = {"models", "cli"}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kiln":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno


def test_stages_import_downward_only():
    wrong = []
    for path in sorted(KILN.rglob("*.py")):
        rel = path.relative_to(KILN)
        me = rel.parts[0].removesuffix(".py")
        mine = LEVEL[me]
        for module, line in _imports(path):
            unit = _unit(module)
            if unit is None or unit == me or (unit == "__init__" and me in PUBLIC_USERS):
                continue
            if LEVEL[unit] > mine or (LEVEL[unit] == mine and mine != 0):
                wrong.append(f"kiln/{rel}:{line} ({me}) imports {module} ({unit})")
    assert not wrong, "imports against DESIGN.md's direction:\n" + "\n".join(wrong)
