"""SLO-aware scheduling by simulated annealing (seed ``slo_aware_annealing.txt``), in its
native setting: a priority mapper on top of vLLM-style continuous batching.

The paper's scheduler decides the order and the grouping ("batches") in which waiting
requests are handed to vLLM; vLLM then batches them continuously with chunked prefill.
``slo-anneal`` is both halves:

**Step formation (vLLM underneath).** Each step, under the token budget ``B``
(``slo-anneal@B``, default 8192: vLLM's ``max_num_batched_tokens``, as ``vllm-default``):

1. every running decode (a request with no prompt token pending) decodes one token, in
   arrival order, whatever ``B`` (stall-free, as the project's vLLM/Sarathi baselines);
2. started prefills continue (chunked prefills in flight and retracted requests being
   recomputed, which vLLM also puts first), in the order they started, in what is left
   of ``B``;
3. then new requests start from the *head batch* of the plan only: the first planned
   batch that still has members that have not started. Its unstarted members get chunks
   in plan order, the last one cut to the budget left (``fifo_prefills``), at most
   vLLM's ``max_num_seqs`` running requests (1024 on >= 70 GB GPUs, else 256). A batch
   becomes the head only at a decision where every member of the batch before it has
   been seen started (``context > 0`` or a token emitted), so requests of two planned
   batches never start in the same step: the paper's 0.1 ms gap between batches, which
   keeps vLLM from merging them into one iteration. A member that memory blocks (the
   engine skips a prompt that does not fit) keeps its batch the head until it starts.

**Planning (re-planning rule).** The plan covers the waiting requests: those not yet
started (no prompt token computed, no token emitted; a request once started stays
started, so a retracted one resumes in rule 2 and never re-enters the plan). The
``window`` oldest of them (by arrival) are annealed; the rest follow after the annealed
batches in arrival order, in full batches. The policy re-plans at a decision when (a) a
waiting request is not in the current plan (an arrival), or (b) every annealed request
has started while others still wait; otherwise it follows the plan. Requests that start,
finish or are aborted leave the plan without a re-plan.

**Planner model** (paper §3.1, §4.2). A plan is a sequence of batches of at most
``batch`` requests each (the paper's maximum batch size), run one after another as in
the paper's eq. 11: a batch's requests are prefilled together (chunked at ``B``), then
decode together until the longest predicted output; the next batch waits for both, so a
request's waiting time is the predicted run time of the batches planned before it. Step
times come from the policy's online step model (``self.step_model``, started from the
context's initial model): a prefill phase is its chunks' steps, a decode step one call of
the model with every decode alive in it, summed in closed form over the stretches where
the set of decodes is constant (the model is affine in the decode context).

The *running* requests (already started) are background load: each started request still
prefilling adds its pending prompt tokens to a prefill phase ahead of the first batch;
every running request decodes one token in every planned step (prefill or decode) until
its predicted remaining output is done (its drawn output length minus the tokens already
emitted, at least one). In a decode stretch the background is read at the stretch's
middle step (count and KV context); in a prefill phase, at its first step.

Per planned request ``i`` of batch ``k`` (``W_k``: the batches before; ``w_i``: seconds
already waited since arrival; ``P_k``: batch ``k``'s prefill phase; ``D_i``: the decode
steps until ``i``'s last predicted token): TTFT ``= w_i + W_k + P_k``, e2e ``= w_i + W_k
+ P_k + D_i``, TPOT ``= D_i / (o_i - 1)`` (0 for one token). The SLO is met by kind:
TTFT+TPOT (chat) when both are within target, end-to-end (code) when e2e is (an e2e
SLO's TTFT/TPOT are a derived envelope, not targets). Objective ``G = attainment / mean
e2e latency = met / sum of e2e latencies`` over the planned (annealed) requests, in 1/s.

**Output lengths.** Each request's output length is one draw from ``N(mean, std)`` of its
``output_estimate`` (the per-task online Gaussian at its arrival; the prior without one),
rounded, clipped to >= 1, drawn once per request from a generator seeded by the policy's
``seed`` setting and the request id (the paper: "generates a random integer based on this
fitted distribution"). The policy never sees true output lengths.

**Search** (Algorithm 1). Two starts, both in full batches of ``batch``: the arrival
order, and the order of each request's predicted e2e latency alone (prefill then decode at
batch size 1, no waiting, no background; shortest first, ties by arrival). If the second
meets every planned SLO the search stops there. Otherwise annealing starts from the start
with the higher objective (the second on a tie): at temperature ``T`` from ``temp`` down,
``iters`` proposals, then ``T *= decay``, until ``T < stop_temp``. A proposal picks one of
three moves uniformly and a request uniformly:

- *squeeze*: into the previous batch (appended), if the request is not in the first
  batch and that batch is not full;
- *delay*: into the next batch (at its front), if that batch is not full; from the last
  batch, into a new batch of its own, unless it is alone there;
- *swap*: two distinct positions of the sequence exchange requests.

An illegal proposal changes nothing (and counts as one of the ``iters``). A move that
empties a batch removes it. The best plan seen is the result. Within one plan each
batch's predicted run is cached by its members and start step (past the background's
last predicted token, by its members alone), so a proposal recomputes the batches it
changed and those it moved within the background's span; a batch's SLO count at its
start time is one bisection.

Readings of what the seed leaves open (each tested in ``tests/sim/test_slo_anneal.py``):

- Hyperparameters (§5.1: "[?] to 500, [?] to 20, [?] to 100, and [?] to 0.95", symbols
  lost): read in the order simulated annealing's parameters are customarily listed
  (initial temperature, final temperature, iterations per temperature, cooling factor) as
  ``T0 = 500``, stop threshold ``20``, ``100`` iterations per temperature, decay ``0.95``:
  63 temperature levels, 6300 proposals a plan at most. The other reading that keeps
  T0 = 500 (20 iterations, threshold 100) anneals a tenth as long (32 levels x 20); §5.2
  varies T0 between 100 and 200, which fits neither default.
- Acceptance of a worse plan: ``G`` has units of 1/s, so ``exp(dG / T)`` with ``T = 500``
  would accept nearly everything. We measure the change in **basis points of the current
  objective**, ``d = 1e4 * (G' - G) / G``, and accept with probability ``exp(d / T)``: at
  T = 500 a plan 1% worse is accepted with probability 0.82 and one 10% worse with 0.14;
  at T = 20, 0.0067 and ~2e-22. When both objectives are 0 (no planned request can meet
  its SLO) ``G`` is flat, so the change is the relative change of the mean latency (in
  basis points, negative when it grows); a plan with ``G > 0`` always beats one with 0.
- The running requests as background load (above); the planner's sequential batches are
  the paper's model, kept although vLLM underneath overlaps the batches (a batch starts
  as soon as the previous one has started): the plan is an order and a grouping, not a
  timetable.
- Prefill phases ignore the chunks' cached prefixes (the knee model's prefill-context
  coefficient; causal attention pairs are counted in full); TPOT is the mean over the
  decode, not the metric's worst running average.
- The planning window ``window`` (default 16 requests) bounds each plan's cost; the
  paper plans every queued request.

Decision CPU time: the simulator does not charge any policy's decision time to simulated
time (``SimEngine.step`` advances the clock by the GPU model's step time only; scheduler
CPU time is in the profile's per-step overhead), so the annealing's wall time is measured
apart (``benchmarks/sim/slo_anneal.py``).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from sglang_ext.policy.output_length import PRIOR, OutputEstimate
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext, PolicySettingError
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepPredictor
from sglang_ext.policy.view import BatchDecision, RequestState
from sglang_ext.sim.competitors.baselines import fifo_prefills

DEFAULT_TOKEN_BUDGET = 8192  # vLLM's max_num_batched_tokens (as vllm-default)
#: the settings' defaults: the paper's hyperparameters (§5.1, read as in the docstring),
#: its maximum batch size, the planning window and the draw's seed
DEFAULTS = {
    "batch": 8.0, "temp": 500.0, "stop_temp": 20.0, "iters": 100.0, "decay": 0.95,
    "window": 16.0, "seed": 1.0,
}
INTEGER_SETTINGS = ("batch", "iters", "window", "seed")
BASIS_POINTS = 1e4
SQUEEZE, DELAY, SWAP = "squeeze", "delay", "swap"
MOVES = (SQUEEZE, DELAY, SWAP)

Plan = list[list[int]]  # batches of indices into the planner's requests


@dataclass(frozen=True, slots=True)
class AnnealSettings:
    batch: int = 8  # the paper's maximum batch size
    temp: float = 500.0  # initial temperature (basis points of the objective)
    stop_temp: float = 20.0  # annealing stops once the temperature falls below it
    iters: int = 100  # proposals per temperature
    decay: float = 0.95  # temperature factor per level
    window: int = 16  # the oldest waiting requests annealed per plan
    seed: int = 1  # output-length draws and the annealing's random moves

    def __post_init__(self) -> None:
        for name in INTEGER_SETTINGS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PolicySettingError(f"slo-anneal setting {name} must be an integer >= 1, "
                                      f"got {value!r}")
        for name in ("temp", "stop_temp"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PolicySettingError(f"slo-anneal setting {name} must be a finite number > 0, "
                                      f"got {value!r}")
        if not self.stop_temp < self.temp:
            raise PolicySettingError(f"slo-anneal setting stop_temp ({self.stop_temp:g}) must be "
                                  f"below temp ({self.temp:g})")
        if not 0.0 < self.decay < 1.0:
            raise PolicySettingError(
                f"slo-anneal setting decay must be in (0, 1), got {self.decay!r}")

    @classmethod
    def from_values(cls, values: dict[str, float]) -> AnnealSettings:
        """From raw setting values (floats, as ``NAME@B,key=value`` gives them); an integer
        setting must be a whole number."""
        fields = {}
        for name, value in values.items():
            if name in INTEGER_SETTINGS:
                if not (math.isfinite(value) and value == int(value)):
                    raise PolicySettingError(f"slo-anneal setting {name} must be a whole number, "
                                          f"got {value!r}")
                value = int(value)
            fields[name] = value
        return cls(**fields)

    @property
    def levels(self) -> int:
        """Temperature levels of one annealing run (``temp * decay**k >= stop_temp``)."""
        return math.floor(math.log(self.stop_temp / self.temp) / math.log(self.decay)) + 1


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """A waiting request as the planner sees it."""

    key: Hashable
    prompt: int  # prompt tokens to prefill
    output: int  # predicted output tokens (the draw)
    waited_s: float  # seconds since arrival
    slo: Slo
    arrival_seq: int = 0


@dataclass(frozen=True, slots=True)
class Running:
    """A started request as background load."""

    pending_prefill: int  # prompt tokens still to prefill (0: decoding)
    context: int  # tokens in KV (after its pending prefill: plus those)
    remaining: int  # predicted output tokens still to emit, >= 1


@dataclass(frozen=True, slots=True)
class Objective:
    g: float  # met / sum of e2e latencies, 1/s
    met: int
    planned: int
    latency_sum_s: float

    @property
    def attainment(self) -> float:
        return self.met / self.planned if self.planned else 1.0

    @property
    def mean_latency_s(self) -> float:
        return self.latency_sum_s / self.planned if self.planned else 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float  # including the time already waited
    tpot_s: float
    e2e_s: float  # including the time already waited
    met: bool


def change_bp(current: Objective, candidate: Objective) -> float:
    """The candidate's change over the current plan in basis points of the current
    objective (positive: better); ``+inf`` from ``G = 0`` to ``G > 0``; between two
    plans with ``G = 0``, the relative change of the mean latency (lower is better)."""
    if current.g > 0:
        return BASIS_POINTS * (candidate.g - current.g) / current.g
    if candidate.g > 0:
        return math.inf
    if current.latency_sum_s <= 0:
        return 0.0
    return BASIS_POINTS * (current.latency_sum_s - candidate.latency_sum_s) / current.latency_sum_s


def acceptance_probability(change: float, temperature: float) -> float:
    """Metropolis rule: 1 for a change >= 0, else ``exp(change / temperature)``."""
    if change >= 0:
        return 1.0
    return math.exp(change / temperature)


def draw_output(estimate: OutputEstimate | None, seed: int, key: Hashable) -> int:
    """One output length from ``N(mean, std)`` of ``estimate``, rounded, >= 1; the same
    for the same ``seed`` and request ``key``."""
    estimate = estimate or PRIOR
    value = estimate.mean
    if estimate.std > 0:
        value = random.Random(f"{seed}/{key!r}").gauss(estimate.mean, estimate.std)
    return max(1, round(value))


@dataclass(frozen=True, slots=True)
class _BatchRun:
    """One batch's run from its start (clock 0), as the planner predicts it."""

    steps: int  # prefill and decode steps
    duration_s: float
    deadlines: list[float]  # per member, ascending: the latest start meeting its SLO
    latency_s: float  # sum over members of waited + e2e from the batch's start
    detail: list[tuple[int, float, float, float, float]]  # (i, first token, last, tpot, deadline)


class Planner:
    """The plan model and its objective for one set of waiting requests, one background
    and one step model (built at each re-plan)."""

    def __init__(
        self, requests: Sequence[PlanRequest], model: StepPredictor, token_budget: int,
        running: Sequence[Running] = (),
    ) -> None:
        self.requests = list(requests)
        self.model = model
        self.token_budget = token_budget
        self._prompt = [r.prompt for r in self.requests]
        self._pairs = [r.prompt * (r.prompt + 1) / 2.0 for r in self.requests]
        self._output = [r.output for r in self.requests]
        self._waited = [r.waited_s for r in self.requests]
        inf = math.inf
        self._ttft = [inf if r.slo.is_end_to_end else r.slo.ttft_s for r in self.requests]
        self._tpot = [inf if r.slo.is_end_to_end else r.slo.tpot_s for r in self.requests]
        self._e2e = [r.slo.e2e_s if r.slo.is_end_to_end else inf for r in self.requests]
        # background: decodes by remaining steps (ascending) with suffix sums of context
        order = sorted(running, key=lambda r: r.remaining)
        self._bg_remaining = [r.remaining for r in order]
        suffix = [0.0] * (len(order) + 1)
        for i in range(len(order) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + order[i].context + order[i].pending_prefill
        self._bg_context = suffix
        self._decode_cost: dict[int, tuple[float, float]] = {}
        self._horizon = self._bg_remaining[-1] if order else 0
        self._runs: dict[tuple[frozenset[int], int], _BatchRun] = {}
        backlog = sum(r.pending_prefill for r in running)
        self.backlog_s, self.backlog_steps = (
            self._prefill_phase(backlog, 0.0, 0) if backlog else (0.0, 0)
        )
        self.evaluations = 0

    # ------------------------------------------------------------ the model
    def _background(self, step: float) -> tuple[int, float]:
        """Background decodes alive at ``step`` steps from now, and their KV context."""
        index = bisect.bisect_right(self._bg_remaining, step)
        alive = len(self._bg_remaining) - index
        return alive, self._bg_context[index] + alive * step

    def _decode(self, decodes: int) -> tuple[float, float]:
        """``(A, D)`` with a decode-only step of ``decodes`` decodes over ``C`` KV tokens
        taking ``A + D * C`` seconds."""
        cost = self._decode_cost.get(decodes)
        if cost is None:
            step_s = self.model.step_s
            base = step_s(decodes, 0, decodes, 0.0, 0.0)
            per_token = (step_s(decodes, 0, decodes, 1e6, 0.0) - base) / 1e6
            cost = self._decode_cost[decodes] = (base, per_token)
        return cost

    def _prefill_phase(self, tokens: int, pairs: float, step: int) -> tuple[float, int]:
        """Seconds and steps to prefill ``tokens`` prompt tokens (``pairs`` causal pairs)
        in chunks of the budget the background decodes leave, from ``step`` on."""
        alive, context = self._background(step)
        chunk = max(1, self.token_budget - alive)
        steps = -(-tokens // chunk)
        step_s = self.model.step_s
        last = tokens - (steps - 1) * chunk
        seconds = step_s(last + alive, 0, alive, context, pairs * last / tokens)
        if steps > 1:
            full = step_s(chunk + alive, 0, alive, context, pairs * chunk / tokens)
            seconds += (steps - 1) * full
        return seconds, steps

    def _run(self, batch: Sequence[int], step: int) -> _BatchRun:
        """Batch ``batch`` started ``step`` steps from now (at clock 0): its prefill phase,
        then its decode until the longest predicted output."""
        prompt, output, waited = self._prompt, self._output, self._waited
        tokens = 0
        pairs = 0.0
        for i in batch:
            tokens += prompt[i]
            pairs += self._pairs[i]
        prefill_s, prefill_steps = self._prefill_phase(tokens, pairs, step)
        step += prefill_steps
        members = sorted(batch, key=output.__getitem__)
        alive = len(members)
        context = float(tokens)  # the members' KV at the first decode step
        done = 0  # decode steps run
        now = prefill_s
        deadlines = []
        latency = 0.0
        detail = []
        for i in members:
            length = output[i] - 1 - done
            if length > 0:
                bg_alive, bg_context = self._background(step + done + (length - 1) / 2)
                base, per_token = self._decode(alive + bg_alive)
                mean_context = context + alive * (length - 1) / 2 + bg_context
                now += length * (base + per_token * mean_context)
                context += alive * length
                done += length
            tpot = (now - prefill_s) / (output[i] - 1) if output[i] > 1 else 0.0
            # the latest batch start (clock) at which i still meets its SLO
            if tpot > self._tpot[i]:
                deadline = -math.inf
            else:
                deadline = min(self._ttft[i] - prefill_s, self._e2e[i] - now) - waited[i]
            deadlines.append(deadline)
            latency += waited[i] + now
            detail.append((i, prefill_s, now, tpot, deadline))
            alive -= 1
            context -= prompt[i] + done
        deadlines.sort()
        return _BatchRun(prefill_steps + done, now, deadlines, latency, detail)

    def evaluate(self, plan: Plan, predictions: list[Prediction | None] | None = None) -> Objective:
        """The objective of ``plan`` (batches of indices into ``requests``); fills
        ``predictions[i]`` per request when given."""
        self.evaluations += 1
        cache, horizon = self._runs, self._horizon
        clock = self.backlog_s
        step = self.backlog_steps
        met = 0
        planned = 0
        latency_sum = 0.0
        for batch in plan:
            if not batch:
                continue
            # past the background's last predicted token a batch's run no longer depends
            # on when it starts
            at = step if step < horizon else horizon
            key = (frozenset(batch), at)
            run = cache.get(key)
            if run is None:
                run = cache[key] = self._run(batch, at)
            size = len(batch)
            met += size - bisect.bisect_left(run.deadlines, clock)
            latency_sum += run.latency_s + size * clock
            if predictions is not None:
                for i, first_s, last_s, tpot, deadline in run.detail:
                    waited = self._waited[i]
                    predictions[i] = Prediction(waited + clock + first_s, tpot,
                                                waited + clock + last_s, clock <= deadline)
            planned += size
            clock += run.duration_s
            step += run.steps
        g = met / latency_sum if latency_sum > 0 else 0.0
        return Objective(g, met, planned, latency_sum)

    def predict(self, plan: Plan) -> list[Prediction]:
        predictions: list[Prediction | None] = [None] * len(self.requests)
        self.evaluate(plan, predictions)
        return [p for p in predictions if p is not None]

    def alone_s(self, i: int) -> float:
        """Request ``i``'s predicted e2e run time alone: its prefill, then its decode at
        batch size 1, no waiting, no background."""
        prompt, output = self._prompt[i], self._output[i]
        chunk = self.token_budget
        steps = -(-prompt // chunk)
        step_s = self.model.step_s
        last = prompt - (steps - 1) * chunk
        seconds = step_s(last, 0, 0, 0.0, self._pairs[i] * last / prompt)
        if steps > 1:
            seconds += (steps - 1) * step_s(chunk, 0, 0, 0.0, self._pairs[i] * chunk / prompt)
        length = output - 1
        if length > 0:
            base, per_token = self._decode(1)
            seconds += length * (base + per_token * (prompt + (length - 1) / 2))
        return seconds


# ---------------------------------------------------------------- the search
def full_batches(order: Sequence[int], size: int) -> Plan:
    return [list(order[i:i + size]) for i in range(0, len(order), size)]


def propose(plan: Plan, move: str, batch_index: int, position: int, cap: int,
            other: tuple[int, int] | None = None) -> Plan | None:
    """``plan`` after ``move`` of the request at ``plan[batch_index][position]`` (swap:
    with the one at ``other``, a (batch, position) pair); ``None`` when the move is
    illegal or changes nothing."""
    if move == SQUEEZE:
        if batch_index == 0 or len(plan[batch_index - 1]) >= cap:
            return None
        new = [list(b) for b in plan]
        request = new[batch_index].pop(position)
        new[batch_index - 1].append(request)
    elif move == DELAY:
        last = batch_index == len(plan) - 1
        if last and len(plan[batch_index]) == 1:
            return None
        if not last and len(plan[batch_index + 1]) >= cap:
            return None
        new = [list(b) for b in plan]
        request = new[batch_index].pop(position)
        if last:
            new.append([request])
        else:
            new[batch_index + 1].insert(0, request)
    elif move == SWAP:
        if other is None or other == (batch_index, position):
            return None
        new = [list(b) for b in plan]
        (k, p), (j, q) = (batch_index, position), other
        new[k][p], new[j][q] = new[j][q], new[k][p]
        return new
    else:
        raise ValueError(f"unknown move {move!r}; moves: {', '.join(MOVES)}")
    return [b for b in new if b]


@dataclass(frozen=True, slots=True)
class SearchResult:
    plan: Plan
    objective: Objective
    stopped_early: bool  # the latency-ordered start met every SLO
    evaluations: int


def anneal(planner: Planner, settings: AnnealSettings, rng: random.Random) -> SearchResult:
    """Algorithm 1 over ``planner.requests`` (module docstring)."""
    n = len(planner.requests)
    cap = settings.batch
    arrival = sorted(range(n), key=lambda i: planner.requests[i].arrival_seq)
    first = full_batches(arrival, cap)
    by_latency = sorted(range(n),
                        key=lambda i: (planner.alone_s(i), planner.requests[i].arrival_seq))
    second = full_batches(by_latency, cap)
    first_score, second_score = planner.evaluate(first), planner.evaluate(second)
    if second_score.met == second_score.planned:
        return SearchResult(second, second_score, True, planner.evaluations)
    if change_bp(second_score, first_score) > 0:
        current, score = first, first_score
    else:
        current, score = second, second_score
    best, best_score = current, score
    if n < 2:
        return SearchResult(best, best_score, False, planner.evaluations)
    temperature = settings.temp
    while temperature >= settings.stop_temp:
        for _ in range(settings.iters):
            candidate = _random_move(current, cap, rng)
            if candidate is None:
                continue
            candidate_score = planner.evaluate(candidate)
            change = change_bp(score, candidate_score)
            if change >= 0 or rng.random() < math.exp(change / temperature):
                current, score = candidate, candidate_score
                if change_bp(best_score, score) > 0:
                    best, best_score = current, score
        temperature *= settings.decay
    return SearchResult(best, best_score, False, planner.evaluations)


def _random_move(plan: Plan, cap: int, rng: random.Random) -> Plan | None:
    move = MOVES[rng.randrange(3)]
    sizes = [len(b) for b in plan]
    total = sum(sizes)
    batch_index, position = _locate(sizes, rng.randrange(total))
    other = None
    if move == SWAP:
        other = _locate(sizes, rng.randrange(total))
    return propose(plan, move, batch_index, position, cap, other)


def _locate(sizes: list[int], flat: int) -> tuple[int, int]:
    for k, size in enumerate(sizes):
        if flat < size:
            return k, flat
        flat -= size
    raise IndexError(flat)


# ---------------------------------------------------------------- the policy
@POLICIES.register("slo-anneal")
class SloAnneal(BatchPolicy):
    """The paper's SLO-aware priority mapper (simulated annealing) over vLLM-style
    continuous batching with chunked prefill (module docstring for the exact rules).

    ``slo-anneal@B,batch=N,temp=T0,stop_temp=T1,iters=I,decay=A,window=W,seed=S``; a
    sweep tunes the budget and ``batch`` only (``tuned_settings``)."""

    name = "slo-anneal"
    takes_token_budget = True
    setting_names = tuple(DEFAULTS)
    tuned_settings = ("batch",)

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.token_budget = context.token_budget or DEFAULT_TOKEN_BUDGET
        self.settings = AnnealSettings.from_values(
            {name: self.setting_value(name, self.token_budget) for name in self.setting_names}
        )
        self.max_num_seqs = 1024 if context.gpu_memory_gb >= 70 else 256
        self.rng = random.Random(self.settings.seed)
        self._outputs: dict[Hashable, int] = {}  # the draw, per request
        self._started: dict[Hashable, int] = {}  # started requests -> start order
        self._start_count = 0
        self.plan: Plan = []  # batches of request ids, head first (annealed, then the rest)
        self._annealed: set[Hashable] = set()  # ids annealed by the last plan
        self._planned: set[Hashable] = set()  # every id in the last plan
        self.plans = 0  # re-plans so far
        self.early_stops = 0
        self.evaluations = 0
        self.last_result: SearchResult | None = None

    defaults = DEFAULTS

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        if name not in cls.defaults:
            return super().default_setting(name, context, token_budget)
        return cls.defaults[name]

    # ------------------------------------------------------------ per request
    def predicted_output(self, request: RequestState) -> int:
        """The request's output-length draw (made once, at first sight)."""
        key = request.req_id
        drawn = self._outputs.get(key)
        if drawn is None:
            estimate = getattr(request, "output_estimate", None)
            drawn = self._outputs[key] = draw_output(estimate, self.settings.seed, key)
        return drawn

    # ------------------------------------------------------------ a step
    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        live = {r.req_id for r in requests}
        for r in requests:
            if (r.context > 0 or r.next_output_index > 0) and r.req_id not in self._started:
                self._started[r.req_id] = self._start_count
                self._start_count += 1
        if len(self._started) > 2 * len(live) + 64:
            self._forget(live)
        decodes = sorted((r for r in requests if r.pending_prefill == 0), key=_arrival)
        started = sorted(
            (r for r in requests if r.pending_prefill > 0 and r.req_id in self._started),
            key=lambda r: self._started[r.req_id],
        )
        waiting = [r for r in requests if r.pending_prefill > 0 and r.req_id not in self._started]
        self._follow(live)
        if waiting and self._needs_plan(waiting):
            self._replan(requests, waiting, now)
        budget = self.token_budget - len(decodes)
        chunks: list[tuple[Hashable, int]] = []
        budget = fifo_prefills(started, budget, chunks)
        if self.plan and budget > 0:
            by_id = {r.req_id: r for r in waiting}
            head = [by_id[key] for key in self.plan[0]]
            room = max(0, self.max_num_seqs - (len(requests) - len(waiting)))
            fifo_prefills(head[:room], budget, chunks)
        return BatchDecision(tuple(r.req_id for r in decodes), tuple(chunks))

    def _forget(self, live: set[Hashable]) -> None:
        self._started = {k: v for k, v in self._started.items() if k in live}
        self._outputs = {k: v for k, v in self._outputs.items() if k in live}

    def _follow(self, live: set[Hashable]) -> None:
        """Drop started, finished and aborted requests from the plan (and empty batches)."""
        started = self._started
        plan = [[k for k in batch if k in live and k not in started] for batch in self.plan]
        self.plan = [batch for batch in plan if batch]

    def _needs_plan(self, waiting: Sequence[RequestState]) -> bool:
        if any(r.req_id not in self._planned for r in waiting):
            return True  # (a) an arrival
        pending = {k for batch in self.plan for k in batch}
        return not (self._annealed & pending)  # (b) the annealed part has all started

    def _replan(self, requests: Sequence[RequestState], waiting: Sequence[RequestState],
                now: float) -> None:
        oldest = sorted(waiting, key=_arrival)
        window, rest = oldest[: self.settings.window], oldest[self.settings.window:]
        planned = [
            PlanRequest(r.req_id, r.pending_prefill, self.predicted_output(r),
                        max(0.0, now - r.arrival), r.slo, r.arrival_seq)
            for r in window
        ]
        running = [
            Running(r.pending_prefill, r.context,
                    max(1, self.predicted_output(r) - r.next_output_index))
            for r in requests if r.req_id in self._started
        ]
        planner = Planner(planned, self.step_model.coefficients, self.token_budget, running)
        result = anneal(planner, self.settings, self.rng)
        self.last_result = result
        self.plans += 1
        self.early_stops += result.stopped_early
        self.evaluations += result.evaluations
        ids = [[planned[i].key for i in batch] for batch in result.plan]
        tail = full_batches([r.req_id for r in rest], self.settings.batch)
        self.plan = ids + tail
        self._annealed = {r.req_id for r in window}
        self._planned = self._annealed | {r.req_id for r in rest}


def _arrival(request: RequestState) -> int:
    return request.arrival_seq


#: the other reading of §5.1's hyperparameters that keeps T0 = 500: 20 iterations per
#: temperature down to 100 (32 levels x 20 proposals, a tenth of the default's search)
SHORT_DEFAULTS = {**DEFAULTS, "stop_temp": 100.0, "iters": 20.0}


@POLICIES.register("slo-anneal-short")
class SloAnnealShort(SloAnneal):
    """``slo-anneal`` on the other reading of the paper's hyperparameters (``stop_temp``
    100, ``iters`` 20): a tenth of the search, for sweeps whose run time must stay bounded."""

    name = "slo-anneal-short"
    defaults = SHORT_DEFAULTS
