"""Benchmark: SGLang's own router (smg, the SGLang Model Gateway) against this project's
control-plane daemon, routing the same open-loop workloads to the same two SGLang servers.

Two stock ``python -m sglang.launch_server`` servers run on the emulated GPU (profile
``llama3.1-8b-h100``, step times x2) with FairBatching on (the shipped
``configs/fairbatching.toml``, step model scaled like the GPU) and join one control-plane
daemon as ranks ``bench-a/0`` and ``bench-b/0``. In front of them, in turn (every router
at one rate before the next rate, so the machine's drift touches all alike):

* ``smg-rr``       -- ``smg launch --policy round_robin`` (smg 1.13, its other defaults);
* ``smg-ca``       -- ``smg launch --policy cache_aware`` with ``--max-concurrent-requests C
  --queue-size Q --queue-timeout-secs 2`` (the TTFT target: a request queued longer has
  missed it), C and Q swept per workload at its top rate until the best goodput is interior
  to the grid (coordinate sweep: C at a fixed Q, then Q at the best C, each grid doubled
  or halved at an edge, at most ``MAX_EXTENSIONS`` times; ``Bench.sweep``), plus the fixed
  flags of ``SMG_CA_EXTRA`` (worker overload protection and the warm-up slice off; why:
  beside it);
* ``smg-ll``       -- ``smg launch --policy least_load`` (queued token work over each
  backend's throughput, with its KV-pressure term; smg's defaults for those), its limits
  swept and its extra flags as ``smg-ca``'s (``TUNED_SMG``);
* ``cp-default``   -- the daemon with its default balancer (``policy`` not set:
  ``pab_cache_aware``, prefix affinity within each rank's PAB; the prefix tree's knobs smg
  ``cache_aware``'s defaults) behind its OpenAI gateway (``fairbatching-controlplane gateway``);
* ``cp-pab``       -- the daemon with ``policy = "pab"``;
* ``cp-least``     -- the daemon with ``policy = "pab_least_loaded"`` (PAB admits, the least
  loaded rank is chosen);
* ``cp-spill``     -- the daemon's default policy with ``on_no_budget = "spill"`` (a request
  no budget covers goes to the rank the policy would pick, whose own admission decides).

The daemon (with its gateway) restarts for every run, as smg does: a prefix-tree balancer's
tree starts empty like the servers' flushed caches.

smg talks HTTP to the servers' ports; the daemon reaches them through their control-plane
ingress (ZeroMQ). Every request is ``POST /v1/completions``, streamed, with a text prompt
(single-token words of the tiny model's tokenizer, so a prompt of N words is N tokens),
``ignore_eos`` and the SLO of ``configs/slo.toml``'s ``standard`` class in
``custom_params`` (TTFT 2000 ms, TPOT 50 ms; also the servers' default class), or in the
``bursty`` workload its own class.

Workloads (seeded, ``--seeds``; at each seed the same requests through every router):

* ``azure``  -- the first ``rate x seconds`` requests of the bundled Azure conversation
  sample (``sglang_ext/data/azure_conv_sample.csv``; prompt and output lengths as recorded,
  prompts capped at 6144 tokens for the tiny model's 8192 context), as
  :mod:`benchmarks.server.stock_vs_fairbatching`'s replay uses it, with fresh Poisson arrival times (the
  simulator's ``Workload.with_arrivals``); prompts distinct per request (no prefix reuse).
* ``prefix`` -- shared prefixes: each request is one of ``PREFIXES`` long system prompts
  (``PREFIX_TOKENS`` tokens, drawn uniformly) followed by a short unique suffix; its prefix
  is in a server's radix cache only if that server served it recently. The prefixes
  (24 x 4096 tokens) do not fit one server's KV pool (``KV_TOKENS``) but half of them do:
  a router that keeps each prefix on one server computes each prefill once. Poisson
  arrivals, every request the ``standard`` class.
* ``bursty`` -- the ``prefix`` workload's requests (same prefixes, suffixes and outputs) at
  gamma arrival times of CV ``BURST_CV`` (4: a run is a few dense bursts and long lulls)
  with three SLO classes drawn per request from ``CLASS_MIX`` (``interactive`` 20%: TTFT
  500 ms; ``standard`` 50%; ``relaxed`` 30%: TTFT 5 s, TPOT 200 ms), named in
  ``custom_params`` (``{"class": name}``), which the servers and the daemon resolve from
  ``configs/slo.toml``. Where deadlines differ, a router that knows them (the daemon's
  PAB per class) can do what one that does not (smg) cannot; attainment and TTFT p99 are
  reported per class too.

Metrics per (workload, router, rate): goodput = rate x SLO attainment (a request meets its
class's SLO when it completes all its tokens within the class's TTFT and TPOT, for the
``standard`` class 2000 ms and 50 ms; TPOT per
request = (last token - first token) / (tokens - 1), a mean, as in
``sglang.benchmark.serving``; failures, 429s and timeouts are misses); TTFT/TPOT
percentiles over completed requests; the prefill tokens the servers actually computed
(from the emulated GPU's step log) over the prompt tokens sent; the router's CPU seconds
per 1000 requests and per 1000 output tokens streamed to the client (``/proc/<pid>/stat``
utime+stime over the run; smg: its one process; the daemon: daemon + gateway processes;
the SGLang servers' CPU beside it; tokens: each stream's usage event, else one per text
chunk, recorded with the run as ``result.output_tokens``); and the
router's added latency: a sequential probe before each run (``PROBES`` 32-token prompts,
2 output tokens, alternately through the router and straight to a server) whose
TTFT median through the router minus the median direct is the router's cost unloaded.

Every finished run is appended to ``out/bench_routers/points.jsonl`` (raw logs beside it);
``docs/bench/routers.md`` and ``routers.json`` are rendered from the points::

    scripts/bench_routers.sh                  # the full run (about 40 min on 2 vCPUs with
                                              # four routers)
    scripts/bench_routers.sh --quick          # one rate per workload, 12 s runs, 3-point sweep (~8 min)
    scripts/bench_routers.sh --render-only    # re-render docs/bench/routers.* from the points
    scripts/bench_routers.sh --workloads prefix --azure-rates 6 --prefix-rates 8,12
    scripts/bench_routers.sh --workloads bursty --bursty-rates 30 --seeds 0,1,2   # 3 seeds a point

The daemon and the servers run in this project's SGLang environment; smg in its own small
one (``FB_EXTRAS=bench-router``; ``--smg PATH`` or ``$FB_SMG`` names its executable).

A server that dies mid-run (a FairBatching scheduler assertion was seen under KV pressure)
is recorded with that run's point (``server_died``, marked in the tables) and the servers
and the daemon are restarted before the next run.

Arrival seeds (``--seeds``, comma-separated, default ``0``): every (workload, rate, router,
limits) run happens once per seed, on that seed's arrival times, prompts and classes; the
points file keys runs by seed too (``--append`` skips the runs saved at each seed; a point
saved without a seed ran at seed 0). Each seed sweeps the tuned smg routers' limits on its
own arrivals and keeps its own best, so smg is at its best at every seed. Where a point ran
at several seeds, the page's tables give the mean over the seeds (goodput, attainment and
the other columns) with each seed's goodput beside it and a sweep table per seed, and the
daemon's best configuration (highest mean goodput) is set against smg's best at each seed:
the ratio of the means and each seed's ratio (that seed's daemon goodput over the highest
smg goodput at that seed). With one seed, near a router's knee, repeated runs of one
configuration differ a lot on this shared machine (see the page's sweep tables), so read
single points with care.
"""
