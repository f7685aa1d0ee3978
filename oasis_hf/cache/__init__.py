"""Host store, block table, summaries, the cache layer and the cache."""

from oasis_hf.cache.block_table import BlockTable
from oasis_hf.cache.host_store import HostKVStore
from oasis_hf.cache.layer import OasisLayer
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.cache.summaries import BlockSummaries

__all__ = ["BlockSummaries", "BlockTable", "HostKVStore", "OasisCache", "OasisLayer"]
