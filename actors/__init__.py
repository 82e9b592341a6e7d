"""Thin Ray actor wrappers and their wiring (docs/ARCHITECTURE.md, "Dependency rule" and
"One step of data flow").

The only package (with the CLI) that imports `ray`. Each actor wraps one core object and
adds nothing but transport: engine replicas (`engine_replica`), the admission scheduler
(`admission`), rollout workers (`rollout_worker`) and the trainer (`trainer_actor`, with
its data-parallel ranks in `trainer_ranks`). `ray_cluster` is the control loop's edge on
Ray (`rlsys.control.cluster.JobCluster`); `job` assembles a job and runs the loop
(`rlsys.control.controller`). Every decision lives in `rlsys.control`, which has no Ray.
"""
