"""At most K staging Jobs at once per operator, and at most N per namespace; the rest wait in
a first-come queue.

Staging is bounded by the storage and the network, not by the cluster's scheduler, so an
operator that starts every staging at once (a fleet rollout, a new namespace) makes them
all slow. The limit counts *stage* Jobs (the Indexed Job of a scaled-out artifact is one);
a finalize Job is not held back: its staging was admitted already and it frees nothing.

Kept in the operator's memory, fed by the stager Job events (which kopf also delivers for
every existing Job when it starts, so a restarted operator counts the Jobs already running)
and by the reconciler's own creations (a reservation taken before the Job exists, under a
lock, so two ModelDeployments reconciled at once cannot both take the last slot). The queue
order is lost on restart; positions are then rebuilt in the order ModelDeployments resume.

Tenants share the slots: one namespace may hold at most ``per_namespace`` of them, and a
waiter whose namespace is at that cap lets the waiters behind it pass, so one namespace
cannot stall staging everywhere (a stage Job may run for days). Only Jobs a ModelDeployment
owns count (``kube.model_deployment_owners``): a Job that merely bears the name or the labels
takes no slot.
"""

from __future__ import annotations

import threading
from collections import Counter

Key = tuple[str, str]
"""(namespace, name)."""


class StagerSlots:
    def __init__(self, limit: int, per_namespace: int = 0) -> None:
        self.limit = limit
        """0: no limit."""
        self.per_namespace = per_namespace
        """Slots one namespace may hold at once; 0: no cap beyond ``limit``."""
        self._running: set[Key] = set()
        self._queue: list[Key] = []
        self._lock = threading.Lock()

    def acquire(self, job: Key, waiter: Key) -> int:
        """0 when ``waiter`` may create ``job`` now (a slot is reserved for it); else its
        1-based position in the queue. First come, first served: a waiter gets a slot only
        when every one queued before it fits too, except those whose namespace is at its
        cap (they wait for their own namespace's Jobs, not for a free slot)."""
        with self._lock:
            if (self.limit <= 0 and self.per_namespace <= 0) or job in self._running:
                self._drop(waiter)
                return 0
            if waiter not in self._queue:
                self._queue.append(waiter)
            free = self.limit - len(self._running) if self.limit > 0 else len(self._queue)
            used = Counter(namespace for namespace, _ in self._running)
            for queued in self._queue:  # who would go, in order, if each asked now
                if 0 < self.per_namespace <= used[queued[0]]:
                    continue
                if free <= 0:
                    break
                if queued == waiter:
                    self._running.add(job)
                    self._queue.remove(waiter)
                    return 0
                free -= 1
                used[queued[0]] += 1
            return self._queue.index(waiter) + 1

    def running(self, job: Key) -> None:
        """A stage Job exists and runs (seen in an event)."""
        with self._lock:
            self._running.add(job)

    def finished(self, job: Key) -> bool:
        """A stage Job ended or is gone; True when that freed a slot."""
        with self._lock:
            if job not in self._running:
                return False
            self._running.discard(job)
            return True

    def forget(self, waiter: Key) -> None:
        """A queued ModelDeployment was deleted."""
        with self._lock:
            self._drop(waiter)

    def waiting(self) -> list[Key]:
        with self._lock:
            return list(self._queue)

    def _drop(self, waiter: Key) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
