#!/usr/bin/env bash
# Runs an mpi4py hello world with "srun -n N --mpi=pmix" on the one-node Slurm
# of slurm_up.sh (started first if it is not running), and checks that every
# rank took part in an allreduce.
#
#   slurm_hello.sh [-n N] [PYTHON]     (N default 4; PYTHON default .venv/bin/python, else python3)
#
# --mpi=pmix is the only Slurm launch Debian's Open MPI 4.1.4 accepts: it was
# built against PMIx (Slurm's mpi_pmix_v4 plugin speaks it) but without
# Slurm's PMI-1/PMI-2, so --mpi=pmi2 fails in MPI_Init (see README.md).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=slurm_lib.sh
. "$HERE/slurm_lib.sh"

n=4
[ "${1:-}" = -n ] && { n=${2:?-n needs a value}; shift 2; }
py=${1:-}
if [ -z "$py" ]; then
    py=$HERE/../../.venv/bin/python
    [ -x "$py" ] || py=python3
fi
"$py" -c "import mpi4py" 2>/dev/null || cannot_run "$py has no mpi4py"

"$HERE/slurm_up.sh" >/dev/null
export SLURM_CONF
# The program runs in srun's environment; drop MPI variables in case this
# script was itself started from an MPI job.
while read -r var; do unset "$var"; done < <(env | sed -n 's/^\(\(OMPI\|PMIX\|OPAL\)_[A-Za-z0-9_]*\)=.*/\1/p')

# --overcommit: more tasks than the node's CPUs are fine (they just share cores).
out=$(srun -n "$n" --overcommit --mpi=pmix "$py" -c '
from mpi4py import MPI
c = MPI.COMM_WORLD
total = c.allreduce(c.rank + 1)
print(f"hello from rank {c.rank} of {c.size} on {MPI.Get_processor_name()}: allreduce {total}", flush=True)
')
printf '%s\n' "$out" | sort -t' ' -k4n
expect=$((n * (n + 1) / 2))
got=$(printf '%s\n' "$out" | grep -c "of $n on .*: allreduce $expect\$" || true)
[ "$got" = "$n" ] || die "expected $n ranks reporting allreduce $expect, got $got"
say "ok: $n ranks under srun --mpi=pmix, allreduce = $expect"
