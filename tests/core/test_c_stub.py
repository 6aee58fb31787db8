"""python/mpidp/_C.pyi describes the extension that is built: the same
top-level names, the same methods and attributes on each type, and the
keyword-only constructor where the stub says so."""

import ast

import pytest

from mpi_jobs import ROOT
from mpidp import _C

pytestmark = pytest.mark.serial

STUB = ast.parse((ROOT / "python" / "mpidp" / "_C.pyi").read_text())


def stub_names():
    names = {}
    for node in STUB.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("_"):
            continue  # the stub's own typing helpers (TypedDicts), not in the extension
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    members.add(item.target.id)
            names[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = None
    return names


def test_stub_and_extension_have_the_same_names():
    stub = set(stub_names())
    built = {n for n in dir(_C) if not n.startswith("__")}
    assert stub - built == set(), f"in the stub, not in the extension: {sorted(stub - built)}"
    assert built - stub == set(), f"in the extension, not in the stub: {sorted(built - stub)}"


# Exceptions carry their attributes (rank, operation) on instances only.
TYPES = [n for n, m in stub_names().items() if m and not n.startswith("Comm") or n == "Comm"]


@pytest.mark.parametrize("cls", TYPES)
def test_each_types_members_match(cls):
    stub = stub_names()[cls]
    kind = getattr(_C, cls)
    built = {n for n in dir(kind) if not n.startswith("__")} - set(dir(tuple))
    built -= {"n_fields", "n_sequence_fields", "n_unnamed_fields"}   # struct sequence bookkeeping
    assert stub - built == set(), f"{cls}: in the stub only: {sorted(stub - built)}"
    assert built - stub == set(), f"{cls}: in the extension only: {sorted(built - stub)}"


def test_reducer_takes_keywords_only():
    with pytest.raises(TypeError):
        _C.Reducer(None)
    with pytest.raises(TypeError, match="missing keyword argument 'comm'"):
        _C.Reducer()

