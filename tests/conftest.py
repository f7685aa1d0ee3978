import os

# Intel MKL picks its GEMM code path by the operands' memory alignment unless its conditional numerical
# reproducibility is on, so two runs of one float32 CPU forward can round differently (host K/V rows 7e-5 apart in
# about one process in seven). The tests that compare two decoding paths need run-to-run reproducible GEMMs. Set
# before torch loads MKL; an MKL_CBWR already in the environment wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_sessionfinish(session, exitstatus):
    """Nothing the tests started may outlive them: no prefetch worker thread and no child process (Mooncake
    services, tensor-parallel workers) at the end of the run; a leftover fails the run and is named. torch's
    Inductor compile-worker pool is stopped first: it is torch's, outlives the test that compiled, and a run's
    verdict must not depend on whether a later test happened to stop it."""
    import gc
    import sys
    import threading
    import time

    import psutil

    gc.collect()
    if "torch._inductor.async_compile" in sys.modules:
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()
    deadline = time.monotonic() + 10  # processes being stopped get a moment to exit
    while True:
        threads = [t.name for t in threading.enumerate() if t.name.startswith("oasis-")]
        children = [p for p in psutil.Process().children(recursive=True) if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
        if not (threads or children) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if threads or children:
        names = threads + [f"{p.name()} (pid {p.pid})" for p in children]
        session.config.get_terminal_writer().line(f"left running after the tests: {', '.join(names)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
