"""Training state and its owners: recovery (the only part that changes training state), snapshots, the ledger
(events and counters), logged values withdrawn on a discarded step, retries, repeated restores, input conventions.

Private: the public name is :class:`lightning_numguard.NumGuardCallback`.
"""
