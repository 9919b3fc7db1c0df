"""The package's layers import downward only, with no circle (DESIGN.md, "Layers").

Read, not run: every ``import`` and ``from ... import`` in every module of src/gradsync, those inside
functions too (a lazy import is still a dependency), is resolved to the module it names
(``from gradsync.group import runtime`` names gradsync.group.runtime, not the package). Each module has a level
(LEVELS: the longest matching prefix); a module may import its own level or lower ones. A circle
is an error even within one level.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "gradsync"

LEVELS = {
    # beside everything, importing nothing above: counters, timelines, checkpoints, the cost model
    "gradsync.observe": 0, "gradsync.observe.meter": 0, "gradsync.observe.trace": 0, "gradsync.observe.stall": 0,
    "gradsync.observe.display": 0, "gradsync.observe.grad_watch": 0,
    "gradsync.checkpoint": 0, "gradsync.sim": 0, "gradsync.clip": 0, "gradsync.compile_guard": 0,
    # a store call with a deadline: torch's Store alone, so the stall inspector can bound its calls too
    "gradsync.group.bounded_store": 0,
    # process group set-up: the World record and host exchange that init() and join share, then
    # joining a program's world, then init() itself (which may join), then spawn (which inits): its
    # signals, its start-up through the forkserver and its failure report first
    "gradsync.group": 1.0, "gradsync.group.world_info": 1.0, "gradsync.group.device_path": 1.05,
    "gradsync.group.join": 1.1, "gradsync.group.runtime": 1.2, "gradsync.group.job_signals": 1.0,
    "gradsync.group.spawn_report": 1.0, "gradsync.group.forkserver": 1.25, "gradsync.group.launch": 1.3,
    "gradsync.group.slurm": 1.0,
    # DistributedSampler reads the world (rank and size) to shard, so it sits just above set-up
    "gradsync.data": 1.5,
    # collectives: the transports (the interface and its implementations), then the algorithms over
    # them, then what picks a transport or an algorithm for a world
    "gradsync.comm.transport": 1.9,
    "gradsync.comm": 2.0, "gradsync.comm.reduce_ops": 2.0, "gradsync.comm.context": 2.0,
    "gradsync.comm.scratch": 2.0, "gradsync.comm.agree": 2.1,
    "gradsync.comm.allreduce_ring": 2.2, "gradsync.comm.allreduce_halving_doubling": 2.2,
    "gradsync.comm.allreduce_tree": 2.2, "gradsync.comm.allreduce_naive": 2.2,
    "gradsync.comm.allreduce_hierarchical": 2.3, "gradsync.comm.broadcast": 2.2, "gradsync.comm.rooted": 2.2,
    "gradsync.comm.allreduce_one_shot": 2.2, "gradsync.comm.allreduce_two_shot": 2.2,
    "gradsync.comm.allreduce_in_place": 2.2, "gradsync.comm.reduce_scatter_staged": 2.2,
    "gradsync.comm.reduce_scatter_in_place": 2.2, "gradsync.comm.reduce_scatter_single_copy": 2.2,
    "gradsync.comm.all_gather_staged": 2.2, "gradsync.comm.all_gather_in_place": 2.2,
    "gradsync.comm.all_gather_single_copy": 2.2,
    "gradsync.comm.select": 2.5, "gradsync.comm.world_transport": 2.5, "gradsync.comm.place": 2.55,
    "gradsync.comm.collectives": 2.6,
    # strategies and the torch backend
    "gradsync.replicas": 3, "gradsync.ddp": 3, "gradsync.ps": 3, "gradsync.zero": 3, "gradsync.c10d": 3,
    "gradsync.diloco": 3,
    # live fault tolerance: DDP rebuilt over a new world when a rank dies
    "gradsync.live": 3.5,
    # the public names (DESIGN.md): the package gathers the strategies and collectives below it, and
    # the main job is written with them (``import gradsync as gs``), so it sits between the two
    "gradsync": 4.5,
    # the main job
    "gradsync.train": 5, "gradsync.bench": 5, "gradsync.cluster": 5,
    # the command line, and `python -m gradsync.train` (torchrun's entry point: the command's train) and `.cluster`
    "gradsync.cli": 6, "gradsync.train.__main__": 6, "gradsync.cluster.__main__": 6,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def level(module: str) -> float:
    # the package's own entry is the package alone: a new module must be given a level, not inherit the
    # public names' one
    prefixes = [p for p in LEVELS if module == p or (module.startswith(p + ".") and p != "gradsync")]
    if not prefixes:
        raise AssertionError(f"{module} has no level in tests/test_layers.py's LEVELS: give it one")
    return LEVELS[max(prefixes, key=len)]


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
    upward = [f"{known[name].relative_to(PACKAGE.parent)} (level {level(name)}) imports "
              f"{known[target].relative_to(PACKAGE.parent)} (level {level(target)})"
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


LOOSE_MODULES = 8
"""At most this many modules sit loose in src/gradsync/ (the package's __init__ among them); the rest
live in a folder named for their purpose (group/, observe/, comm/, ...)."""
SOURCE_LINES = 500
"""No source file (Python or the native core's C) is longer than this."""


def test_the_top_level_is_grouped_and_no_source_file_is_long():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= LOOSE_MODULES, f"{len(loose)} modules loose in src/gradsync/: {loose}"
    long = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*"))
            if path.suffix in (".py", ".c", ".h") for lines in [len(path.read_text().splitlines())]
            if lines > SOURCE_LINES}
    assert not long, f"source files over {SOURCE_LINES} lines: {long}"
