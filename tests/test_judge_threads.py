"""The thread defence names the candidate's threads, not the ones torch starts for the judge's baseline."""

from __future__ import annotations

import threading

from kernelfuse.judge.guard import new_threads, python_threads


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

    before = python_threads()
    borrowed = Timer(0.2, lambda: None)  # the candidate's own callback in torch's timer
    borrowed.record_call()
    done = threading.Event()
    named = threading.Thread(target=done.wait, name="subproc_worker_timer", daemon=True)
    named.start()
    try:
        assert new_threads(before).count("subproc_worker_timer") == 2
    finally:
        borrowed.quit()
        done.set()
