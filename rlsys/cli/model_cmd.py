"""`rlsys model info PRESET [--set key=value]... [--json]`: shape facts of a model preset.

Invariant: importing this module imports click and the standard library only; torch is
imported inside the command (the model is built on the meta device: no memory, no init).
"""

from __future__ import annotations

import json
from typing import Any

import click

from rlsys.cli.errors import UserError


@click.group("model")
def model() -> None:
    """Inspect the policy model."""


def _parse_overrides(pairs: tuple[str, ...]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = yaml.safe_load(raw)
    return out


def model_report(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The facts `model info` prints, as a dict (also used by tests and benchmarks)."""
    import pydantic
    import torch

    from rlsys.cli.job_config import config_user_error
    from rlsys.config.model import preset
    from rlsys.model import Transformer

    try:
        cfg = preset(name).with_overrides(overrides)
    except KeyError as err:
        raise UserError(str(err.args[0])) from None
    except pydantic.ValidationError as err:
        raise config_user_error(err, "model") from None
    with torch.device("meta"):
        net = Transformer(cfg)
    kinds = cfg.layer_kinds()
    return {
        "preset": name,
        "layers": cfg.n_layers,
        "attention_pattern": kinds,
        "pattern_summary": f"{kinds.count('swa')} swa : {kinds.count('sparse')} sparse",
        "total_parameters": net.num_parameters(),
        "active_parameters": net.num_parameters(active=True),
        "kv_cache_bytes_per_token": cfg.kv_cache_bytes_per_token(),
        "swa_cache_bytes_per_sequence": cfg.swa_cache_bytes_per_sequence(),
        "routing_record_bytes_per_token": cfg.routing_record_bytes_per_token(),
        "routing_record_dtypes": {"indices": cfg.expert_index_dtype(), "gates": "float32"},
        "selection_record_bytes_per_token": cfg.selection_record_bytes_per_token(),
        "config": cfg.model_dump(),
    }


@model.command("info")
@click.argument("preset_name", metavar="PRESET")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a field.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(preset_name: str, sets: tuple[str, ...], as_json: bool) -> None:
    """Layers, attention pattern, parameter counts, cache and routing-record sizes."""
    report = model_report(preset_name, _parse_overrides(sets))
    if as_json:
        click.echo(json.dumps(report))
        return
    kinds = report["attention_pattern"]
    compact = "".join("S" if k == "sparse" else "w" for k in kinds)
    click.echo(f"preset                 {report['preset']}")
    click.echo(f"layers                 {report['layers']} ({report['pattern_summary']})")
    click.echo(f"pattern (w=SWA S=SGQA) {compact}")
    click.echo(f"total parameters       {report['total_parameters']:,}")
    click.echo(f"active parameters      {report['active_parameters']:,}")
    click.echo(
        f"KV cache bytes/token   {report['kv_cache_bytes_per_token']:,}"
        f" (+ {report['swa_cache_bytes_per_sequence']:,} B/sequence window-bounded SWA)"
    )
    click.echo(
        f"routing bytes/token    {report['routing_record_bytes_per_token']:,}"
        f" (ids {report['routing_record_dtypes']['indices']}, gates float32)"
    )
    click.echo(
        f"selection bytes/token  {report['selection_record_bytes_per_token']:,}"
        " (int16 block ids, when engine.record_selections)"
    )
