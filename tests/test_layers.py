"""The package's layers import downward only, with no circle (DESIGN.md, "Layers").

Read, not run: every ``import`` and ``from ... import`` in every module of src/gradsync, those inside
functions too (a lazy import is still a dependency), is resolved to the module it names
(``from gradsync.group import runtime`` names gradsync.group.runtime, not the package).

The layers are rooms, highest first (LAYERS): a folder, or a module that is a room of its own. A
module is in the layer of the most specific room that holds it and may import its own layer and the
ones below, never one above; a ``__main__`` module is a command line (``python -m gradsync.train``,
torchrun's entry, and ``python -m gradsync.cluster``) and sits with cli/. No file has a level of its
own and there are no exceptions: a module that needs one is in the wrong room. A circle is an error
even within one layer. A new room (a folder or a loose module) fails until it is given its layer.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "gradsync"

LAYERS = (
    ("the command line", ("gradsync.cli",)),
    ("benchmarks and the emulated cluster", ("gradsync.bench", "gradsync.cluster")),
    ("the main job", ("gradsync.train",)),
    # the public names (``import gradsync as gs``): the package gathers them from the layers below, and
    # the main job is written with them
    ("the public names", ("gradsync",)),
    ("live fault tolerance", ("gradsync.live",)),
    ("strategies", ("gradsync.ddp", "gradsync.ps", "gradsync.zero", "gradsync.diloco", "gradsync.replicas")),
    ("the torch.distributed backend", ("gradsync.c10d",)),
    ("collective algorithms, and what picks an algorithm and a transport", ("gradsync.comm",)),
    ("transports", ("gradsync.comm.transport",)),
    # beside them, importing nothing above: DistributedSampler, checkpoints, clipping
    ("set-up, observation, the cost model, and beside them", ("gradsync.group", "gradsync.observe", "gradsync.sim",
                                                               "gradsync.data", "gradsync.checkpoint", "gradsync.clip",
                                                               "gradsync.compile_guard")),
)
ROOMS = {room: len(LAYERS) - height for height, (_, rooms) in enumerate(LAYERS) for room in rooms}
"""Each room's layer: higher numbers above."""


def level(module: str) -> int:
    if module.endswith(".__main__"):
        return ROOMS["gradsync.cli"]
    # the package's own entry holds only itself: a new loose module must be given a layer, not inherit
    # the public names' one
    rooms = [room for room in ROOMS if module == room or (module.startswith(room + ".") and room != "gradsync")]
    if not rooms:
        raise AssertionError(f"{module} is in no room of tests/test_layers.py's LAYERS: give its room a layer")
    return ROOMS[max(rooms, key=len)]


def layer_name(module: str) -> str:
    return LAYERS[len(LAYERS) - level(module)][0]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from a import b": the submodule a.b when there is one, else the module a
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith("gradsync") and candidate != name:
                found.add(candidate)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_every_module_has_a_level():
    for name in modules():
        level(name)


def test_no_module_imports_a_higher_layer():
    known = modules()
    upward = [f"{known[name].relative_to(PACKAGE.parent)} ({layer_name(name)}) imports "
              f"{known[target].relative_to(PACKAGE.parent)} ({layer_name(target)})"
              for name, targets in sorted(graph().items()) for target in sorted(targets)
              if level(target) > level(name)]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def find_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles():
    known = modules()
    edges = graph()
    circles = find_circles(edges)
    described = []
    for circle in circles:
        pairs = [f"{known[a].relative_to(PACKAGE.parent)} -> {known[b].relative_to(PACKAGE.parent)}"
                 for a in circle for b in sorted(edges[a]) if b in circle]
        described.append("; ".join(pairs))
    assert not circles, "import circles:\n" + "\n".join(described)


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_itself(edges, expected):
    assert find_circles(edges) == expected


TRANSPORT_INTERNALS = ("gradsync.comm.transport.shm", "gradsync.comm.transport.torch_distributed")
"""The transports' implementations: only comm/ reaches them; everything else asks comm's public
surface (comm/world_transport.py, comm/collectives.py)."""


def test_nothing_outside_comm_imports_a_transports_internals():
    reaching = [f"{name} imports {target}" for name, targets in sorted(graph().items())
                if not name.startswith("gradsync.comm") for target in sorted(targets)
                if target.startswith(TRANSPORT_INTERNALS)]
    assert not reaching, "imports of the transports' internals from outside comm/:\n" + "\n".join(reaching)


def private_imports() -> list[str]:
    """Every ``from gradsync.x import _name`` in the package where _name is not a module of it: a private
    name of one module used by another (what is shared deserves a public name in the right room)."""
    known = modules()
    found = []
    for name, path in sorted(known.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("gradsync"):
                continue
            for alias in node.names:
                if (alias.name.startswith("_") and not alias.name.startswith("__") and base != name
                        and f"{base}.{alias.name}" not in known):
                    found.append(f"{name} imports {alias.name} from {base}")
    return found


def test_no_module_imports_another_modules_private_name():
    found = private_imports()
    assert not found, "private names imported from another module:\n" + "\n".join(found)


TESTS = PACKAGE.parent.parent / "tests"


def registered_objects() -> dict[str, str]:
    """Every class the package loads by name (``module:Class``): each strategy's objects (train/strategies/
    registry.py) and each tracker (train/trackers); name -> module:Class."""
    from gradsync.train.strategies.registry import STRATEGIES
    from gradsync.train.trackers import TRACKERS

    found = {f"tracker {name}": kind.object for name, kind in TRACKERS.items()}
    for name, strategy in STRATEGIES.items():
        found[f"strategy {name}"] = strategy.object
        if strategy.live_object is not None:
            found[f"strategy {name}, live"] = strategy.live_object
    return found


def test_every_class_the_registries_name_loads_with_its_interface():
    from gradsync.train.strategies.base import StrategyObject
    from gradsync.train.strategies.registry import STRATEGIES
    from gradsync.train.trackers import TRACKERS
    from gradsync.train.trackers.base import Tracker

    for name, strategy in STRATEGIES.items():
        for live in (False, True) if strategy.live_object is not None else (False,):
            loaded = strategy.load(live)
            assert isinstance(loaded, type) and issubclass(loaded, StrategyObject), (name, live, loaded)
    for name, kind in TRACKERS.items():
        loaded = kind.load()
        assert isinstance(loaded, type) and issubclass(loaded, Tracker), (name, loaded)


def test_every_module_is_reached_by_a_test():
    """A module no test imports, directly or through the modules it imports, runs as ``python -m``, or loads
    from a registry is a room nobody checks. Reached: the modules tests/*.py import or name
    (``gradsync.x.y``, also in a subprocess's command), a package's ``__main__`` where a test runs
    ``-m`` on it, the classes the registries name; then everything those import."""
    known = modules()
    roots = set()
    for path in TESTS.glob("*.py"):
        text = path.read_text()
        for named in re.findall(r"gradsync(?:\.\w+)*", text) + [f"gradsync.{m}" for m in
                                                                 re.findall(r"from gradsync import (\w+)", text)]:
            while named and named not in known:
                named = named.rpartition(".")[0]
            if named:
                roots.add(named)
        for package in re.findall(r"""["']-m["'],\s*["'](gradsync(?:\.\w+)*)["']""", text):
            roots.add(f"{package}.__main__")
    roots |= {target.partition(":")[0] for target in registered_objects().values()}
    edges, reached, stack = graph(), set(), [root for root in roots if root in known]
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            stack.extend(edges[module])
    unreached = sorted(set(known) - reached)
    assert not unreached, "modules no test reaches:\n" + "\n".join(unreached)
