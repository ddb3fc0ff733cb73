"""Where a sweep's or a capacity search's simulations run: local worker processes
(``process``, the default) or the tasks of a Ray cluster (``ray``, the ``ray`` extra).

Either way a worker first runs ``initializer(*initargs)`` once (setting the per-process
globals the submitted functions read), and the executor returned is a
``concurrent.futures.Executor`` whose ``submit`` returns a ``concurrent.futures.Future``,
so ``map`` yields results in submission order and the results are the same on both.
Ray is imported only when ``ray`` is chosen.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

EXECUTORS = ("process", "ray")
INSTALL_RAY = "pip install 'fairbatching-sglang[ray]'"


class ExecutorError(Exception):
    """An executor that cannot run here: printed as one line."""


@dataclass(frozen=True)
class ExecutorSpec:
    """``name``: one of ``EXECUTORS``; ``ray_address``: the Ray cluster to join (``ray`` only;
    without it, ``RAY_ADDRESS`` when set, else a local instance is started)."""

    name: str = "process"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.name not in EXECUTORS:
            raise ExecutorError(f"unknown executor {self.name!r}; choose one of "
                                f"{', '.join(EXECUTORS)}")
        if self.ray_address is not None and self.name != "ray":
            raise ExecutorError("--ray-address applies to --executor ray only")


PROCESSES = ExecutorSpec()


@dataclass(frozen=True)
class WorkerPool:
    executor: Executor
    workers: int  # simulations at once


def check_available(spec: ExecutorSpec) -> None:
    """Fail now, with one line, when ``spec`` cannot run here (Ray not installed)."""
    if spec.name == "ray":
        _import_ray()


def open_pool(
    spec: ExecutorSpec, jobs: int | None, initializer: Callable[..., None],
    initargs: Sequence[Any], *, tasks: int | None = None,
) -> WorkerPool:
    """Workers that have each run ``initializer(*initargs)``; at most ``tasks`` of them.

    ``process``: ``jobs`` worker processes (default: every core), forked, so ``initargs``
    need not pickle; one worker runs in this process. ``ray``: tasks on the Ray instance this
    process is connected to, else on the cluster at ``spec.ray_address`` (or
    ``RAY_ADDRESS``), else on a local instance started with ``jobs`` CPUs (default: every
    core); ``workers`` is the instance's CPU count. Each Ray worker process runs the
    initializer before its first task, on ``initargs`` stored once in Ray's object store."""
    if spec.name == "ray":
        ray = _import_ray()
        if not ray.is_initialized():
            _connect(ray, spec.ray_address, _capped(jobs or os.cpu_count() or 1, tasks))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        return WorkerPool(RayExecutor(ray, initializer, initargs), _capped(cpus, tasks))
    workers = _capped(jobs or os.cpu_count() or 1, tasks)
    if workers == 1:
        initializer(*initargs)
        return WorkerPool(InProcessExecutor(), 1)
    return WorkerPool(
        ProcessPoolExecutor(workers, initializer=initializer, initargs=tuple(initargs)), workers,
    )


def _capped(workers: int, tasks: int | None) -> int:
    return max(1, min(workers, tasks) if tasks else workers)


class InProcessExecutor(Executor):
    """Runs each call here, when submitted; ``map`` runs them as its results are taken."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        return future

    def map(self, fn, *iterables, timeout=None, chunksize=1) -> Iterator:
        return map(fn, *iterables)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ExecutorError(f"--executor ray needs Ray, which is not installed here: "
                            f"{INSTALL_RAY}") from None
    return ray


def _connect(ray, address: str | None, cpus: int) -> None:
    if address is not None:
        ray.init(address=address)
    elif os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(num_cpus=cpus, include_dashboard=False)


class RayExecutor(Executor):
    """``submit`` as a Ray task of one CPU; its future is the task's result."""

    def __init__(self, ray, initializer: Callable[..., None], initargs: Iterable[Any]) -> None:
        self._ray = ray
        self._task = ray.remote(num_cpus=1)(_run_initialized)
        self._initializer = initializer
        self._shared = [ray.put(tuple(initargs))]  # in a list: handed to tasks unresolved
        self._futures: list[Future] = []
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        ref = self._task.remote(self._initializer, self._shared, fn, args, kwargs)
        future = ref.future()
        self._futures.append(future)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        if cancel_futures:
            for future in self._futures:
                if not future.done():
                    self._ray.cancel(future.object_ref)
        if wait:
            futures.wait(self._futures)
        self._futures = []


_initialized_with: str | None = None


def _run_initialized(initializer: Callable[..., None], shared: list, fn: Callable,
                     args: tuple, kwargs: dict) -> Any:
    """A Ray task's body: ``fn(*args, **kwargs)`` in a worker process that has run
    ``initializer`` on the initargs ``shared[0]`` refers to (once per process and initargs)."""
    global _initialized_with
    key = shared[0].hex()
    if _initialized_with != key:
        import ray

        initializer(*ray.get(shared[0]))
        _initialized_with = key
    return fn(*args, **kwargs)
