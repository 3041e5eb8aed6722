import os
import sys

import pytest

# torch's OpenMP threads spin while they wait for work by default. With the tests spread over
# processes (README: -n 2) there are more threads than cores, and a thread spinning for a peer that
# is not running burns the core the peer needs: the CPU tests ran several times slower. Waiting
# threads sleep instead (set before torch, and so its OpenMP runtime, is loaded; subprocesses inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Each test process gets its share of the cores for torch's intra-op threads (our CPU kernels run on
# them): two processes of two threads each on two cores only add switching. Tests about thread
# counts set theirs and restore it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Tests run against the installed package (pip install -e .); make a source checkout importable too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-model tests that take minutes on 2 cores (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "metal_emu: the Metal kernels in the Metal-on-CPU harness (tests/backends.py; "
                                       "deselect with -m 'not metal_emu')")
    # torch.compile's inductor imports torch/utils/mkldnn.py, whose classes use the deprecated
    # torch.jit.script_method: torch's own warning, repeated per class; torch_marlin uses no TorchScript.
    config.addinivalue_line("filterwarnings",
                            r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit\._script")


# The files that take minutes (real models; the perf gates build the two load-traced harness
# modules) run first: with the tests spread over processes one file at a time in collection order
# (README: --dist loadfile --no-loadscope-reorder), the other process works through the rest
# meanwhile instead of both ending on one of them.
LONGEST_FILES = ("test_metal_perf_gates.py", "test_models.py")


def pytest_collection_modifyitems(config, items):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for name in LONGEST_FILES:
        assert os.path.isfile(os.path.join(tests_dir, name)), f"tests/conftest.py: LONGEST_FILES names {name}, gone"
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: the rest keep their order


def pytest_sessionstart(session):
    # Harness build messages reach the terminal while pytest captures test output (-q included).
    import metal_emu

    capman = session.config.pluginmanager.getplugin("capturemanager")

    def announce(message):
        if capman is None:
            print(message, file=sys.stderr, flush=True)
            return
        with capman.global_and_fixture_disabled():
            sys.stderr.write(message + "\n")
            sys.stderr.flush()

    metal_emu.announce = announce
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: its controller said it once
    missing = [n for n in metal_emu.HARNESS_MODULES if metal_emu.built_module(n) is None]
    if missing:
        announce(f"tests: {len(missing)} of {len(metal_emu.HARNESS_MODULES)} Metal-on-CPU harness modules are not built "
                 "yet; the first test that needs one compiles it into build/ (about 3 minutes for the main one on "
                 "an idle 2-core machine; a line says when each starts and ends)")
