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


def test_stream_lines_are_typed_with_their_kind():
    import pytest

    from sentineld.contracts.records import AGENT_WARNING, AgentNotice, EndLine, StartLine

    assert StartLine("r", 0, 12, "h", 1.5).to_json() == {"kind": "start", "run_id": "r", "rank": 0, "pid": 12,
                                                         "host": "h", "time_s": 1.5}
    assert EndLine("finished", 3, 2.0).to_json() == {"kind": "end", "reason": "finished", "steps": 3, "time_s": 2.0}
    assert AgentNotice(AGENT_WARNING, "m").to_json() == {"kind": "agent_warning", "message": "m"}
    assert AgentNotice(AGENT_WARNING, "m", 4).to_json()["step"] == 4
    with pytest.raises(ValueError, match="agent notice"):
        AgentNotice("agent_chat", "m")
