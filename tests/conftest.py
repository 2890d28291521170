"""The tests: unit/ (one component at a time), integration/ (compiled steps end to end, against eager PyTorch or an
uninterrupted run), distributed/ (several processes over gloo). Shared helpers and the scripts the tests launch as
subprocesses live in support/, which this puts on sys.path (`from harness import ...`, `from models import ...`).

Markers (pyproject.toml): `cuda` marks the tests worth running on a GPU (`PSTAR_TEST_DEVICE=cuda pytest -m cuda`),
`multi_gpu` those that need two GPUs of one host, `slow` the ones that take tens of seconds on the CI machine,
`host_is_device` those that run pstar-fx's own CPU path (below).
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

from pstar_fx.api import options

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICE_TYPE = os.environ.get("PSTAR_TEST_DEVICE", "cpu")


def _share_the_cores_between_workers() -> bool:
    """Under pytest-xdist (`-n N`) each worker process gets its share of the cores as torch's intra-op threads, and
    the subprocesses its tests start (examples, ranks) inherit the share through OMP_NUM_THREADS. Left alone, each
    worker's OpenMP team is as large as the machine and stalls on the threads the other workers push off a core:
    on the 2-core CI machine two workers ran a fault-injection test in 18-20 s each with 2 threads, 8 s with 1.
    Returns whether it set a share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)
    return workers > 1


CORES_SHARED = _share_the_cores_between_workers()


def pytest_configure(config):
    """With the cores shared between workers, pstar-fx's warning that host-side updates run on one thread (meant
    for torchrun's OMP_NUM_THREADS=1 on a machine of many cores) is the share working as intended: not shown. The
    test of that warning catches it all the same (pytest.warns records every warning)."""
    if CORES_SHARED:
        config.addinivalue_line("filterwarnings", "ignore:.*CPU threads, but torch uses 1 thread here:UserWarning")


# On a CPU device pstar-fx takes the host for the device (api/options.py CPU_DEVICE_IS_HOST): a chunk's slot is its
# host home, so nothing is copied, host-side updates run inline and none is streamed. The tests take a GPU's paths
# instead (copies, the worker thread, streamed updates where the cost model picks them), so that a schedule that
# forgets a fetch or a write-back fails on the CPU too: set here, before any fixture of any scope builds a step. A test
# marked `host_is_device` (every test, with PSTAR_TEST_HOST_IS_DEVICE=1) runs the CPU's own path, as do the tests
# that run an example or a worker in a process of its own (as a user runs it). With PSTAR_TEST_HOST_IS_DEVICE=1 the
# tests of the GPU paths' own mechanics (slot allocations, the worker thread, the cost model choosing streamed
# updates) fail by design; the rest pass.
HOST_IS_DEVICE = os.environ.get("PSTAR_TEST_HOST_IS_DEVICE") == "1"
options.CPU_DEVICE_IS_HOST = HOST_IS_DEVICE


@pytest.fixture(autouse=True)
def _host_is_device_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("host_is_device") is not None:
        monkeypatch.setattr(options, "CPU_DEVICE_IS_HOST", True)


@pytest.fixture(autouse=True)
def _fuse_default(monkeypatch):
    """PSTAR_TEST_FUSE=1 / 0 compiles every step that leaves fuse=None fused / unfused on the test device, in every
    precision (the GPU subset runs its mixed-precision tests both ways); unset, the defaults of api/options.py."""
    value = os.environ.get("PSTAR_TEST_FUSE")
    if value is not None:
        from pstar_fx.api import options
        from pstar_fx.ir.graph import Precision
        for precision in Precision:
            monkeypatch.setitem(options.DEFAULT_FUSE, (DEVICE_TYPE, precision), value == "1")
        monkeypatch.setattr(options, "FUSE_IF_FASTER", False)   # fused means fused, whatever the estimate


def _cpu_on_a_gpu_machine() -> str | None:
    import torch
    if DEVICE_TYPE == "cpu" and torch.cuda.is_available():
        return ("this machine has CUDA and PSTAR_TEST_DEVICE is not 'cuda': every compiled step ran on the CPU, and "
                "the cuda-marked tests' GPU checks did nothing (the GPU subset: `PSTAR_TEST_DEVICE=cuda pytest -m cuda "
                "tests`)")
    return None


def pytest_report_header(config):
    """Which device the compiled steps run on (shown without -q)."""
    return [f"pstar-fx tests: steps on {DEVICE_TYPE} (PSTAR_TEST_DEVICE)"]


def pytest_terminal_summary(terminalreporter):
    """On a machine with CUDA and PSTAR_TEST_DEVICE unset, a warning at the end (-q too): the steps ran on the CPU."""
    why = _cpu_on_a_gpu_machine()
    if why is not None:
        terminalreporter.write_line(f"WARNING: {why}", yellow=True, bold=True)
