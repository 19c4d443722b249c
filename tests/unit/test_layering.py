"""The import contract of issue 27: the core (``engine/``, ``scheduler/``, ``kvcache/``,
``attention/``) imports no latent-family module; families import the core, never the
reverse. The core may import the shared latent primitives (``latent.family``, the interface
it calls; ``latent.spec``; ``latent.vectors``) and the model loading of ``models/``.
``KNOWN`` lists the imports not yet behind the family interface; it may only shrink."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "latentserve"
CORE = ("engine", "scheduler", "kvcache", "attention")
SHARED = {"latentserve.latent.family", "latentserve.latent.spec", "latentserve.latent.vectors"}
FAMILY_MODELS = {"latentserve.models.huginn", "latentserve.models.ouro"}
KNOWN: set = set()  # (core file, family module) not behind latent.family: none left


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
    if module in SHARED:
        return False
    return module.startswith("latentserve.latent.") or module in FAMILY_MODELS or any(
        module.startswith(m + ".") for m in FAMILY_MODELS)


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
