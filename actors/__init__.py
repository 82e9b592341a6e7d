"""Thin Ray actor wrappers that assemble the core objects (docs/ARCHITECTURE.md,
"Dependency rule" and "One step of data flow").

The only package (with the CLI) that imports `ray`. Each actor wraps one core object and
adds nothing but transport: engine replicas (`engine_replica`), the admission scheduler
(`admission`), rollout workers (`rollout_worker`) and the trainer (`trainer_actor`, which
reads trajectories from the rollout stream through `trajectory_inbox`). The driver-side
loop that joins them is `controller`, the Ray edge around a core with no Ray in it:
`planner` (planning, the staleness gate), `failures` (failed rollouts, task errors, dead
workers), `step_commit` (a step's ledger commit), with typed `messages` between them.
"""
