"""run.yaml records the config a run trained with, resolved: a default derived at run time (the anchors
per row from the token budget) is written as the number, and the file loads back as the same run.

Run: `.venv/bin/python -m pytest -n 0 -q tests/unit/test_run_record.py`
"""

from __future__ import annotations

import yaml

from dflash_core.defaults import default_num_anchors
from dflash_core.train.config import TrainConfig
from dflash_core.train.entry import write_run_record
from tests.unit.test_trainer import tiny_config


def test_run_yaml_records_the_resolved_number_of_anchors(tmp_path):
    config = tiny_config(tmp_path, token_budget=2048, drafter={"num_layers": 1, "block_size": 4})
    assert config.drafter.num_anchors is None
    write_run_record(config)
    path = config.run_dir / "run.yaml"
    assert yaml.safe_load(path.read_text())["drafter"]["num_anchors"] == default_num_anchors(2048) == 512
    again = TrainConfig.from_yaml(path)
    assert again.resolved_num_anchors == config.resolved_num_anchors
    assert again.model_dump(exclude={"drafter"}) == config.model_dump(exclude={"drafter"})


def test_an_explicit_number_of_anchors_is_kept(tmp_path):
    config = tiny_config(tmp_path)  # num_anchors: 16
    write_run_record(config)
    assert yaml.safe_load((config.run_dir / "run.yaml").read_text())["drafter"]["num_anchors"] == 16
