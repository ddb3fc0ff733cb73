"""Fit a simulator hardware profile to a measured step-time grid; write it and its report.

    python -m benchmarks.gpu.fit_measured_profile --grid ../shared/data/gpu/llama3.1-8b-h100.csv \\
        --base llama3.1-8b-h100 --name llama3.1-8b-h100-measured \\
        --out-profile configs/profiles/llama3.1-8b-h100-measured.toml \\
        --out-doc docs/bench/measured_profile.md

The fit is :func:`sglang_ext.sim.fitting.profile_fit.fit_profile`.  This script reads the inputs,
takes the grid's model from its JSON sidecar (``<grid>.json``; see
:func:`sglang_ext.sim.fitting.grid_fit.base_for_grid`), and renders the report: the fitted
values against the base's, the residuals by kind of step, three reference steps, and what each
refinement of the roofline is worth (the fit repeated without it).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.fitting.grid_fit import base_for_grid, read_grid_meta
from sglang_ext.sim.fitting.profile_fit import (
    FIT_FIELDS,
    ProfileFit,
    Residuals,
    fit_profile,
    fitted_profile_toml,
    residuals,
    step_errors,
)
from sglang_ext.sim.fitting.step_grid import GridRow, read_grid
from sglang_ext.sim.gpu import RooflineGpu
from sglang_ext.sim.profile import (
    HardwareProfile,
    bundled_profile_path,
    load_profile,
)

#: (label, shape): the reference steps the report compares.
REFERENCE_STEPS = (
    ("decode, batch 1 at 1k context", StepShape.from_requests((), [1024])),
    ("prefill of 2048 tokens", StepShape.from_requests([(2048, 0)])),
    ("decode, 256 requests at 1k context", StepShape.from_requests((), [1024] * 256)),
)

#: (label, field to hold at its default, fit keyword overrides, use the vocabulary split)
ABLATIONS = (
    ("all refinements", None, {}, True),
    ("LM head on every token, embedding multiplied", None, {}, False),
    ("attention compute efficiency = linear layers'", "gpu.attention_compute_efficiency", {}, True),
    ("attention bandwidth efficiency = weights'", "gpu.attention_bandwidth_efficiency", {}, True),
    ("no attention occupancy limit", "gpu.attention_saturation_tiles", {}, True),
    ("no prefill overhead", "runtime.prefill_overhead_ms", {}, True),
    ("one attention kernel per step (batch)", None, {"attention_kernels": "batch"}, True),
    ("none: the original fields only", "new", {"attention_kernels": "batch"}, False),
)

_ORIGINAL_FIELDS = {
    "gpu.compute_efficiency", "runtime.step_overhead_ms", "runtime.per_request_overhead_us"
}

#: (dotted field, unit): the values the report shows, base against fitted.
SHOWN_FIELDS = (
    ("gpu.compute_efficiency", "of bf16_tflops"),
    ("gpu.bandwidth_efficiency", "of hbm_tb_s"),
    ("gpu.attention_compute_efficiency", "of bf16_tflops"),
    ("gpu.attention_bandwidth_efficiency", "of hbm_tb_s"),
    ("gpu.attention_saturation_tiles", "thread blocks"),
    ("gpu.attention_tile_queries", "query rows"),
    ("runtime.step_overhead_ms", "ms"),
    ("runtime.per_request_overhead_us", "µs"),
    ("runtime.prefill_overhead_ms", "ms"),
    ("runtime.attention_kernels", ""),
    ("model.embedding_params", "parameters"),
    ("model.lm_head_params", "parameters"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True, type=Path, help="measured grid CSV")
    parser.add_argument("--base", required=True,
                        help="profile to start from: a bundled name or a TOML path")
    parser.add_argument("--name", required=True, help="name of the fitted profile")
    parser.add_argument("--out-profile", required=True, type=Path, help="TOML to write")
    parser.add_argument("--out-doc", required=True, type=Path, help="markdown report to write")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.gpu.fit_measured_profile",
                          *(argv or sys.argv[1:])])

    rows = read_grid(args.grid)
    meta = read_grid_meta(args.grid)
    base = _load_base(args.base)
    fit_base = base_for_grid(base, meta)
    fit = fit_profile(rows, fit_base, args.name)
    args.out_profile.write_text(fitted_profile_toml(fit, grid=str(args.grid), command=command))
    args.out_doc.write_text(render_report(fit, base, rows, meta, grid=str(args.grid),
                                          profile_path=str(args.out_profile), command=command))
    overall = fit.residual("all")
    print(f"{args.out_profile}: median error {overall.median_signed_pct:+.1f}%, "
          f"median |error| {overall.median_abs_pct:.1f}% over {fit.rows} rows; "
          f"report {args.out_doc}")
    return 0


def _load_base(name_or_path: str) -> HardwareProfile:
    path = Path(name_or_path)
    return load_profile(path if path.is_file() else bundled_profile_path(name_or_path))


# ----------------------------------------------------------------------------------- report


def render_report(fit: ProfileFit, base: HardwareProfile, rows: list[GridRow], meta: dict,
                  *, grid: str, profile_path: str, command: str) -> str:
    counts = ", ".join(f"{r.rows} {r.kind}" for r in fit.residuals if r.kind != "all")
    device = " / ".join(str(meta[k]) for k in ("gpu", "torch", "cuda") if k in meta)
    lines = [
        "# A simulator profile calibrated against a measured step-time grid",
        "",
        f"`{profile_path}` is the profile `{base.name}` with its efficiencies and overheads "
        f"fitted to `{grid}`: {fit.rows} forward steps ({counts}) of a "
        f"{base.model.name}-shaped model"
        + (f" measured on {device}" if device else "")
        + " (device time of a CUDA-graph replay, `graph_ms`; the grid's README says how).",
        "",
        f"Regenerate: `{command}`",
        "",
        "## Method",
        "",
        "The simulator's GPU stays a roofline (`sglang_ext/sim/gpu.py`): a sum of "
        "per-kernel-class `max(compute time, memory time)` terms plus overheads.  The fit "
        "(`sglang_ext.sim.fitting.profile_fit.fit_profile`) only moves its physical rates and "
        "overheads, so the scheduler's predictors still face a GPU they were not written from.  "
        "The grid showed what the plain roofline lacks (the evidence and the ablation below); "
        "each is an optional profile field whose default is the old model, so the hand-written "
        "profiles give the same step times:",
        "",
        "* **LM head on the last token of each sequence, embedding looked up** "
        "(`model.lm_head_params`, `model.embedding_params`, from the grid's `config.vocab` x "
        "`hidden_size`; set, not fitted): a decode pays the LM head, a prefill token does not.  It "
        "makes `compute_efficiency` a rate on the FLOPs the GPU really does; on this grid it "
        "moves the fit little.",
        "* **Attention efficiencies of their own** (`gpu.attention_compute_efficiency`, "
        "`gpu.attention_bandwidth_efficiency`): FA2's prefill attention runs far below the GEMMs' "
        "rate, and decode attention streams KV slower than the weights stream.",
        "* **Attention occupancy** (`gpu.attention_saturation_tiles`, "
        "`gpu.attention_tile_queries`): "
        "FA2 without split-KV runs one thread block per (sequence, KV head) for a decode and per "
        "(128-query tile, head) for a prefill chunk; with fewer blocks than the GPU holds, each "
        "streams at its SM's share, so a batch-1 decode at 16k context reads its KV at a small "
        "fraction of the bandwidth, and a 256-token chunk after a long prefix computes at a "
        "fraction of the attention rate.",
        "* **Separate prefill and decode attention kernels** (`runtime.attention_kernels = "
        "\"split\"`), each with its own roofline and occupancy, as the grid's engine runs them.",
        "* **A prefill overhead** (`runtime.prefill_overhead_ms`): a step with a prefill chunk "
        "costs a fixed extra (its own attention kernels per layer), whatever the number of chunks.",
        "",
        "Fit: `scipy.optimize.least_squares` on log(model / measured) over all rows, soft-L1 loss "
        "with a 2 % knee (least squares for small errors, absolute log error for large ones, so "
        "the few shapes a sum-only step shape cannot describe do not drag the rest), from the "
        "base's values; deterministic.  Fitted values are rounded to four significant digits and "
        "every number below is the rounded profile's.  `gpu.bandwidth_efficiency` is kept at the "
        "base's copy-benchmark value: on a grid the weight-read time of a small step and the step "
        "overhead appear only as their sum.  Noise, stall and memory fields are the base's.",
        "",
        "## Fitted values",
        "",
        "| field | base | measured profile | how | unit |",
        "|---|---|---|---|---|",
    ]
    lines += _value_rows(base, fit)
    lines += [
        "",
        "## Residuals by kind",
        "",
        "Error = (model − measured) / measured of the noise-free step time.  *Worst* is the "
        "signed error of largest magnitude.",
        "",
        "| kind | rows | measured profile: median | median abs | p90 abs | worst | "
        f"`{base.name}`: median | median abs | p90 abs | worst |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    old = {r.kind: r for r in residuals(base, rows)}
    for new in fit.residuals:
        lines.append(f"| {new.kind} | {new.rows} | {_stats(new)} | {_stats(old[new.kind])} |")
    lines += [
        "",
        "## Reference steps",
        "",
        f"| step | measured (grid) | `{fit.profile.name}` | `{base.name}` |",
        "|---|---|---|---|",
    ]
    lines += _reference_rows(fit.profile, base, rows)
    lines += _evidence(fit.profile, rows)
    lines += [
        "",
        "## What each refinement is worth",
        "",
        "The same fit with one refinement taken out (that field held at its default, or the "
        "layout / model split reverted).  Mean abs log error is the quantity a robust fit "
        "minimises; the medians are signed.",
        "",
        "| fit | mean abs log error | median abs | p90 abs | decode median | prefill median "
        "| mixed median | random median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += _ablation_rows(rows, base, fit.profile.name, meta)
    lines += [
        "",
        "## Largest errors",
        "",
        "| kind | chunks | prefill tokens | prefix | decodes | decode context | measured ms "
        "| model ms | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += _worst_rows(fit.profile, rows, count=8)
    lines += [
        "",
        "What the roofline cannot express, by construction:",
        "",
        "* **Long-tailed decode contexts.**  A step shape carries the sum of the decodes' "
        "contexts, not the longest one.  With split-KV off, the longest sequence's blocks run "
        "on alone at the end of each layer, so a serving-like batch with a few long contexts is "
        "slower than the mean context predicts: the `random` rows with many decodes are the "
        "under-predicted ones." + _uniform_fit_note(rows, fit, meta),
        "* **Short chunks after a long prefix.**  A prefill tile computes 128 query rows even "
        "when the chunk has fewer, and walks the whole prefix; the step shape's causal pair "
        "count does not see the padding.",
        "* **The knee of the linear layers.**  Real GEMMs leave the memory roof gradually "
        "(64–512 tokens); the roofline's `max` turns sharply, so steps near the ridge carry "
        "a few percent either way.",
        "",
        "The grid is an upper bound on an SGLang server's device time (plain PyTorch, FA2, no "
        "fused kernels; see the grid's README).  Use this profile to test the scheduler against "
        "a GPU whose curve has the measured shape, not as a prediction of SGLang's throughput.",
        "",
    ]
    return "\n".join(lines)


def _evidence(profile: HardwareProfile, rows: list[GridRow]) -> list[str]:
    """Rates read straight off the grid (differences of measured times), and the same
    differences of the fitted model."""
    gpu = RooflineGpu(profile)
    kv_bytes = profile.model.kv_bytes_per_token
    lines = [
        "",
        "## Evidence: attention rates read off the grid",
        "",
        "Decode KV read rate at a fixed batch size: Δ time / Δ KV bytes between the batch's "
        "shortest and longest context in the grid.  FA2 runs one thread block per (sequence, "
        "KV head), so a small batch reads its KV far below the bandwidth roof.",
        "",
        "| decodes | thread blocks | contexts per sequence | measured TB/s | model TB/s |",
        "|---|---|---|---|---|",
    ]
    decodes: dict[int, list[GridRow]] = {}
    for row in rows:
        if row.kind == "decode":
            decodes.setdefault(row.n_decode, []).append(row)
    for batch, group in sorted(decodes.items()):
        if len(group) < 2:
            continue
        short = min(group, key=lambda r: r.decode_ctx)
        long = max(group, key=lambda r: r.decode_ctx)
        moved = (long.decode_ctx - short.decode_ctx) * kv_bytes
        measured = moved / (long.seconds - short.seconds) / 1e12
        modelled = moved / (gpu.ideal_step_s(long.shape) - gpu.ideal_step_s(short.shape)) / 1e12
        lines.append(f"| {batch} | {batch * profile.model.num_kv_heads} | "
                     f"{short.decode_ctx // batch}–{long.decode_ctx // batch} | "
                     f"{measured:.2f} | {modelled:.2f} |")
    lines += [
        "",
        "Prefill attention rate after a cached prefix: Δ time / Δ attention FLOPs between a "
        "single chunk with the prefix and the same chunk without one.  A short chunk has few "
        "(128-query tile, head) blocks, so it computes its attention at a fraction of the rate.",
        "",
        "| chunk tokens | prefix | thread blocks | measured TFLOP/s | model TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    m = profile.model
    flops_per_pair = 4.0 * m.num_layers * m.num_attention_heads * m.head_dim
    alone = {r.prefill_tokens: r for r in rows
             if r.kind == "prefill" and r.n_prefill == 1 and r.prefill_prefix == 0}
    for row in rows:
        base = alone.get(row.prefill_tokens)
        if row.kind != "prefill" or row.n_prefill != 1 or not row.prefill_prefix or base is None:
            continue
        flops = (row.prefill_pairs - base.prefill_pairs) * flops_per_pair
        measured = flops / (row.seconds - base.seconds) / 1e12
        modelled = flops / (gpu.ideal_step_s(row.shape) - gpu.ideal_step_s(base.shape)) / 1e12
        tiles = -(-row.prefill_tokens // profile.gpu.attention_tile_queries)  # rounded up
        blocks = m.num_attention_heads * tiles
        lines.append(f"| {row.prefill_tokens} | {row.prefill_prefix} | {blocks} | "
                     f"{measured:.0f} | {modelled:.0f} |")
    return lines


def _value_rows(base: HardwareProfile, fit: ProfileFit) -> list[str]:
    rows = []
    for dotted, unit in SHOWN_FIELDS:
        section, key = dotted.split(".")
        before, after = _shown(base, section, key), _shown(fit.profile, section, key)
        how = "fitted" if dotted in fit.fitted else "kept" if before == after else "set"
        rows.append(f"| `{dotted}` | {before} | {after} | {how} | {unit} |")
    return rows


def _shown(profile: HardwareProfile, section: str, key: str) -> str:
    value = getattr(getattr(profile, section), key)
    if value is None:  # an unset attention efficiency is the linear layers' one
        linear = key.removeprefix("attention_")
        return f"{getattr(profile.gpu, linear):g} (= {linear})"
    if key == "attention_saturation_tiles" and not value:
        return "0 (off)"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, float) and value >= 1e6 and value.is_integer():
        return f"{value:,.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _stats(r: Residuals) -> str:
    return (f"{r.median_signed_pct:+.1f}% | {r.median_abs_pct:.1f}% | {r.p90_abs_pct:.1f}% "
            f"| {r.worst_pct:+.1f}%")


def _reference_rows(fitted: HardwareProfile, base: HardwareProfile,
                    rows: list[GridRow]) -> list[str]:
    new_gpu, old_gpu = RooflineGpu(fitted), RooflineGpu(base)
    lines = []
    for label, shape in REFERENCE_STEPS:
        measured = next((r.graph_ms for r in rows if r.shape == shape), None)
        new_ms, old_ms = new_gpu.ideal_step_s(shape) * 1e3, old_gpu.ideal_step_s(shape) * 1e3
        if measured is None:
            lines.append(f"| {label} | — | {new_ms:.1f} ms | {old_ms:.1f} ms |")
        else:
            lines.append(f"| {label} | {measured:.1f} ms | {new_ms:.1f} ms "
                         f"({new_ms / measured - 1:+.0%}) | {old_ms:.1f} ms "
                         f"({old_ms / measured - 1:+.0%}) |")
    return lines


def _ablation_rows(rows: list[GridRow], base: HardwareProfile, name: str,
                   meta: dict) -> list[str]:
    lines = []
    for label, held, options, vocabulary in ABLATIONS:
        if held == "new":
            fit_fields = [f for f in FIT_FIELDS if f.dotted in _ORIGINAL_FIELDS]
        else:
            fit_fields = [f for f in FIT_FIELDS if f.dotted != held]
        start = base_for_grid(base, meta) if vocabulary else base
        fit = fit_profile(rows, start, name, fit_fields=fit_fields, **options)
        overall = fit.residual("all")
        kinds = " | ".join(f"{fit.residual(k).median_signed_pct:+.1f}%"
                           for k in ("decode", "prefill", "mixed", "random"))
        lines.append(f"| {label} | {fit.mean_abs_log_error:.4f} | {overall.median_abs_pct:.1f}% "
                     f"| {overall.p90_abs_pct:.1f}% | {kinds} |")
    return lines


def _uniform_fit_note(rows: list[GridRow], fit: ProfileFit, meta: dict) -> str:
    """How the fit changes without the serving-like (``random``) rows."""
    uniform = [r for r in rows if r.kind != "random"]
    if len(uniform) == len(rows) or not uniform:
        return ""
    alone = fit_profile(uniform, fit.base, fit.profile.name)
    g = alone.profile.gpu
    kinds = ", ".join(f"{r.kind} {r.median_abs_pct:.1f}%" for r in alone.residuals
                      if r.kind != "all")
    random_error = next(r for r in residuals(alone.profile, rows) if r.kind == "random")
    sms = f"; the measured GPU has {meta['sm_count']} SMs" if "sm_count" in meta else ""
    return (
        f"  Fitted to the {len(uniform)} other rows alone, the attention bandwidth efficiency "
        f"would be {g.attention_bandwidth_efficiency:g} (against "
        f"{fit.profile.gpu.attention_bandwidth_efficiency:g}) and the saturation "
        f"{g.attention_saturation_tiles:g} thread blocks (against "
        f"{fit.profile.gpu.attention_saturation_tiles:g}{sms}), with median "
        f"abs errors {kinds} -- and the `random` rows' median error "
        f"{random_error.median_signed_pct:+.1f}% (p90 abs {random_error.p90_abs_pct:.1f}%).  The "
        "bundled profile is fitted to all rows: it trades some accuracy on large uniform decode "
        "batches (the KV rates above) for serving-like ones."
    )


def _worst_rows(profile: HardwareProfile, rows: list[GridRow], count: int) -> list[str]:
    errors = step_errors(profile, rows)
    order = sorted(range(len(rows)), key=lambda i: (-abs(errors[i]), i))[:count]
    lines = []
    for i in order:
        r = rows[i]
        model_ms = r.graph_ms * (1 + errors[i])
        lines.append(f"| {r.kind} | {r.n_prefill} | {r.prefill_tokens} | {r.prefill_prefix} "
                     f"| {r.n_decode} | {r.decode_ctx} | {r.graph_ms:.1f} | {model_ms:.1f} "
                     f"| {errors[i]:+.1%} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
