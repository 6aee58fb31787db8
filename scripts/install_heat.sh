#!/bin/sh
# Installs Heat 1.9 into .venv-heat, beside .venv's torch, for the benchmarks'
# Heat baseline (benchmarks/heat_baseline.py puts it on the path).
#
# Heat 1.9.0 declares Python >= 3.12 but runs on 3.11, and pip would resolve
# its torch/torchvision pins to another torch; so Heat goes in without its
# dependencies, with the torchvision release that pairs with the installed
# torch (torch 2.N pairs with torchvision 0.(N+15)). Heat's other
# dependencies (numpy, scipy, packaging, mpi4py) are mpidp's or its tests'.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
HEAT_VERSION=${HEAT_VERSION:-1.9.0}
tv=$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(f"0.{int(v[1]) + 15}.*")')
"$PY" -m pip install -q scipy packaging
"$PY" -m pip install -q --no-deps --ignore-requires-python --upgrade --target .venv-heat \
    "heat==$HEAT_VERSION" "torchvision==$tv"
"$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); import heat_baseline as h; m, note = h.import_heat(); print(note); sys.exit(m is None)'
