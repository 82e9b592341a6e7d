"""Experiment tracking: a job's per-step series, resolved config and final ledger stats,
sent to the trackers its config lists (W&B, MLflow, TensorBoard).

Importing this package imports no tracker's library (each is imported when a job opens
it), nor torch, ray or the ledger: trackers see plain dicts.
"""
