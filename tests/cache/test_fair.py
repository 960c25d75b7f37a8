"""FairQueue: tenants are served by weight, not by arrival; FIFO within a tenant; a tenant's backlog is bounded.
FairThread runs the jobs in that order on a real thread."""
import threading
import time

from prefixcache.cache.fair import FairQueue, FairThread


def drain(q: FairQueue) -> list:
    q.close()
    return list(iter(q.get, None))


def test_a_newcomer_is_served_within_two_gets_of_a_backlog():
    q = FairQueue(bound=1000)
    for i in range(100):
        q.put("a", ("a", i))
    q.put("b", ("b", 0))
    assert [q.get(), q.get()] == [("a", 0), ("b", 0)]


def test_each_tenant_is_served_first_in_first_out():
    q = FairQueue(bound=1000)
    for i in range(20):
        q.put("a" if i % 3 else "b", i)
    served = drain(q)
    assert [i for i in served if i % 3] == [i for i in range(20) if i % 3]
    assert [i for i in served if not i % 3] == list(range(0, 20, 3))


def test_turns_follow_the_cache_shares():
    q = FairQueue(bound=1000)
    q.set_shares({"a": 0.5, "b": 0.25})
    for i in range(60):
        q.put("a", "a")
        q.put("b", "b")
    first = drain(q)[:60]
    assert first.count("a") == 40 and first.count("b") == 20


def test_tenants_without_a_share_split_the_rest_equally():
    q = FairQueue(bound=1000)
    q.set_shares({"a": 0.5})  # b and c split the other half
    for _ in range(40):
        for t in "abc":
            q.put(t, t)
    first = drain(q)[:40]
    assert (first.count("a"), first.count("b"), first.count("c")) == (20, 10, 10)


def test_an_idle_tenant_banks_no_turns():
    """b was served while a was away; a back with a backlog gets every other turn, not a run of turns."""
    q = FairQueue(bound=1000)
    for _ in range(10):
        q.put("b", "b")
    assert [q.get() for _ in range(10)] == ["b"] * 10
    for _ in range(10):
        q.put("b", "b")
        q.put("a", "a")
    assert drain(q)[:6] in (["b", "a"] * 3, ["a", "b"] * 3)


def test_a_tenant_over_its_bound_is_refused_and_others_are_not():
    q = FairQueue(bound=3)
    assert all(q.put("a", i) for i in range(3))
    assert not q.put("a", 3)
    assert q.put("b", 0)
    q.get()  # a's first: a has room again
    assert q.put("a", 4)


def test_a_thread_serves_every_job_of_many_threads_fairly():
    """Four producers on their own threads; the one worker thread runs each job once, each tenant's in order, and
    the tenant that queued one job while a blocked thread held a backlog of another's runs second."""
    gate, ran = threading.Event(), []
    worker = FairThread("test-fair", bound=1000)
    worker.submit("x", gate.wait)  # the worker is busy until every job below is queued

    def produce(tenant: str) -> None:
        for i in range(200):
            worker.submit(tenant, ran.append, (tenant, i))

    producers = [threading.Thread(target=produce, args=(t,)) for t in "abcd"]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    last = worker.submit("e", ran.append, ("e", 0))
    gate.set()
    last.result(timeout=10)
    worker.shutdown()
    assert len(ran) == 801
    for t in "abcd":
        assert [i for u, i in ran if u == t] == list(range(200))
    assert ran.index(("e", 0)) <= 4  # behind at most one job of each tenant that was waiting


def test_a_failing_job_fails_its_future_alone():
    worker = FairThread("test-fair", bound=10)
    bad = worker.submit("a", int, "not a number")
    good = worker.submit("a", int, "7")
    assert good.result(timeout=10) == 7 and isinstance(bad.exception(), ValueError)
    worker.shutdown()


def test_a_held_tenant_waits_while_others_are_served():
    q = FairQueue(bound=10)
    for i in range(3):
        q.put("a", ("a", i))
    assert q.get() == ("a", 0)
    t0 = time.monotonic()
    q.hold("a", 0.3)
    q.put("b", ("b", 0))
    assert q.get() == ("b", 0)  # a's next starts earlier, but a is held
    assert q.get() == ("a", 1) and time.monotonic() - t0 >= 0.3


def test_a_thread_with_a_duty_holds_each_tenant_in_proportion_to_its_jobs():
    thread = FairThread("duty", bound=10, duty=0.25)
    try:
        done: list[str] = []
        t0 = time.monotonic()
        jobs = [thread.submit("a", lambda: (time.sleep(0.05), done.append("a"))) for _ in range(3)]
        time.sleep(0.01)
        b = thread.submit("b", lambda: done.append("b"))
        for job in [*jobs, b]:
            job.result(timeout=10)
        # each of a's jobs holds a three times its 0.05 s; b's goes between them
        assert time.monotonic() - t0 >= 3 * 0.05 + 2 * 3 * 0.05 and done.index("b") == 1, done
    finally:
        thread.shutdown()


def test_two_workers_run_another_tenants_job_beside_a_long_one_and_a_tenants_one_at_a_time():
    thread = FairThread("two", bound=10, workers=2)
    try:
        started = threading.Event()
        gate = threading.Event()
        running: list[str] = []

        def long(name: str) -> None:
            running.append(name)
            started.set()
            gate.wait(10)

        first = thread.submit("a", long, "a0")
        started.wait(10)
        second = thread.submit("a", long, "a1")  # a's next waits for a's first, though a thread is free
        b = thread.submit("b", lambda: "b")
        assert b.result(timeout=10) == "b" and running == ["a0"] and not second.done()
        gate.set()
        for job in (first, second):
            job.result(timeout=10)
        assert running == ["a0", "a1"]
    finally:
        gate.set()
        thread.shutdown()
