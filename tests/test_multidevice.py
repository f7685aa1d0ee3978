"""OasisCache under transformers tensor parallelism: 2 processes, KV heads sharded across ranks (gloo on CPU; on a
machine with two GPUs transformers runs the ranks on NCCL, one GPU each)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._factories import oasis_cache, tiny_model
from tests.test_generate import left_padded


@pytest.mark.parametrize("budget", [4096, 128], ids=["budget-covers-context", "small-budget"])
def test_two_process_tensor_parallel_matches_single_process(tmp_path, budget):
    model = tiny_model("llama")  # 4 query heads, 2 KV heads: one KV head per rank
    model.save_pretrained(tmp_path / "model")
    ids, mask = left_padded([150, 97])
    oasis = tiny_model("llama", attn="oasis")
    cache = oasis_cache(oasis, budget_tokens=budget)
    with torch.no_grad():
        single = oasis.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                do_sample=False, pad_token_id=0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if torch.cuda.device_count() < 2:  # one GPU cannot host two NCCL ranks: run both on the CPU with gloo
        env["CUDA_VISIBLE_DEVICES"] = ""
    # The worker runs as a module: run as a script, its folder (tests/) would come first on sys.path and the test
    # package `tests/kernels` would shadow the `kernels` package that transformers imports when it is installed.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "tests._tp_worker", str(tmp_path / "model"), str(tmp_path), str(budget)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world"] == 2
        if torch.cuda.device_count() >= 2:  # transformers ran the ranks on NCCL, one GPU each
            assert report["device"] == f"cuda:{rank}"
        assert report["kv_heads"] == [1, 1]  # each rank's pools hold its shard of the KV heads
        assert report["slots"] == [budget // 16] * 2 and max(report["max_resident"]) <= budget // 16
        assert torch.equal(torch.tensor(report["tokens"]), single), f"rank {rank} differs from one process"
