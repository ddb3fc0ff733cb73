"""Where simulations run (``sglang_ext.sim.executors``): local processes or Ray, the same
results on either; Ray refused in one line where it is not installed."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import Future

import pytest
from sim_helpers import CATALOG, llama, synthetic_workload

from sglang_ext.sim.commands import main
from sglang_ext.sim.executors import (
    EXECUTORS,
    ExecutorError,
    ExecutorSpec,
    InProcessExecutor,
    check_available,
    open_pool,
)
from sglang_ext.sim.runner import Scenario
from sglang_ext.sim.sweep import plan_sweep, run_sweep

_setting: str | None = None


def _set(value: str) -> None:
    global _setting
    _setting = value


def _read(suffix: str) -> tuple[str, int]:
    return f"{_setting}{suffix}", os.getpid()


def _fail() -> None:
    raise ValueError("no such load")


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError


# ------------------------------------------------------------------ the factory
def test_the_executors_offered():
    assert EXECUTORS == ("process", "ray")
    assert ExecutorSpec() == ExecutorSpec("process", None)


def test_an_unknown_executor_is_refused_with_the_choices():
    with pytest.raises(ExecutorError, match="unknown executor 'dask'; choose one of process, ray"):
        ExecutorSpec("dask")


def test_a_ray_address_is_refused_for_local_processes():
    with pytest.raises(ExecutorError, match="--ray-address applies to --executor ray only"):
        ExecutorSpec("process", "auto")


def test_one_worker_runs_here_after_the_initializer(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_setting", None)
    pool = open_pool(ExecutorSpec(), 1, _set, ("scenario",))
    assert pool.workers == 1 and isinstance(pool.executor, InProcessExecutor)
    with pool.executor as executor:
        assert list(executor.map(_read, ["-a", "-b"])) == [("scenario-a", os.getpid()),
                                                           ("scenario-b", os.getpid())]
        future = executor.submit(_read, "-c")
        assert isinstance(future, Future) and future.result() == ("scenario-c", os.getpid())
        with pytest.raises(ValueError, match="no such load"):
            executor.submit(_fail).result()


def test_never_more_workers_than_tasks(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_setting", None)
    pool = open_pool(ExecutorSpec(), 8, _set, ("only",), tasks=1)
    assert pool.workers == 1 and _setting == "only"


@pytest.mark.slow
def test_worker_processes_each_run_the_initializer():
    pool = open_pool(ExecutorSpec(), 2, _set, ("forked",), tasks=4)
    assert pool.workers == 2
    with pool.executor as executor:
        results = list(executor.map(_read, ["-1", "-2", "-3"]))
    assert [value for value, _ in results] == ["forked-1", "forked-2", "forked-3"]
    assert os.getpid() not in {pid for _, pid in results}


def test_ray_missing_is_one_clear_error(no_ray):
    spec = ExecutorSpec("ray")
    message = r"--executor ray needs Ray, which is not installed here: pip install 'fairbatching-sglang\[ray\]'"
    with pytest.raises(ExecutorError, match=message):
        check_available(spec)
    with pytest.raises(ExecutorError, match=message):
        open_pool(spec, 2, _set, ("x",))
    check_available(ExecutorSpec())  # the local processes need nothing more


@pytest.mark.parametrize("command", [
    ["sweep"], ["demo"], ["capacity", "--policy", "fb"],
])
def test_the_cli_refuses_ray_missing_at_start_up(command, no_ray, tmp_path, capsys):
    assert main([*command, "--executor", "ray", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --executor ray needs Ray, which is not installed here: "
                   "pip install 'fairbatching-sglang[ray]'\n")
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_ray_address_without_ray(tmp_path, capsys):
    assert main(["capacity", "--policy", "fb", "--ray-address", "auto",
                 "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --ray-address applies to --executor ray only\n"


# ------------------------------------------------------------------ on a local Ray instance
@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def _without_wall_times(document: dict) -> dict:
    document = json.loads(json.dumps(document))
    del document["capacity"]["wall_s"]
    for entry in document["policies"].values():
        del entry["capacity_search"]["wall_s"]
    return document


@pytest.mark.slow
def test_a_sweep_on_ray_gives_the_results_of_local_processes(local_ray):
    scenario = Scenario(synthetic_workload(40), llama(), CATALOG, arrivals="poisson", seed=0,
                        drain_s=60.0)
    plan = plan_sweep(["fb", "sarathi", "sglang-default"], budgets=(256, 1024))
    ticks: list[int] = []
    local, local_samples = run_sweep(scenario, plan, (4.0, 8.0), cdf_rate=8.0, jobs=2)
    on_ray, ray_samples = run_sweep(scenario, plan, (4.0, 8.0), cdf_rate=8.0, jobs=2,
                                    executor=ExecutorSpec("ray"), progress=ticks.append)
    assert on_ray == local and ray_samples == local_samples
    assert sum(ticks) == 4 * 2  # fb, sglang-default, sarathi@256 and @1024, at 2 loads each
    assert set(on_ray["policies"]) == {"fb", "sarathi", "sarathi@256", "sarathi@1024",
                                       "sglang-default"}


@pytest.mark.slow
def test_a_capacity_search_on_ray_gives_the_results_of_local_processes(local_ray, tmp_path,
                                                                      capsys):
    argv = ["capacity", "--policy", "fb", "--policy", "sarathi@512", "--head-seconds", "20",
            "--tolerance", "0.2", "--jobs", "2"]
    assert main([*argv, "--out", str(tmp_path / "process")]) == 0
    assert main([*argv, "--executor", "ray", "--out", str(tmp_path / "ray")]) == 0
    local, on_ray = (json.loads((tmp_path / name / "results.json").read_text())
                     for name in ("process", "ray"))
    assert _without_wall_times(on_ray) == _without_wall_times(local)
    assert on_ray["capacity"]["jobs"] == 2
    assert "(2 at once)" in capsys.readouterr().out
