"""What a run trains: the drafter's config from the TrainConfig and the target (shapes, tapped layers,
mask token, loss, variant), and the target's tokenizer the mask token is chosen with."""

from __future__ import annotations

import warnings
from pathlib import Path

from dflash_core.model import DFlashConfig
from dflash_core.model.dflash2 import drafter_config
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import TokenizedCorpus


def load_target_tokenizer(spec: str, *, models_dir: Path):
    """The target's tokenizer where there is one (`embedded`, a model directory holding tokenizer
    files), else None (`tiny:`/`random:` targets). Used to pick the mask token."""
    if spec == "embedded":
        from dflash_core.embedded import embedded_model_dir

        directory = embedded_model_dir(models_dir)
    elif Path(spec).is_dir() and any((Path(spec) / name).is_file()
                                     for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        directory = Path(spec)
    else:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as error:
        warnings.warn(f"could not load the target's tokenizer from {directory} ({error}); the mask token is "
                      "chosen from the config and the corpus only", stacklevel=2)
        return None


def drafter_config_for(config: TrainConfig, *, target_config, corpus: TokenizedCorpus | None = None,
                       tokenizer=None) -> DFlashConfig:
    """The drafter a run trains, its architecture only: shapes from the target, tapped layers, mask token
    and variant (a DFlash2Config for variant dflash2) from `config.drafter` (how it trains:
    `config.drafter.loss_spec()`). The mask token is checked (never an
    end token) or chosen with the tokenizer and the corpus's token counts (a row the data never contains)."""
    import dataclasses

    import numpy as np

    from dflash_core.model.config import _text_config
    from dflash_core.model.mask_token import resolve_mask_token_id

    d = config.drafter
    text = _text_config(target_config)
    counts = None
    if d.mask_token_id is None and corpus is not None and corpus.tokens.size:  # only a chosen mask needs them
        counts = np.zeros(int(text.vocab_size), dtype=np.int64)
        for start in range(0, corpus.tokens.size, 1 << 24):  # bincount upcasts: chunks keep that copy small
            chunk = np.bincount(corpus.tokens[start:start + (1 << 24)], minlength=counts.size)
            counts[: min(chunk.size, counts.size)] += chunk[: counts.size]
    mask_token_id = resolve_mask_token_id(d.mask_token_id, target_config=target_config, tokenizer=tokenizer,
                                          token_counts=counts)
    layer_ids = d.tapped_layer_ids(num_target_layers=text.num_hidden_layers)
    if d.intermediate_size not in (None, text.intermediate_size) and d.init == "target":
        raise ValueError(f"drafter.intermediate_size {d.intermediate_size} with drafter.init 'target': its layers "
                         f"start as the target's, whose MLPs are {text.intermediate_size} wide; leave "
                         "intermediate_size unset or use init 'random'")
    base = DFlashConfig.from_target(
        target_config, num_layers=d.num_layers, block_size=d.block_size, num_tapped_layers=len(layer_ids),
        mask_token_id=mask_token_id, layer_types=d.layer_types, sliding_window=d.sliding_window)
    base = dataclasses.replace(base, target_layer_ids=layer_ids,
                               intermediate_size=d.intermediate_size or base.intermediate_size)
    return drafter_config(d.variant, base, **(d.dflash2_fields() if d.variant == "dflash2" else {}))
