"""Names users write in their code: one public name each, the one the README gives."""

from __future__ import annotations

from pathlib import Path

from sentineld.contracts.errors import BadInput, SentineldError
from sentineld.contracts.treecodec import TreeCodecError

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_recipe_has_one_public_name():
    import sentineld.contracts.recipe as contract
    import sentineld.recipe as public

    assert public.Recipe is contract.Recipe and public.train_step is contract.train_step
    assert "from sentineld.recipe import Recipe" in README
    assert "sentineld.contracts.recipe" not in README  # the contract's home is not the user's name


def test_a_tree_codec_error_is_bad_input():
    assert issubclass(TreeCodecError, BadInput) and issubclass(TreeCodecError, SentineldError)
    assert issubclass(TreeCodecError, ValueError)  # callers that catch ValueError still do
    assert TreeCodecError("x").exit_code == 2
