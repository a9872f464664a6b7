"""The layout's rules, checked on the source: no import cycles, and each layer imports only what it may.

Every import counts, also one inside a function (that is how a cycle hides) and one under TYPE_CHECKING (a reader
follows it all the same). A module's name is its path: gasloc.peer.swarm.gossip is peer/swarm/gossip.py.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["protocol", "runtime", "cli", "bootstrap", "sim", "peer"]


def modules() -> dict[str, Path]:
    out = {"gasloc": ROOT / "__init__.py"}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("gasloc", *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Top-level names (for third-party and stdlib) and gasloc module names that `path` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from gasloc.peer.train import model` imports the module gasloc.peer.train.model
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == "gasloc" or t.startswith("gasloc."):
                while t not in known:  # `import gasloc.x.y` of a name inside a module: the module
                    t = t.rpartition(".")[0]
                out.add(t)
            else:
                out.add(t.split(".")[0])
    return out


GRAPH = {name: imports_of(name, path, set(modules())) for name, path in modules().items()}


def test_every_package_folder_is_a_package_and_every_module_is_found():
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *[p for p in (ROOT / pkg).rglob("*") if p.is_dir()]]:
            if folder.name in ("__pycache__", "corpus"):
                continue
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has no __init__.py"
    assert "gasloc.peer.swarm.gossip" in GRAPH and "gasloc.protocol.search" in GRAPH


def test_no_import_cycles():
    internal = {m: {t for t in deps if t in GRAPH and t != m} for m, deps in GRAPH.items()}
    # a package's __init__ is imported by its submodules implicitly; only explicit imports count here
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(internal[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(internal):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _violations(prefix: str, allowed) -> list[str]:
    return [f"{m} imports {t}" for m, deps in sorted(GRAPH.items())
            if m == prefix or m.startswith(prefix + ".") for t in sorted(deps) if not allowed(t)]


STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def test_protocol_is_sans_io():
    """protocol/ is the sans-I/O heart: the standard library, pydantic, torch and itself."""
    ok = lambda t: t in STDLIB or t in ("pydantic", "torch") or t.startswith("gasloc.protocol")  # noqa: E731
    assert not _violations("gasloc.protocol", ok)


def test_training_side_imports_neither_transport_nor_swarm():
    bad = ("gasloc.peer.transport", "gasloc.peer.swarm", "gasloc.peer.daemon", "gasloc.bootstrap")
    assert not _violations("gasloc.peer.train", lambda t: not t.startswith(bad) and t != "hivemind")


def test_runtime_imports_no_component():
    assert not _violations("gasloc.runtime", lambda t: not t.startswith("gasloc.") or t.startswith("gasloc.runtime"))


def test_simulator_imports_neither_network_nor_daemon():
    """`gasloc sim` runs the training side and the protocol on a virtual clock: no hivemind, no p2p."""
    bad = ("gasloc.peer.transport", "gasloc.peer.swarm", "gasloc.peer.daemon", "gasloc.bootstrap")
    assert not _violations("gasloc.sim", lambda t: not t.startswith(bad) and t != "hivemind")


def test_layer_check_can_fail(tmp_path):
    """The checks see lazy imports: a function-level import of the transport from the training side is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from gasloc.peer.transport import exchange\n    from . import model\n")
    deps = imports_of("gasloc.peer.train.probe", probe, set(GRAPH))
    assert deps == {"gasloc.peer.transport.exchange", "gasloc.peer.train.model"}
    GRAPH["gasloc.peer.train.probe"] = deps
    try:
        assert _violations("gasloc.peer.train", lambda t: not t.startswith("gasloc.peer.transport"))
    finally:
        del GRAPH["gasloc.peer.train.probe"]


def test_no_library_code_in_cli():
    """cli/ holds commands: each module there defines a click command or serves exactly one command."""
    for path in sorted((ROOT / "cli").glob("*.py")):
        users = {m for m, deps in GRAPH.items() if f"gasloc.cli.{path.stem}" in deps}
        outside = {u for u in users if not u.startswith("gasloc.cli")}
        assert not outside, f"cli/{path.name} is imported by {sorted(outside)}: library code belongs in runtime/"


def test_docstrings_cite_only_the_repository():
    offenders = [str(p.relative_to(ROOT)) for p in modules().values() if "shared/" in p.read_text()]
    assert not offenders, f"these cite files outside the repository: {offenders}"


@pytest.mark.timeout(120)
def test_ruff_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                       text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
