"""The layering of `elasticep` as a test: every import between its subpackages points
down the one order below, so no subpackage imports one above it and no two import each
other (no cycle). Imports inside functions and under TYPE_CHECKING count too.

The order is the one docs/ARCHITECTURE.md's package list gives; a new subpackage must
be placed in it here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elasticep

# bottom first: each subpackage (or top-level module) may import only those before it
LAYERS = (
    "enums", "wire", "config", "utils", "membership", "distributed", "compat", "eplb", "moe",
    "models", "engine", "frontend_link", "elastic", "deploy", "frontend", "entrypoints",
)

ROOT = Path(elasticep.__file__).parent


def _layer_of(path: Path) -> str | None:
    """The subpackage (or top-level module) that ``path`` belongs to; None for the
    package's own ``__init__``."""
    rel = path.relative_to(ROOT)
    if len(rel.parts) == 1:
        return None if rel.stem == "__init__" else rel.stem
    return rel.parts[0]


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every elasticep import in ``path``, relative ones
    resolved against the module's package."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                out.append((node.lineno, node.module or ""))
                continue
            base = package[:len(package) - (node.level - 1)]
            if node.module:
                out.append((node.lineno, ".".join([*base, node.module])))
            else:  # from . import a, b: each name may be a module
                out += [(node.lineno, ".".join([*base, a.name])) for a in node.names]
    return [(line, mod) for line, mod in out if mod.split(".")[0] == "elasticep"]


def _edges() -> list[tuple[str, str, str]]:
    """(importer layer, imported layer, "file:line") for every cross-subpackage import."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _layer_of(path)
        for line, mod in _imported(path):
            parts = mod.split(".")
            if len(parts) < 2:
                continue  # `import elasticep`
            other = parts[1]
            if me is not None and other != me:
                edges.append((me, other, f"{path.relative_to(ROOT.parent)}:{line}"))
    return edges


def test_every_subpackage_has_a_layer():
    names = {_layer_of(p) for p in ROOT.rglob("*.py")} - {None}
    assert names <= set(LAYERS), f"place {sorted(names - set(LAYERS))} in LAYERS"


def test_imports_point_down_only():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [f"{where}: {me} imports {other}" for me, other, where in _edges()
              if other in rank and rank[other] >= rank[me]]
    assert not upward, "upward imports (or a cycle):\n" + "\n".join(upward)


def test_the_check_resolves_relative_imports():
    """The checker itself: a relative import resolves into its package."""
    pkg = ROOT / "membership" / "service.py"
    mods = {mod for _line, mod in _imported(pkg)}
    assert "elasticep.membership.messages" in mods  # from . import messages as m
    assert "elasticep.membership.registry" in mods  # from .registry import ...


# The rooms of `moe`: the exchange moves rows and runs no expert or router on them (it
# imports nothing of moe outside itself: no expert kernel, no routing rule, no
# executor; the weighted sum that ends its combine is its own), and the
# expert kernels compute and move nothing, so they import no exchange. What fuses the two
# (moe/fused_exchange*.py) and the executors sit in moe/ itself, above both.
MOE = ROOT / "moe"


def _room_imports(room: str, forbidden: str, allowed: str = "") -> list[str]:
    """"file:line imports module" for every import under ``forbidden`` (a dotted prefix)
    in the modules under ``moe/<room>/``, less those under ``allowed``."""
    def under(mod: str, prefix: str) -> bool:
        return bool(prefix) and (mod == prefix or mod.startswith(prefix + "."))
    found = []
    for path in sorted((MOE / room).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, mod in _imported(path):
            if under(mod, forbidden) and not under(mod, allowed):
                found.append(f"{rel}:{line} imports {mod}")
    return found


def test_the_exchange_imports_nothing_of_moe_outside_itself():
    found = _room_imports("exchange", "elasticep.moe", allowed="elasticep.moe.exchange")
    assert not found, "the exchange imports expert kernels, routing or executors:\n" + \
        "\n".join(found)


def test_the_expert_kernels_import_no_exchange():
    found = _room_imports("experts", "elasticep.moe.exchange")
    assert not found, "expert kernels import the exchange:\n" + "\n".join(found)


def test_the_rooms_check_sees_imports():
    """The checker itself: the executor that joins the rooms imports both."""
    mods = {mod for _line, mod in _imported(MOE / "cuda_executor.py")}
    assert "elasticep.moe.exchange.ipc_exchange" in mods
    assert "elasticep.moe.experts.expert_compute" in mods
