"""Assembling and running one job: ledger, stream, actors, controller (what `rlsys run` does).

Invariants: the config is already validated; the job row and its resolved config are
written before any actor starts; from that moment every way out (a named end, an
interrupt, a crash in any phase: stream, Ray, trackers, actors, warm start, critic
pre-training, first broadcast, the loop) ends the job with a status and a reason in the
ledger (`JobLifetime`), so `lost` is 0 afterwards; the actors are torn down whatever
happens; while the job runs, its driver's heartbeat is on its row.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlsys.actors.admission import AdmissionActor
from rlsys.actors.cluster_metrics import ClusterMetrics
from rlsys.actors.engine_replica import EngineReplica
from rlsys.actors.placement import check_placement, job_demands, total, wait_ready
from rlsys.actors.ray_cluster import JobHandles, RayCluster
from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.actors.runtime import init_ray, joins_cluster
from rlsys.actors.trainer_actor import TrainerActor
from rlsys.config.job import JobConfig
from rlsys.config.locations import resolve_ledger_url
from rlsys.control.controller import Controller
from rlsys.control.job_lifetime import JobLifetime
from rlsys.control.job_reporting import JobReporting
from rlsys.control.messages import WarmStartReport
from rlsys.ledger.db import redact
from rlsys.ledger.liveness import JOB_ORPHANED, JobStillRunning, effective_status, heartbeat_age_s
from rlsys.ledger.queries import stats
from rlsys.ledger.store import JOB_LIVE_STATUSES, Ledger
from rlsys.ledger.stream import open_stream

STOP_REQUESTED = "stopping"


def ledger_url_for(cfg: JobConfig) -> str:
    """`store.ledger_url`, else RLSYS_LEDGER_URL, else RUN_ROOT/ledger.db (as every command)."""
    return resolve_ledger_url(cfg.store.ledger_url, run_root=cfg.store.run_root)


def stream_url_for(cfg: JobConfig, job_id: str) -> str:
    """The job's rollout stream: `local://` is a SQLite file in the job's run directory;
    a shared Redis or SQLite file gets one stream per job."""
    url = cfg.store.stream_url
    sep = "&" if "?" in url else "?"
    if url.startswith("local://"):
        return f"sqlite:///{Path(cfg.store.run_root).absolute() / job_id / 'stream.db'}"
    if url.startswith(("redis://", "rediss://", "unix://")) and "stream=" not in url:
        return f"{url}{sep}stream=rlsys:{job_id}"
    if url.startswith("sqlite://") and "stream=" not in url:
        return f"{url}{sep}stream={job_id}"
    return url


def run_job(
    cfg: JobConfig,
    *,
    resume: str | None = None,
    job_id: str | None = None,
    address: str | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_event: Callable[[str], None] = print,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `cfg` to its end; returns the ledger's stats of the job plus run facts, with
    `status` and `end_reason`. A crash ends the job `failed` and is raised; a named end
    (solved, no learning signal, a stop, an interrupt) is returned. `on_phase` hears each
    phase of the driver's start-up by name, before it runs."""
    ledger = Ledger.open(ledger_url_for(cfg))
    cluster: RayCluster | None = None
    reporting: JobReporting | None = None
    controller: Controller | None = None
    started = time.time()
    try:
        job_id = _open_job(ledger, cfg, resume, job_id)
        run_dir = Path(cfg.store.run_root) / job_id
        run_dir.mkdir(parents=True, exist_ok=True)
        on_event(f"job {job_id}: ledger {redact(ledger_url_for(cfg))}")
        with JobLifetime(ledger, job_id, cfg.store.driver_timeout_s, on_phase) as life:
            life.phase("stream")
            stream_url = stream_url_for(cfg, job_id)
            open_stream(stream_url).close()  # fails here, before any actor starts
            life.phase("ray")
            init_ray(address, logical_cpus=_logical_cpus(cfg) + 1)
            life.phase("placement")
            # a cluster this driver started cannot grow: an actor it cannot place would
            # wait forever, so the job ends here naming the field (`placement`)
            check_placement(cfg, can_grow=joins_cluster(address), on_event=on_event)
            life.phase("reporting")
            reporting = JobReporting.open(cfg, job_id, ledger, run_dir, on_event, ClusterMetrics)
            life.phase("actors")
            cluster = _start_actors(cfg, job_id, run_dir, stream_url)
            checkpoint = run_dir / "checkpoint"
            if not resume:
                _prepare_trainer(cfg, cluster.h.trainer, checkpoint, life, on_event)
            life.phase("first_broadcast")
            controller = Controller(
                cfg,
                job_id,
                ledger,
                cluster,
                run_dir=run_dir,
                start=cluster.trainer_position(),
                on_step=reporting.wrap(on_step),
                should_stop=lambda: _stop_requested(ledger, job_id),
            )
            controller.broadcast_weights()
            life.phase("loop")
            started = time.time()
            life.end(*controller.run())
        return _summary(ledger, job_id, life, controller, cluster, started)
    finally:
        if reporting is not None:
            reporting.end()
        if cluster is not None:
            for actor in cluster.h.all():
                ray.kill(actor, no_restart=True)
        ledger.close()


def _open_job(ledger: Ledger, cfg: JobConfig, resume: str | None, job_id: str | None) -> str:
    """Create the job's row, or re-open a resumed job's: refused while its driver lives
    (two drivers would share it) or while it is orphaned (reap it first)."""
    if not resume:
        return ledger.create_job(cfg.name, json.loads(cfg.model_dump_json()), job_id=job_id)
    job = ledger.get_job(resume)  # raises UnknownJob
    status = effective_status(job)
    if status == JOB_ORPHANED:
        raise JobStillRunning(
            f"job {resume} is orphaned (its driver died): `rlsys jobs reap {resume}` ends it, "
            "then resume it"
        )
    if status in JOB_LIVE_STATUSES:
        raise JobStillRunning(
            f"job {resume} is still {status} (its driver beat {heartbeat_age_s(job):.0f} s "
            "ago): stop it first (`rlsys jobs stop`)"
        )
    ledger.set_job_status(resume, "running")
    return resume


def _logical_cpus(cfg: JobConfig) -> float:
    return total(job_demands(cfg), "CPU")  # every actor's, trainer followers included


def _start_actors(cfg: JobConfig, job_id: str, run_dir: Path, stream_url: str) -> RayCluster:
    """The trainer, the engine replicas, the admission scheduler and the workers, ready."""
    make_trainer = partial(
        _make_trainer, cfg, job_id, str(run_dir / "checkpoint"), stream_url, itertools.count()
    )
    trainer = make_trainer()
    replicas = {
        f"replica-{i}": EngineReplica.options(
            name=actor_name(job_id, f"replica-{i}"),
            num_cpus=cfg.engine.placement.num_cpus,
            num_gpus=cfg.engine.placement.num_gpus,
            resources=cfg.engine.placement.resources,
            max_concurrency=256,
        ).remote(f"replica-{i}", cfg)
        for i in range(cfg.engine.placement.replicas)
    }
    # The admission scheduler is the control plane's singleton: it lives on the driver's
    # node, whose loss ends the job anyway, never on a node that may go with its workers.
    admission = AdmissionActor.options(scheduling_strategy=_on_driver_node()).remote(
        list(replicas), max_running=cfg.engine.max_running, max_queue=cfg.engine.max_queue
    )
    make_worker = partial(_make_worker, cfg, job_id, admission, replicas, stream_url)
    workers = {f"worker-{i}": make_worker(f"worker-{i}") for i in range(cfg.rollout.workers)}
    handles = JobHandles(admission, replicas, workers, trainer)
    ready = {
        **{name: w.ready.remote() for name, w in workers.items()},
        **{name: r.ready.remote() for name, r in replicas.items()},
        "trainer": trainer.__ray_ready__.remote(),
    }
    try:
        wait_ready(ready, cfg.store.start_timeout_s)
    except BaseException:
        for actor in handles.all():  # none may start later, for a job that has ended
            ray.kill(actor, no_restart=True)
        raise
    return RayCluster(handles, cfg.engine, make_worker, make_trainer)


def _prepare_trainer(
    cfg: JobConfig,
    trainer: ActorHandle,
    checkpoint: Path,
    life: JobLifetime,
    on_event: Callable[[str], None],
) -> None:
    """A new job's warm start and critic pre-training, then its step-0 checkpoint."""
    critic = cfg.algo.critic
    pretrain_critic = critic.enabled and critic.pretrain_steps > 0
    if not (cfg.trainer.warm_start.steps or pretrain_critic):
        return
    if cfg.trainer.warm_start.steps:
        life.phase("warm_start")
        on_event(f"warm start: {cfg.trainer.warm_start.steps} supervised steps on demonstrations")
        report: WarmStartReport = ray.get(trainer.warm_start.remote())
        on_event(
            f"warm start done: {report.demonstrations} demonstrations, "
            f"NLL {report.nll_first:.3f} -> {report.nll_last:.3f}"
        )
    if pretrain_critic:
        life.phase("critic_pretrain")
        on_event(f"critic pre-training: {critic.pretrain_steps} value-regression steps")
        on_event(f"critic pre-training done: {ray.get(trainer.pretrain_critic.remote())}")
    # Step 0 checkpointed: a trainer replaced before step 1 restarts warm.
    ray.get(trainer.checkpoint.remote(str(checkpoint), None))


def _summary(
    ledger: Ledger,
    job_id: str,
    life: JobLifetime,
    controller: Controller | None,
    cluster: RayCluster | None,
    started: float,
) -> dict[str, Any]:
    out = stats(ledger, job_id)
    out.update(status=life.status, end_reason=life.reason, wall_s=time.time() - started)
    if (
        controller is None or cluster is None
    ):  # ended before the loop (an interrupt during the warm start)
        return {**out, "steps": []}
    run = controller.stats
    out.update(
        steps=run.steps,
        worker_deaths=run.worker_deaths,
        task_errors=run.task_errors,
        trainer_restarts=run.trainer_restarts,
        redelivered=run.redelivered,
        stale_filtered=run.stale_filtered,
        stream_retries=run.stream_retries,
        stream_failed=run.stream_failed,
        step_retries=run.step_retries,
        ack_retries=run.ack_retries,
        ledger_reconnects=ledger.reconnects,
        staleness_holds=controller.planner.staleness_holds,
        replicas_dropped=run.replicas_dropped,
        weight_groups_formed=cluster.publisher.groups_formed,
        task_pass_rate=controller.planner.profiles.pass_rate(),
        fresh_pass_rate=controller.planner.profiles.fresh_pass_rate(),
        prompt_mix=controller.planner.profiles.mix(),
    )
    return out


def _on_driver_node() -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _make_worker(
    cfg: JobConfig,
    job_id: str,
    admission: ActorHandle,
    replicas: dict[str, ActorHandle],
    stream_url: str,
    name: str,
) -> ActorHandle:
    return RolloutWorker.options(
        name=actor_name(job_id, name),
        num_cpus=cfg.rollout.num_cpus,
        resources=cfg.rollout.resources,
        max_concurrency=cfg.rollout.concurrency_per_worker + 2,
    ).remote(
        name,
        job_id,
        ledger_url_for(cfg),
        cfg,
        admission,
        replicas,
        stream_url,
    )


def _make_trainer(
    cfg: JobConfig, job_id: str, checkpoint: str, stream_url: str, generation: Iterator[int]
) -> ActorHandle:
    """A trainer actor (`trainer-0`, then `trainer-1`, ... for replacements), restored from
    `checkpoint` when one exists (a resume, a replacement)."""
    return TrainerActor.options(
        name=actor_name(job_id, f"trainer-{next(generation)}"),
        num_cpus=cfg.trainer.num_cpus,
        num_gpus=cfg.trainer.num_gpus,
        resources=cfg.trainer.resources,
    ).remote(cfg, checkpoint, stream_url)


def actor_name(job_id: str, role: str) -> str:
    """The Ray name of a job's actor (e.g. `rlsys:JOB:worker-0`): what operators and fault
    tests use to find it with `ray.get_actor`."""
    return f"rlsys:{job_id}:{role}"


def _stop_requested(ledger: Ledger, job_id: str) -> bool:
    try:
        return ledger.get_job(job_id)["status"] == STOP_REQUESTED
    except Exception:
        return False
