"""The job config: the one YAML file a user writes (`rlsys run CONFIG`).

Invariants:
- pydantic only (no torch, no ray): a config is validated before anything starts;
- every section forbids unknown keys, and every error names its field path;
- the `engine` section is the engine's one configuration (`rlsys.config.engine`), the
  `sampling` section the one sampling configuration (`rlsys.config.sampling`);
- sections owned by other layers (the task, the sandbox, the scaffold) are kept as plain
  mappings here and validated with those layers' own schemas by
  `rlsys.rollout.job_sections.validate_owned_sections` (which the one loader,
  `rlsys.cli.job_config.load_job_config`, calls), because the dependency rule keeps
  `rlsys.config` below them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlsys.config.algo import AlgoConfig
from rlsys.config.curriculum import CurriculumConfig
from rlsys.config.engine import EngineConfig
from rlsys.config.locations import default_run_root
from rlsys.config.model import PRESETS, ModelConfig
from rlsys.config.sampling import SamplingConfig
from rlsys.config.tracking import TrackerConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    kind: Literal["native", "hf"] = Field(
        "native",
        description="native: our Sparse GQA model from `preset`; hf: a Hugging Face causal LM "
        "from the local directory `path` (trained through the same policy-model interface; "
        "served by `engine.backend: vllm`).",
    )
    path: str | None = Field(
        None, description="kind hf: a local Hugging Face model directory (config + weights)."
    )
    make_tiny: Literal["qwen3", "qwen3_moe"] | None = Field(
        None,
        description="kind hf: when `path` does not exist, `rlsys run` first writes a tiny "
        "random model of this kind there (rlsys.model.hf_tiny: tests and demos; nothing is "
        "downloaded). Unset: a missing `path` is an error.",
    )
    preset: str = Field("small", description=f"Model preset: one of {sorted(PRESETS)}.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="ModelConfig fields to override."
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        # resolved where the config is loaded: actors may run in another directory
        return str(Path(path).expanduser().absolute()) if path else path

    @model_validator(mode="after")
    def _known_preset(self) -> ModelSection:
        if self.preset not in PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; allowed: {', '.join(sorted(PRESETS))}"
            )
        if self.kind == "hf" and not self.path:
            raise ValueError("model.path: kind hf needs a local Hugging Face model directory")
        if self.make_tiny and self.kind != "hf":
            raise ValueError("model.make_tiny: only for model.kind hf")
        self.resolve()
        return self

    def resolve(self) -> ModelConfig:
        return PRESETS[self.preset].with_overrides(self.overrides)


class RolloutSection(_Section):
    workers: int = Field(2, ge=1, le=1024, description="Rollout worker actors.")
    group_size: int = Field(8, ge=1, le=1024, description="Rollouts per prompt (a group).")
    groups_in_flight: int = Field(
        4, ge=1, description="Groups planned and not yet trained (the one training included)."
    )
    pipeline: Literal["async", "sync"] = Field(
        "async",
        description=(
            "async: generation keeps running while the trainer steps (staleness <= "
            "algo.max_staleness); sync: generate one step's groups, train, publish, repeat "
            "(the baseline; staleness 0)."
        ),
    )
    concurrency_per_worker: int = Field(
        4, ge=1, le=256, description="Rollouts a worker runs at once."
    )
    lease_s: float = Field(10.0, gt=0, description="Worker lease; lapsed leases are reconciled.")
    retry_lost: bool = Field(True, description="Retry rollouts of a lost worker as linked rows.")
    max_attempts: int = Field(2, ge=1, description="Attempts per rollout, the first included.")
    num_cpus: float = Field(0.25, ge=0, description="Ray CPUs per rollout worker actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per rollout worker actor; it is placed on a node "
        "that offers them.",
    )
    task: dict[str, Any] = Field(
        default_factory=lambda: {"type": "arithmetic"}, description="Task config."
    )
    sandbox: dict[str, Any] = Field(
        default_factory=lambda: {"type": "bwrap"}, description="Sandbox config."
    )
    scaffold: dict[str, Any] = Field(
        default_factory=dict, description="Scaffold config (turns, budgets)."
    )
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig,
        description="Which prompts are drawn (per-prompt profiles) and when the task is solved.",
    )


class WarmStartSection(_Section):
    steps: int = Field(
        0, ge=0, description="Supervised steps on synthetic demonstrations (0 = off)."
    )
    demonstrations: int = Field(256, ge=1, description="Demonstrations generated from the task.")
    lr: float = Field(3e-3, gt=0, description="Learning rate of the warm start.")
    batch_size: int = Field(16, ge=1, description="Demonstrations per warm-start step.")
    content_weight: float = Field(
        0.0, ge=0, description="Extra loss weight on the tokens that carry the answer."
    )
    lr_schedule: Literal["constant", "cosine", "stable_decay"] = Field(
        "stable_decay",
        description="Warm-start learning rate over its steps (stable_decay: constant, then "
        "linear to 0 over the last quarter).",
    )
    slip_rate: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of demonstrations in which the demonstrator makes a mistake "
        "(reward 0), so the warm-started policy leaves RL a known headroom.",
    )


class TrainerSection(_Section):
    steps: int = Field(20, ge=1, description="Optimiser steps of the RL phase.")
    groups_per_step: int = Field(4, ge=1, description="Groups consumed per optimiser step.")
    lr: float = Field(3e-4, gt=0, description="Adam learning rate (after the warm-up).")
    warmup_steps: int = Field(
        10, ge=0, description="Steps of linear learning-rate warm-up of the RL phase."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    replay_experts: Literal["off", "indices", "indices_and_gates"] = Field(
        "indices", description="Routed-expert replay for the actor (and the reference policy)."
    )
    replay_selections: bool = Field(
        False,
        description="Replay the engine's Sparse GQA block selections in the actor and the "
        "reference forward (needs engine.record_selections; CPU reference path).",
    )
    replay_candidates: bool = Field(True, description="Log-probs over the recorded top-p set only.")
    zero_center: bool = Field(True, description="Zero-center projection on the logit gradient.")
    mtp_weight: float = Field(
        0.1,
        ge=0,
        description="Weight of the MTP heads' next-next-token loss on the policy tokens, in "
        "the warm start and RL steps; it trains the heads only, never the policy (0 = off).",
    )
    lm_head_chunk: int = Field(
        1024,
        ge=0,
        description="Rows per LM-head + log-softmax chunk, recomputed in the backward so the "
        "full logits tensor never exists (0 = one unchunked pass).",
    )
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Tokens per forward/backward micro-batch (gradients accumulate)."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in the backward instead of storing "
        "them: memory per token falls to the residual stream's, for ~1/3 more compute; the "
        "gradients are bitwise the same.",
    )
    cuda_graphs: bool = Field(
        False,
        description="Replay the policy's packed block trunk as CUDA graphs (forward and "
        "backward), captured the second time a micro-batch layout (its sequence lengths) "
        "repeats: the host's per-kernel launch cost leaves the step, the values stay "
        "bitwise the eager ones. It pays where layouts repeat (fixed-length packing); a "
        "layout that never repeats stays eager. Needs a CUDA policy in bfloat16, "
        "data_parallel 1 and activation checkpointing off.",
    )
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every N optimiser steps.")
    mismatch_rollouts: int = Field(
        2,
        ge=0,
        description="Stale rollouts per step recomputed under the weights that sampled them "
        "(host copies of the last max_staleness versions) for the `mismatch` metric; 0: "
        "staleness-0 tokens only (no copies kept).",
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs of the trainer actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs of the trainer actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per trainer actor; it is placed on a node "
        "that offers them.",
    )
    data_parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trainer ranks, each a process holding a shard of the policy and of its "
        "optimiser state (FSDP2, torch.distributed.fsdp.fully_shard) with trainer.num_gpus "
        "GPUs: 1 (NCCL, a GPU per rank) or 0 (gloo on CPUs). Every rank runs its share of "
        "each step's micro-batches; the loss and metrics are the whole batch's; engines "
        "receive full weights (engine.weight_transport: object_store). 1: one unsharded "
        "trainer.",
    )
    data_parallel_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Bound on every collective between trainer ranks: a dead or hung rank "
        "fails the trainer (which the job restarts from its checkpoint), never hangs it.",
    )
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection)

    @model_validator(mode="after")
    def _cuda_graphs_fit(self) -> TrainerSection:
        if not self.cuda_graphs:
            return self
        if self.data_parallel != 1:
            raise ValueError(
                f"trainer.cuda_graphs needs trainer.data_parallel 1, not {self.data_parallel}: "
                "FSDP gathers and scatters each block's parameters around it, which a graph "
                "of the whole trunk cannot hold"
            )
        if self.activation_checkpointing:
            raise ValueError(
                "trainer.cuda_graphs and trainer.activation_checkpointing exclude each other: "
                "a graph keeps every block's activations for its backward; turn one off"
            )
        return self

    @model_validator(mode="after")
    def _data_parallel_fits(self) -> TrainerSection:
        if self.data_parallel == 1:
            return self
        if self.num_gpus not in (0, 1):
            raise ValueError(
                f"trainer.data_parallel {self.data_parallel}: each rank is one process with "
                f"one GPU (NCCL) or none (gloo), so trainer.num_gpus must be 1 or 0, not "
                f"{self.num_gpus}"
            )
        return self


class StoreSection(_Section):
    ledger_url: str | None = Field(
        None,
        description="Ledger URL (default: $RLSYS_LEDGER_URL, else RUN_ROOT/ledger.db; "
        "rlsys.config.locations).",
    )
    stream_url: str = Field(
        "local://",
        description="Rollout stream: local:// (a SQLite file in the job's run directory, "
        "shared by every process of this machine), sqlite:///PATH, or redis://HOST:PORT/DB "
        "(a cluster). Workers and the trainer run in separate processes, so an in-process "
        "memory:// stream cannot carry a job.",
    )

    @model_validator(mode="after")
    def _cross_process_stream(self) -> StoreSection:
        schemes = ("local://", "sqlite://", "redis://", "rediss://", "unix://")
        if not self.stream_url.startswith(schemes):
            raise ValueError(
                f"store.stream_url {self.stream_url!r}: must start with one of "
                f"{', '.join(schemes)} (workers and the trainer are separate processes)"
            )
        return self

    driver_timeout_s: float = Field(
        60.0,
        ge=1.0,
        description="The driver renews the job's heartbeat in the ledger every sixth of this; "
        "a running job whose heartbeat is older reads `orphaned` (its driver died) until "
        "`rlsys jobs reap` ends it.",
    )
    start_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="How long the driver waits for the job's actors to be placed and ready "
        "(model loads included) before the job ends failed naming the ones that are not; on "
        "a cluster that autoscales, the nodes they need must come within it.",
    )
    stream_retry_s: float = Field(
        45.0,
        ge=0.0,
        description="How long a rollout worker retries publishing to an unreachable stream "
        "(bounded backoff) before the rollout ends `failed_stream` and is retried as a new "
        "linked rollout.",
    )
    run_root: str = Field(
        default_factory=default_run_root,
        description="Where ledgers, checkpoints and logs live (default: $RLSYS_RUN_ROOT, "
        "else ./runs).",
    )


class JobConfig(_Section):
    """A whole RL job."""

    name: str = Field("rlsys-job", min_length=1, max_length=200, description="Job name.")
    seed: int = Field(0, description="Seed of everything random.")
    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    store: StoreSection = Field(default_factory=StoreSection)
    tracking: list[TrackerConfig] = Field(
        default_factory=list,
        description="Experiment trackers that get each trainer step's series, the resolved "
        "config and the ledger's final stats (`type`: wandb, mlflow or tensorboard).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if "route_gates" not in self.engine.model_fields_set:
            # ship what the trainer's replay reads: only indices_and_gates reads the gates,
            # which are four fifths of a route's bytes in every trajectory on the stream
            gates = "float32" if self.trainer.replay_experts == "indices_and_gates" else "none"
            self.engine = self.engine.model_copy(update={"route_gates": gates})
        if self.trainer.replay_experts == "indices_and_gates" and self.engine.route_gates != (
            "float32"
        ):
            raise ValueError(
                "trainer.replay_experts indices_and_gates replays the engine's exact gates: "
                f"engine.route_gates must be float32, not {self.engine.route_gates}"
            )
        if self.trainer.replay_selections and not self.engine.record_selections:
            raise ValueError(
                "trainer.replay_selections needs engine.record_selections: the trainer can "
                "only replay the selections the engine recorded"
            )
        self.engine.check_model(self.model.resolve())
        if self.trainer.groups_per_step > self.rollout.groups_in_flight:
            raise ValueError(
                "trainer.groups_per_step must be <= rollout.groups_in_flight "
                f"({self.trainer.groups_per_step} > {self.rollout.groups_in_flight}): "
                "the trainer would wait forever for groups that are never dispatched"
            )
        lookahead = self.trainer.groups_per_step * (self.algo.max_staleness + 1)
        if self.rollout.pipeline == "async" and self.rollout.groups_in_flight > lookahead:
            raise ValueError(
                f"rollout.groups_in_flight ({self.rollout.groups_in_flight}) must be <= "
                "trainer.groups_per_step * (algo.max_staleness + 1) "
                f"({lookahead}): more groups would be generated than can be trained "
                "before they go stale"
            )
        gpus = self.engine.placement.num_gpus
        if self.engine.weight_transport == "collective" and (gpus > 0) != (
            self.trainer.num_gpus > 0
        ):
            raise ValueError(
                "engine.weight_transport: collective needs the trainer and the replicas on "
                f"the same kind of device (trainer.num_gpus {self.trainer.num_gpus}, "
                f"engine.placement.num_gpus {gpus}): both > 0 (NCCL) or both 0 (gloo)"
            )
        if self.engine.tp > 1 and gpus > 0 and gpus != self.engine.tp:
            raise ValueError(
                f"engine.tp ({self.engine.tp}) with engine.placement.num_gpus ({gpus}): a GPU "
                "replica runs one NCCL rank per GPU, so num_gpus must equal tp (or be 0: TP "
                "on the CPU)"
            )
        self._replica_device_follows_placement()
        self._backend_fits_model()
        self._data_parallel_supports()
        if self.sampling.max_tokens_per_turn >= self.engine.max_context_tokens:
            raise ValueError("sampling.max_tokens_per_turn must be < engine.max_context_tokens")
        return self

    def _replica_device_follows_placement(self) -> None:
        """A replica runs where Ray put it: `device` and `tp_backend` follow
        `engine.placement.num_gpus`; the engine's seed is the job's unless given."""
        on_gpu = self.engine.placement.num_gpus > 0
        if self.engine.device.startswith("cuda") != on_gpu:
            raise ValueError(
                f"engine.device {self.engine.device!r}: a replica runs on the device Ray gives "
                f"it (engine.placement.num_gpus {self.engine.placement.num_gpus}); leave "
                "engine.device out"
            )
        if (self.engine.tp_backend == "nccl") != (on_gpu and self.engine.tp > 1):
            raise ValueError(
                f"engine.tp_backend {self.engine.tp_backend!r}: nccl exactly when a GPU replica "
                "has tp > 1 (engine.placement.num_gpus > 0); leave engine.tp_backend out"
            )
        if "seed" not in self.engine.model_fields_set:
            self.engine = self.engine.model_copy(update={"seed": self.seed})

    def _data_parallel_supports(self) -> None:
        """What does not run sharded yet is refused here, by field (rlsys.trainer.fsdp)."""
        if self.trainer.data_parallel == 1:
            return
        refused = {
            "model.kind must be native (FSDP2 shards our Transformer's blocks)": (
                self.model.kind != "native"
            ),
            # both the trainer ranks' group and the broadcast group are the process's
            # default torch.distributed group (rlsys.engine.sync_group): one process has one
            "engine.weight_transport must be object_store": (
                self.engine.weight_transport == "collective"
            ),
        }
        wrong = [why for why, bad in refused.items() if bad]
        if wrong:
            raise ValueError(
                f"trainer.data_parallel {self.trainer.data_parallel}: " + "; ".join(wrong)
            )

    def _backend_fits_model(self) -> None:
        serves = {"native": "native", "vllm": "hf"}  # engine backend -> the model kind it serves
        if serves[self.engine.backend] != self.model.kind:
            raise ValueError(
                f"engine.backend {self.engine.backend!r} serves model.kind "
                f"{serves[self.engine.backend]!r}, not {self.model.kind!r}"
            )
        if self.engine.backend == "vllm" and (
            self.engine.weight_transport != "object_store" or self.engine.tp != 1
        ):
            raise ValueError(
                "engine.backend vllm: weights move through the object store "
                "(engine.weight_transport: object_store) and each replica has tp 1"
            )
