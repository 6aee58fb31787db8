"""The three helpers Horovod's test/parallel/test_torch.py takes from its
test/utils/common.py, written for mpidp's runs of that suite
(tests/horovod/test_horovod_suite.py puts this folder on PYTHONPATH)."""

import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    """This process's rank and the job's size from the MPI launcher's
    environment (Open MPI's, MPICH's, Slurm's); (0, 1) outside a launcher."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """A test that needs a GPU: skipped, or failed where the run demands GPUs
    (HOROVOD_TEST_GPU=1, as Horovod's GPU CI sets)."""
    if os.environ.get("HOROVOD_TEST_GPU") == "1":
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    """A path to a file that does not exist yet, removed afterwards."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.remove(path)
    try:
        yield path
    finally:
        if os.path.exists(path):
            os.remove(path)
