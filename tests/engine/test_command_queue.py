"""The scheduler thread's command queue, shared by the native and the vLLM engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from rlsys.engine.command_queue import CommandQueue

pytestmark = pytest.mark.unit


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)


class Work:
    """A stand-in engine: `left` steps of work; each step notes what ran before it."""

    def __init__(self) -> None:
        self.left = 0
        self.log: list[str] = []
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        self.in_step.set()
        assert self.release.wait(30)
        self.log.append("step")
        self.left -= 1


def start(queue: CommandQueue, work: Work) -> threading.Thread:
    loop = threading.Thread(target=queue.serve, args=(work.has_work, work.step), daemon=True)
    loop.start()
    return loop


def test_commands_run_in_order_between_steps_and_steps_run_while_there_is_work() -> None:
    queue, work = CommandQueue(), Work()
    loop = start(queue, work)

    def add(n: int) -> Callable[[], None]:
        def command() -> None:
            work.log.append(f"add{n}")
            work.left += n

        return command

    queue.submit(add(2))
    wait_until(lambda: work.log.count("step") == 2)
    assert queue.call(lambda: len(work.log)) == 3  # the loop slept, then took the call
    queue.submit(add(1))
    queue.submit(add(1))
    wait_until(lambda: work.log.count("step") == 4)
    assert work.log[:3] == ["add2", "step", "step"]
    assert work.log[3] == "add1" and "step" in work.log[4:]
    assert queue.close(loop) and not loop.is_alive()


def test_call_returns_the_value_or_raises_the_error_of_its_function() -> None:
    queue, work = CommandQueue(), Work()
    loop = start(queue, work)
    assert queue.call(lambda: threading.current_thread() is loop)
    with pytest.raises(ZeroDivisionError):
        queue.call(lambda: 1 / 0)
    queue.close(loop)


def test_close_runs_the_commands_the_loop_never_took_and_refuses_new_ones() -> None:
    queue, work = CommandQueue(), Work()
    work.left, work.release = 1, threading.Event()
    loop = start(queue, work)
    assert work.in_step.wait(30)  # the loop is inside a step: commands now wait for it
    ran: list[threading.Thread] = []
    queue.submit(lambda: ran.append(threading.current_thread()))
    closer = threading.Thread(target=queue.close, args=(loop,))

    def closed() -> bool:
        try:
            queue.submit(lambda: None)
        except RuntimeError:
            return True
        return False

    closer.start()
    wait_until(closed)
    work.release.set()  # the step ends; the loop sees the queue closed and returns
    closer.join(30)
    assert ran == [closer], "a command accepted before close runs once, in close"
    assert not loop.is_alive() and not queue.close(loop)
