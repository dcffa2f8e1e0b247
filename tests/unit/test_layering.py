"""The package layering of ``docs/layout.md``, checked on the source: dependencies point one way,
no import cycle exists (not even one hidden by a function-level import), function-level imports
of kolossos modules stay where they buy start-up time, and no module keeps a registry keyed by
the objects it describes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kolossos"

#: the layer of each top-level package (``""`` is ``kolossos/__init__.py``); a module may import
#: its own layer and the layers below it, never above
LAYERS: dict[str, int] = {
    # 0 - the ground: no kolossos import above it
    "_lazy": 0,
    "_version": 0,
    "accelerator": 0,
    "cluster": 0,
    "device": 0,
    "interface": 0,
    "launch_env": 0,
    "logging": 0,
    "utils": 0,
    "initialize": 0,
    # 1 - shared concepts every engine uses
    "amp": 1,
    "checkpoint_io": 1,
    "datasets": 1,
    "models": 1,
    "nn": 1,
    "pipeline": 1,
    "sequence": 1,  # ring self-attention, Ulysses all-to-all, ring attention
    "shardformer": 1,
    "lazy": 1,
    "tensor": 1,  # ColoTensor over DTensor, sharding specs, the layout converter
    # 2 - the engines (each owns its config and checkpoint IO)
    "auto_parallel": 2,  # ColoTracer and the activation-checkpoint search
    "ddp": 2,
    "fsdp": 2,
    "hybrid": 2,
    "inference": 2,  # generation engine over the shardformer plans (InferenceEngine)
    "moe": 2,  # routers, experts, MoE layer, expert-parallel all-to-all
    "zero": 2,
    # 3 - the facade
    "booster": 3,
    "mixed_precision": 3,
    # 4 - built on everything
    "": 4,
    "cli": 4,
    "legacy": 4,
    # Colossal-AI's old top-level import paths, thin aliases of kolossos.legacy
    "builder": 4,
    "constants": 4,
    "context": 4,
    "core": 4,
    "engine": 4,
    "global_variables": 4,
    "model_zoo": 4,  # the tutorials' model_zoo.vit.vit / model_zoo.gpt.gpt
    "registry": 4,
    "testing": 4,
    "train": 4,  # the `kolossos train` job
    "trainer": 4,  # Colossal-AI's colossalai.trainer (Trainer, hooks): kolossos.legacy.trainer
}
#: the imports allowed between two packages of one layer (the order inside a layer)
SIDEWAYS = {
    ("cluster", "accelerator"),
    ("cluster", "launch_env"),  # the watchdog's environment variable
    ("cluster", "device"),  # DeviceMeshManager keeps DeviceMesh objects
    ("device", "accelerator"),  # DeviceMesh's default device
    ("initialize", "cluster"),  # heartbeat, flight recorder and failure hook of each rank
    ("utils", "accelerator"),
    ("utils", "_lazy"),
    ("initialize", "accelerator"),
    ("initialize", "launch_env"),
    ("initialize", "logging"),
    ("initialize", "utils"),
    ("shardformer", "nn"),  # the plans build tensor-parallel layers
    ("hybrid", "ddp"),
    ("hybrid", "zero"),  # HybridParallelPlugin's ZeRO is LowLevelZero over the dp axis
    ("moe", "hybrid"),  # MoeHybridParallelPlugin's engine extends the hybrid engine
    ("mixed_precision", "booster"),  # the documented alias of kolossos.booster.mixed_precision
    ("cli", ""),  # kolossos.__version__
    ("cli", "train"),  # the command line runs the training job
    ("train", ""),  # kolossos.launch
    ("testing", ""),
    ("", "legacy"),  # kolossos.launch* resolve through kolossos.legacy.launch_hook (lazily)
    ("builder", "legacy"),
    ("constants", "legacy"),
    ("context", "legacy"),
    ("core", "legacy"),
    ("engine", "legacy"),
    ("global_variables", "legacy"),
    ("model_zoo", "legacy"),
    ("registry", "legacy"),
    ("trainer", "legacy"),  # Python config files, until the legacy Config reads them itself
}
#: packages whose function-level kolossos imports are allowed: they defer torch for the start-up
#: time of the command line (cli, train) or keep pytest's import order (testing)
DEFERRED_IMPORTS_OK = {"cli", "train", "testing"}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    deferred: bool  # inside a function
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(node: ast.ImportFrom | ast.Import, importer: str, is_package: bool) -> list[str]:
    """The kolossos modules an import statement loads (a ``from`` name that is a submodule
    counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("kolossos")]
    base = node.module or ""
    if node.level:
        anchor = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    if not base.startswith("kolossos"):
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in MODULES else base)
    return out


def _imports(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST, deferred: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:  # the TYPE_CHECKING body never runs
                    yield from walk(sub, deferred)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _resolve(child, module, is_package):
                    yield Import(module, target, deferred, child.lineno)
                continue
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from walk(child, inner)

    yield from walk(tree, False)


ALL_IMPORTS = [imp for name, path in MODULES.items() for imp in _imports(name, path)]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.source].relative_to(ROOT.parent)}:{imp.line} imports {imp.target}"


def test_dependencies_point_down_the_layers() -> None:
    wrong = []
    for imp in ALL_IMPORTS:
        src, dst = _package(imp.source), _package(imp.target)
        if src == dst or src not in LAYERS:
            continue
        assert dst in LAYERS, f"{dst!r} has no layer: add the new package to LAYERS"
        if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] and (src, dst) not in SIDEWAYS):
            wrong.append(_where(imp))
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_every_package_has_a_layer() -> None:
    assert {_package(m) for m in MODULES} <= set(LAYERS)


def test_no_engine_imports_the_booster() -> None:
    engines = {p for p, layer in LAYERS.items() if layer <= 2}
    wrong = [
        _where(i)
        for i in ALL_IMPORTS
        if _package(i.source) in engines and _package(i.target) == "booster"
    ]
    assert not wrong, wrong


def test_function_level_imports_only_where_they_buy_start_up_time() -> None:
    wrong = [
        _where(i)
        for i in ALL_IMPORTS
        if i.deferred and _package(i.source) not in DEFERRED_IMPORTS_OK
    ]
    assert not wrong, "move these imports to module level (untangle the cycle):\n" + "\n".join(
        wrong
    )


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    """Module -> modules it loads: the target, and the target's packages that are not being
    imported already (the importer's own ancestors are)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in imports:
        ancestors = {
            ".".join(imp.source.split(".")[:i]) for i in range(1, imp.source.count(".") + 1)
        }
        parts = imp.target.split(".")
        chain = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
        for step in chain:
            if step in MODULES and step not in ancestors and step != imp.source:
                graph[imp.source].add(step)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_even_through_function_level_imports() -> None:
    cycles = _cycles(_graph(ALL_IMPORTS))
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("maker", ["WeakKeyDictionary", "WeakIdKeyDictionary", "WeakSet"])
def test_no_module_level_registry_of_objects(maker: str) -> None:
    """State about models, optimizers and parameters lives on those objects or on the plugin
    instance that made them, so a second Booster never sees the first one's entries."""
    wrong = []
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and maker in ast.unparse(value.func):
                wrong.append(f"{name}:{node.lineno}")
    assert not wrong, wrong


def test_the_checks_can_fail() -> None:
    """The cycle finder and the layer rule see a planted violation."""
    planted = [
        Import("kolossos.amp.cast", "kolossos.booster.booster", True, 1),
        Import("kolossos.booster.booster", "kolossos.amp.cast", False, 1),
    ]
    assert _cycles(_graph(planted)) == [["kolossos.amp.cast", "kolossos.booster.booster"]]
    assert LAYERS[_package(planted[0].target)] > LAYERS[_package(planted[0].source)]
