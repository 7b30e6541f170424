"""Run a function on P gloo ranks in spawned processes and return what each rank returned: run()
spawns a group per call, Group keeps one alive across calls.

Each rank: torch.set_num_threads(1), a gloo process group over a file store in a fresh temporary
directory (60 s collective timeout), fn(rank, world_size, *args), the group destroyed. Results or
the rank's traceback come back through a multiprocessing Queue. The parent waits at most `timeout`
seconds in all; on the first failing rank or the deadline it kills every rank still running and
raises with the traceback, so a failure never hangs the test session.
"""
from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """A rank raised, or the ranks did not finish in time."""


def _entry(fn: Callable, rank: int, world_size: int, store: str, results, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend="gloo", init_method=f"file://{store}", world_size=world_size, rank=rank,
                                timeout=timedelta(seconds=60))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001  (any failure goes back to the parent, before the group closes)
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> List[Any]:
    """fn(rank, world_size, *args) on world_size ranks; [rank 0's result, rank 1's, ...].
    fn and args must be picklable (fn a module-level function)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="ae_cp_")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, os.path.join(tmp, "store"), results, args),
                         daemon=True) for r in range(world_size)]
    got, error = {}, None
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(got) < world_size and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"ranks {sorted(set(range(world_size)) - set(got))} did not finish in {timeout:.0f} s"
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:  # killed without reporting (e.g. a crash in C++)
                    error = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                continue
            if ok:
                got[rank] = value
            else:
                error = f"rank {rank} failed:\n{value}"
        if error is not None:  # the other ranks' errors too (a peer's failure shows as a closed connection)
            grace = time.monotonic() + 2.0
            while time.monotonic() < grace:
                try:
                    rank, ok, value = results.get(timeout=max(grace - time.monotonic(), 0.01))
                except queue.Empty:
                    break
                if not ok:
                    error += f"\nrank {rank} failed:\n{value}"
    finally:
        for p in procs:
            p.join(timeout=5 if error is None else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise RankFailed(error)
    return [got[r] for r in range(world_size)]


def _serve(rank: int, world_size: int, store: str, inbox, results) -> None:
    """A Group's rank: join the group, then run each (seq, fn, args) from `inbox` until None."""
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo", init_method=f"file://{store}", world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=60))
    try:
        while (job := inbox.get()) is not None:
            seq, fn, args = job
            try:
                results.put((seq, rank, True, fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001  (back to the parent; the rank serves on)
                results.put((seq, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Group:
    """world_size gloo ranks kept alive between calls, for tests that run many small problems (a
    fuzz test's examples): call() costs a queue round trip instead of run()'s process spawn and
    group set-up. A failing or late call closes the group and raises RankFailed (a rank that
    raised inside a collective leaves its peers waiting there); the next call starts a new one.
    fn must run the same collectives on every rank, as under run()."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = None
        self._seq = 0

    def _start(self):
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="ae_cp_")
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        store = os.path.join(self._tmp, "store")
        self._procs = [ctx.Process(target=_serve, args=(r, self.world_size, store, self._inboxes[r], self._results),
                                   daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def call(self, fn: Callable, *args: Any, timeout: float = 120.0) -> List[Any]:
        """fn(rank, world_size, *args) on every rank: [rank 0's result, ...]."""
        if self._procs is None:
            self._start()
        self._seq += 1
        for box in self._inboxes:
            box.put((self._seq, fn, args))
        got, error = {}, None
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"ranks {sorted(set(range(self.world_size)) - set(got))} did not finish in {timeout:.0f} s"
                break
            try:
                seq, rank, ok, value = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    error = f"rank {dead[0]} exited with code {self._procs[dead[0]].exitcode}"
                continue
            if seq != self._seq:
                continue  # a late reply to an earlier call that already failed
            if ok:
                got[rank] = value
            else:
                error = f"rank {rank} failed:\n{value}"
        if error is not None:
            self.close()
            raise RankFailed(error)
        return [got[r] for r in range(self.world_size)]

    def close(self):
        if self._procs is None:
            return
        for box in self._inboxes:
            try:
                box.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._results.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._procs = None


def case_table(case: Callable, counter, rank: int, world: int, sizes: List[int],
               names: List[str]) -> Dict[str, Optional[str]]:
    """A rank's part of a table of cases run on every group size of `sizes` (ranks 0 .. size - 1:
    the world itself, or a subgroup, so that one spawn of the largest size serves them all and
    `group=` is exercised): case(rank, size, name, counter, group) for each name, {"size/name":
    None (passed) or the traceback} for the sizes this rank belongs to. A failure is recorded, not
    raised, so every rank runs the same collectives in the same order."""
    res: Dict[str, Optional[str]] = {}
    for size in sizes:
        group = None if size == world else dist.new_group(list(range(size)))  # every rank calls new_group
        if rank >= size:
            continue
        for name in names:
            try:
                case(rank, size, name, counter, group)
                res[f"{size}/{name}"] = None
            except Exception:  # noqa: BLE001
                res[f"{size}/{name}"] = traceback.format_exc()
    return res


class CaseTable:
    """One spawn of max(sizes) ranks running `suite(rank, world, sizes, names)` (a case_table), the
    first time a test asks; check(world, name) then asserts that case ran on every rank of its
    group and passed there."""

    def __init__(self, suite: Callable, sizes: List[int], names: List[str], timeout: float = 150.0):
        self.suite, self.sizes, self.names, self.timeout = suite, list(sizes), list(names), timeout
        self._res: List[Any] = []

    def results(self) -> List[Dict[str, Optional[str]]]:
        if not self._res:
            try:
                self._res.append(run(self.suite, max(self.sizes), self.sizes, self.names, timeout=self.timeout))
            except RankFailed as e:
                self._res.append(e)
        if isinstance(self._res[0], Exception):
            raise self._res[0]
        return self._res[0]

    def check(self, world: int, name: str) -> None:
        key = f"{world}/{name}"
        ran = [r for r, res in enumerate(self.results()) if key in res]
        assert ran == list(range(world)), f"{key} ran on ranks {ran}, want 0 .. {world - 1}"
        failed = {r: res[key] for r, res in enumerate(self.results()) if res.get(key) is not None}
        assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
