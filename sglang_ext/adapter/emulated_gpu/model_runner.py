"""A ModelRunner that loads no weights and allocates no KV tensors.

Modelled on SGLang's ``hardware_backend/mlx/model_runner_stub.py`` (``MlxModelRunnerStub``),
which cannot be imported without ``mlx``.  It keeps only the CPU bookkeeping the scheduler
needs -- a ``ReqToTokenPool`` and a ``TokenToKVPoolAllocator`` over a KV cache that holds
no tensors -- and sets the attributes the scheduler reads.  On an SGLang upgrade, diff this
file against that stub.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.runtime_context import get_exec, get_parallel, get_schedule

__all__ = ["EmulatedModelRunner", "resolve_max_running_requests"]

logger = logging.getLogger(__name__)


class TensorlessKVCache(KVCache):
    """A KV cache of ``size`` token slots that stores nothing; any buffer access raises."""

    def __init__(self, size: int, dtype: torch.dtype, device: str) -> None:
        # KVCache.__init__ is skipped: it sets up memory-saver and custom pools.
        self.size = size
        self.page_size = 1
        self.dtype = dtype
        self.store_dtype = dtype
        self.device = device
        self.layer_num = 0
        self.start_layer = 0
        self.end_layer = 0
        self.allocation_label = None
        self.mem_usage = 0
        self.cpu_offloading_chunk_size = 8192
        self.layer_transfer_counter = None
        self.enable_custom_mem_pool = False
        self.custom_mem_pool = None

    def _no_buffer(self) -> RuntimeError:
        return RuntimeError("the emulated GPU keeps no KV tensors")

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise self._no_buffer()

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise self._no_buffer()

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_buffer()

    def set_kv_buffer(self, layer, loc, cache_k, cache_v) -> None:
        raise self._no_buffer()

    def get_kv_size_bytes(self) -> tuple[int, int]:
        return 0, 0


class _NoModel:
    """Stands in for the model where ModelRunner inspects it (``forward``'s signature)."""

    @staticmethod
    def forward() -> None:
        pass


def resolve_max_running_requests(
    kv_tokens: int, context_len: int, requested: int | None, attn_dp_size: int = 1
) -> int:
    """SGLang's ``KVCacheConfigurator.resolve_max_num_reqs`` for a plain (non-hybrid) model.

    Without ``--max-running-requests``: ``kv_tokens / context_len * 512`` clamped to
    [2048, 4096]; in both cases at most ``kv_tokens // 2``.
    """
    if requested is not None:
        return max(1, min(max(1, requested // attn_dp_size), kv_tokens // 2))
    estimated = max(min(int(kv_tokens / context_len * 512), 4096), 2048)
    return max(1, min(estimated, kv_tokens // 2))


class EmulatedModelRunner(ModelRunner):
    """ModelRunner whose pools are CPU bookkeeping only, sized to ``kv_pool_tokens``."""

    canary_manager = None
    prefill_aware_swa = False

    def __init__(self, *args, kv_pool_tokens: int, **kwargs) -> None:
        if kv_pool_tokens < 2:
            raise ValueError(f"emulated KV pool must hold >= 2 tokens, got {kv_pool_tokens}")
        self._kv_pool_tokens = kv_pool_tokens
        super().__init__(*args, **kwargs)

    @property
    def logical_max_total_num_tokens(self) -> int:
        return self.req_to_token_pool.schedulable_token_capacity(self.max_total_num_tokens)

    @property
    def preloaded_weights_bytes(self) -> int:
        return 0

    def load_model(self) -> None:
        self.model = _NoModel()
        self.sliding_window_size = None
        self.dtype = self.model_config.dtype
        self.weight_load_mem_usage = 0

    def initialize(self) -> None:
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        self.memory_saver_adapter = TorchMemorySaverAdapter.create(
            enable=get_exec().features.enable_memory_saver
        )
        self.sampler = None
        self.load_model()
        num_layers = max(
            self.model_config.num_hidden_layers, self.model_config.num_attention_layers
        )
        self.layer_info = ModelLayerInfo(
            start_layer=0, end_layer=num_layers, num_effective_layers=num_layers
        )
        self.kv_cache_dtype = self.dtype
        self.max_total_num_tokens = self._kv_pool_tokens
        self.max_running_requests = resolve_max_running_requests(
            self.max_total_num_tokens,
            self.model_config.context_len,
            get_schedule().max_running_requests,
            get_parallel().attn_dp_size,
        )
        self.is_hybrid_swa = False
        self.req_to_token_pool = ReqToTokenPool(
            size=self.max_running_requests,
            max_context_len=self.model_config.context_len,
            device="cpu",
            enable_memory_saver=False,
        )
        kv_cache = TensorlessKVCache(
            size=self.max_total_num_tokens, dtype=self.kv_cache_dtype, device="cpu"
        )
        self.token_to_kv_pool = kv_cache
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            size=self.max_total_num_tokens,
            dtype=self.kv_cache_dtype,
            device="cpu",
            kvcache=kv_cache,
            need_sort=False,
        )
        self.decode_cuda_graph_runner = None
        self.attn_backend = None
        self.init_ngram_embedding_manager()
        logger.info(
            "Emulated GPU: no weights, no KV tensors; KV pool %d tokens, max_running_requests %d",
            self.max_total_num_tokens,
            self.max_running_requests,
        )

    def alloc_memory_pool(self, memory_pool_config=None, *, draft_parallel_layout=None) -> None:
        """Nothing to allocate: the pools were built in ``initialize``."""

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True) -> None:
        """No graphs and no eager warm-up: nothing here ever runs the model."""
        self.eager_runner = None
        self.prefill_cuda_graph_runner = None
        self.decode_cuda_graph_runner = None
        self.decode_cuda_graph_captured = False
        self.decode_cuda_graph_capture_bs = []

    def init_attention_backends(self) -> None:
        """No attention runs here."""
        self.attn_backend = None
