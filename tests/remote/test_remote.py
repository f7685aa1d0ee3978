"""Remote KV tier on Mooncake Store: prefill in one process, decode in another, faults, cleanup (CPU, loopback)."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from oasis_hf import OasisConfig, PrefetchError, RemoteTierError, UnsupportedError
from oasis_hf.remote import MooncakeCluster, MooncakeTier, attach, mooncake_missing
from tests._factories import oasis_cache, tiny_model
from tests.remote._remote_worker import prompt_ids

MISSING = mooncake_missing()
pytestmark = pytest.mark.skipif(
    MISSING is not None,
    reason=f"{MISSING} (scripts/test.sh installs the package; the system library libibverbs1 comes from "
           "apt-get install libibverbs1, which CI runs)",
)

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(budget_tokens=128, max_fetch_blocks=2, selector="lookahead")  # 8 slots of 16: real eviction/fetches


@pytest.fixture(scope="module")
def cluster():
    with MooncakeCluster(pool_bytes=256 << 20) as running:
        yield running


def prefill_in_other_process(master: str, request: str, fields: dict) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "remote" / "_remote_worker.py"), master, request,
                          json.dumps(fields)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def greedy(model, cache, first, steps):
    """`steps` greedy tokens after `first` (B,) by single-token forwards on `cache`."""
    token, out = first.view(-1, 1), [first.view(-1, 1)]
    with torch.inference_mode():
        for _ in range(steps):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(token)
    return torch.cat(out, dim=1)


def local_run(model, cache, steps):
    with torch.inference_mode():
        first = model(prompt_ids().to(model.device), past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)
    out = greedy(model, cache, first, steps)
    if hasattr(cache, "close"):
        cache.close()
    return out


@pytest.mark.parametrize("fields", [dict(budget_tokens=4096, selector="lookahead"), SMALL,
                                    dict(SMALL, layer_budget_tokens={1: 256})],
                         ids=["budget-covers-context", "small-budget", "layer-budgets"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefill_and_decode_processes_match_one_process(cluster, fields, device):
    """On CUDA the decode steps are captured graphs that write new rows into the pinned tail ring."""
    request = f"req-{uuid.uuid4().hex[:8]}"
    prefill_in_other_process(cluster.master_address, request, dict(fields, device=device))
    model = tiny_model("llama", attn="oasis", device=device)
    tier = MooncakeTier(cluster.master_address)
    cache, extra = attach(model.config, tier, request, device, hot_blocks=16)
    host_bytes = cache.host.nbytes
    # 150 -> 190 tokens: blocks fill, are pushed back, and move in and out of the pool.
    remote = greedy(model, cache, torch.tensor(extra["next"], device=device), steps=40)
    store = cache.host
    keys = store.request_keys()
    assert store.pushed_count > 0  # completed blocks went back to the pool
    # The per-layer budgets as published, and each layer's pool sized by its own.
    assert cache.config.layer_budget_tokens == OasisConfig(layer_budget_tokens=fields.get("layer_budget_tokens")
                                                           ).layer_budget_tokens
    assert [layer.budget_blocks for layer in cache.oasis_layers] == [cache.config.layer_budget_blocks(i)
                                                                     for i in range(2)]
    assert [layer.pool_k.shape[2] for layer in cache.oasis_layers] == [layer.budget_blocks
                                                                       for layer in cache.oasis_layers]
    if fields["budget_tokens"] < 4096:
        assert store.pulled_blocks > 0 and cache.stats.summary()["fetched_blocks"] > 0
        assert store.ahead_pulled > 0  # the network thread pulled likely blocks ahead of need
    if device == "cuda":
        assert cache.stats.graph_replays > 0
    # The decode node's host memory is the tail ring and the hot cache: fixed, whatever the sequence length.
    assert store.nbytes == host_bytes
    cache.close()
    assert not any(tier.exists(keys))  # the finished request's objects are gone from the pool

    reference = local_run(model, oasis_cache(model, **fields), steps=40)
    assert torch.equal(remote, reference)
    if fields["budget_tokens"] >= 4096:
        dense = local_run(tiny_model("llama", device=device), DynamicCache(config=model.config), steps=40)
        assert torch.equal(remote, dense)
    tier.close()


def test_missing_block_and_request_are_named(cluster):
    request = f"req-{uuid.uuid4().hex[:8]}"
    prefill_in_other_process(cluster.master_address, request, SMALL)
    model = tiny_model("llama", attn="oasis")
    tier = MooncakeTier(cluster.master_address)
    with pytest.raises(RemoteTierError, match="'nope' is not in the remote tier"):
        attach(model.config, tier, "nope", "cpu")
    tier.remove([f"{request}/L0/B0"])  # the sink block: always resident, pulled at attach
    with pytest.raises(RemoteTierError, match=f"{request}/L0/B0.*-704 OBJECT_NOT_FOUND"):
        attach(model.config, tier, request, "cpu")
    with pytest.raises(UnsupportedError, match="asynchronous selector"):
        attach(model.config, tier, request, "cpu", selector="current-query")
    with pytest.raises(UnsupportedError, match=r"\['layer_budget_tokens'\] must stay as published \(\[None\]\)"):
        attach(model.config, tier, request, "cpu", layer_budget_tokens={0: 256})
    names = ["state", *(f"B{n}" for n in range(10))]
    tier.remove([f"{request}/meta"] + [f"{request}/L{i}/{name}" for i in range(2) for name in names])
    tier.close()


def test_full_pool_fails_the_write_and_keeps_live_requests():
    """Writes are hard-pinned: Mooncake would otherwise evict older objects silently to make room."""
    with MooncakeCluster(pool_bytes=16 << 20) as small:  # (a 4 MiB pool process aborts at start)
        tier = MooncakeTier(small.master_address)
        block = torch.zeros(1 << 20, dtype=torch.uint8)
        written = 0
        with pytest.raises(RemoteTierError, match="NO_AVAILABLE_HANDLE.*pool is full"):
            for i in range(32):
                tier.put([f"live/{i}"], [block.data_ptr()], [block.numel()])
                written += 1
        assert 0 < written < 32 and all(tier.exists([f"live/{i}" for i in range(written)]))
        tier.close()


@pytest.mark.parametrize("victim", ["master", "pool"])
def test_dead_service_mid_decode_raises_within_10s(victim):
    with MooncakeCluster(pool_bytes=64 << 20) as own:
        request = "req-fault"
        prefill_in_other_process(own.master_address, request, SMALL)
        model = tiny_model("llama", attn="oasis")
        tier = MooncakeTier(own.master_address)
        cache, extra = attach(model.config, tier, request, "cpu", hot_blocks=4, free_on_close=False)
        token = torch.tensor(extra["next"]).view(-1, 1)
        with torch.inference_mode():
            for _ in range(3):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            (own.kill_master if victim == "master" else own.kill_pool)()
            t0 = time.monotonic()
            with pytest.raises((PrefetchError, RemoteTierError)) as err:
                for _ in range(40):  # a block completes every 16 tokens: its push, or a pull, meets the dead service
                    token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                cache.wait()
            elapsed = time.monotonic() - t0
        assert elapsed < 10, f"the failure took {elapsed:.1f} s to surface"
        chain = f"{err.value} {err.value.__cause__}"
        assert ("RPC_FAIL" in chain) or ("TRANSFER_FAIL" in chain) or ("OBJECT_NOT_FOUND" in chain), chain
        threads = [runtime.prefetcher._thread for runtime in cache.runtimes.values() if runtime.started]
        with pytest.raises(PrefetchError):
            cache.close()  # the worker's failure is reported again, and the worker thread still stops
        tier.close()
    assert own.master is None and own.pool is None
    assert threads and not any(thread.is_alive() for thread in threads)


def test_forgotten_remote_cache_and_cluster_leave_nothing_running(cluster):
    """A script that never closes its attached cache (network thread running) nor its own cluster still exits, and
    its Mooncake processes are stopped."""
    request = f"req-{uuid.uuid4().hex[:8]}"
    prefill_in_other_process(cluster.master_address, request, SMALL)
    code = (
        "import sys, torch\n"
        "from oasis_hf.remote import MooncakeCluster, MooncakeTier, attach\n"
        "from tests._factories import tiny_model\n"
        "own = MooncakeCluster(pool_bytes=16 << 20).start()\n"
        "print(own.master.pid, own.pool.pid, flush=True)\n"
        "m = tiny_model('llama', attn='oasis')\n"
        f"cache, extra = attach(m.config, MooncakeTier({cluster.master_address!r}), {request!r}, 'cpu', "
        "ahead_blocks=4)\n"
        "token = torch.tensor(extra['next']).view(-1, 1)\n"
        "with torch.inference_mode():\n"
        "    for _ in range(20):\n"
        "        token = m(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)\n"
        "assert cache.host._net_thread is not None\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    for pid in map(int, run.stdout.split()[:2]):
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), f"Mooncake process {pid} still runs"


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_mooncake_services_die_with_a_killed_parent(how):
    """SIGKILL or SIGTERM of the process that started a MooncakeCluster (no finalizer runs) stops its master and
    pool process too (parent-death signal); before, both kept running."""
    code = (
        "import time\n"
        "from oasis_hf.remote import MooncakeCluster\n"
        "own = MooncakeCluster(pool_bytes=16 << 20).start()\n"
        "print(own.master.pid, own.pool.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
        parent.send_signal(how)
        parent.wait(timeout=30)
        for pid in pids:
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), f"Mooncake process {pid} still runs"
    finally:
        parent.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "gone zombie"
