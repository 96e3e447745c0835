"""CPU threads that follow the machine: torch's intra-op threads use every core while the machine is free and only the
cores other processes leave while they hold some.

torch's OpenMP threads meet at a barrier after every op and spin while they wait: when another process holds a core,
the thread descheduled there stalls the rest, and the spinning ones take time from it (2 spinning processes on 2
cores: plain decoding of the default target 4.5–8.3 tok/s at 2 threads, 21–23 at 1; docs/performance.md). Every
WINDOW_S seconds of decoding, `follow()` reads how much CPU the other processes used (/proc/stat less this process;
niced work, which yields, not counted) and sets the threads to the cores they leave, changing only when two windows in
a row agree.
Off where the user chose the threads (OMP_NUM_THREADS, `pin`, `--threads`) or the machine's counters cannot be read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

WINDOW_S = 0.5  # seconds of decoding between readings: a change of load is followed within two
FREE_CORE = 0.5  # a core counts as free when the other processes leave at least this share of it
STALE_S = 4 * WINDOW_S  # a window longer than this spans an idle spell (no cycles): start a new one


def threads_for(others: float, cores: int, most: int) -> int:
    """Threads for the cores the other processes leave (they use `others` cores on average): 1 to `most`."""
    return max(1, min(most, int(cores - others + 1 - FREE_CORE)))


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has run (user, system, interrupts; not niced, idle or stolen)."""
    with open("/proc/stat") as f:
        user, _nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@dataclass
class Governor:
    """The readings of the last window and the change waiting for a second window to agree."""

    most: int  # threads on a free machine
    cores: int
    busy_s: Callable[[], float] = machine_busy_s
    own_s: Callable[[], float] = time.process_time
    clock: Callable[[], float] = time.perf_counter
    mark: tuple[float, float, float] | None = None  # (clock, machine busy s, own cpu s) at the window's start
    pending: int | None = None

    def reading(self) -> tuple[float, float, float]:
        return self.clock(), self.busy_s(), self.own_s()

    def want(self) -> int | None:
        """At the end of a window, the threads it calls for (None mid-window or after an idle spell)."""
        now = self.clock()
        if self.mark is not None and now - self.mark[0] < WINDOW_S:
            return None
        new, old = self.reading(), self.mark
        self.mark = new
        if old is None or new[0] - old[0] > STALE_S:
            return None
        others = max(0.0, (new[1] - old[1]) - (new[2] - old[2])) / (new[0] - old[0])
        return threads_for(others, self.cores, self.most)

    def follow(self) -> None:
        """Called by the decoding thread once a cycle: set its threads when two windows in a row call for a change."""
        want = self.want()
        if want is None:
            return
        if want == torch.get_num_threads():
            self.pending = None
        elif want == self.pending:
            torch.set_num_threads(want)
            self.pending = None
        else:
            self.pending = want


_governor: Governor | None = None
_decided = False  # whether governor() has looked at the machine
_pinned = False


def pin(n: int) -> None:
    """Use n threads from now on, whatever the load (--threads)."""
    global _pinned
    _pinned = True
    torch.set_num_threads(n)


def hand_over() -> int:
    """Drop this thread to one torch thread and return the count it had, for the thread that will run the model.

    libgomp keeps a team of threads for every thread that starts a parallel op, and once the teams' threads outnumber
    the cores every team spins only ~100 times before sleeping at a barrier: each op of the model's thread then waits
    on wake-ups (a plain step of the default target on 2 cores: 29 ms where it alone ran parallel ops, 38 ms after the
    main thread had loaded the model on two threads). A thread on one torch thread starts no team."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    return n


def governor() -> Governor | None:
    """The process's governor, or None where the threads are the user's or the load cannot be read."""
    global _governor, _decided
    if _pinned or "OMP_NUM_THREADS" in os.environ:
        return None
    if not _decided:
        _decided = True
        cores = os.cpu_count() or 1
        try:  # /proc/stat counts every core: only meaningful when this process may run on all of them
            readable = len(os.sched_getaffinity(0)) == cores and machine_busy_s() >= 0
        except (OSError, AttributeError, ValueError):
            readable = False
        _governor = Governor(torch.get_num_threads(), cores) if readable and torch.get_num_threads() > 1 else None
    return _governor


def follow() -> None:
    """Match this thread's torch threads to the cores the machine has free (a no-op where the governor is off)."""
    g = governor()
    if g is not None:
        g.follow()
