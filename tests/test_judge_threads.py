"""The thread defence names the candidate's threads, not the ones torch starts for the judge's baseline."""

from __future__ import annotations

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


def test_tqdms_monitor_thread_is_not_work_escaping_but_a_subclass_of_it_is() -> None:
    """Inductor's progress bars start tqdm's monitor thread: it only refreshes bars. A subclass could run anything."""
    pytest.importorskip("tqdm")
    from tqdm._monitor import TMonitor

    class Bars:
        _instances: list[object] = []

    class Borrowed(TMonitor):
        def run(self) -> None:
            self.was_killed.wait()

    before = python_threads()
    monitors = [TMonitor(Bars, 10), Borrowed(Bars, 10)]  # each starts itself
    try:
        assert new_threads(before) == [monitors[1].name]
    finally:
        for m in monitors:
            m.exit()


def test_a_new_thread_with_the_ident_of_an_earlier_one_is_still_new() -> None:
    """The OS hands an ended thread's ident to the next thread it starts: threads are told apart as objects, so
    a candidate's thread that reuses the ident of one running before the call is still found (the reuse is forced
    here: the new thread reports the old one's ident)."""
    stop = threading.Event()
    before_thread = threading.Thread(target=stop.wait, name="running_before")
    before_thread.start()
    before = python_threads()

    class SameIdent(threading.Thread):
        @property
        def ident(self) -> int | None:
            return before_thread.ident

    fresh = SameIdent(target=stop.wait, name="candidate_worker")
    fresh.start()
    try:
        assert fresh.ident == before_thread.ident
        assert "candidate_worker" in new_threads(before)
    finally:
        stop.set()
        fresh.join()
        before_thread.join()
