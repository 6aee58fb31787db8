"""mpidp._runtime.config: every MPIDP_* variable is declared once, checked the same way
everywhere, and listed in the README's settings table."""

import re
import subprocess
import sys

import pytest

from mpi_jobs import ROOT, clean_env
from mpidp._runtime import config as config

pytestmark = pytest.mark.serial


def test_defaults_when_unset(monkeypatch):
    for name in config.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert config.get("MPIDP_TIMEOUT") == 1800.0
    assert config.get("MPIDP_ON_TIMEOUT") == "abort"
    assert config.get("MPIDP_RANKS_PER_NODE") is None
    assert config.get("MPIDP_CHECK") is False and config.get("MPIDP_CHECK_EVERY") == 100
    monkeypatch.setenv("MPIDP_TIMEOUT", "")            # empty counts as unset
    assert config.get("MPIDP_TIMEOUT") == 1800.0


def test_values_are_parsed(monkeypatch):
    monkeypatch.setenv("MPIDP_TIMEOUT", "2.5")
    monkeypatch.setenv("MPIDP_ON_TIMEOUT", " Raise ")
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "4")
    monkeypatch.setenv("MPIDP_DP_STAGING", "1")
    assert config.get("MPIDP_TIMEOUT") == 2.5
    assert config.get("MPIDP_ON_TIMEOUT") == "raise"
    assert config.get("MPIDP_RANKS_PER_NODE") == 4
    assert config.get("MPIDP_DP_STAGING") is True


@pytest.mark.parametrize("name, raw, words", [
    ("MPIDP_TIMEOUT", "soon", "MPIDP_TIMEOUT must be a positive number of seconds, got 'soon'"),
    ("MPIDP_TIMEOUT", "0", "positive number of seconds"),
    ("MPIDP_ON_TIMEOUT", "retry", "MPIDP_ON_TIMEOUT must be 'abort' or 'raise'"),
    ("MPIDP_RANKS_PER_NODE", "0", "MPIDP_RANKS_PER_NODE must be a positive integer"),
    ("MPIDP_RANKS_PER_NODE", "two", "positive integer, got 'two'"),
    ("MPIDP_CHECK", "yes", "MPIDP_CHECK must be 0 or 1"),
    ("MPIDP_HOOK_PROGRESS", "2", "MPIDP_HOOK_PROGRESS must be 0 or 1"),
])
def test_bad_values_name_the_variable(monkeypatch, name, raw, words):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(words)):
        config.get(name)


def test_the_extensions_own_setting_is_not_read_here():
    with pytest.raises(KeyError, match="C extension"):
        config.get("MPIDP_SIMD")


def test_readme_lists_every_setting():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Settings"):readme.index("## Layout")]
    for name in list(config.SETTINGS) + list(config.BUILD_AND_TEST):
        assert f"`{name}`" in table, f"{name} is missing from the README's settings table"


def test_every_variable_the_build_and_scripts_read_is_listed():
    read = set(re.findall(r"environ(?:\.get\(|\[)\"(MPIDP_\w+)", (ROOT / "setup.py").read_text()))
    for script in (ROOT / "scripts").glob("*.sh"):
        read |= set(re.findall(r"\$\{?(MPIDP_[A-Z0-9_]+)", script.read_text()))
    assert "MPIDP_BUILD_DIR" in read and "MPIDP_TEST_LIMIT" in read   # the patterns still match
    unlisted = read - set(config.SETTINGS) - set(config.BUILD_AND_TEST)
    assert not unlisted, f"read but not in mpidp._runtime.config: {sorted(unlisted)}"


def test_the_package_reads_mpidp_variables_only_through_config():
    for path in (ROOT / "python" / "mpidp").glob("*.py"):
        if path.name == "_config.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"environ[^\n]*[\"']MPIDP_", line), (
                f"{path.name}:{n} reads an MPIDP_ variable directly; use _config.get()")


@pytest.mark.parametrize("env, spin", [
    ({}, 0.02),                                        # a core per rank: spin long
    ({"OMPI_MCA_mpi_yield_when_idle": "1"}, 0.003),    # MPI was told the ranks share cores
    ({"OMPI_MCA_mpi_yield_when_idle": "1", "MPIDP_WAIT_SPIN_MS": "7.5"}, 0.0075),
    ({"MPIDP_WAIT_SPIN_MS": "0"}, 0.0),
])
def test_waits_spin_less_where_mpi_says_the_cores_are_shared(env, spin):
    """The spin of every wait follows MPI's mpi_yield_when_idle (mpirun also
    turns it on by itself when it oversubscribes a node), and
    MPIDP_WAIT_SPIN_MS overrides it. Reading MPI's setting leaves MPI's
    thread level as mpi4py asked for it (Open MPI's tool interface can
    overwrite it). A fresh singleton process per case: MPI reads its
    settings at MPI_Init."""
    code = ("import mpidp, mpidp._C as C; from mpi4py import MPI; "
            "print(C.process_state()['wait_spin'], MPI.Query_thread() == MPI.THREAD_MULTIPLE)")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(**env), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    got, multiple = out.stdout.strip().splitlines()[-1].split()
    assert float(got) == pytest.approx(spin)
    assert multiple == "True"


@pytest.mark.parametrize("env, first, algorithm", [
    ({}, "import mpidp; from mpi4py import MPI", 3),
    ({}, "from mpi4py import MPI; import mpidp", 3),  # MPI initialised before mpidp loads
    ({"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "0"}, "from mpi4py import MPI; import mpidp", 0),
    ({"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1"}, "import mpidp; from mpi4py import MPI", 1),
])
def test_mpi_iallreduce_takes_rabenseifner_unless_the_user_chose(env, first, algorithm):
    """Open MPI's own choice for an in-place MPI_Iallreduce (every mpidp
    allreduce) is a binomial tree; mpidp makes it Rabenseifner's through MPI's
    tool interface, so also when the program initialised MPI first, and leaves
    a value the user set alone. What `python -m mpidp` reports is read back
    from MPI, and MPI's thread level stays as mpi4py asked for it."""
    code = (f"{first}; import mpidp._C as C; from mpidp.__main__ import report; "
            "print(C.iallreduce_algorithm(), MPI.Query_thread() == MPI.THREAD_MULTIPLE, "
            "dict(report()[0])['MPI_Iallreduce algorithm'].replace(' ', '_'))")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(**env), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    got, multiple, shown = out.stdout.strip().splitlines()[-1].split()
    assert int(got) == algorithm
    assert multiple == "True"
    assert shown == {0: "Open_MPI's_choice", 1: "ring", 3: "Rabenseifner"}[algorithm]


def test_ranks_whose_mpi_iallreduce_algorithms_differ_end_with_a_message():
    """An MPMD job whose second rank tells Open MPI to choose its own
    MPI_Iallreduce algorithm while the first takes mpidp's: their messages
    cannot match (Open MPI's MPI_Comm_idup already reduces), so the job ends
    at the deadline with a message naming what never finished -- never a
    silent hang or a wrong sum."""
    code = ("import torch, mpidp\n"
            "mpidp.DataParallel(torch.nn.Linear(4, 4), blocking_parameter_updates=True)\n"
            "print('WRAPPED', flush=True)\n")
    cmd = ["mpirun", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1",
           "-x", "MPIDP_TIMEOUT=5", "-np", "1", sys.executable, "-c", code, ":", "-np", "1",
           "env", "OMPI_MCA_coll_libnbc_iallreduce_algorithm=0", sys.executable, "-c", code]
    out = subprocess.run(cmd, env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "WRAPPED" not in out.stdout
    assert "no progress for 5.0 s" in out.stdout and "MPI_Comm_idup" in out.stdout, out.stdout


def test_a_bad_wait_spin_names_the_variable(monkeypatch):
    monkeypatch.setenv("MPIDP_WAIT_SPIN_MS", "-1")
    with pytest.raises(ValueError, match=re.escape("MPIDP_WAIT_SPIN_MS must be a number of "
                                                   "milliseconds >= 0, got '-1'")):
        config.get("MPIDP_WAIT_SPIN_MS")
