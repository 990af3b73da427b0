"""The codebase's shape (issue 30): no import cycles among dynatree's modules, and every
registered method honours the engine's contracts (a `TreePolicy`, an acceptance rule that is a
`Verifier`, a validated config dataclass)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import dynatree
from dynatree import make_config
from dynatree.config import MethodConfig
from dynatree.methods import METHODS
from dynatree.policies.base import TreePolicy
from dynatree.verify import Verifier

PACKAGE = Path(dynatree.__file__).parent


def module_name(path: Path) -> str:
    parts = ("dynatree",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> set[str]:
    """The module names an import statement inside `package` names (relative ones resolved); for
    `from M import x`, both M and M.x (x may be a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return {base} | {f"{base}.{a.name}" for a in node.names}


def module_level_imports(everything: bool = False) -> dict[str, set[str]]:
    """dynatree module -> the dynatree modules it imports when it is imported (statements at module
    level, `if` blocks included; imports inside functions run later and cannot form a cycle).
    With `everything`, every module name it imports (the standard library's and others' too)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        statements = list(ast.parse(path.read_text()).body)
        while statements:
            node = statements.pop()
            if isinstance(node, (ast.If, ast.Try)):
                statements += node.body + node.orelse + getattr(node, "finalbody", [])
                statements += [s for h in getattr(node, "handlers", []) for s in h.body]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= imported_names(node, package)
        graph[name] = found if everything else {m for m in found if m in modules and m != name}
    return graph


def test_the_package_has_no_import_cycles():
    graph = module_level_imports()
    assert len(graph) > 50 and "dynatree.decode" in graph["dynatree.api"]  # the scan sees the package
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_every_method_of_the_engine_honours_the_contracts():
    for name, method in METHODS.items():
        assert dataclasses.is_dataclass(method.config_cls) and issubclass(method.config_cls, MethodConfig), name
        config = make_config(name)  # the defaults validate
        if method.policy_cls is None:
            assert method.engine != "dynatree", name  # transformers' or llama.cpp's own decoding
            continue
        assert method.engine == "dynatree" and issubclass(method.policy_cls, TreePolicy), name
        policy = method.policy_cls(config)
        assert policy.verifier is None or isinstance(policy.verifier, Verifier), name
        assert policy.needs_drafter is (method.draft != "none"), name


def test_policies_and_verifiers_are_pure():
    """Issue 30: nothing a tree policy or an acceptance rule imports, however indirectly, reads a clock
    or runs a model: not `time`, not the model runtime, not the cost-curve measurement, not the decoder."""
    graph, names = module_level_imports(), module_level_imports(everything=True)
    roots = [m for m in graph if m.startswith("dynatree.policies.")] + ["dynatree.verify", "dynatree.costmodel"]
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    closure, todo = set(), list(roots)
    while todo:  # what they import, at module level or inside a function (which runs when they do)
        module = todo.pop()
        if module not in closure:
            closure.add(module)
            todo += graph[module] | (imports_anywhere(modules[module]) & set(modules))
    assert {"dynatree.policies.dynatree", "dynatree.costmodel", "dynatree.sampling"} <= closure
    assert not closure & {"dynatree.runtime", "dynatree.costmeasure", "dynatree.decode", "dynatree.models"}
    clocks = {m for m in closure if names[m] & {"time", "timeit", "transformers"}}
    assert not clocks, f"{sorted(clocks)} import a clock or transformers"
    # nor inside a function (an import there runs when the policy does)
    for module in closure:
        inside = set()
        for node in ast.walk(ast.parse(modules[module].read_text())):
            if isinstance(node, ast.Import):
                inside |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                inside.add((node.module or "").split(".")[0])
        assert not inside & {"time", "timeit", "transformers"}, (module, inside)
        forbidden = {"dynatree.runtime", "dynatree.costmeasure", "dynatree.decode", "dynatree.models"}
        assert not imports_anywhere(modules[module]) & forbidden, module
    # nor do they call a drafter: they yield `Ask`s and the decoder calls it (`decode.answer`)
    for module in [m for m in closure if m.startswith("dynatree.policies.")]:
        called = {node.func.attr for node in ast.walk(ast.parse(modules[module].read_text()))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
        assert not called & {"propose", "without_model", "reset", "commit", "warm_up"}, (module, called)
    # the decoder times its run (the cost-aware policy learns from it) but meters no memory: api.run does
    assert "dynatree.stats.PeakMemory" not in names["dynatree.decode"]
    assert "dynatree.stats.PeakMemory" in names["dynatree.api"]


def imports_anywhere(path: Path) -> set[str]:
    """Every dynatree module (or name) the module at `path` imports, at module level or inside functions."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imported_names(node, package)
    return {m for m in found if m.startswith("dynatree")}


def test_the_distillers_and_the_bench_do_not_reach_into_each_other():
    """Both read prompts through dynatree.prompts; neither imports the other, even inside a function;
    and every path from a --draft value to a loaded draft goes through draftload (no entry point
    loads a draft model itself)."""
    imported = {module_name(p): imports_anywhere(p) for p in PACKAGE.rglob("*.py")}
    for module, found in imported.items():
        if module.startswith("dynatree.distill"):
            assert not {m for m in found if m.startswith("dynatree.bench")}, module
        if module.startswith("dynatree.bench"):
            assert not {m for m in found if m.startswith("dynatree.distill")}, module
    users = {m for m, found in imported.items() if "dynatree.draftload.load_draft" in found}
    assert {"dynatree.api", "dynatree.cli", "dynatree.bench.commands", "dynatree.bench.runner",
            "dynatree.serve.engine"} <= users
    loaders = {m for m, found in imported.items() if "dynatree.featurehead.load_head" in found}
    assert "dynatree.draftload" in loaders and loaders <= {"dynatree.draftload", "dynatree.distill.eagle_train"}, loaders
