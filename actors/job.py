"""Assembling and running one job: ledger, stream, actors, controller (what `rlsys run` does).

Invariants: the config is already validated; the job row and its resolved config are
written before any actor starts; whatever happens, the actors are torn down and the job
ends with a status in the ledger (`finish_job`), so `lost` is 0 afterwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray

from rlsys.actors.admission import AdmissionActor
from rlsys.actors.controller import Controller, JobHandles
from rlsys.actors.engine_replica import EngineReplica
from rlsys.actors.job_reporting import JobReporting
from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.actors.runtime import init_ray
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


def _stream_url(cfg: JobConfig, job_id: str) -> str:
    url = cfg.store.stream_url
    sep = "&" if "?" in url else "?"
    if url.startswith("redis://") and "stream=" not in url:
        return f"{url}{sep}stream=rlsys:{job_id}"
    if url.startswith("memory://"):
        return f"memory://{job_id}"
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
    stream = open_stream(_stream_url(cfg, job_id))
    logical = (
        cfg.engine.replicas * cfg.engine.num_cpus
        + cfg.rollout.workers * cfg.rollout.num_cpus
        + cfg.trainer.num_cpus
    )
    init_ray(address, logical_cpus=logical + 1)
    cfg_dict = json.loads(cfg.model_dump_json())
    checkpoint = run_dir / "checkpoint"
    handles: JobHandles | None = None
    reporting: JobReporting | None = None
    try:
        reporting = JobReporting.open(cfg, job_id, ledger, run_dir, on_event)
        trainer = TrainerActor.options(
            num_cpus=cfg.trainer.num_cpus, num_gpus=cfg.trainer.num_gpus
        ).remote(cfg_dict, str(checkpoint) if resume else None)
        start = ray.get(trainer.position.remote())
        replicas = {
            f"replica-{i}": EngineReplica.options(
                name=actor_name(job_id, f"replica-{i}"),
                num_cpus=cfg.engine.num_cpus,
                num_gpus=cfg.engine.num_gpus,
                max_concurrency=256,
            ).remote(f"replica-{i}", cfg_dict)
            for i in range(cfg.engine.replicas)
        }
        admission = AdmissionActor.remote(
            list(replicas), max_running=cfg.engine.max_running, max_queue=cfg.engine.max_queue
        )
        make_worker = partial(_make_worker, cfg, job_id, admission, replicas)
        workers = {f"worker-{i}": make_worker(f"worker-{i}") for i in range(cfg.rollout.workers)}
        handles = JobHandles(admission, replicas, workers, trainer)
        ray.get(
            [w.ready.remote() for w in workers.values()]
            + [r.ready.remote() for r in replicas.values()]
        )
        if not resume and cfg.trainer.warm_start.steps:
            on_event(
                f"warm start: {cfg.trainer.warm_start.steps} supervised steps on demonstrations"
            )
            warm = ray.get(trainer.warm_start.remote())
            on_event(f"warm start done: {warm}")
        controller = Controller(
            cfg,
            job_id,
            ledger,
            stream,
            handles,
            make_worker,
            run_dir=run_dir,
            start_step=start["step"],
            start_version=start["version"],
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
            stale_filtered=controller.stats.stale_filtered,
            staleness_holds=controller.stats.staleness_holds,
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
        stream.close()
        ledger.close()


def _make_worker(
    cfg: JobConfig, job_id: str, admission: Any, replicas: dict[str, Any], name: str
) -> Any:
    return RolloutWorker.options(
        name=actor_name(job_id, name),
        num_cpus=cfg.rollout.num_cpus,
        max_concurrency=cfg.rollout.concurrency_per_worker + 2,
    ).remote(
        name, job_id, ledger_url_for(cfg), json.loads(cfg.model_dump_json()), admission, replicas
    )


def actor_name(job_id: str, role: str) -> str:
    """The Ray name of a job's actor (e.g. `rlsys:JOB:worker-0`): what operators and fault
    tests use to find it with `ray.get_actor`."""
    return f"rlsys:{job_id}:{role}"


def _stop_requested(ledger: Ledger, job_id: str) -> bool:
    try:
        return ledger.get_job(job_id)["status"] == STOP_REQUESTED
    except Exception:
        return False
