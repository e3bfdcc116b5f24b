"""The decode loops drop to the cores other processes leave free, and take them back when the
machine is quiet."""

from __future__ import annotations

import pytest

from draftsmith.runtime.decoding.threads import ThreadGovernor

pytestmark = pytest.mark.unit


class FakeMachine:
    """A 2-core machine whose other processes use ``others`` cores' worth of CPU while we use
    ``ours``."""

    def __init__(self) -> None:
        self.t, self.own, self.busy, self.threads = 0.0, 0.0, 100.0, 2
        self.others, self.ours = 0.0, 2.0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.own += self.ours * seconds
        self.busy += (self.ours + self.others) * seconds

    def governor(self, **kw) -> ThreadGovernor:
        return ThreadGovernor(
            interval_s=0.1,
            cpus=2,
            busy_reader=lambda: self.busy,
            clock=lambda: self.t,
            own_cpu=lambda: self.own,
            get_threads=lambda: self.threads,
            set_threads=lambda n: setattr(self, "threads", n),
            **kw,
        )


def test_one_busy_process_takes_a_core_and_gives_it_back(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_THREADS", raising=False)
    machine = FakeMachine()
    gov = machine.governor()
    machine.advance(0.2)
    gov.tick()
    assert machine.threads == 2  # quiet: both cores stay ours
    machine.others, machine.ours = 1.0, 1.0  # a busy process arrives
    machine.advance(0.2)
    gov.tick()
    assert machine.threads == 1 and gov.changes == 1
    machine.advance(0.05)
    gov.tick()  # between looks nothing is read or changed
    assert gov.changes == 1
    machine.others, machine.ours = 0.0, 1.0  # it leaves
    machine.advance(0.2)
    gov.tick()
    assert machine.threads == 2 and gov.changes == 2


@pytest.mark.parametrize(("others", "threads"), [(0.1, 2), (0.3, 1), (1.0, 1), (2.0, 1)])
def test_the_thread_count_follows_the_cores_others_take(monkeypatch, others, threads):
    monkeypatch.delenv("DRAFTSMITH_THREADS", raising=False)
    machine = FakeMachine()
    gov = machine.governor()
    machine.others = others
    machine.advance(0.5)
    gov.tick()
    assert machine.threads == threads  # never below one thread, background noise (0.1 core) ignored


def test_fixed_threads_or_no_proc_stat_leave_the_count_alone(monkeypatch):
    machine = FakeMachine()
    monkeypatch.setenv("DRAFTSMITH_THREADS", "fixed")
    fixed = machine.governor()
    machine.others = 2.0
    machine.advance(1.0)
    fixed.tick()
    assert machine.threads == 2 and not fixed.enabled
    monkeypatch.delenv("DRAFTSMITH_THREADS")
    blind = ThreadGovernor(
        busy_reader=lambda: None, set_threads=lambda n: pytest.fail("must not set threads")
    )
    blind.tick()
    assert not blind.enabled


def test_restore_gives_back_the_starting_count(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_THREADS", raising=False)
    machine = FakeMachine()
    gov = machine.governor()
    machine.others = 1.0
    machine.advance(0.5)
    gov.tick()
    assert machine.threads == 1
    gov.restore()
    assert machine.threads == 2
