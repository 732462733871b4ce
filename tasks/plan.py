"""Capacity planning as a Prefect task: the plan as a table artifact, and a refusal when nothing fits."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from dflash_core.planner import Plan, PlanInputs, plan
from dflash_core.units import binary_bytes, decimal_bytes
from tasks.artifacts import ui_key


class NoLayoutFits(RuntimeError):
    """No GPU layout holds the target, the drafter and its optimizer state."""


@task
def plan_capacity(inputs: PlanInputs, *, require_fit: bool = True, name: str = "") -> Plan:
    """Run the planner, attach its table (key `capacity-plan-<name>`), and refuse a run no layout can hold."""
    result = plan(inputs)
    rows = [
        {"quantity": "offline hidden states (all tokens)", "value": binary_bytes(result.offline_bytes),
         "decimal": decimal_bytes(result.offline_bytes)},
        {"quantity": "offline hidden states (anchors only)", "value": binary_bytes(result.anchor_only_bytes),
         "decimal": decimal_bytes(result.anchor_only_bytes)},
        {"quantity": "online hidden states", "value": binary_bytes(0), "decimal": "0 B"},
        {"quantity": "drafter parameters", "value": f"{result.drafter_params / 1e9:.3f} B", "decimal": ""},
        {"quantity": "generation wall time", "value": f"{result.generation_hours:.2f} h", "decimal": ""},
    ] + ([{"quantity": "passes over the training data", "value": f"{result.data_passes:.1f}",
           "decimal": result.data_note or "ok"}] if result.data_passes is not None else []) + [
        {"quantity": f"layout {v.layout} x{v.replicas}", "value": binary_bytes(v.peak_bytes_per_gpu),
         "decimal": f"{'fits' if v.fits else 'does not fit' if v.fits is False else 'unknown'}: {v.note}"}
        for v in result.layouts
    ]
    create_table_artifact(rows, key=ui_key("capacity-plan", name),
                          description=f"dflash plan {name} (binary units; TB = 10^12)")
    if result.data_note:
        get_run_logger().warning(result.data_note)
    if require_fit and not any(v.fits for v in result.layouts):
        notes = "; ".join(f"{v.layout}: {v.note}" for v in result.layouts)
        raise NoLayoutFits(f"no GPU layout fits this run ({notes})")
    return result
