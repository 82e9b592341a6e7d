"""Trackers are chosen in the job config by `type`, through one registry."""

import typing

import pytest

from rlsys.cli.errors import UserError
from rlsys.cli.job_config import load_job_config
from rlsys.config.tracking import TrackerConfig
from rlsys.tracking.registry import TRACKERS

pytestmark = pytest.mark.unit

SMOKE = "configs/smoke-tiny.yaml"


def test_every_tracker_type_the_config_accepts_has_an_implementation_and_no_other():
    union = typing.get_args(TrackerConfig)[0]
    types = {
        typing.get_args(cls.model_fields["type"].annotation)[0] for cls in typing.get_args(union)
    }
    assert types == set(TRACKERS) == {"wandb", "mlflow", "tensorboard"}


def test_a_tracker_list_is_validated_entry_by_entry():
    cfg = load_job_config(
        SMOKE, ("tracking=[{type: wandb, mode: offline}, {type: mlflow, experiment: x}]",)
    )
    assert [t.type for t in cfg.tracking] == ["wandb", "mlflow"]
    assert cfg.tracking[0].mode == "offline" and cfg.tracking[1].experiment == "x"


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{type: comet}", "tracking.0: Input tag 'comet'"),
        ("{type: wandb, mode: sometimes}", "tracking.0.wandb.mode"),
        ("{type: mlflow, experimnet: x}", "tracking.0.mlflow.experimnet: unknown key"),
    ],
)
def test_a_bad_tracker_entry_names_its_field(entry, message):
    with pytest.raises(UserError) as err:
        load_job_config(SMOKE, (f"tracking=[{entry}]",))
    assert message in str(err.value)
