"""The injectors of the lossy-network faults (``--netem``): packets dropped, delayed, duplicated, reordered.

Each changes what the forwarder between the workers' and Redis's network
namespaces (:mod:`lab.netem`) does to every packet, for a window measured in
leases, then restores a clean link, also when the run stops early. Both
kernels' TCP stacks retransmit and back off for real; redis-py sees slow
replies, time-outs and reconnects.
"""

from __future__ import annotations

from lab.faultlab.context import LabContext, ScheduledFault
from lab.netem import Impairment


def _window(context: LabContext, impairment: Impairment, leases: float) -> float:
    """``impairment`` for ``leases`` leases (at most until the run stops); the seconds it lasted."""
    seconds = leases * context.lease
    with context.redis_lock:
        context.topology.impair(impairment)
        try:
            context.wait(lambda: False, seconds)
        finally:
            context.topology.impair(Impairment())
    return seconds


def netem_loss(context: LabContext, fault: ScheduledFault) -> str:
    lossy = _window(context, Impairment(loss=0.3, delay_ms=40, jitter_ms=40), 1.5)
    late = _window(context, Impairment(delay_ms=1500 * context.lease), 0.5)
    return (
        f"30% of packets dropped, the rest delayed 40-80 ms, for {lossy:.0f} s; then every packet delayed "
        f"1.5 leases ({1.5 * context.lease:.0f} s, beyond the lease) for {late:.0f} s"
    )


def netem_partition(context: LabContext, fault: ScheduledFault) -> str:
    seconds = _window(context, Impairment(loss=1.0), 2.0)
    return f"every packet between the workers and Redis dropped for {seconds:.0f} s (2 leases)"


def netem_dup_reorder(context: LabContext, fault: ScheduledFault) -> str:
    seconds = _window(context, Impairment(duplicate=0.25, reorder=0.4, delay_ms=5, jitter_ms=30), 2.0)
    return f"25% of packets duplicated, 40% sent out of order (5-35 ms jitter) for {seconds:.0f} s"
