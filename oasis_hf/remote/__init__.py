"""Remote KV tier for prefill/decode disaggregation (Mooncake Store).

Nothing here imports Mooncake until it is used: `MooncakeTier` and `MooncakeCluster` import it on construction
and explain how to install it when it is missing.

>>> from oasis_hf.remote import MooncakeCluster, MooncakeTier, attach, publish
>>> with MooncakeCluster(pool_bytes=4 << 30) as cluster:          # or an existing master: "host:port"
...     publish(prefilled_cache, MooncakeTier(cluster.master_address), "req-1")       # prefill node
...     cache, extra = attach(model.config, MooncakeTier(cluster.master_address), "req-1", "cuda")  # decode node
"""

from oasis_hf.remote.disagg import attach, publish
from oasis_hf.remote.mooncake import MooncakeCluster, MooncakeTier, mooncake_available, mooncake_missing
from oasis_hf.remote.store import RemoteBlockStore

__all__ = ["MooncakeCluster", "MooncakeTier", "RemoteBlockStore", "attach", "mooncake_available", "mooncake_missing",
           "publish"]
