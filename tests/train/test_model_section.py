"""ModelSection's execution fields: validated, and passed to the model without changing its parameters."""

import pytest

from rpegjax.options import AttentionKind, RematPolicy
from rpegjax.train.config import ModelSection


def test_model_section_execution_fields():
    section = ModelSection(attention="blockwise", remat="full", scan_layers=True, attention_block_size=256)
    assert section.execution() == {"attention": AttentionKind.BLOCKWISE, "attention_block_size": 256,
                                   "remat": RematPolicy.FULL, "scan_layers": True}
    with pytest.raises(ValueError, match=r"ModelSection.attention must be one of .* got 'flash'"):
        ModelSection(attention="flash")
    with pytest.raises(ValueError, match=r"ModelSection.remat must be one of .* got 'all'"):
        ModelSection(remat="all")
    with pytest.raises(ValueError, match=r"ModelSection.attention_block_size must be a positive integer, got 0"):
        ModelSection(attention_block_size=0)


def test_a_model_path_that_is_not_a_directory_is_refused(tmp_path):
    assert ModelSection(path=str(tmp_path)).path == str(tmp_path)
    with pytest.raises(ValueError, match=r"ModelSection.path '.*missing' is not a directory"):
        ModelSection(path=str(tmp_path / "missing"))
