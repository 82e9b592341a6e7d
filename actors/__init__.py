"""Thin Ray actor wrappers that assemble the core objects (DESIGN.md sections 2-3).

The only package (with the CLI) that imports `ray`. Each actor wraps one core object and
adds nothing but transport: engine replicas (`engine_replica`), the admission scheduler
(`admission`), rollout workers (`rollout_worker`) and the trainer (`trainer_actor`). The
driver-side loop that joins them is `controller`.
"""
