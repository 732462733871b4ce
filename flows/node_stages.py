"""What the pipeline's provision stage hands the stages after it: the model it placed, the node, and the
node's work queue, so a form names the model once (`provision.provision.model_dir`) and every stage runs
on the node it was provisioned for.

A stage field that loads the target says `@node` (`MODEL_FROM_NODE`) and is filled with the model's
placement (its RAM-disk copy when its home was slow); generate's and train's `node` are filled with the
provisioned node (preserved when they fail); each stage is sent to the node's queue, which only the
node's own worker polls (dflash_core/nodes/worker.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dflash_core.nodes import Node
from dflash_core.stage_results import MODEL_FROM_NODE, ProvisionedNode

# (form field, the model field's path inside that stage's parameters)
MODEL_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("generation", ("engine", "model")),
    ("tokenization", ("tokenizer_dir",)),
    ("training", ("config", "target")),
    ("evaluation", ("target",)),
    ("export", ("target",)),
    ("served", ("target",)),
)
CHECKPOINT_NAMES_TARGET = ("evaluation", "export", "served")  # None there: the checkpoint's own target
NODE_FIELDS = ("generation", "training")  # stages whose `node` is preserved when they fail
ON_NODE_STAGES = ("generation", "tokenization", "training", "evaluation", "export", "served")


def _get(params: BaseModel, path: tuple[str, ...]) -> Any:
    value: Any = params
    for name in path:
        value = getattr(value, name, None) if value is not None else None
    return value


def _set(params: BaseModel, path: tuple[str, ...], value: Any) -> BaseModel:
    head, *rest = path
    if not rest:
        return params.model_copy(update={head: value})
    return params.model_copy(update={head: _set(getattr(params, head), tuple(rest), value)})


def model_field_problems(form: BaseModel, *, node_model: bool) -> list[str]:
    """What is wrong with the form's model fields: with a provisioned model (`node_model`) each stage that
    loads the target says `@node` (evaluation and export may leave it empty: the checkpoint names its target); without
    one, `@node` has nothing to name."""
    problems = []
    for field, path in MODEL_FIELDS:
        stage = getattr(form, field)
        if stage is None or (path[0] == "engine" and stage.engine is None and not node_model) or _own_nodes(stage):
            continue
        value, name = _get(stage, path), ".".join((field, *path))
        if node_model and value != MODEL_FROM_NODE and not (field in CHECKPOINT_NAMES_TARGET and value is None):
            problems.append(f"{name} is {value!r}, but the provision stage places the model (provision.provision."
                            f"model_dir): set it to {MODEL_FROM_NODE!r} so the model is named once")
        elif not node_model and value == MODEL_FROM_NODE:
            problems.append(f"{name} is {MODEL_FROM_NODE!r}, but no provision stage with provision.model_dir places a "
                            f"model: add one, or name the model here")
    return problems


def on_node(field: str, params: BaseModel, node: ProvisionedNode | None) -> BaseModel:
    """The stage's parameters with `@node` replaced by the placed model, its `node` filled in (not a generation
    across nodes: each of its nodes has its own model), and a training run's default output_dir under the node's
    work dir (the form was read where the pipeline runs, whose work dir the default names)."""
    if node is None or _own_nodes(params):
        return params
    for stage, path in MODEL_FIELDS:
        if stage == field and _get(params, path) == MODEL_FROM_NODE:
            if not node.model:
                raise ValueError(f"{field}.{'.'.join(path)} is {MODEL_FROM_NODE!r}, but provision placed no model")
            params = _set(params, path, node.model)
    if field in NODE_FIELDS and getattr(params, "node", None) is None:
        params = params.model_copy(update={"node": Node.model_validate(node.node)})
    if field == "training" and "output_dir" not in params.config.model_fields_set:
        params = _set(params, ("config", "output_dir"), Path(node.work_dir) / "runs")
    return params


def queue_of(field: str, node: ProvisionedNode | None, params: BaseModel | None = None) -> str | None:
    """The work queue a stage's run is sent to: the node's, for the stages that run on it (a generation across
    nodes runs where the pipeline runs and sends each share to its own node)."""
    return node.work_queue if node is not None and field in ON_NODE_STAGES and not _own_nodes(params) else None


def _own_nodes(params: BaseModel) -> bool:
    """A generation across nodes (generate's `nodes`): its nodes, not the pipeline's, run it."""
    return bool(getattr(params, "nodes", None))


def stage_runner(run_stage: Callable[..., Any], node: ProvisionedNode | None) -> Callable[..., Any]:
    """`run_stage(deployment, params)` for the form field `field`, on the node."""
    def run(field: str, deployment: str, params: BaseModel, **kwargs: Any) -> Any:
        return run_stage(deployment, on_node(field, params, node), work_queue=queue_of(field, node, params), **kwargs)

    return run
