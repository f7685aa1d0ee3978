"""`OasisConfig`: one frozen, validated description of how an `OasisCache` behaves.

Everything mutable (residency, lengths, buffers) lives on the cache; the config never changes after construction.
Use `dataclasses.replace(cfg, ...)` for variants and `cfg.to_dict()` / `OasisConfig.from_dict(d)` for JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KERNEL_BACKENDS = ("auto", "triton", "torch")
#: torch.compile modes `OasisConfig.compile_mode` accepts (None: Inductor's default).
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")


def _is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is an ``int`` to Python, never a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)
SUMMARY_KINDS = ("mean", "minmax", "mean+minmax", "quantized")


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `tokens` tokens: ``ceil(tokens / block_size)``, the one place the
    block geometry rounds up."""
    return -(-tokens // block_size)


@dataclass(frozen=True)
class OasisConfig:
    """How an `OasisCache` splits the KV cache between host memory and the GPU.

    The full K/V of every full-attention layer lives in host memory (pinned when CUDA is present). The GPU keeps, per
    (sequence, KV head, layer), at most `budget_tokens` tokens in `budget_tokens // block_size` block slots: the sink
    blocks, the recent window, and the blocks the selector picks. Attention over those blocks is exact.

    Parameters
    ----------
    block_size : int
        Tokens per KV block (the unit of selection and transfer). Power of two, 16..256. Default 32. Smaller blocks
        select more precisely at the same budget (at budget 512 on Qwen2.5-Coder-1.5B, 8k tokens, 16 instead of 32
        raised the accuracy suite's average from 71.7 to 83.7; at 2048 from 87.3 to 87.8) and cost twice the summary
        memory and scoring work; the block planner's kernel holds up to 16,384 blocks per table (256k tokens at 16;
        larger tables plan with its PyTorch twin).
        Use 16 at budgets of 1,024 and below (with ``sink_tokens=16, recent_tokens=64``).
    budget_tokens : int
        GPU KV budget per (sequence, KV head, layer) in tokens; a multiple of `block_size`. Default 2048.
    layer_budget_tokens : dict[int, int] | None
        Budgets of single layers that differ from `budget_tokens`, as ``{layer index: tokens}`` (the model's layer
        index, a full-attention layer; each a multiple of `block_size` with the same lower bound as
        `budget_tokens`). Layers are not equally sparse (Qwen2.5-Coder-0.5B at 4k tokens, 320 resident: the first
        and last three layers keep 0.72-0.83 of their attention mass, the middle ones 0.89-0.97), so more slots
        there (a budget that covers the context makes a layer exact) and fewer elsewhere keep more attention mass at
        the same total; ``eval.recall`` reports the recall per layer, ``eval.layer_budgets`` turns it into budgets
        at the same total. More mass is not more accuracy: on that model's suite prompts the mass-driven split
        scored below the uniform budget (docs/results.md, "Per-layer budgets at the same total"). Every slot is
        allocated up front and counted in `OasisCache.device_nbytes`; a layer of more than 512 slots plans its
        delta with the PyTorch twin of the planner kernel (slower, the same plan). Stored as a tuple of
        ``(layer, tokens)`` pairs, sorted; see `layer_budget`. Default None (every layer `budget_tokens`).
    sink_tokens : int
        Tokens at the start of each sequence that are always resident (attention sinks); a multiple of
        `block_size`. Default 32.
    recent_tokens : int
        Size of the always-resident recent window, in tokens, not counting the partially filled last block; a
        multiple of `block_size`. Default 128.
    selector : str
        Block selection policy: ``"lookahead"`` (after each step, score blocks with the queries of the forward's
        draft positions, or of the step itself without drafts, and move the delta for the next step in the
        background: OasisKV), ``"previous-query"`` (the same with the forward's first query only),
        ``"current-query"`` (score every block with the step's own queries and fetch misses synchronously, inside
        the step), ``"static"`` (sinks + the most recent blocks: StreamingLLM at equal budget) or ``"oracle"``
        (exact attention mass from the full keys; slow, for tests and recall). See `oasis_hf.selectors`.
    summary : str
        Block summary kept on the GPU for scoring: ``"mean"`` (mean key per block and KV head, 1/block_size of
        the keys), ``"minmax"`` (Quest's per-channel bounds, 2/block_size of the keys) or ``"mean+minmax"`` (both,
        3/block_size; a block's score is the average of the two: the bounds rank blocks with one matching key, the
        mean blocks with many) or ``"quantized"`` (the bounds and every key at 2 bits per channel inside them,
        scored token by token: 1/8 + 3/block_size of the keys, the mean key included for `quantized_rerank`; ranks
        blocks closest to exact attention, reads the most per scoring; needs a head dim divisible by 4). See
        `oasis_hf.cache.summaries`.
    quantized_rerank : int
        ``summary="quantized"`` only: score in two stages. ``mean+minmax`` (the bounds and the mean key) rates every
        block, and the key codes of only ``k * S`` of them, the best it rates, rank those (``S`` = the blocks a
        layer's budget selects beyond its sinks and recent window; the forced blocks are read besides): in each
        query row's softmax every other block counts as its tokens at its mean key's logit. Offline
        (`eval.rank_summaries`) k = 4 ranked as well as the codes of every block, k = 2 within 0.015 of it.
        ``0``: the codes of every block (one stage; a token pass over the whole context per scoring). Default 4.
    max_fetch_blocks : int | None
        Cap on selector-driven block fetches per (sequence, KV head, layer) and step; the best-scoring misses go
        first and the least important resident blocks are evicted. Blocks that must be resident (sinks, recent
        window, new tokens) are never capped. ``None`` means no cap. Default 16.
    keep_margin : float
        Hysteresis of the plan: a resident block's score counts ``1 + keep_margin`` times when the top blocks are
        chosen, so a block that is not resident replaces one that is only when it scores more than that factor
        above it. Scores that move a little from step to step swap blocks near the selection's edge back and forth
        (each swap a block over PCIe and, in a background job, a longer gather beside the step); a margin keeps
        such near-ties where they are. ``0.0`` (default): plain top blocks.
    sync_fetch_blocks : int
        Asynchronous selectors (``lookahead``, ``previous-query``) only: a correction inside each step. Before the
        step's attention, its own queries score every block (as ``current-query`` does, without the selection
        memory) and up to this many of the best-scoring blocks that are not resident are fetched synchronously,
        evicting the residents those queries rate lowest; the background job still moves the rest of the delta.
        It fetches nothing when the prefetched blocks already hold the step's top blocks, so its transfer cost
        follows the misses (FreeKV corrects its speculative selection in the same spirit). ``0`` (default): off.
    sync_fetch_memory : bool
        With ``sync_fetch_blocks``: the correction ranks blocks by the step's own share or the decayed selection
        memory, whichever is larger (the memory is read, not updated), so it evicts the residents that neither this
        step nor the recent ones rate, not the ones this step's queries rate lowest, which the next background job
        would fetch back. Needs ``score_decay > 0``. Default False (the step's own queries alone).
    selection_interval : int
        Asynchronous selectors (``lookahead``, ``previous-query``) only: each layer runs its selection job (score,
        plan, fetch) after every Nth decode forward and keeps the blocks the last job chose in between (new tokens
        still land in their blocks, the recent window still slides, the in-step correction still runs). A job
        beside the step slows the step's weight GEMMs whatever it moves (about 12-15 us per layer-step at batch 8
        on the Llama-8B shape), so fewer jobs make a faster step, for a selection up to N - 1 forwards older.
        Default 1 (every forward).
    fetch_programs : int | None
        GPU programs (thread blocks) the gather kernel of a *background* selection job may use; each loops over its
        share of the delta. A program reading host memory holds its SM while it waits on PCIe, so an uncapped
        gather running beside the decode step stalls it; a few programs still saturate PCIe and leave the other SMs
        to the step. Fetches inside the step (``current-query``) always use the whole GPU. ``None``: no cap.
        Default 16 (measured on the H200: `eval.bench_kernels`, gather interference table).
    kernel_backend : str
        ``"auto"`` (Triton on CUDA tensors or under ``TRITON_INTERPRET=1``, PyTorch otherwise), ``"triton"`` or
        ``"torch"`` (the reference twins).
    host_capacity_tokens : int | None
        Pre-size the host store for this many tokens per sequence. ``None`` sizes it at the first forward and grows
        it by new segments (the store is never copied as a whole).
    host_growth_tokens : int
        Smallest growth step of the host store, in tokens; a multiple of `block_size`. Default 4096.
    pin_host_memory : bool | None
        Pin the host store (needed for asynchronous transfers). ``None`` pins when CUDA is available.
    host_memory_headroom_bytes : int
        Host memory left free when sizing the store; an allocation that would cut into it fails up front with
        `HostMemoryError`. Default 1 GiB.
    host_memory_limit_bytes : int | None
        Most bytes the host store may hold. When set, allocations are checked against it instead of the OS's
        available memory (and the headroom): use it to cap a cache, or on machines whose memory grows on demand
        (ballooned VMs report too little available memory up front). ``None`` (default) asks the OS.
    prefetch : bool
        Run the selection jobs of asynchronous selectors (``lookahead``, ``previous-query``) beside the decode
        step: on the prefetch CUDA stream (see `prefetch_launch`), or in the worker thread on the CPU. The next step
        of a layer waits for its job, so the output is the same with ``False``, which runs each job inline right
        after the step. Default True.
    prefetch_launch : str
        How a background job reaches its CUDA stream: ``"caller"`` (default) launches a job captured as a CUDA graph
        from the calling thread straight onto the prefetch stream (one graph launch, no thread hand-off; eager jobs,
        e.g. on the CPU or before a job graph exists, still go to the worker thread); ``"thread"`` hands every job
        to the worker thread. On the per-layer path (the model's eager modules around per-layer graphs, batch 8 at
        32k on the 8B shape) the H200 measured 27.3 ms per decode step with ``"caller"`` against 47.0 ms with
        ``"thread"`` (`eval/results/lookahead_decode_8b_b8_32k_run4.md`): a job graph of ~40 nodes launches in
        microseconds. Inside the whole-step graph (`whole_step`) jobs are forked in the graph and this does not
        apply.
    prefetch_policy : str
        What a step does when its layer's selection job is still running: ``"wait"`` (default: wait for it, so the
        selection never depends on timing) or ``"stale"`` (run on the blocks already resident, count a stale step,
        and let a later job's proposal in; a job proposes the delta into staging buffers and the next step commits
        it, revalidated, only if the job has finished). Either way attention is exact over what is resident.
    prefill_window_tokens : int
        How a selector (other than ``static`` and ``oracle``) makes the first selection after a prefill (and after
        each chunk of a chunked prefill): ``0`` scores with the prompt's last query against the block summaries, as
        a decode step does; ``W > 0`` uses the exact attention of the prompt's last ``W`` queries over its keys
        (still on the GPU at that point), SnapKV's observation window. The prompt's end (the question, the
        instruction) is the best evidence of what the first answer tokens read. Default 32.
    score_decay : float
        Selection memory of the selectors other than ``static`` and ``oracle``, in ``[0, 1)``. ``0``: each
        selection uses only the queries that made it. ``d > 0``: a block's score is the larger of its new score (its
        mean attention share per query row) and ``d`` times its previous score, so a block that mattered a few steps
        ago is not evicted by one step whose queries look elsewhere (answers that list several distant facts).
        Default 0.9.

        On Qwen2.5-Coder-1.5B at 8k tokens and budget 512 (lookahead with the 0.5B draft, blocks of 32) the window
        and the memory together took the five multi-fact tasks of the accuracy suite from 68.4 to 73.4 on average;
        with blocks of 16 (the larger lever at small budgets: 71.7 -> 83.7 on the whole suite) they added 0.6
        (`eval/results/accuracy_gpu_qwen_1.5b_variants_8k.md`). Both cost a few element-wise operations per
        selection; set them to 0 for the selection of earlier releases.
    measure_recall : bool
        After each decode step, compare what was resident with the step's exact attention (all keys read back from
        host memory: slow, for evaluation). Adds ``mass_recall`` (share of the exact attention mass on resident
        blocks) and ``topk_recall`` (share of the exact top-``S`` blocks that were resident) to the stats.
        Default False.
    dense_chunk_tokens : int
        A forward of more new tokens than this on a non-empty cache (chunked prefill) attends exactly, over the whole
        sequence read back from host memory one layer at a time; shorter forwards (decode, draft verification) take
        the sparse step over the resident blocks. A forward whose new blocks do not fit the budget always takes the
        exact path. Default 64: above the 1 + drafts of speculative verification, below the chunk sizes of a
        chunked prefill (`generate(..., prefill_chunk_size=...)`).
    drop_rejected_drafts : bool
        When speculative decoding rejects drafts (``crop``), selection jobs of that forward that have not started yet
        score with the accepted tokens' queries only. Jobs already running, or replayed as CUDA graphs, keep all
        queries: on CUDA with the default ``prefetch_launch="caller"`` every job after a ``T``'s first two is a graph
        launched at once, so this acts on the CPU and on eager jobs only. Changes which blocks are chosen, never the
        exactness of attention. Default True.
    whole_step : bool
        On CUDA, a model switched by `oasis_hf.enable` runs the decode and verification forwards of ``model(...)``
        and ``model.generate`` over this cache (``T <= 16`` new tokens, after the prefill) as one CUDA graph of the
        whole forward per ``T`` (`oasis_hf.DecodeGraph`): one launch per step instead of the model's eager modules.
        Forwards it cannot take (sliding-window layers, several devices, the stale policy, ``measure_recall``, a
        remote tier, attention or hidden-state outputs) run eagerly, with one log line saying why. Default True;
        False keeps every forward eager (per-layer graphs, see `cuda_graphs`). The CPU always runs eagerly.
    queued_generate : bool
        With the whole-step graph path, ``model.generate`` over this cache (greedy or sampling, no drafts) reads
        its stop flag one step late (transformers' deferred stop check), so the host queues each step while the
        GPU runs the previous one instead of both waiting for each other every step; an EOS that ends every
        sequence costs one extra forward, which is undone (`oasis_hf.integrations.queued_generate`). Default True;
        False keeps transformers' loop, which synchronises with the device every step.
    cuda_graphs : bool
        On CUDA, capture each layer's decode step (selection, delta, fetch, sparse attention) in a CUDA graph per
        forward length ``T <= 16`` and replay it: one graph launch per layer instead of the step's 5-8 kernel
        launches and its Python. The first forward of each ``T`` runs eagerly, the second captures. Default True;
        False runs every step eagerly.
    compile_model : bool
        The whole-step graph (`whole_step`) runs the model's own modules through ``torch.compile`` (Inductor)
        before capturing them: the norms, RoPE, activations and residual adds around the attention fuse into a few
        kernels, where eagerly each is several small kernels per layer. The model traces as one graph: each layer's
        cache update and attention are one opaque operator (`oasis_hf.cache.step_op`), so nothing of the model is
        copied or rewritten. The first two forwards of each ``T`` compile (10-46 s for an 8B model on an H100 or
        H200, less with Inductor's on-disk cache); later steps replay the captured graph. A later cache of the same
        shape in the process (the next ``generate`` call) runs one eager forward before its capture instead of two.
        Changes the rounding of bf16 models slightly (fused kernels keep float32 intermediates where eager modules
        round each op to bf16). Default False. On the CPU, where the whole-step path runs eagerly every call, it
        compiles there too (a test of the mechanism, no speed-up).
    compile_mode : str | None
        ``torch.compile``'s ``mode`` for `compile_model`: ``None`` (Inductor's default: the weight GEMMs stay
        cuBLAS calls) or ``"max-autotune-no-cudagraphs"`` (Inductor benchmarks its own Triton GEMMs against cuBLAS
        per shape; at one token per step it fuses each projection into a bandwidth-bound reduction, measured on
        the H200 at 117 instead of 132 us per Llama-8B layer, and at batch 8 it is slower than cuBLAS, 150 us; the
        first forward of each ``T`` takes a minute or more longer). Modes that add CUDA graphs of their own
        (``"reduce-overhead"``, ``"max-autotune"``) are refused: the whole-step graph is already one. Default None.
    """

    block_size: int = 32
    budget_tokens: int = 2048
    layer_budget_tokens: Any = None
    sink_tokens: int = 32
    recent_tokens: int = 128
    selector: str = "current-query"
    summary: str = "mean"
    quantized_rerank: int = 4
    max_fetch_blocks: int | None = 16
    keep_margin: float = 0.0
    sync_fetch_blocks: int = 0
    sync_fetch_memory: bool = False
    selection_interval: int = 1
    fetch_programs: int | None = 16
    kernel_backend: str = "auto"
    host_capacity_tokens: int | None = None
    host_growth_tokens: int = 4096
    pin_host_memory: bool | None = None
    host_memory_headroom_bytes: int = 1 << 30
    host_memory_limit_bytes: int | None = None
    prefetch: bool = True
    prefetch_launch: str = "caller"
    prefetch_policy: str = "wait"
    prefill_window_tokens: int = 32
    score_decay: float = 0.9
    measure_recall: bool = False
    dense_chunk_tokens: int = 64
    drop_rejected_drafts: bool = True
    whole_step: bool = True
    queued_generate: bool = True
    cuda_graphs: bool = True
    compile_model: bool = False
    compile_mode: str | None = None

    def __post_init__(self) -> None:
        from oasis_hf.selectors import SELECTORS  # local: selectors import nothing from config at module level

        def bad(field: str, value: Any, why: str) -> ValueError:
            return ValueError(f"OasisConfig.{field}={value!r} is invalid: {why}")

        for name in ("block_size", "budget_tokens", "sink_tokens", "recent_tokens", "host_growth_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(name, value, "expected an int")
        bs = self.block_size
        if bs < 16 or bs > 256 or bs & (bs - 1):
            raise bad("block_size", bs, "use a power of two between 16 and 256 (e.g. 32)")
        for name in ("budget_tokens", "host_growth_tokens"):
            value = getattr(self, name)
            if value <= 0 or value % bs:
                raise bad(name, value, f"must be a positive multiple of block_size={bs}")
        for name in ("sink_tokens", "recent_tokens"):
            value = getattr(self, name)
            if value < 0 or value % bs:
                raise bad(name, value, f"must be a non-negative multiple of block_size={bs}")
        # Resident at all times: sinks + recent window + the partial last block, plus one slot for a selected block.
        floor = self.sink_tokens + self.recent_tokens + 2 * bs
        if self.budget_tokens < floor:
            raise bad(
                "budget_tokens",
                self.budget_tokens,
                f"must be >= sink_tokens + recent_tokens + 2*block_size = {floor}; "
                "raise budget_tokens or lower sink_tokens/recent_tokens",
            )
        self._check_layer_budgets(bad, floor)
        if self.selector not in SELECTORS:
            raise bad("selector", self.selector, f"choose one of {sorted(SELECTORS)}")
        if self.summary not in SUMMARY_KINDS:
            raise bad("summary", self.summary, f"choose one of {list(SUMMARY_KINDS)}")
        if not _is_int(self.quantized_rerank) or self.quantized_rerank < 0:
            raise bad("quantized_rerank", self.quantized_rerank,
                      "use a non-negative int: k of the k x S candidate blocks (0: the codes of every block)")
        if self.prefetch_launch not in ("thread", "caller"):
            raise bad("prefetch_launch", self.prefetch_launch, "choose 'thread' or 'caller'")
        if self.prefetch_policy not in ("wait", "stale"):
            raise bad("prefetch_policy", self.prefetch_policy, "choose 'wait' or 'stale'")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise bad("kernel_backend", self.kernel_backend, f"choose one of {list(KERNEL_BACKENDS)}")
        if self.max_fetch_blocks is not None and (
            not isinstance(self.max_fetch_blocks, int) or isinstance(self.max_fetch_blocks, bool)
            or self.max_fetch_blocks < 1
        ):
            raise bad("max_fetch_blocks", self.max_fetch_blocks, "use a positive int, or None for no cap")
        if not isinstance(self.keep_margin, (int, float)) or isinstance(self.keep_margin, bool) or not (
            0.0 <= self.keep_margin < float("inf")
        ):
            raise bad("keep_margin", self.keep_margin, "use a finite float >= 0 (0: no hysteresis)")
        if not _is_int(self.sync_fetch_blocks) or self.sync_fetch_blocks < 0:
            raise bad("sync_fetch_blocks", self.sync_fetch_blocks, "use a non-negative int (0: off)")
        if self.sync_fetch_blocks and not SELECTORS[self.selector].asynchronous:
            raise bad("sync_fetch_blocks", self.sync_fetch_blocks,
                      f"it corrects an asynchronous selector (lookahead, previous-query) inside the step; "
                      f"{self.selector!r} selects inside the step already (its cap is max_fetch_blocks): set 0")
        if not _is_int(self.selection_interval) or self.selection_interval < 1:
            raise bad("selection_interval", self.selection_interval, "use a positive int (1: a job every forward)")
        if self.selection_interval > 1 and not SELECTORS[self.selector].asynchronous:
            raise bad("selection_interval", self.selection_interval,
                      f"it spaces the background jobs of an asynchronous selector (lookahead, previous-query); "
                      f"{self.selector!r} selects inside every step: set 1")
        if self.fetch_programs is not None and (
            not isinstance(self.fetch_programs, int) or isinstance(self.fetch_programs, bool)
            or self.fetch_programs < 1
        ):
            raise bad("fetch_programs", self.fetch_programs, "use a positive int, or None for no cap")
        if self.host_capacity_tokens is not None and (
            not _is_int(self.host_capacity_tokens) or self.host_capacity_tokens <= 0
        ):
            raise bad("host_capacity_tokens", self.host_capacity_tokens, "use a positive int, or None")
        if self.pin_host_memory is not None and not isinstance(self.pin_host_memory, bool):
            raise bad("pin_host_memory", self.pin_host_memory, "use True, False or None (auto)")
        if self.pin_host_memory is True:
            import torch  # local: validating the other fields imports nothing

            if not torch.cuda.is_available():
                raise bad("pin_host_memory", True, "page-locked host memory is for GPU transfers and this torch sees "
                          "no CUDA device; use None (pin when CUDA is present) or False")
        for name in ("prefetch", "measure_recall", "cuda_graphs", "drop_rejected_drafts", "whole_step",
                     "queued_generate", "compile_model"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "use True or False")
        if self.compile_mode not in COMPILE_MODES:
            raise bad("compile_mode", self.compile_mode, f"choose one of {list(COMPILE_MODES)} (modes with CUDA graphs "
                      "of their own cannot run inside the whole-step graph)")
        if self.compile_mode is not None and not self.compile_model:
            raise bad("compile_mode", self.compile_mode, "it applies to compile_model=True; set that too, or leave "
                      "compile_mode=None")
        if not _is_int(self.host_memory_headroom_bytes) or self.host_memory_headroom_bytes < 0:
            raise bad("host_memory_headroom_bytes", self.host_memory_headroom_bytes, "use a non-negative int")
        if not isinstance(self.dense_chunk_tokens, int) or isinstance(self.dense_chunk_tokens, bool) or (
            self.dense_chunk_tokens < 1
        ):
            raise bad("dense_chunk_tokens", self.dense_chunk_tokens, "use a positive int")
        if not isinstance(self.prefill_window_tokens, int) or isinstance(self.prefill_window_tokens, bool) or (
            self.prefill_window_tokens < 0
        ):
            raise bad("prefill_window_tokens", self.prefill_window_tokens,
                      "use a non-negative int (0: the last prompt query against the summaries)")
        if not isinstance(self.score_decay, (int, float)) or isinstance(self.score_decay, bool) or not (
            0.0 <= self.score_decay < 1.0
        ):
            raise bad("score_decay", self.score_decay, "use a float in [0, 1) (0: no selection memory)")
        if not isinstance(self.sync_fetch_memory, bool):
            raise bad("sync_fetch_memory", self.sync_fetch_memory, "use True or False")
        if self.sync_fetch_memory and not (self.sync_fetch_blocks and self.score_decay > 0):
            raise bad("sync_fetch_memory", self.sync_fetch_memory,
                      "it ranks the in-step correction by the selection memory: set sync_fetch_blocks > 0 and "
                      "score_decay > 0, or leave it False")
        if self.host_memory_limit_bytes is not None and (
            not isinstance(self.host_memory_limit_bytes, int) or isinstance(self.host_memory_limit_bytes, bool)
            or self.host_memory_limit_bytes <= 0
        ):
            raise bad("host_memory_limit_bytes", self.host_memory_limit_bytes, "use a positive int, or None")

    def _check_layer_budgets(self, bad, floor: int) -> None:
        """Normalise `layer_budget_tokens` (a mapping or pairs, e.g. from JSON) to sorted pairs, and check them."""
        spec = self.layer_budget_tokens
        if spec is None:
            return
        try:
            pairs = [tuple(item) for item in (spec.items() if isinstance(spec, dict) else spec)]
            pairs = [(int(layer) if isinstance(layer, str) and layer.isdigit() else layer, tokens)
                     for layer, tokens in pairs]  # JSON turns int keys into strings
        except (TypeError, ValueError):
            raise bad("layer_budget_tokens", spec, "use a dict {layer index: tokens}") from None
        bs = self.block_size
        for layer, tokens in pairs:
            if not _is_int(layer) or layer < 0:
                raise bad("layer_budget_tokens", spec, f"layer {layer!r} is not a non-negative int layer index")
            if not _is_int(tokens) or tokens % bs or tokens < floor:
                raise bad("layer_budget_tokens", spec, f"layer {layer}'s budget {tokens!r} must be a multiple of "
                          f"block_size={bs} and >= sink_tokens + recent_tokens + 2*block_size = {floor}")
        if len({layer for layer, _ in pairs}) != len(pairs):
            raise bad("layer_budget_tokens", spec, "a layer is named twice")
        object.__setattr__(self, "layer_budget_tokens", tuple(sorted(pairs)) or None)

    def layer_budget(self, layer_idx: int) -> int:
        """The GPU KV budget of layer `layer_idx` in tokens (`layer_budget_tokens`, else `budget_tokens`)."""
        return dict(self.layer_budget_tokens or ()).get(layer_idx, self.budget_tokens)

    # Derived sizes, in blocks.
    @property
    def budget_blocks(self) -> int:
        """Block slots per (sequence, KV head, layer) on the GPU (layers without a budget of their own)."""
        return self.budget_tokens // self.block_size

    def layer_budget_blocks(self, layer_idx: int) -> int:
        """Block slots per (sequence, KV head) of layer `layer_idx` on the GPU."""
        return self.layer_budget(layer_idx) // self.block_size

    def score_candidates(self, layer_idx: int, num_tokens: int) -> int:
        """Blocks whose key codes a ``quantized`` summary's scoring of `num_tokens` query positions reads in layer
        `layer_idx` (`quantized_rerank`): ``k * S`` chosen ones, ``S`` the layer's budget beyond its sinks and
        recent window, plus room for every forced block (sinks, recent window, the blocks of the new tokens);
        0 for one stage or another summary."""
        if self.summary != "quantized" or not self.quantized_rerank:
            return 0
        selected = self.layer_budget_blocks(layer_idx) - self.sink_blocks - self.recent_blocks
        forced = self.sink_blocks + self.recent_blocks + -(-num_tokens // self.block_size) + 1
        return self.quantized_rerank * selected + forced

    @property
    def sink_blocks(self) -> int:
        return self.sink_tokens // self.block_size

    @property
    def recent_blocks(self) -> int:
        """Always-resident blocks at the end: the recent window plus the partially filled last block."""
        return self.recent_tokens // self.block_size + 1

    def blocks(self, tokens: int) -> int:
        """Blocks that hold positions ``0 .. tokens - 1`` (the last one possibly partial)."""
        return blocks_for(tokens, self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OasisConfig:
        """Build a config from a dict, rejecting unknown keys (a typo must not be silently ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown OasisConfig field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**data)
