"""Assembling and running one job: ledger, stream, actors, controller (what `rlsys run` does).

Invariants: the config is already validated; the job row and its resolved config are
written before any actor starts; whatever happens, the actors are torn down and the job
ends with a status in the ledger (`finish_job`), so `lost` is 0 afterwards.
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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlsys.actors.admission import AdmissionActor
from rlsys.actors.controller import Controller, JobHandles
from rlsys.actors.engine_replica import EngineReplica
from rlsys.actors.job_reporting import JobReporting
from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.actors.runtime import init_ray
from rlsys.actors.step_commit import trainer_position
from rlsys.actors.trainer_actor import TrainerActor
from rlsys.config.job import JobConfig
from rlsys.config.locations import resolve_ledger_url
from rlsys.ledger.db import redact
from rlsys.ledger.queries import stats
from rlsys.ledger.store import Ledger
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
) -> dict[str, Any]:
    """Run `cfg` to completion; returns the ledger's stats of the job plus run facts."""
    ledger = Ledger.open(ledger_url_for(cfg))
    if resume:
        ledger.get_job(resume)  # raises UnknownJob
        job_id = resume
        ledger.set_job_status(job_id, "running")
    else:
        job_id = ledger.create_job(cfg.name, json.loads(cfg.model_dump_json()), job_id=job_id)
    run_dir = Path(cfg.store.run_root) / job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    on_event(f"job {job_id}: ledger {redact(ledger_url_for(cfg))}")
    stream_url = stream_url_for(cfg, job_id)
    open_stream(stream_url).close()  # fails here, before any actor starts, if unreachable
    logical = (
        cfg.engine.replicas * cfg.engine.num_cpus
        + cfg.rollout.workers * cfg.rollout.num_cpus
        + cfg.trainer.num_cpus * cfg.trainer.data_parallel  # rank 0 and its followers
    )
    init_ray(address, logical_cpus=logical + 1)
    cfg_dict = json.loads(cfg.model_dump_json())
    checkpoint = run_dir / "checkpoint"
    handles: JobHandles | None = None
    reporting: JobReporting | None = None
    try:
        reporting = JobReporting.open(cfg, job_id, ledger, run_dir, on_event)
        make_trainer = partial(
            _make_trainer, cfg, job_id, str(checkpoint), stream_url, itertools.count()
        )
        trainer = make_trainer()
        replicas = {
            f"replica-{i}": EngineReplica.options(
                name=actor_name(job_id, f"replica-{i}"),
                num_cpus=cfg.engine.num_cpus,
                num_gpus=cfg.engine.num_gpus,
                resources=cfg.engine.resources,
                max_concurrency=256,
            ).remote(f"replica-{i}", cfg_dict)
            for i in range(cfg.engine.replicas)
        }
        # The admission scheduler is the control plane's singleton: it lives on the driver's
        # node, whose loss ends the job anyway, never on a node that may go with its workers.
        admission = AdmissionActor.options(scheduling_strategy=_on_driver_node()).remote(
            list(replicas), max_running=cfg.engine.max_running, max_queue=cfg.engine.max_queue
        )
        make_worker = partial(_make_worker, cfg, job_id, admission, replicas, stream_url)
        workers = {f"worker-{i}": make_worker(f"worker-{i}") for i in range(cfg.rollout.workers)}
        handles = JobHandles(admission, replicas, workers, trainer)
        ray.get(
            [w.ready.remote() for w in workers.values()]
            + [r.ready.remote() for r in replicas.values()]
        )
        critic = cfg.algo.critic
        pretrain_critic = critic.enabled and critic.pretrain_steps > 0
        if not resume and (cfg.trainer.warm_start.steps or pretrain_critic):
            if cfg.trainer.warm_start.steps:
                on_event(
                    f"warm start: {cfg.trainer.warm_start.steps} supervised steps on demonstrations"
                )
                warm = ray.get(trainer.warm_start.remote())
                on_event(f"warm start done: {warm}")
            if pretrain_critic:
                on_event(f"critic pre-training: {critic.pretrain_steps} value-regression steps")
                on_event(f"critic pre-training done: {ray.get(trainer.pretrain_critic.remote())}")
            # Step 0 checkpointed: a trainer replaced before step 1 restarts warm.
            ray.get(trainer.checkpoint.remote(str(checkpoint), {}))
        start = trainer_position(ray.get(trainer.position.remote()))
        controller = Controller(
            cfg,
            job_id,
            ledger,
            handles,
            make_worker,
            make_trainer,
            run_dir=run_dir,
            start=start,
            on_step=reporting.wrap(on_step),
            should_stop=lambda: _stop_requested(ledger, job_id),
        )
        controller.broadcast_weights()
        started = time.time()
        status = controller.run()
        out = stats(ledger, job_id)
        out.update(
            status=status,
            wall_s=time.time() - started,
            steps=controller.stats.steps,
            worker_deaths=controller.stats.worker_deaths,
            task_errors=controller.stats.task_errors,
            trainer_restarts=controller.stats.trainer_restarts,
            redelivered=controller.stats.redelivered,
            stale_filtered=controller.stats.stale_filtered,
            staleness_holds=controller.planner.staleness_holds,
            replicas_dropped=controller.stats.replicas_dropped,
            weight_groups_formed=controller.publisher.groups_formed,
        )
        return out
    finally:
        if reporting is not None:
            reporting.end()
        if handles is not None:
            for actor in [
                *handles.workers.values(),
                *handles.replicas.values(),
                handles.trainer,
                handles.admission,
            ]:
                ray.kill(actor, no_restart=True)
        ledger.close()


def _on_driver_node() -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _make_worker(
    cfg: JobConfig,
    job_id: str,
    admission: Any,
    replicas: dict[str, Any],
    stream_url: str,
    name: str,
) -> Any:
    return RolloutWorker.options(
        name=actor_name(job_id, name),
        num_cpus=cfg.rollout.num_cpus,
        resources=cfg.rollout.resources,
        max_concurrency=cfg.rollout.concurrency_per_worker + 2,
    ).remote(
        name,
        job_id,
        ledger_url_for(cfg),
        json.loads(cfg.model_dump_json()),
        admission,
        replicas,
        stream_url,
    )


def _make_trainer(
    cfg: JobConfig, job_id: str, checkpoint: str, stream_url: str, generation: Iterator[int]
) -> Any:
    """A trainer actor (`trainer-0`, then `trainer-1`, ... for replacements), restored from
    `checkpoint` when one exists (a resume, a replacement)."""
    return TrainerActor.options(
        name=actor_name(job_id, f"trainer-{next(generation)}"),
        num_cpus=cfg.trainer.num_cpus,
        num_gpus=cfg.trainer.num_gpus,
        resources=cfg.trainer.resources,
    ).remote(json.loads(cfg.model_dump_json()), checkpoint, stream_url)


def actor_name(job_id: str, role: str) -> str:
    """The Ray name of a job's actor (e.g. `rlsys:JOB:worker-0`): what operators and fault
    tests use to find it with `ray.get_actor`."""
    return f"rlsys:{job_id}:{role}"


def _stop_requested(ledger: Ledger, job_id: str) -> bool:
    try:
        return ledger.get_job(job_id)["status"] == STOP_REQUESTED
    except Exception:
        return False
