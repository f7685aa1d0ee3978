"""A bounded soak: many generate calls with a fresh OasisCache each leave nothing behind (`eval.soak` runs 1,000 per
selector and records memory too)."""

import threading

import psutil
import pytest

from eval.soak import soak
from tests._factories import tiny_model


@pytest.mark.parametrize("with_block", [True, False], ids=["with", "forgotten"])
def test_generate_calls_leave_no_threads_or_descriptors_behind(with_block):
    """150 lookahead generate calls (each cache starts a worker thread), closed by a `with` block or just dropped:
    the live threads and open descriptors after the last call are those before the first."""
    model = tiny_model("llama", attn="oasis")
    threads, fds = threading.active_count(), psutil.Process().num_fds()
    rows = soak(model, "lookahead", with_block, 150, {1, 150}, prompt=120, new_tokens=4)
    assert [r["threads"] for r in rows] == [threads, threads]
    assert rows[-1]["fds"] <= fds + 1 and rows[-1]["fds"] <= rows[0]["fds"]
