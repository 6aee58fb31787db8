#!/usr/bin/env bash
# pytest_rank.sh PYTHON pytest-args...: one rank of an MPI pytest run. Rank 0
# prints to the terminal; the others log to tests/logs/rank-K.log.
py=$1
shift
rank=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}
if [ "$rank" = 0 ]; then
    exec "$py" -m pytest "$@"
fi
exec "$py" -m pytest "$@" >"tests/logs/rank-$rank.log" 2>&1
