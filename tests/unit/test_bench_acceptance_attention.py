"""The acceptance bench's training attention: flex on a GPU for our rows and speculators' (as each trains by default),
the dense path on the CPU; both paths of each side compute the same attention."""

import pytest

from bench.acceptance import run as acceptance


@pytest.mark.parametrize("asked, device, trained", [(None, "cuda", "flex"), ("auto", "cuda:1", "flex"),
                                                   ("auto", "cpu", "sdpa"), ("sdpa", "cuda", "sdpa")])
def test_our_rows_train_with_flex_attention_on_a_gpu_unless_told_otherwise(tmp_path, asked, device, trained):
    """The bench's default (auto) trains our rows as a run does: flex on a GPU. The dense SDPA path computed the
    whole [queries x keys] grid: ~45x the blocks flex visits on the bench's packed rows at the default's anchors."""
    import dataclasses

    from bench.acceptance import variants as rows
    from bench.acceptance import worker

    if asked is None:
        asked = acceptance.parse_args(["--tiny"]).attention
    worker.WORKER.update(shape=dataclasses.asdict(rows.TINY), attention=asked, device=device)
    try:
        config = worker.train_config(rows.Job("default", 0, 4), rows.variants()["default"], tmp_path)
        assert worker.training_attention() == config.attention_backend == trained
    finally:
        worker.WORKER.clear()


def speculators_step(model_dir, *, resolve_on: str, run_on: str, attention: str = "auto", compiled: bool = False,
                     backward: bool = False) -> tuple[str, float]:
    """One step of speculators' DFlash 2 drafter as the acceptance bench builds it for a worker on `resolve_on` (its
    attention follows `--attention` there), run on `run_on` over a packed row of two documents from the tiny
    target saved in `model_dir` (`save_tiny_target`): its attention implementation and loss. `compiled` runs its
    torch.compile'd forward (as the bench does), else the eager one (flex eagerly: torch's reference, which a CPU
    runs forward only); `backward` also checks every gradient is finite.
    Also run by tests/gpu/test_speculators_flex_gpu.py."""
    import dataclasses
    import warnings

    from bench.acceptance import speculators as spec
    from bench.acceptance import variants as rows
    from bench.acceptance import worker
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_core.target import HiddenStateCapture

    spec.stand_in_for_missing()
    recipe = spec.speculators_recipe("dflash2")
    target = AutoModelForCausalLM.from_pretrained(model_dir).to(run_on)
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (1, 192), device=run_on)
    position_ids = torch.cat([torch.arange(64), torch.arange(128)])[None].to(run_on)
    document_ids = (position_ids == 0).cumsum(1) - 1
    loss_mask = torch.ones(1, 192, dtype=torch.long, device=run_on)
    loss_mask[:, :8] = loss_mask[:, 64:72] = 0
    saved = dict(worker.WORKER)
    try:
        worker.WORKER.clear()
        worker.WORKER.update(shape=dataclasses.asdict(rows.TINY), attention=attention, device=resolve_on,
                             model_dir=str(model_dir))  # the bench's default: its forward compiled
        torch.manual_seed(0)
        model = spec.speculators_model("dflash2", recipe, 5).to(run_on)
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)
    if model._attn_impl == "simple_flex_attention" and run_on == "cpu":  # its compiled mask builder: GPU only
        from torch.nn.attention.flex_attention import create_block_mask

        model._create_mask_fn = create_block_mask
    step_kwargs, _ = type(model).get_trainer_kwargs(**{**recipe, "loss_implementation": "eager", "max_anchors": 16})
    captured = HiddenStateCapture(target, layer_ids=[k - 1 for k in model.target_layer_ids],
                                  capture_final=True)(ids, position_ids=position_ids)
    eager = getattr(type(model).forward, "_torchdynamo_orig_callable", type(model).forward)
    forward = type(model).forward if compiled else eager
    torch.manual_seed(3)  # its anchors come from the global RNG
    with torch.set_grad_enabled(backward), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention without torch.compile: a slow reference
        _, loss, _ = forward(model, hidden_states=captured.tapped_hidden, input_ids=ids, loss_mask=loss_mask,
                             verifier_last_hidden_states=captured.final_hidden, document_ids=document_ids,
                             position_ids=position_ids, **step_kwargs)
        if backward:
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.requires_grad]
            assert grads and all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    return model._attn_impl, loss.item()


def save_tiny_target(path) -> None:
    """A 12-layer tiny Llama with weights on disk, as speculators loads its verifier (12 layers: its default taps)."""
    from dflash_core.target import build_target, tiny_target_config

    build_target(tiny_target_config("llama", num_layers=12, hidden_size=64, vocab_size=256),
                 device="cpu").save_pretrained(path)


def test_speculators_rows_train_with_its_flex_attention_on_a_gpu_and_the_same_loss_as_its_dense_path(tmp_path):
    """Its drafter follows --attention as ours does: on a GPU its own default (flex), its dense sdpa on the CPU;
    both give the same loss on a packed row of two documents (its flex forward, run eagerly here)."""
    from bench.acceptance import speculators as spec
    from bench.acceptance import worker

    save_tiny_target(tmp_path)
    flex = speculators_step(tmp_path, resolve_on="cuda", run_on="cpu")
    dense = speculators_step(tmp_path, resolve_on="cpu", run_on="cpu")
    assert (flex[0], dense[0]) == ("simple_flex_attention", "sdpa")
    assert flex[1] == pytest.approx(dense[1], rel=1e-5)
    assert speculators_step(tmp_path, resolve_on="cpu", run_on="cpu", backward=True) == dense  # a training step
    saved = dict(worker.WORKER)
    try:  # its forward uncompiled (--speculators-eager): its dense path, not torch's slow flex reference
        worker.WORKER.update(attention="auto", device="cuda", speculators_compile=False)
        assert spec.speculators_attention() == "sdpa"
        worker.WORKER.update(speculators_compile=True)
        assert spec.speculators_attention() == "flex"
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)
