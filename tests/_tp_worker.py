"""One rank of the tensor-parallel test, run by torch.distributed.run: gloo on CPU; NCCL, one GPU per rank, where
transformers finds CUDA (it picks the backend and device)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import oasis_hf  # noqa: E402
from tests._factories import oasis_cache  # noqa: E402
from tests.test_generate import left_padded  # noqa: E402


def main(model_dir: str, out_dir: str, budget: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    oasis_hf.enable(model)
    ids, mask = left_padded([150, 97])
    ids, mask = ids.to(model.device), mask.to(model.device)  # cuda:<rank> under NCCL, cpu under gloo
    cache = oasis_cache(model, budget_tokens=budget)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    layers = cache.oasis_layers
    report = {
        "tokens": out.tolist(),
        "device": str(cache.oasis_layers[0].pool_k.device),
        "kv_heads": [layer.num_kv_heads for layer in layers],
        "slots": [layer.pool_k.shape[2] for layer in layers],
        "max_resident": [int(layer.table.resident_count().max()) for layer in layers],
        "world": dist.get_world_size(),
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    cache.close()
    # The process group's threads must end before the interpreter does: left to exit, gloo's worker threads were
    # destroyed while joinable now and then ("terminate called without an active exception", exit code -6).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
