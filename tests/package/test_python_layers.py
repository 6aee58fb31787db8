"""The Python package's layers (docs/design-notes.md, "The package's
layers"): imports run one way, front ends -> fault_tolerance -> algorithms
-> collectives -> engines -> primitives -> runtime -> the C extension, as
tests/core/test_core_layers.py checks for the C core. Every import counts, also
one inside a function: a lazy import that runs back up is a cycle all the
same. Read from the source with ast; nothing is imported."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "python", "mpidp")

# Each layer may import the layers below it and, within itself, modules of
# its own subpackage (without cycles).
LAYERS = [
    ("the C and C++ extensions", ("_C", "_grad_hook", "_c10d", "_version")),
    ("runtime", ("_runtime",)),
    ("primitives", ("primitives",)),
    ("engines", ("_engines",)),
    ("collectives", ("collectives",)),
    ("algorithms", ("algorithms",)),
    ("fault tolerance", ("fault_tolerance",)),
    ("front ends", ("c10d", "horovod", "planning", "__init__", "__main__", "nn", "optim")),
]
TOP_LEVEL = {"__init__", "__main__", "_version", "nn", "optim"}


def layer_of(module: str) -> int:
    head = module.split(".")[0]
    for i, (_, heads) in enumerate(LAYERS):
        if head in heads:
            return i
    raise AssertionError(f"mpidp.{module} is in no layer: add it to LAYERS")


def modules():
    """{module name under mpidp ('' parts dotted; a package's __init__ as the package): path}."""
    out = {}
    for dirpath, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, n), PACKAGE)[:-3].replace(os.sep, ".")
                out[rel] = os.path.join(dirpath, n)
    return out


def imports_of(name: str, path: str):
    """The mpidp modules `name` imports (absolute under mpidp), with their lines."""
    package = name.rpartition(".")[0] if not name.endswith("__init__") else name[:-9]
    if name == "__init__":
        package = ""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("mpidp"):
                    continue
                base = node.module.split(".")[1:]
            else:
                parts = package.split(".") if package else []
                base = parts[:len(parts) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            if node.module is None or node.level == 0 and node.module == "mpidp":
                for a in node.names:
                    found.append((".".join(base + [a.name]), node.lineno))
            else:
                found.append((".".join(base), node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mpidp."):
                    found.append((a.name[6:], node.lineno))
    return found


def resolve(target: str, known) -> str:
    """`target` as a module of `known` (a name imported from a package is the package)."""
    while target and target not in known and target + ".__init__" not in known:
        target = target.rpartition(".")[0]
    return target + ".__init__" if target + ".__init__" in known else target


def test_at_most_six_modules_at_the_top():
    top = {n for n in modules() if "." not in n}
    assert top <= TOP_LEVEL, f"modules at mpidp's top level beyond {sorted(TOP_LEVEL)}: " \
                             f"{sorted(top - TOP_LEVEL)}"


def test_no_import_runs_back_up():
    known = modules()
    wrong = []
    for name, path in known.items():
        mine = layer_of(name)
        for target, line in imports_of(name, path):
            if target.split(".")[0] in ("_C", "_grad_hook", "_version"):
                continue
            if layer_of(target) > mine:
                wrong.append(f"mpidp.{name} (line {line}, {LAYERS[mine][0]}) imports mpidp.{target} "
                             f"({LAYERS[layer_of(target)][0]})")
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_no_import_cycle():
    known = modules()
    graph = {n: {resolve(t, known) for t, _ in imports_of(n, p)} - {""} for n, p in known.items()}
    for n in graph:
        graph[n] = {t for t in graph[n] if t in known and t != n}
    # A package's __init__ re-exporting its modules is not a cycle with them
    # unless one of them imports the package's __init__ back.
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


CSRC = os.path.join(ROOT, "csrc")
# A module imported by name from C or C++ (pybind11's module_::import, the
# C API's PyImport_ImportModule).
IMPORT_BY_NAME = re.compile(r'(?:module_?::import|PyImport_ImportModule)\(\s*"mpidp\.([\w.]+)"')


def test_the_extensions_import_no_layer_above_them_by_name():
    """The C and C++ extensions are the bottom layer: a Python module above
    them that they need registers itself with them (as the backend's
    shrunk_backend does) rather than being imported by name."""
    wrong = []
    for dirpath, _, names in os.walk(CSRC):
        for n in names:
            if n.endswith((".c", ".cpp", ".h", ".hpp")):
                path = os.path.join(dirpath, n)
                text = open(path).read()
                for m in IMPORT_BY_NAME.finditer(text):
                    if layer_of(m.group(1)) > 0:
                        line = text.count("\n", 0, m.start()) + 1
                        wrong.append(f"{os.path.relpath(path, CSRC)}:{line} imports mpidp."
                                     f"{m.group(1)} ({LAYERS[layer_of(m.group(1))][0]})")
    assert not wrong, "the extensions import layers above them by name:\n" + "\n".join(wrong)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
