"""Train a drafter online: plan capacity (refuse what cannot fit) -> train (torchrun subprocess;
capture validated on the first batches; resumes from the latest checkpoint on retry) -> report.
Evaluation and export join as their flows land.

Run: `dflash run train --params '{"config": {"target": "embedded", "data": ["tokenized/demo/smollm2/"]}}'`
"""

from __future__ import annotations


from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from dflash_core.settings import load_settings
from dflash_core.train.config import TrainConfig
from flows.command_line import run_from_command_line
from tasks.train import plan_training, report_training, run_training


class TrainFlowParams(BaseModel):
    config: TrainConfig = Field(description="The run schema: every hyperparameter and path.")
    nproc_per_node: int = Field(1, ge=1, description="Processes (GPUs) on this node; >1 runs torchrun with DDP.")
    gpu_memory_gib: float = Field(139.0, gt=0, description="For the capacity check.")
    expected_samples: int = Field(100_000, gt=0, description="For the capacity check's storage figures.")
    expected_mean_tokens: float = Field(2_000, gt=0)


@flow(name="dflash-train", log_prints=True, persist_result=True)
def train(params: TrainFlowParams) -> dict:
    settings = load_settings()
    config = params.config.model_copy(update={"output_dir": params.config.output_dir.resolve()})
    plan_training(config, gpu_memory_gib=params.gpu_memory_gib, num_gpus=params.nproc_per_node,
                  samples=params.expected_samples, mean_tokens=params.expected_mean_tokens)
    checkpoint = run_training(config, nproc_per_node=params.nproc_per_node, flow_run_id=str(flow_run.id or ""))
    report = report_training(settings, config, checkpoint=checkpoint)
    return {"checkpoint": checkpoint, "metrics": report.uri, "run_dir": str(config.run_dir)}



if __name__ == "__main__":
    run_from_command_line(train, TrainFlowParams)
