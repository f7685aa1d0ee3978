"""The prefill node of the remote-tier tests: prefill a prompt with OasisCache and publish it (own process)."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from oasis_hf.remote import MooncakeTier, publish  # noqa: E402
from tests._factories import VOCAB, oasis_cache, tiny_model  # noqa: E402


def main(master: str, request: str, fields_json: str) -> None:
    fields = json.loads(fields_json)
    device = fields.pop("device", "cpu")
    model = tiny_model("llama", attn="oasis", device=device)
    ids = prompt_ids().to(device)
    cache = oasis_cache(model, **fields)
    with torch.inference_mode():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
    tier = MooncakeTier(master)
    publish(cache, tier, request, extra={"next": logits.argmax(-1).tolist()})
    cache.close()
    tier.close()


def prompt_ids(batch: int = 2, length: int = 150) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(1, VOCAB, (batch, length), generator=gen)


if __name__ == "__main__":
    main(*sys.argv[1:])
