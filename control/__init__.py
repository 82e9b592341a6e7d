"""The control core of a job, with no Ray in it (docs/ARCHITECTURE.md, "Layout" and
"Dependency rule").

The driver-side loop, `controller`, reaches the actors only through the `JobCluster`
protocol of `cluster` (Ray's implementation is `rlsys.actors.ray_cluster`), and decides
through small units: `planner` (planning, the window, the staleness gate), `failures`
(failed rollouts, task errors, dead workers), `step_commit` (a step's ledger commit),
`groups`, `generation` (what a step cost in generation), `task_profiles` (the curriculum),
`job_end`, `job_lifetime` and `job_reporting`. `messages` holds the typed messages between
the actors. The Ray-free halves of the actors live here too: a worker's ledger writes
(`ledger_sink`, `ledger_writer`) and the trainer's side of the stream (`trajectory_inbox`).
`tests/test_architecture.py` fails if anything here imports Ray.
"""
