# mpidp: `make test` and `make demo` do all set-up on a fresh machine.
#   make setup    install what is missing (Open MPI, .venv, Python packages), build mpidp
#   make test     setup + C tests (ASan/UBSan) + pytest at 1, 2, 3 (ranks3 tests) and 4 MPI ranks
#                 + DataParallel's tests with the Python gradient hook
#                 + pytest at 2 ranks against the oldest mpi4py pyproject.toml claims
#                 + the fault-tolerance tests: ranks killed under ULFM (Open MPI 5,
#                   .venv-ft), beside the C, 1-rank, 3-rank and hook passes
#                   (scripts/test_passes.sh)
#   make demo     setup + the main job: DASO on the digits images, 4 ranks as 2 emulated nodes
#   make ctest    C unit tests (ASan/UBSan) and a replay of the fuzz corpus
#   make pytest-N pytest at N ranks (N = 1, 2, 3, 4)
#   make pytest-oldest-deps  pytest at 2 ranks with the oldest claimed mpi4py (builds it once)
#   make pytest-python-hook  DataParallel's tests at 2 ranks with the Python gradient hook
#   make pytest-ft  fault-tolerant mode: jobs under ULFM whose ranks are killed (builds .venv-ft once)
#   make fuzz     libFuzzer harnesses (DLPack intake, DASO and averaging schedules), FUZZ_SECONDS each
#   make valgrind a short DataParallel and DASO job under valgrind memcheck
#   make bench    the step-time benchmark (benchmarks/bench_step.py) at 2 ranks
#   make bench-daso  DASO vs DDP and DataParallel on an emulated 2-node cluster (root)
#   make bench-ft    fault-tolerant mode: recovery time from a killed rank, cost per step
#   make docs     the HTML documentation (Sphinx, warnings as errors) into docs/_build/html

PY       := .venv/bin/python
NPROC    := $(shell nproc 2>/dev/null || echo 2)
# The demo: DASO on 4 ranks laid out as 2 emulated nodes of 2 ranks.
NP_DEMO  := 4
DEMO_RANKS_PER_NODE := 2

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup test ctest pytest pytest-1 pytest-2 pytest-3 pytest-4 pytest-python-hook pytest-oldest-deps pytest-ft demo bench bench-daso bench-ft fuzz valgrind docs clean

setup:
	@./scripts/setup_env.sh

test: setup
	@./scripts/test_passes.sh

# The C tests compile on every core and then run one after another.
ctest:
	@$(MAKE) --no-print-directory -s -j$(NPROC) -C tests/c all
	@$(MAKE) --no-print-directory -s -C tests/c
	@$(MAKE) --no-print-directory -s -C tests/fuzz replay

# Debian packages the two targets below need, installed when missing (as root).
fuzz:
	@command -v clang >/dev/null || ./scripts/apt_install.sh clang
	$(MAKE) --no-print-directory -C tests/fuzz run

valgrind: setup
	@command -v valgrind >/dev/null || ./scripts/apt_install.sh valgrind
	$(MAKE) --no-print-directory -C tests/valgrind run

# Every pytest pass, one after another (`make test` runs some of them beside
# the fault-tolerance pass: scripts/test_passes.sh).
pytest: pytest-1 pytest-3 pytest-python-hook pytest-2 pytest-4 pytest-oldest-deps pytest-ft

# Explicit rules: make skips pattern rules for .PHONY targets, so a
# `pytest-%: ...` rule would silently run nothing for them.
pytest-1 pytest-2 pytest-4: setup
	@./scripts/run_pytest.sh $(@:pytest-%=%)

# At 3 ranks (a size that is no power of two) only the tests marked ranks3 run.
pytest-3: setup
	@./scripts/run_pytest.sh 3 -m "ranks3 and not serial"

pytest-oldest-deps: setup
	@./scripts/test_oldest_deps.sh

pytest-ft: setup
	@./scripts/test_fault_tolerance.sh

# DataParallel's tests (their folder) with the Python-level gradient hook: the
# path of builds without the C++ hook (mpidp._grad_hook), and of GPU staging.
pytest-python-hook: setup
	@MPIDP_GRAD_HOOK=python ./scripts/run_pytest.sh 2 tests/algorithms/data_parallel

docs: setup
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

demo: setup
	MPIDP_RANKS_PER_NODE=$(DEMO_RANKS_PER_NODE) ./scripts/mpirun.sh $(NP_DEMO) $(PY) examples/digits.py

bench: setup
	./scripts/mpirun.sh 2 $(PY) benchmarks/bench_step.py

bench-ft: setup
	./scripts/setup_ft_env.sh
	$(PY) benchmarks/bench_fault_tolerance.py

# DASO against DDP and DataParallel on an emulated 2-node cluster (root; ~20 min)
bench-daso: setup
	$(PY) benchmarks/bench_daso.py --rate 1gbit,none

# setup.py's clean knows where builds go (MPIDP_BUILD_DIR, see setup.py).
clean:
	-$(PY) setup.py -q clean --all
	rm -rf build tests/c/build docs/_build python/mpidp/*.so python/*.egg-info .venv-oldest .venv-heat
