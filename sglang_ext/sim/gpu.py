"""The simulator's GPU: a physically grounded roofline step-time model with noise and stalls.

This is deliberately *not* the scheduler's predictor ``a + b * new_tokens + c * context``.  The
scheduler has to learn its coefficients online from the noisy times this model produces; if the
simulated GPU were the linear model itself, prediction would be perfect and every time-budget
result would be flattering.

Model
-----
One forward step processes ``new_tokens = prefill_tokens + decode_requests`` tokens.  Its time is
a sum of per-kernel-class rooflines (each ``max(compute time, memory time)``) plus overheads::

    F = bf16_tflops * 1e12 * compute_efficiency          # achieved FLOP/s
    B = hbm_tb_s   * 1e12 * bandwidth_efficiency         # achieved bytes/s

    # linear layers (QKV/O projections, MLP, LM head): every weight read once per step
    linear_flops = 2 * num_params * new_tokens
    linear_bytes = weight_bytes                          # num_params * bytes_per_param
    t_linear     = max(linear_flops / F, linear_bytes / B)

    # attention: QK^T and PV are 2 FLOPs each per (query, key, head-dim element, head)
    attn_flops = 4 * num_layers * num_attention_heads * head_dim
                   * (prefill_attention_pairs + decode_context)
    attn_bytes = kv_bytes_per_token * (prefill_context + decode_context + new_tokens)
                                                         # read cached KV, write the new KV
    t_attn     = max(attn_flops / F, attn_bytes / B)

    t_ideal = step_overhead_ms / 1e3
            + per_request_overhead_us / 1e6 * (prefill_requests + decode_requests)
            + t_linear + t_attn

The ``max`` makes the step time non-linear in the token count: a small (decode) batch costs the
weight-read time no matter how many tokens it carries, until ``new_tokens`` crosses the ridge
point ``F / B * bytes_per_param / 2`` (~230 tokens for Llama-3.1-8B on an H100, ~30 on an H20)
where the linear layers become compute-bound; and prefill attention grows quadratically in the
chunk length.

Optional refinements
--------------------
Optional profile fields (``configs/profiles/README.md``) refine the model for a profile
calibrated against measured step times (``sglang_ext.sim.fitting.profile_fit``).  Their defaults give
the model above exactly::

    # embedding rows are looked up, the LM head runs on the last token of each sequence
    P_tok  = num_params - embedding_params - lm_head_params
    t_linear = max(2 * P_tok * new_tokens / F, P_tok * bytes_per_param / B)
             + max(2 * lm_head_params * sequences / F, lm_head_params * bytes_per_param / B)

    # attention kernels have their own efficiencies (default: the linear layers')
    Fa = bf16_tflops * 1e12 * attention_compute_efficiency
    Ba = hbm_tb_s   * 1e12 * attention_bandwidth_efficiency

    # occupancy: a kernel with fewer work tiles than attention_saturation_tiles (S) reaches
    # only tiles / S of its roof (a tile streams at its SM's share); S = 0 turns this off
    prefill_tiles = num_attention_heads * max(prefill_requests,
                                              prefill_tokens / attention_tile_queries)
    decode_tiles  = num_kv_heads * decode_requests       # one tile per (sequence, KV head)
    u(tiles) = min(1, tiles / S)

    attention_kernels = "batch":  one kernel, one roofline over the summed work, u(all tiles)
    attention_kernels = "split":  t_attn = max(prefill compute, prefill memory) / u(prefill_tiles)
                                         + max(decode compute, decode memory) / u(decode_tiles)

    t_ideal += prefill_overhead_ms / 1e3   if the step has any prefill chunk

Measured time::

    t_measured = t_ideal * exp(noise_sigma * Z - noise_sigma**2 / 2)   # Z ~ N(0, 1), mean 1
               (+ U(stall_ms_min, stall_ms_max) / 1e3  with probability stall_probability)

drawn from a seeded ``numpy.random.Generator``; every call consumes exactly three draws, so a
seed reproduces the same noise sequence for the same sequence of calls.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.profile import HardwareProfile

__all__ = ["RooflineGpu", "StepBreakdown", "StepShape"]


class StepBreakdown(NamedTuple):
    """Components of :meth:`RooflineGpu.ideal_step_s`, all in seconds."""

    overhead_s: float  # fixed + per-request overhead
    linear_s: float  # max(linear_compute_s, linear_memory_s)
    attention_s: float  # max(attention_compute_s, attention_memory_s)
    linear_compute_s: float
    linear_memory_s: float
    attention_compute_s: float
    attention_memory_s: float

    @property
    def total_s(self) -> float:
        return self.overhead_s + self.linear_s + self.attention_s

    @property
    def linear_bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof limits the linear layers."""
        return "compute" if self.linear_compute_s >= self.linear_memory_s else "memory"

    @property
    def attention_bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof limits attention."""
        return "compute" if self.attention_compute_s >= self.attention_memory_s else "memory"


class RooflineGpu:
    """Roofline step-time model of one GPU serving one model (see the module docstring)."""

    __slots__ = (
        "_attn_flops_per_pair",
        "_attn_inv_bw",
        "_attn_inv_flops",
        "_head_flops_per_sequence",
        "_head_weight_s",
        "_inv_bw",
        "_inv_flops",
        "_kv_bytes_per_token",
        "_kv_heads",
        "_linear_flops_per_token",
        "_noise_shift",
        "_overhead_s",
        "_per_request_s",
        "_prefill_overhead_s",
        "_query_heads",
        "_rng",
        "_saturation_tiles",
        "_sigma",
        "_split_attention",
        "_stall_min_s",
        "_stall_p",
        "_stall_span_s",
        "_tile_queries",
        "_weight_s",
        "profile",
        "seed",
        "stalls",
        "steps",
    )

    def __init__(self, profile: HardwareProfile, seed: int = 0) -> None:
        self.profile = profile
        self.seed = seed
        self.stalls = 0  # stalls injected so far
        self.steps = 0  # measure_step_s calls so far
        self._rng = np.random.default_rng(seed)
        m, g, r = profile.model, profile.gpu, profile.runtime
        self._overhead_s = r.step_overhead_ms / 1e3
        self._per_request_s = r.per_request_overhead_us / 1e6
        self._prefill_overhead_s = r.prefill_overhead_ms / 1e3
        self._inv_flops = 1.0 / g.effective_flops
        self._inv_bw = 1.0 / g.effective_bandwidth
        self._linear_flops_per_token = 2.0 * m.per_token_params
        self._weight_s = m.per_token_params * m.bytes_per_param * self._inv_bw
        self._head_flops_per_sequence = 2.0 * m.lm_head_params
        self._head_weight_s = m.lm_head_params * m.bytes_per_param * self._inv_bw
        self._attn_flops_per_pair = 4.0 * m.num_layers * m.num_attention_heads * m.head_dim
        self._attn_inv_flops = 1.0 / g.effective_attention_flops
        self._attn_inv_bw = 1.0 / g.effective_attention_bandwidth
        self._kv_bytes_per_token = m.kv_bytes_per_token
        self._query_heads = m.num_attention_heads
        self._kv_heads = m.num_kv_heads
        self._saturation_tiles = g.attention_saturation_tiles
        self._tile_queries = g.attention_tile_queries
        self._split_attention = r.attention_kernels == "split"
        self._sigma = r.noise_sigma
        self._noise_shift = -0.5 * r.noise_sigma * r.noise_sigma  # makes E[noise] = 1
        self._stall_p = r.stall_probability
        self._stall_min_s = r.stall_ms_min / 1e3
        self._stall_span_s = (r.stall_ms_max - r.stall_ms_min) / 1e3

    # ---------------------------------------------------------------- deterministic model
    def breakdown(self, shape: StepShape) -> StepBreakdown:
        """Per-component times (seconds) of the ideal step; raises ValueError on a bad shape."""
        new_tokens = shape.prefill_tokens + shape.decode_requests
        if (
            shape.prefill_tokens < 0
            or shape.decode_requests < 0
            or shape.prefill_context < 0
            or shape.decode_context < 0
            or shape.prefill_requests < 0
            or shape.prefill_attention_pairs < 0
        ):
            raise ValueError(f"negative quantity in step shape {shape}")
        if new_tokens <= 0:
            raise ValueError(f"empty step (no new tokens): {shape}")
        # A shape built without a chunk count still has one chunk if it has prefill tokens.
        chunks = shape.prefill_requests or (1 if shape.prefill_tokens else 0)
        lin_c = self._linear_flops_per_token * new_tokens * self._inv_flops
        lin_m = self._weight_s
        linear = max(lin_m, lin_c)
        if self._head_flops_per_sequence:
            sequences = chunks + shape.decode_requests
            head_c = self._head_flops_per_sequence * sequences * self._inv_flops
            head_m = self._head_weight_s
            linear += max(head_m, head_c)
            lin_c += head_c
            lin_m += head_m
        if self._split_attention:
            att_s, att_c, att_m = self._split_attention_s(shape, chunks)
        else:
            att_s, att_c, att_m = self._batch_attention_s(shape, chunks, new_tokens)
        overhead = self._overhead_s + self._per_request_s * (
            shape.prefill_requests + shape.decode_requests
        )
        if shape.prefill_tokens:
            overhead += self._prefill_overhead_s
        return StepBreakdown(
            overhead_s=overhead,
            linear_s=linear,
            attention_s=att_s,
            linear_compute_s=lin_c,
            linear_memory_s=lin_m,
            attention_compute_s=att_c,
            attention_memory_s=att_m,
        )

    def _occupancy(self, tiles: float) -> float:
        """Fraction of the attention roof that ``tiles`` work tiles reach."""
        if not self._saturation_tiles or tiles >= self._saturation_tiles:
            return 1.0
        return tiles / self._saturation_tiles

    def _prefill_tiles(self, shape: StepShape, chunks: int) -> float:
        return self._query_heads * max(chunks, shape.prefill_tokens / self._tile_queries)

    def _batch_attention_s(
        self, shape: StepShape, chunks: int, new_tokens: int
    ) -> tuple[float, float, float]:
        """One attention kernel over the whole step: (time, compute time, memory time)."""
        att_c = (
            self._attn_flops_per_pair
            * (shape.prefill_attention_pairs + shape.decode_context)
            * self._attn_inv_flops
        )
        att_m = (
            self._kv_bytes_per_token
            * (shape.prefill_context + shape.decode_context + new_tokens)
            * self._attn_inv_bw
        )
        if self._saturation_tiles:
            tiles = self._kv_heads * shape.decode_requests
            if shape.prefill_tokens:
                tiles += self._prefill_tiles(shape, chunks)
            occupancy = self._occupancy(tiles)
            att_c /= occupancy
            att_m /= occupancy
        return max(att_m, att_c), att_c, att_m

    def _split_attention_s(self, shape: StepShape, chunks: int) -> tuple[float, float, float]:
        """Prefill and decode attention as separate kernels: (time, compute time, memory time)."""
        pre_c = pre_m = dec_c = dec_m = 0.0
        if shape.prefill_tokens:
            occupancy = self._occupancy(self._prefill_tiles(shape, chunks))
            pre_c = (
                self._attn_flops_per_pair
                * shape.prefill_attention_pairs
                * self._attn_inv_flops
                / occupancy
            )
            pre_m = (
                self._kv_bytes_per_token
                * (shape.prefill_context + shape.prefill_tokens)
                * self._attn_inv_bw
                / occupancy
            )
        if shape.decode_requests:
            occupancy = self._occupancy(self._kv_heads * shape.decode_requests)
            dec_c = (
                self._attn_flops_per_pair * shape.decode_context * self._attn_inv_flops / occupancy
            )
            dec_m = (
                self._kv_bytes_per_token
                * (shape.decode_context + shape.decode_requests)
                * self._attn_inv_bw
                / occupancy
            )
        return max(pre_c, pre_m) + max(dec_c, dec_m), pre_c + dec_c, pre_m + dec_m

    def ideal_step_s(self, shape: StepShape) -> float:
        """Noise-free step time in seconds.  ValueError for an empty or negative shape."""
        return self.breakdown(shape).total_s

    # ---------------------------------------------------------------- stochastic model
    def measure_step_s(self, shape: StepShape) -> float:
        """One observed step time in seconds: ideal * lognormal noise, plus a rare stall.

        Always > 0.  Consumes exactly three draws from the seeded generator per call.
        """
        t = self.ideal_step_s(shape)
        rng = self._rng
        z = float(rng.standard_normal())
        u_stall, u_len = rng.random(2).tolist()
        if self._sigma > 0.0:
            t *= math.exp(self._sigma * z + self._noise_shift)
        self.steps += 1
        if u_stall < self._stall_p:
            self.stalls += 1
            t += self._stall_min_s + self._stall_span_s * u_len
        return t

    def __repr__(self) -> str:
        return f"RooflineGpu(profile={self.profile.name!r}, seed={self.seed}, stalls={self.stalls})"
