"""The admission scheduler as one Ray actor (serial: one decision at a time)."""

from __future__ import annotations

import ray

from rlsys.rollout.admission import AdmissionScheduler

AdmissionActor = ray.remote(num_cpus=0, max_concurrency=1)(AdmissionScheduler)
