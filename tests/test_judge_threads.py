"""The thread defence names the candidate's threads, not the ones torch starts for the judge's baseline."""

from __future__ import annotations

import os
import threading

import pytest

from kernelfuse.judge.guard import compiler_threads, new_threads, python_threads, record_thread_origins


def test_inductor_compile_worker_timer_is_not_the_candidates() -> None:
    from torch._inductor.compile_worker import subproc_pool
    from torch._inductor.compile_worker.timer import Timer

    before = python_threads()
    torch_timer = Timer(0.2, subproc_pool.SubprocPool.quiesce)  # as SubprocPool makes it: torch's own callback
    torch_timer.record_call()
    assert "subproc_worker_timer" not in new_threads(before)
    torch_timer.quit()


def test_a_thread_borrowing_torchs_timer_or_its_name_is_reported() -> None:
    from torch._inductor.compile_worker.timer import Timer

    record_thread_origins()  # as the judge's worker does: the timer's thread then starts in torch's compiler code
    before = python_threads()
    borrowed = Timer(0.2, lambda: None)  # the candidate's own callback in torch's timer
    borrowed.record_call()
    done = threading.Event()
    named = threading.Thread(target=done.wait, name="subproc_worker_timer", daemon=True)
    named.start()
    try:
        assert new_threads(before).count("subproc_worker_timer") == 2
        assert "subproc_worker_timer" not in compiler_threads(before)
    finally:
        borrowed.quit()
        done.set()


def test_a_helper_librarys_thread_belongs_to_the_code_that_asked_for_it() -> None:
    """tqdm starts its monitor thread for its caller: Inductor's progress bar makes it torch.compile's, a candidate's
    own bar the candidate's."""
    tqdm = pytest.importorskip("tqdm")
    from tqdm import std

    record_thread_origins()
    before = python_threads()
    old = std.TMonitor
    std.tqdm.monitor_interval, interval = 10, std.tqdm.monitor_interval
    try:
        bar = tqdm.tqdm(total=2, disable=False, file=open(os.devnull, "w"))  # noqa: SIM115 - closed below
        assert any(getattr(t, "kernelfuse_origin", "") == __file__ for t in threading.enumerate()
                   if t.ident not in before and isinstance(t, old))
        bar.close()
    finally:
        std.tqdm.monitor_interval = interval
        if std.tqdm.monitor is not None:
            std.tqdm.monitor.exit()
            std.tqdm.monitor = None
