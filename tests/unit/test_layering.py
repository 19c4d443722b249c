"""The import contract of issue 27: the core (``engine/``, ``scheduler/``, ``kvcache/``,
``attention/``) imports no latent-family module; families import the core, never the
reverse. The core may import the shared latent primitives (``latent.family``, the interface
it calls; ``latent.spec``; ``latent.vectors``), the model loading of ``models/`` and
``latent.load``, the one loading entry point that names every family's checkpoint.
``KNOWN`` lists the imports not yet behind the family interface; it may only shrink.

And of issue 33: the packages of ``src/latentserve`` (a subpackage or a top-level module
each) import each other without a cycle, function-level imports included."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "latentserve"
CORE = ("engine", "scheduler", "kvcache", "attention")
SHARED = {"latentserve.latent.family", "latentserve.latent.spec", "latentserve.latent.vectors"}
LOADING = "latentserve.latent.load"
KNOWN: set = set()  # (core file, family module) not behind latent.family: none left
# Package cycles not yet broken (sorted pairs); it may only shrink.
KNOWN_CYCLES: set = set()  # package cycles not yet broken: none left; may only shrink


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            package = SRC.parent.joinpath(*node.module.split(".")).is_dir()
            names |= ({f"{node.module}.{a.name}" for a in node.names} if package
                      else {node.module})
    return names


def _is_family(module: str) -> bool:
    return module.startswith("latentserve.latent.") and module not in SHARED | {LOADING}


def test_the_core_imports_no_family_module():
    found = set()
    for part in CORE:
        for path in sorted((SRC / part).rglob("*.py")):
            rel = str(path.relative_to(SRC))
            found |= {(rel, m) for m in _imports(path) if _is_family(m)}
    assert found <= KNOWN, f"core files import family modules: {sorted(found - KNOWN)}"
    assert found == KNOWN, f"no longer imported, drop from KNOWN: {sorted(KNOWN - found)}"


def test_the_shared_primitives_import_no_family_module():
    for name in ("family", "spec", "vectors"):
        bad = {m for m in _imports(SRC / "latent" / f"{name}.py") if _is_family(m)}
        assert not bad, f"latent/{name}.py imports {sorted(bad)}"


def _package_graph() -> dict[str, set[str]]:
    """Top-level package (``engine``, ``config``, ...) -> the other ones it imports."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        package = rel[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve it
                base = ["latentserve", *rel[:-1]][:len(rel) + 1 - node.level]
                modules = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            targets = {m.split(".")[1] for m in modules if m.startswith("latentserve.")}
            graph.setdefault(package, set()).update(targets - {package})
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one package, each a sorted tuple."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    return {tuple(sorted({p} | {q for q in reach[p] if p in reach.get(q, ())}))
            for p in graph if any(p in reach.get(q, ()) for q in reach[p] if q != p)}


def test_the_packages_import_each_other_without_a_cycle():
    found = _cycles(_package_graph())
    assert found <= KNOWN_CYCLES, f"package import cycles: {sorted(found - KNOWN_CYCLES)}"
    assert found == KNOWN_CYCLES, f"broken, drop from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - found)}"


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == {("a", "b", "c")}
