"""bench_acceptance's training attention: flex on a GPU for our rows and speculators' (as each trains by default),
the dense path on the CPU; both paths of each side compute the same attention."""

import pytest


@pytest.mark.parametrize("asked, device, trained", [(None, "cuda", "flex"), ("auto", "cuda:1", "flex"),
                                                   ("auto", "cpu", "sdpa"), ("sdpa", "cuda", "sdpa")])
def test_our_rows_train_with_flex_attention_on_a_gpu_unless_told_otherwise(bench, tmp_path, asked, device, trained):
    """The bench's default (auto) trains our rows as a run does: flex on a GPU. The dense SDPA path computed the
    whole [queries x keys] grid: ~45x the blocks flex visits on the bench's packed rows at the default's anchors."""
    import dataclasses

    import acceptance_variants as rows
    import acceptance_worker as worker

    if asked is None:
        asked = bench.parse_args(["--tiny"]).attention
    worker.WORKER.update(shape=dataclasses.asdict(rows.TINY), attention=asked, device=device)
    try:
        config = worker.train_config(rows.Job("default", 0, 4), rows.variants()["default"], tmp_path)
        assert worker.training_attention() == config.attention_backend == trained
    finally:
        worker.WORKER.clear()


def test_speculators_rows_train_with_its_flex_attention_on_a_gpu_and_the_same_loss_as_its_dense_path(bench, tmp_path):
    """Its drafter follows --attention as ours does: on a GPU its own default (flex), its dense sdpa on the CPU;
    both give the same loss on a packed row of two documents (its flex forward, run eagerly here)."""
    import dataclasses
    import warnings

    import acceptance_speculators as spec
    import acceptance_variants as rows
    import acceptance_worker as worker
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers import AutoModelForCausalLM

    from dflash_core.target import HiddenStateCapture, build_target, tiny_target_config

    build_target(tiny_target_config("llama", num_layers=12, hidden_size=64, vocab_size=256),
                 device="cpu").save_pretrained(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(tmp_path)
    spec.stand_in_for_missing()
    recipe = spec.speculators_recipe("dflash2")
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (1, 192))
    position_ids = torch.cat([torch.arange(64), torch.arange(128)])[None]
    document_ids = (position_ids == 0).cumsum(1) - 1
    loss_mask = torch.ones(1, 192, dtype=torch.long)
    loss_mask[:, :8] = loss_mask[:, 64:72] = 0
    losses = {}
    saved = dict(worker.WORKER)
    try:
        for device in ("cuda", "cpu"):
            worker.WORKER.clear()
            worker.WORKER.update(shape=dataclasses.asdict(rows.TINY), attention="auto", device=device,
                                 model_dir=str(tmp_path))
            torch.manual_seed(0)
            model = spec.speculators_model("dflash2", recipe, 5)
            losses[model._attn_impl] = None
            if model._attn_impl == "simple_flex_attention":  # its compiled mask builder: GPU only
                model._create_mask_fn = create_block_mask
            step_kwargs, _ = type(model).get_trainer_kwargs(**{**recipe, "loss_implementation": "eager",
                                                              "max_anchors": 16})
            captured = HiddenStateCapture(target, layer_ids=[k - 1 for k in model.target_layer_ids],
                                          capture_final=True)(ids, position_ids=position_ids)
            forward = getattr(type(model).forward, "_torchdynamo_orig_callable", type(model).forward)
            torch.manual_seed(3)  # its anchors come from the global RNG
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex_attention without torch.compile: a slow reference
                _, loss, _ = forward(model, hidden_states=captured.tapped_hidden, input_ids=ids, loss_mask=loss_mask,
                                     verifier_last_hidden_states=captured.final_hidden, document_ids=document_ids,
                                     position_ids=position_ids, **step_kwargs)
            losses[model._attn_impl] = loss.item()
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)
    assert list(losses) == ["simple_flex_attention", "sdpa"]
    assert losses["simple_flex_attention"] == pytest.approx(losses["sdpa"], rel=1e-5)
    try:  # its forward uncompiled (--speculators-eager): its dense path, not torch's slow flex reference
        worker.WORKER.update(attention="auto", device="cuda", speculators_compile=False)
        assert spec.speculators_attention() == "sdpa"
        worker.WORKER.update(speculators_compile=True)
        assert spec.speculators_attention() == "flex"
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)
