"""The package's dependencies point one way: no import cycle between its modules, and nothing
inside it imports the command line (``hmi.cli`` and its command groups are a leaf that only parses
and prints)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hmi"


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports anywhere (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def without_packages(edges):
    """A package's ``__init__`` importing its own submodules is not a cycle of the design."""
    return {m: {n for n in ns if not (n.startswith(m + ".") or m.startswith(n + "."))} for m, ns in edges.items()}


def test_the_package_has_no_import_cycle():
    found = cycle(without_packages(graph()))
    assert found is None, " -> ".join(found)


def is_cli(module: str) -> bool:
    return module == "hmi.cli" or module.startswith("hmi.cli.")


def test_nothing_inside_the_package_imports_the_command_line():
    users = sorted(m for m, ns in graph().items() if not is_cli(m) and any(is_cli(n) for n in ns))
    assert users == []


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def package_of(module: str) -> str:
    """``hmi.plot.store`` -> ``plot``; top-level modules (``hmi.cli``) are their own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def packages_both_ways(edges) -> list[tuple[str, str]]:
    between = {(package_of(m), package_of(n)) for m, ns in edges.items() for n in ns}
    return sorted((a, b) for a, b in between if a < b and (b, a) in between)


def test_no_two_packages_import_each_other():
    assert packages_both_ways(graph()) == []


def test_the_package_pair_finder_finds_a_planted_pair():
    assert packages_both_ways({"hmi.model.a": {"hmi.plot.b"}, "hmi.plot.b": {"hmi.model.c"}}) == [("model", "plot")]
