"""One forward step of a dense decoder, timed over a grid of batch shapes: the step-time
grids of ``../shared/data/gpu/`` (read by :mod:`sglang_ext.sim.fitting.step_grid`)::

    python -m benchmarks.gpu.step_profiler --config PATH/config.json --out grid.csv
    python -m benchmarks.gpu.step_profiler --model tiny --device cpu --out /tmp/tiny.csv

The model takes its shapes from a Hugging Face ``config.json`` (dense decoders only; every
model runs Llama's block) and random weights. Per layer: RMSNorm, fused QKV GEMM, RoPE, KV
write, attention, O GEMM, RMSNorm, gate/up GEMM, SiLU*mul, down GEMM; then the final norm,
the LM head on the last token of each sequence and argmax.

On CUDA (bf16) attention is ``varlen_attn`` where torch has it and it passes a check against
SDPA (else SDPA per sequence; the metadata says which), ``graph_ms`` is the median of CUDA
graph replays (device time) and a shape out of memory is skipped and noted. On the CPU (fp32)
attention is SDPA per sequence and the graph columns hold wall-clock times. Rows are written
and flushed one shape at a time and ``<out>.json`` (the run's metadata) is kept current, so a
run cut off by ``--max-seconds``, SIGINT or SIGTERM still leaves a valid grid.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import itertools
import json
import math
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sglang_ext.sim.fitting.step_grid import GRID_COLUMNS

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
            "num_experts_per_tok", "n_shared_experts")
GRAPH_REPLAYS = 8
EAGER_RUNS = 3
L2_SPAN_BYTES = 128 << 20  # above any current GPU's L2: windows this far apart share no lines
CPU_GRAPH_NOTE = "none (cpu): graph_* columns are wall-clock times"
DEFAULT_LIMITS = {  # device -> max_tokens, max_context, max_kv, random
    "cuda": (16384, 32768, 393216, 90),
    "cpu": (256, 1024, 8192, 12),
}


class ProfileError(Exception):
    """A user mistake: :func:`main` prints it on one line and exits with status 2."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tied: bool

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=256,
                  tied=False)


def model_shape(config: dict) -> ModelShape:
    """A dense decoder's shapes from its ``config.json``; :class:`ProfileError` naming the key
    for a mixture-of-experts model or a missing or invalid value."""
    for key in MOE_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise ProfileError(f"{key} = {value}: a mixture-of-experts model; only dense "
                               "decoders are supported")
    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ProfileError(f"num_attention_heads {heads} is not a multiple of "
                           f"num_key_value_heads {kv_heads}")
    if config.get("head_dim") is None and hidden % heads:
        raise ProfileError(f"head_dim is missing and hidden_size {hidden} is not a multiple "
                           f"of num_attention_heads {heads}")
    head_dim = _positive_int(config, "head_dim", default=hidden // heads)
    if head_dim % 2:
        raise ProfileError(f"head_dim {head_dim} is odd (RoPE needs an even head_dim)")
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ProfileError(f"tie_word_embeddings {tied!r} is not true or false")
    return ModelShape(layers=_positive_int(config, "num_hidden_layers"), hidden=hidden,
                      heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      inter=_positive_int(config, "intermediate_size"),
                      vocab=_positive_int(config, "vocab_size"), tied=tied)


def _positive_int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ProfileError(f"{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{key} {value!r} is not a positive integer")
    return value


def load_config(path: Path) -> ModelShape:
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ProfileError(f"{path}: not a JSON object")
    try:
        return model_shape(config)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None


# ---- batch shapes (pure) -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Chunk:
    new: int
    prefix: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's batch: prefill chunks, then decodes given by their KV length (the new
    token included)."""
    kind: str
    chunks: tuple[Chunk, ...] = ()
    decodes: tuple[int, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.new for chunk in self.chunks)

    @property
    def prefill_prefix(self) -> int:
        return sum(chunk.prefix for chunk in self.chunks)

    @property
    def prefill_pairs(self) -> float:
        """Causal query-key pairs of the chunks: ``sum n * (prefix + (n + 1) / 2)``."""
        return sum(c.new * (c.prefix + (c.new + 1) / 2) for c in self.chunks)

    @property
    def new_tokens(self) -> int:
        return self.prefill_tokens + len(self.decodes)

    @property
    def kv_tokens(self) -> int:
        return self.prefill_prefix + self.prefill_tokens + sum(self.decodes)

    def columns(self) -> dict[str, object]:
        """The grid's shape columns (all of :data:`GRID_COLUMNS` but the times)."""
        return {"kind": self.kind, "n_prefill": len(self.chunks),
                "prefill_tokens": self.prefill_tokens, "prefill_prefix": self.prefill_prefix,
                "prefill_pairs": f"{self.prefill_pairs:.4f}", "n_decode": len(self.decodes),
                "decode_ctx": sum(self.decodes), "new_tokens": self.new_tokens}


@dataclass(frozen=True, slots=True)
class Limits:
    max_tokens: int   # new tokens in one step
    max_context: int  # KV length of one sequence
    max_kv: int       # KV tokens of one step, all sequences together
    random: int       # serving-like random batches
    seed: int

    @property
    def max_decodes(self) -> int:
        return min(512, self.max_tokens)

    def admit(self, batch: Batch) -> bool:
        lengths = [c.prefix + c.new for c in batch.chunks] + list(batch.decodes)
        return (0 < batch.new_tokens <= self.max_tokens and batch.kv_tokens <= self.max_kv
                and all(c.new > 0 for c in batch.chunks) and 0 < min(lengths)
                and max(lengths) <= self.max_context
                and (batch.kind != "mixed" or bool(batch.chunks and batch.decodes)))


def ladder(low: int, high: int) -> list[int]:
    """The 1-1.5-2 series (1, 2, 3, 4, 6, 8, 12, ...) within ``[low, high]``."""
    values, power = [], 1
    while power <= high:
        values += [v for v in dict.fromkeys((power, power * 3 // 2)) if low <= v <= high]
        power *= 2
    return values


def build_grid(limits: Limits) -> list[Batch]:
    """The shapes to time, in order: decode, prefill, mixed, then ``limits.random`` seeded
    serving-like batches; only those within ``limits``."""
    fixed = [*decode_shapes(limits), *prefill_shapes(limits), *mixed_shapes(limits)]
    rng = random.Random(limits.seed)
    randoms = [random_shape(rng, limits) for _ in range(limits.random)]
    return [b for b in dict.fromkeys(fixed) if limits.admit(b)] + randoms


def decode_shapes(limits: Limits) -> list[Batch]:
    contexts = [c for c in (limits.max_context // 4 ** k for k in (3, 2, 1, 0)) if c >= 16]
    return [Batch("decode", decodes=(ctx,) * batch) for batch in ladder(1, limits.max_decodes)
            for ctx in contexts]


def prefill_shapes(limits: Limits) -> list[Batch]:
    tokens, context = limits.max_tokens, limits.max_context
    single = [(Chunk(n),) for n in ladder(16, tokens)]
    cached = [(Chunk(tokens // share, prefix),) for share in (64, 16, 4)
              for prefix in (context // 16, context // 4, context * 3 // 4)]
    several = [(Chunk(tokens // (share * count)),) * count for share in (2, 8)
               for count in (2, 4, 8, 16)]
    return [Batch("prefill", chunks) for chunks in single + cached + several]


def mixed_shapes(limits: Limits) -> list[Batch]:
    tokens, context, most = limits.max_tokens, limits.max_context, limits.max_decodes
    decode_sets = ((most // 64, context // 32), (most // 16, context // 32),
                   (most // 4, context // 32), (most // 2, context // 32),
                   (most // 8, context // 8), (most // 2, context // 128))
    plain = [(Chunk(2 ** k), batch, ctx) for batch, ctx in decode_sets
             for k in range(5, int(math.log2(max(tokens // 2, 1))) + 1)]
    cached = [(Chunk(tokens // 32, context // 4), most // 8, context // 32),
              (Chunk(tokens // 8, context // 4), most // 8, context // 32),
              (Chunk(tokens // 16, context // 8), most // 4, context // 16)]
    return [Batch("mixed", (chunk,), (ctx,) * batch) for chunk, batch, ctx in plain + cached]


def random_shape(rng: random.Random, limits: Limits) -> Batch:
    """A serving-like mix: up to 80% of the decode cap with log-normal contexts and 0-3
    chunks of log-uniform length, half of them after a cached prefix; what overflows
    ``limits`` is left out."""
    def log_uniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(max(low, high)))))

    longest_chunk = max(1, min(4096, limits.max_tokens // 4))
    median_context = math.log(max(16, limits.max_context // 16))
    for _ in range(1000):
        chunks = [Chunk(log_uniform(min(16, longest_chunk), longest_chunk))
                  for _ in range(rng.randint(0, 3))]
        chunks = [Chunk(c.new, log_uniform(16, limits.max_context - c.new))
                  if limits.max_context - c.new >= 16 and rng.random() < 0.5 else c for c in chunks]
        n_decode = 0 if rng.random() < 0.2 else rng.randint(1, max(1, limits.max_decodes * 4 // 5))
        decodes = [min(limits.max_context, max(16, round(rng.lognormvariate(median_context, 1.0))))
                   for _ in range(n_decode)]
        tokens, kv = limits.max_tokens, limits.max_kv
        kept_chunks, kept_decodes = [], []
        for chunk in chunks:
            if chunk.new <= tokens and chunk.prefix + chunk.new <= kv:
                kept_chunks.append(chunk)
                tokens, kv = tokens - chunk.new, kv - chunk.prefix - chunk.new
        for context in decodes:
            if tokens and context <= kv:
                kept_decodes.append(context)
                tokens, kv = tokens - 1, kv - context
        batch = Batch("random", tuple(kept_chunks), tuple(kept_decodes))
        if limits.admit(batch):
            return batch
    raise ProfileError(f"cannot draw a random batch within {asdict(limits)}")


# ---- the model and one step (torch) ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Layer:
    norm_in: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True, slots=True)
class Model:
    shape: ModelShape
    layers: tuple[Layer, ...]
    norm_final: torch.Tensor
    lm_head: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype


def build_model(shape: ModelShape, device: torch.device) -> Model:
    """Random weights: bf16 on CUDA, fp32 on the CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols, device=device, dtype=dtype).normal_(0, cols ** -0.5)

    def norm() -> torch.Tensor:
        return torch.ones(shape.hidden, device=device, dtype=dtype)

    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layers = tuple(Layer(norm(), weight(q_dim + 2 * kv_dim, shape.hidden),
                         weight(shape.hidden, q_dim), norm(), weight(2 * shape.inter, shape.hidden),
                         weight(shape.hidden, shape.inter)) for _ in range(shape.layers))
    return Model(shape, layers, norm(), weight(shape.vocab, shape.hidden))


@dataclass(frozen=True, slots=True)
class KvPool:
    """One layer's worth of KV slots; each layer reads and writes its own window of them."""
    keys: torch.Tensor    # [slots, kv_heads, head_dim]
    values: torch.Tensor
    layer_stride: int     # how far the window moves from one layer to the next (slots)

    def window_start(self, layer: int, length: int) -> int:
        return (layer * self.layer_stride) % (self.keys.shape[0] - length + 1)


def layer_stride(model: Model) -> int:
    """Slots between two layers' windows on CUDA, so no layer hits L2 for another; 0 on the CPU."""
    if model.device.type != "cuda":
        return 0
    slot_bytes = model.shape.kv_heads * model.shape.head_dim * model.dtype.itemsize
    return -(-L2_SPAN_BYTES // slot_bytes)


def build_pool(model: Model, slots: int) -> KvPool:
    stride = layer_stride(model)
    size = (slots + 2 * stride, model.shape.kv_heads, model.shape.head_dim)
    keys, values = (torch.empty(size, device=model.device, dtype=model.dtype).normal_()
                    for _ in range(2))
    return KvPool(keys, values, stride)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a batch sits: query rows (the chunks' new tokens, then one row per decode) and
    KV window slots (each chunk's prefix and new tokens, then each decode's context)."""
    chunk_rows: tuple[tuple[int, int], ...]   # (first query row, rows)
    chunk_keys: tuple[tuple[int, int], ...]   # (first KV slot, KV length)
    decode_keys: tuple[tuple[int, int], ...]
    positions: tuple[int, ...]                # position of each query row
    write_slots: tuple[int, ...]              # where each query row's K and V go
    last_rows: tuple[int, ...]                # each sequence's last query row

    @property
    def prefill_rows(self) -> int:
        return sum(rows for _, rows in self.chunk_rows)

    @property
    def prefill_slots(self) -> int:
        return sum(length for _, length in self.chunk_keys)

    @property
    def slots(self) -> int:
        return self.prefill_slots + sum(length for _, length in self.decode_keys)


def layout(batch: Batch) -> Layout:
    chunk_rows, chunk_keys, decode_keys, positions, writes, last = [], [], [], [], [], []
    row = slot = 0
    for chunk in batch.chunks:
        length = chunk.prefix + chunk.new
        chunk_rows.append((row, chunk.new))
        chunk_keys.append((slot, length))
        positions += range(chunk.prefix, length)
        writes += range(slot + chunk.prefix, slot + length)
        row, slot = row + chunk.new, slot + length
        last.append(row - 1)
    for context in batch.decodes:
        decode_keys.append((slot, context))
        positions.append(context - 1)
        writes.append(slot + context - 1)
        last.append(row)
        row, slot = row + 1, slot + context
    return Layout(*(tuple(part) for part in (chunk_rows, chunk_keys, decode_keys, positions,
                                             writes, last)))


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Attention:
    name: str  # for the metadata
    bind: Callable[[Layout, ModelShape, torch.device], Attend]  # -> (q, keys, values) -> out


def sdpa_attention(lay: Layout, shape: ModelShape, device: torch.device) -> Attend:
    """SDPA one sequence at a time: chunks causal with their cached prefix; a decode's query
    heads of one KV group packed as rows, so each KV head is read once."""
    masks = [causal_lower_right(rows, length) if length > rows else None
             for (_, rows), (_, length) in zip(lay.chunk_rows, lay.chunk_keys)]
    first_decode = lay.prefill_rows

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = []
        for (row, rows), (slot, length), mask in zip(lay.chunk_rows, lay.chunk_keys, masks):
            k, v = keys[slot:slot + length], values[slot:slot + length]
            o = F.scaled_dot_product_attention(heads_first(q[row:row + rows]), heads_first(k),
                                               heads_first(v), attn_mask=mask,
                                               is_causal=mask is None, enable_gqa=True)
            out.append(o[0].transpose(0, 1))
        for i, (slot, length) in enumerate(lay.decode_keys):
            packed = q[first_decode + i].view(1, shape.kv_heads, shape.group, shape.head_dim)
            k, v = keys[slot:slot + length], values[slot:slot + length]
            o = F.scaled_dot_product_attention(packed, heads_first(k), heads_first(v))
            out.append(o.view(1, shape.heads, shape.head_dim))
        return torch.cat(out)
    return attend


def varlen_attention(varlen_attn: Callable) -> Attention:
    """``torch.nn.attention.varlen.varlen_attn``: the chunks in one causal call, the decodes in
    another with the query heads of one KV group packed as rows; no split-KV (``num_splits=1``
    where torch has it), as in the shared grid."""
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    splits = {"num_splits": 1} if "num_splits" in params else {}

    def bind(lay: Layout, shape: ModelShape, device: torch.device) -> Attend:
        def cumulative(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(lengths)], device=device,
                                dtype=torch.int32)

        rows, slots = lay.prefill_rows, lay.prefill_slots
        lengths = [length for _, length in lay.decode_keys]
        group, n_decode = shape.group, len(lengths)
        chunk_q = cumulative([n for _, n in lay.chunk_rows])
        chunk_k = cumulative([n for _, n in lay.chunk_keys])
        decode_q = torch.arange(0, (n_decode + 1) * group, group, device=device, dtype=torch.int32)
        decode_k = cumulative(lengths)
        max_q = max((n for _, n in lay.chunk_rows), default=0)
        max_k = max((n for _, n in lay.chunk_keys), default=0)

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            out = []
            if rows:
                out.append(varlen_attn(q[:rows], keys[:slots], values[:slots], chunk_q, chunk_k,
                                       max_q, max_k, **causal, **gqa, **splits))
            if n_decode:
                packed = q[rows:].view(n_decode, shape.kv_heads, group, shape.head_dim)
                packed = packed.transpose(1, 2).reshape(n_decode * group, shape.kv_heads, -1)
                o = varlen_attn(packed, keys[slots:], values[slots:], decode_q, decode_k, group,
                                max(lengths), **splits)
                out.append(o.view(n_decode, group, shape.kv_heads, -1).transpose(1, 2)
                           .reshape(n_decode, shape.heads, shape.head_dim))
            return torch.cat(out) if len(out) > 1 else out[0]
        return attend
    options = (*causal, *gqa, *splits)
    return Attention(f"torch.nn.attention.varlen.varlen_attn({options}), decode GQA-packed", bind)


SDPA = Attention("scaled_dot_product_attention per sequence, decode GQA-packed", sdpa_attention)


def pick_attention(model: Model) -> Attention:
    """``varlen_attn`` on CUDA when torch has it and it agrees with SDPA on a small batch of
    this model's heads under a CUDA graph; SDPA otherwise (the reason goes in the name)."""
    if model.device.type != "cuda":
        return SDPA
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return Attention(f"{SDPA.name} (this torch has no varlen_attn)", SDPA.bind)
    candidate = varlen_attention(varlen_attn)
    try:
        _check_against_sdpa(candidate, model)
    except Exception as exc:  # noqa: BLE001 -- any failure means: use the fallback
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return Attention(f"{SDPA.name} (varlen_attn failed: {reason})", SDPA.bind)
    return candidate


def _check_against_sdpa(candidate: Attention, model: Model) -> None:
    shape, device = model.shape, model.device
    lay = layout(Batch("random", (Chunk(5, 3), Chunk(7)), (9, 4, 1)))
    def noise(rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, shape.head_dim, device=device, dtype=model.dtype)

    q = noise(len(lay.positions), shape.heads)
    keys, values = noise(lay.slots, shape.kv_heads), noise(lay.slots, shape.kv_heads)
    attend = candidate.bind(lay, shape, device)
    attend(q, keys, values)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, keys, values)
    graph.replay()
    expected = sdpa_attention(lay, shape, device)(q, keys, values)
    if not torch.allclose(out.float(), expected.float(), atol=3e-2, rtol=3e-2):
        raise ValueError("results differ from scaled_dot_product_attention")


def rope_tables(positions: tuple[int, ...], head_dim: int,
                model: Model) -> tuple[torch.Tensor, ...]:
    inverse = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * inverse
    return tuple(t[:, None, :].to(model.device, model.dtype) for t in (angles.cos(), angles.sin()))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def make_step(model: Model, pool: KvPool, attention: Attention,
              batch: Batch) -> Callable[[], torch.Tensor]:
    """One forward step of ``batch`` on static inputs (so a CUDA graph can capture it); returns
    the next token of each sequence."""
    shape, device = model.shape, model.device
    lay = layout(batch)
    rows = len(lay.positions)
    x0 = torch.randn(rows, shape.hidden, device=device, dtype=model.dtype)
    cos, sin = rope_tables(lay.positions, shape.head_dim, model)
    write_slots = torch.tensor(lay.write_slots, device=device)
    last_rows = torch.tensor(lay.last_rows, device=device)
    starts = [pool.window_start(i, lay.slots) for i in range(shape.layers)]
    attend = attention.bind(lay, shape, device)
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (shape.hidden,), weight, eps=1e-5)

    def layer_forward(x: torch.Tensor, layer: Layer, start: int) -> torch.Tensor:
        q, k, v = F.linear(norm(x, layer.norm_in), layer.qkv).split((q_dim, kv_dim, kv_dim), -1)
        q = rope(q.view(rows, shape.heads, -1), cos, sin)
        keys = pool.keys.narrow(0, start, lay.slots)
        values = pool.values.narrow(0, start, lay.slots)
        keys.index_copy_(0, write_slots, rope(k.view(rows, shape.kv_heads, -1), cos, sin))
        values.index_copy_(0, write_slots, v.view(rows, shape.kv_heads, -1))
        x = x + F.linear(attend(q, keys, values).reshape(rows, q_dim), layer.o)
        gate, up = F.linear(norm(x, layer.norm_post), layer.gate_up).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    def step() -> torch.Tensor:
        x = x0
        for layer, start in zip(model.layers, starts):
            x = layer_forward(x, layer, start)
        last = norm(x.index_select(0, last_rows), model.norm_final)
        return F.linear(last, model.lm_head).argmax(-1)
    return step


# ---- timing ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Timing:
    graph_ms: float
    graph_p10: float
    graph_p90: float
    eager_ms: float
    eager_p90: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def wall_ms(step: Callable[[], object], sync: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - started) * 1e3


def time_step(step: Callable[[], torch.Tensor], device: torch.device) -> Timing:
    """CUDA: the median and spread of graph replays (device time) and of eager runs (wall
    clock, launch overhead included). CPU: warm wall-clock runs in both."""
    if device.type != "cuda":
        step()
        eager = [wall_ms(step, lambda: None) for _ in range(EAGER_RUNS)]
        return Timing(statistics.median(eager), percentile(eager, 0.1), percentile(eager, 0.9),
                      statistics.median(eager), percentile(eager, 0.9))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    eager = [wall_ms(step, torch.cuda.synchronize) for _ in range(EAGER_RUNS)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(GRAPH_REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    replays = [start.elapsed_time(end) for start, end in events]
    return Timing(statistics.median(replays), percentile(replays, 0.1), percentile(replays, 0.9),
                  statistics.median(eager), percentile(eager, 0.9))


def is_out_of_memory(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ---- the run -----------------------------------------------------------------------------

@dataclass(slots=True)
class Stop:
    """Why the run ends after the shape in progress (``None``: it goes on)."""
    reason: str | None = None


def stop_on_signals(stop: Stop) -> Callable[[], None]:
    """SIGINT and SIGTERM set ``stop.reason``; a second one acts as before. Returns the undo."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def request(signum: int, frame: object) -> None:
        stop.reason = signal.Signals(signum).name
        restore()

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    for sig in signals:
        signal.signal(sig, request)
    return restore


def profile(grid: list[Batch], measure: Callable[[Batch], Timing], out: Path, meta: dict,
            stop: Stop, started: float, max_seconds: float | None) -> dict:
    """Times each shape of ``grid``, appending its row to ``out`` (flushed) and refreshing the
    metadata beside it, until the grid is done, ``max_seconds`` have passed since ``started``
    (monotonic) or ``stop.reason`` is set; a shape out of device memory is skipped and noted.
    Returns the final metadata."""
    done, skipped = 0, []

    def progress(status: str, stopped: str | None = None) -> dict:
        return {**meta, "shapes": done, "planned": len(grid), "skipped": skipped,
                "seconds": round(time.monotonic() - started, 1), "status": status,
                "stopped": stopped}

    write_json(out.with_suffix(".json"), progress("running"))
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(GRID_COLUMNS)
        handle.flush()
        for index, batch in enumerate(grid):
            if index and max_seconds is not None and time.monotonic() - started >= max_seconds:
                stop.reason = stop.reason or f"max-seconds ({max_seconds:g} s)"
            if stop.reason:
                break
            try:
                timing = measure(batch)
            except KeyboardInterrupt:
                stop.reason = "SIGINT"
                break
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                timing = None
            if timing is None:
                skipped.append({**batch.columns(), "error": "out of memory"})
                torch.cuda.empty_cache()
            else:
                times = {name: f"{value:.4f}" for name, value in asdict(timing).items()}
                row = {**batch.columns(), **times}
                writer.writerow([row[name] for name in GRID_COLUMNS])
                handle.flush()
                done += 1
            write_json(out.with_suffix(".json"), progress("running"))
    early = done + len(skipped) < len(grid)
    final = progress("stopped early", stop.reason) if early else progress("complete")
    write_json(out.with_suffix(".json"), final)
    return final


def write_json(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def pick_device(name: str | None) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ProfileError(f"--device cuda: CUDA is not available to torch {torch.__version__}; "
                           "use --device cpu")
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def requested_limits(args: argparse.Namespace, device: torch.device) -> Limits:
    names = ("max_tokens", "max_context", "max_kv", "random")
    defaults = dict(zip(names, DEFAULT_LIMITS[device.type]))
    chosen = {key: default if getattr(args, key) is None else getattr(args, key)
              for key, default in defaults.items()}
    return Limits(**chosen, seed=args.seed)


def fit_to_memory(limits: Limits, model: Model) -> Limits:
    """``limits`` with ``max_kv`` cut to the KV slots that fit in free device memory beside
    the largest step's activations (unchanged on the CPU)."""
    if model.device.type != "cuda":
        return limits
    shape, itemsize = model.shape, model.dtype.itemsize
    free, _ = torch.cuda.mem_get_info(model.device)
    row_bytes = itemsize * (4 * shape.hidden + 2 * (shape.heads + shape.kv_heads) * shape.head_dim
                            + 3 * shape.inter)
    spare = free - 3 * limits.max_tokens * row_bytes - (2 << 30)
    slots = spare // (2 * shape.kv_heads * shape.head_dim * itemsize) - 2 * layer_stride(model)
    if slots < 1:
        raise ProfileError(f"no room for a KV cache: {free / 2**30:.1f} GiB free after the "
                           f"weights; lower --max-tokens ({limits.max_tokens})")
    return replace(limits, max_kv=min(limits.max_kv, slots))


def describe(name: str, model: Model, attention: Attention, limits: Limits, pool: KvPool,
             args: argparse.Namespace) -> dict:
    cuda = model.device.type == "cuda"
    props = torch.cuda.get_device_properties(model.device) if cuda else None
    return {
        "model": name, "config": asdict(model.shape),
        "gpu": props.name if cuda else None,
        "cpu": None if cuda else (platform.processor() or platform.machine()),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "dtype": str(model.dtype).removeprefix("torch."), "attention": attention.name,
        "graph": (f"CUDA graph: graph_ms is the median of {GRAPH_REPLAYS} replays, device time "
                  "(CUDA events)") if cuda else CPU_GRAPH_NOTE,
        "eager": f"median and p90 of {EAGER_RUNS} warm runs, wall clock, launch overhead included",
        "sm_count": props.multi_processor_count if cuda else None,
        "seed": limits.seed,
        "options": {"max_tokens": args.max_tokens, "max_context": args.max_context,
                    "max_kv": args.max_kv, "random": args.random, "max_seconds": args.max_seconds},
        "limits": asdict(limits), "kv_pool_slots": pool.keys.shape[0],
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def run(args: argparse.Namespace, stop: Stop) -> dict:
    started = time.monotonic()
    if args.out.suffix == ".json":
        raise ProfileError(f"--out {args.out}: the grid is a CSV (its metadata goes beside it "
                           "as .json)")
    device = pick_device(args.device)
    shape = TINY if args.model == "tiny" else load_config(args.config)
    name = args.name or ("tiny" if args.model else args.config.resolve().parent.name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        try:
            model = build_model(shape, device)
        except torch.OutOfMemoryError:
            raise ProfileError(f"the weights of {name} do not fit in {device} memory") from None
        limits = fit_to_memory(requested_limits(args, device), model)
        grid = build_grid(limits)
        if not grid:
            raise ProfileError(f"no batch shape fits the limits {asdict(limits)}")
        pool = build_pool(model, max(batch.kv_tokens for batch in grid))
        attention = pick_attention(model)
        meta = describe(name, model, attention, limits, pool, args)

        def measure(batch: Batch) -> Timing:
            return time_step(make_step(model, pool, attention, batch), device)
        return profile(grid, measure, args.out, meta, stop, started, args.max_seconds)


def _at_least(minimum: float, convert: Callable[[str], float] = int) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}")
        return value
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a Hugging Face config.json of a dense decoder")
    source.add_argument("--model", choices=("tiny",),
                        help="a built-in model (tiny: 2 layers, hidden 64)")
    parser.add_argument("--out", type=Path, required=True,
                        help="the grid CSV; the run's metadata goes beside it (.json)")
    parser.add_argument("--name",
                        help="the model's name in the metadata (default: the config's folder)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    cuda, cpu = DEFAULT_LIMITS["cuda"], DEFAULT_LIMITS["cpu"]
    parser.add_argument("--max-tokens", type=_at_least(1),
                        help=f"new tokens in one step (default {cuda[0]} on cuda, {cpu[0]} on cpu)")
    parser.add_argument("--max-context", type=_at_least(1),
                        help=f"KV length of one sequence (default {cuda[1]} / {cpu[1]})")
    parser.add_argument("--max-kv", type=_at_least(1),
                        help=f"KV tokens of one step, cut to what memory holds "
                             f"(default {cuda[2]} / {cpu[2]})")
    parser.add_argument("--random", type=_at_least(0),
                        help=f"serving-like random batches (default {cuda[3]} / {cpu[3]})")
    parser.add_argument("--seed", type=int, default=0, help="for the random batches and weights")
    parser.add_argument("--max-seconds", type=_at_least(0, float),
                        help="stop after the shape in progress once this many seconds have passed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = Stop()
    restore_signals = stop_on_signals(stop)
    try:
        meta = run(args, stop)
    except ProfileError as exc:
        print(f"step_profiler: error: {exc}", file=sys.stderr)
        return 2
    finally:
        restore_signals()
    print(f"{meta['shapes']} of {meta['planned']} shapes in {meta['seconds']} s ({meta['status']}"
          f"{': ' + meta['stopped'] if meta['stopped'] else ''}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
