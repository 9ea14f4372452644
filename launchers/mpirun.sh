#!/usr/bin/env bash
# Train with a commhooks hook under mpirun / mpiexec (Open MPI or MPICH / Intel MPI).
#
#   NP=2 HOOK=qsr CONFIG=configs/qsr_mnist1d.json launchers/mpirun.sh [extra train args]
#   MPIRUN=.cache/mpich/bin/mpiexec launchers/mpirun.sh          # MPICH (installed by make)
#   BACKEND=horovod launchers/mpirun.sh                          # Horovod (or deepspeed; default ddp)
#
# commhooks.launch reads OMPI_COMM_WORLD_* (Open MPI) or PMI_* / MPI_LOCAL* (MPICH,
# Intel MPI); rank 0 picks a free port and mpi4py broadcasts it (or export
# MASTER_ADDR / MASTER_PORT yourself). With BACKEND=horovod, commhooks.horovod.init()
# brings up Horovod's Gloo controller from the same variables (rank 0 serves the
# rendezvous, as horovodrun would). On a cluster: add a hostfile
# (Open MPI: --hostfile hosts, "node01 slots=4" per line; MPICH: -f hosts,
# "node01:4"), and keep one rank per GPU / per core group.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
HOOK=${HOOK:-qsr}
CONFIG=${CONFIG:-configs/qsr_mnist1d.json}
BACKEND=${BACKEND:-ddp}
MPIRUN=${MPIRUN:-.venv/bin/mpirun}
PY=${PY:-$PWD/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TRAIN=("$PY" -m commhooks.tools.train --backend "$BACKEND" --hook "$HOOK" --config "$CONFIG" "$@")

if "$MPIRUN" --version 2>&1 | grep -qi "open mpi\|open-mpi\|openrte"; then
    flags=(-np "$NP" -x OMP_NUM_THREADS -x PATH)
    for v in MASTER_ADDR MASTER_PORT; do [ -n "${!v:-}" ] && flags+=(-x "$v"); done
    # Open MPI refuses to run as root without these (containers, workstations):
    [ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
    # more ranks than cores (a 2-core workstation) needs --oversubscribe:
    [ "$NP" -gt "$(nproc)" ] && flags+=(--oversubscribe)
    exec "$MPIRUN" "${flags[@]}" "${TRAIN[@]}"
else
    # MPICH / Intel MPI (hydra). mpi4py must load the launcher's libmpi, not the venv's Open MPI:
    libdir=$(cd "$(dirname "$(command -v "$MPIRUN")")/../lib" && pwd)
    export MPI4PY_LIBMPI=${MPI4PY_LIBMPI:-$libdir/libmpi.so.12}
    exec "$MPIRUN" -n "$NP" -genv OMP_NUM_THREADS "$OMP_NUM_THREADS" -genv MPI4PY_LIBMPI "$MPI4PY_LIBMPI" "${TRAIN[@]}"
fi
