"""run_ahead: results in order, work overlapped with the consumer, bytes in flight bounded, errors and early stops."""

import random
import threading
import time

import pytest

from qconvert.write.prefetch import run_ahead


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "qconvert-prefetch"]


def test_results_come_in_task_order_whatever_the_timing():
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.004) for _ in range(40)]

    def task(i):
        def run():
            time.sleep(delays[i])
            return [(i, part) for part in range(i % 3 + 1)]
        return run

    out = list(run_ahead(((1, task(i)) for i in range(40)), limit_bytes=5))
    assert out == [(i, part) for i in range(40) for part in range(i % 3 + 1)]
    assert prefetch_threads() == []


def test_the_next_task_runs_while_the_consumer_holds_a_result():
    started = [threading.Event() for _ in range(3)]

    def task(i):
        def run():
            started[i].set()
            return [i]
        return run

    stream = run_ahead(((10, task(i)) for i in range(3)), limit_bytes=20)
    assert next(stream) == 0
    # Still holding result 0: the worker must get task 1 done without waiting for us.
    assert started[1].wait(timeout=10)
    assert list(stream) == [1, 2]


def test_bytes_in_flight_stay_within_the_limit():
    costs = [30, 10, 10, 50, 10, 120, 10, 10, 10, 40]
    limit = 60
    lock = threading.Lock()
    released = set()
    peaks = []

    def task(i):
        def run():
            with lock:
                # Tasks started and not yet moved past by the consumer, this one included.
                peaks.append(sum(costs[j] for j in range(i + 1) if j not in released))
            time.sleep(0.002)
            return [i]
        return run

    stream = run_ahead(((costs[i], task(i)) for i in range(len(costs))), limit_bytes=limit)
    consumed = []
    for i in stream:
        time.sleep(0.004)  # a slow consumer, so the worker runs ahead as far as it may
        consumed.append(i)
        with lock:
            released.add(i)  # done with it; the next request lets it go
    # Over the limit only when one task alone costs more (the 120-byte one runs by itself).
    assert all(peak <= limit or peak == cost for peak, cost in zip(peaks, costs))
    assert max(peaks) == 120 and consumed == list(range(len(costs)))


@pytest.mark.parametrize("error", [ValueError("bad tensor"), KeyboardInterrupt()])
def test_a_task_error_reaches_the_consumer_after_the_results_before_it(error):
    def task(i):
        def run():
            if i == 3:
                raise error
            return [i]
        return run

    seen = []
    with pytest.raises(type(error)):
        for item in run_ahead(((1, task(i)) for i in range(6)), limit_bytes=2):
            seen.append(item)
    assert seen == [0, 1, 2] and prefetch_threads() == []


def test_stopping_early_stops_the_worker():
    ran = []

    def task(i):
        def run():
            ran.append(i)
            return [i]
        return run

    stream = run_ahead(((1, task(i)) for i in range(1000)), limit_bytes=2)
    assert next(stream) == 0
    stream.close()
    assert prefetch_threads() == [] and len(ran) <= 4
