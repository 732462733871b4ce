"""The generate flow's parameters (its form in the Prefect UI): the prompt sources, the server, sampling and
the nodes to generate on. Apart from the flow (flows/generate.py) so that the modules the flow leans on
(flows/generate_nodes.py, flows/demo.py) can take them without importing the flow."""

from __future__ import annotations

from pydantic import Field, model_validator

from dflash_core.data.holdout import HoldoutSpec
from dflash_core.data.prompts import DEFAULT_MAX_PROMPT_CHARS, TurnPolicy
from dflash_core.nodes import Node
from dflash_core.serving.canary import CanaryThresholds
from dflash_core.serving.client import ClientConfig, SamplingParams
from dflash_core.serving.profiles import EngineProfile
from dflash_core.strict import StrictModel
from flows.nodes import ProvisionParams


def _engine_buttons(field_schema: dict) -> None:
    """`EngineProfile | None` as Prefect's form can draw it: pydantic writes `anyOf: [{oneOf: [profiles...],
    discriminator}, null]`, whose first option has no title, so the form shows a blank button and no engine can be
    picked without JSON. One flat `anyOf: [null, vllm, sglang, transformers]` gives a button per engine (None first,
    the default); each profile's `engine` const still tells them apart, so the same JSON is accepted."""
    profiles, none = field_schema.pop("anyOf")
    field_schema["anyOf"] = [none, *profiles["oneOf"]]


class GenerationNode(StrictModel):
    provision: ProvisionParams = Field(description=(
        "The node (inline, or node_name + inventory) and how to provision it; provision starts its worker, "
        "which runs this node's share."))
    engine: EngineProfile | None = Field(None, json_schema_extra=_engine_buttons, description=(
        "Its server profile; None: the run's engine. Every node serves the same model (the same name in requests) "
        "with the same engine, so a shard one node answered counts as done for the others. `@node` as its model: "
        "the model this node's provision placed."))
    num_instances: int = Field(1, gt=0, description="Its server instances (one per GPU); its share is in proportion.")
    devices: list[str] | None = Field(None, description="CUDA device per instance, e.g. ['0','1'].")
    base_port: int = Field(8100, gt=1023, lt=65000)

    @model_validator(mode="after")
    def _with_worker(self) -> GenerationNode:
        if not self.provision.start_worker:
            raise ValueError("a generation node needs its worker (provision.start_worker true): its share runs there")
        return self


class PromptSourceParam(StrictModel):
    path: str = Field(description="Local .json / .jsonl / .parquet file (ShareGPT or OpenAI messages).")
    name: str = Field(description="Source name recorded on every prompt.")
    weight: float = Field(1.0, gt=0, description="Share of the mix, relative to the other sources.")
    turns: TurnPolicy = Field(
        "first_user_turn", description="Multi-turn conversations: first_user_turn keeps the system and first user "
        "turn; regenerate_turns asks every user turn in order with the target's own answers as context.")
    max_chars: int = Field(DEFAULT_MAX_PROMPT_CHARS, gt=0,
                           description="Prompts longer than this (all kept turns) are rejected as too_long.")


class GenerateParams(StrictModel):
    dataset: str = Field(description="Dataset name in S3 keys (prompts/(dataset)/, completions/(dataset)/).")
    prompts_version: str = Field("v1", description="Prompt set version (prompts/(dataset)/(version)/).")
    run: str = Field(description="Generation run name (completions/(dataset)/(run)/), e.g. the target's name.")
    prompt_sources: list[PromptSourceParam] = Field(
        default_factory=list, description="Import these first; empty: use the existing prompt shards.")
    total_prompts: int | None = Field(None, gt=0, description="Mix this many prompts (None: all).")
    shard_size: int = Field(512, gt=0, description="Prompts per shard.")
    seed: int = 0
    refresh: bool = Field(False, description=(
        "Check every shard again instead of trusting the all-done shortcut and cached task results (shards already "
        "answered with the same prompts, model and sampling are kept; change `run` to answer anew): how to rerun a "
        "finished generation: the server refuses Retry on a Completed run (the UI still shows a success toast)."))
    engine: EngineProfile | None = Field(None, json_schema_extra=_engine_buttons,
                                         description="Server profile; None: transformers serve on the embedded model.")
    node: Node | None = Field(None, description=(
        "The node this runs on (from the inventory): preserved (logs, configs, inventory to S3; nothing deleted) "
        "when the flow fails, crashes or is cancelled."))
    num_instances: int = Field(1, gt=0, description="Data-parallel server instances (one per GPU).")
    base_port: int = Field(8100, gt=1023, lt=65000)
    devices: list[str] | None = Field(None, description="CUDA device per instance, e.g. ['0','1'].")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    client: ClientConfig = Field(default_factory=ClientConfig)
    canary_prompts: int = Field(8, ge=0, description="0 skips the canary.")
    canary: CanaryThresholds = Field(default_factory=CanaryThresholds)
    holdout: HoldoutSpec = Field(default_factory=HoldoutSpec, description=(
        "Prompts held out at import (per source, whole conversations, seeded): answered like the others, tokenized into "
        "the held-out split, never trained on; what evaluation measures by default."))
    max_failed_fraction: float = Field(
        0.02, ge=0, le=1, description="Failed prompts (after the client's retries) above this fraction of all "
        "prompts fail the flow, so nothing downstream tokenizes or trains on partial data; at or below it the "
        "flow completes with a warning artifact. Failed prompts are retried by rerunning the flow.")
    nodes: list[GenerationNode] = Field(default_factory=list, description=(
        "Generate on these nodes at once (each from the inventory, with its engine, instances and devices): this run "
        "imports the prompts, provisions every node and starts one generate-node run per node on the node's own "
        "queue, each answering a share of the prompt shards in proportion to its instances; a node that drops out "
        "hands its unanswered shards to the others. Empty: this run answers every shard where it runs."))
    node_timeout_s: float = Field(180.0, gt=0, description=(
        "With nodes: a node whose worker has not been heard from for this long is lost; its run is marked Crashed "
        "and its unanswered shards go to the other nodes."))
    prompt_shards: list[str] | None = Field(None, description=(
        "Answer only these prompt shards (their keys under prompts/(dataset)/(version)/): a node's share, which a "
        "generation across nodes sets; None: every shard of the prompt set."))

    @model_validator(mode="after")
    def _nodes_or_one_host(self) -> GenerateParams:
        if not self.nodes:
            return self
        # compared with the defaults, not model_fields_set: a form sent from the UI carries every field
        per_node = [name for name in ("node", "num_instances", "devices", "base_port", "prompt_shards")
                    if getattr(self, name) != type(self).model_fields[name].default]
        if per_node:
            raise ValueError(f"with nodes, set {', '.join(per_node)} on each node (nodes[i]), not for the whole run")
        if self.engine is None and any(spec.engine is None for spec in self.nodes):
            raise ValueError("with nodes, name the engine (engine, or each node's): every node must serve the same "
                             "model, and the embedded default lives in each host's own work dir")
        names = [spec.provision.node.name if spec.provision.node else spec.provision.node_name
                 for spec in self.nodes]
        twice = sorted({name for name in names if name is not None and names.count(name) > 1})
        if twice:
            raise ValueError(f"nodes lists {twice} more than once: give each node once, with its num_instances")
        return self
