"""Finding a run's class in its training script by path (sentineld.integrations.codeload):
the script's top level runs, its `if __name__ == "__main__":` block does not, and a class the
replay cannot reach gets a message saying what to move."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sentineld.integrations.codeload import class_ref, load_class
from sentineld.replay.trust import UntrustedError

SCRIPT = '''
import pathlib, sys
MARK = pathlib.Path(__file__).with_name("main-block-ran")

class Top:
    class Inner:
        pass

def factory():
    class Local:
        pass
    return Local

if __name__ == "__main__":
    MARK.touch()
    class UnderGuard:
        pass
'''


@pytest.fixture
def script(tmp_path: Path) -> Path:
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    os.chmod(tmp_path, 0o700)
    os.chmod(p, 0o600)
    return p


def _ref(script: Path, qualname: str) -> dict[str, object]:
    return {"module": "__main__", "qualname": qualname, "script": str(script)}


def test_a_top_level_class_and_a_nested_one_load_without_running_the_main_block(script: Path) -> None:
    cls = load_class(_ref(script, "Top"), str(script.parent), trust=False)
    assert cls.__name__ == "Top" and cls.__module__ == "sentineld_script_train"
    assert load_class(_ref(script, "Top.Inner"), str(script.parent), trust=False).__name__ == "Inner"
    assert not (script.parent / "main-block-ran").exists()


def test_a_class_under_the_main_guard_gets_told_to_move_above_it(script: Path) -> None:
    with pytest.raises(ValueError, match=r"not defined at the top level of script .*move the class above"):
        load_class(_ref(script, "UnderGuard"), str(script.parent), trust=False)


def test_a_class_defined_in_a_function_is_refused_with_the_reason(script: Path) -> None:
    with pytest.raises(ValueError, match="defined inside a function"):
        load_class(_ref(script, "factory.<locals>.Local"), str(script.parent), trust=False)


def test_a_notebook_class_without_a_script_says_to_move_it_into_a_module() -> None:
    with pytest.raises(ValueError, match="without a script file .* move it into a module"):
        load_class({"module": "__main__", "qualname": "Net", "script": None}, ".", trust=False)


def test_a_script_in_a_group_writable_folder_is_not_executed(script: Path) -> None:
    os.chmod(script.parent, 0o770)
    with pytest.raises(UntrustedError, match="writable by group or others"):
        load_class(_ref(script, "Top"), str(script.parent), trust=False)
    assert load_class(_ref(script, "Top"), str(script.parent), trust=True).__name__ == "Top"


def test_a_group_writable_sibling_module_the_script_imports_is_refused(tmp_path: Path) -> None:
    # The script lives outside the run's working folder; its own folder's imports are guarded too.
    folder = tmp_path / "code"
    folder.mkdir(mode=0o700)
    (folder / "train.py").write_text("import helper_mod_sentineld_test\nclass Net:\n    pass\n")
    sibling = folder / "helper_mod_sentineld_test.py"
    sibling.write_text("X = 1\n")
    os.chmod(folder / "train.py", 0o600)
    os.chmod(sibling, 0o660)
    ref = _ref(folder / "train.py", "Net")
    with pytest.raises(UntrustedError, match="refusing to import 'helper_mod_sentineld_test'.*writable by group"):
        load_class(ref, str(tmp_path), trust=False)
    os.chmod(sibling, 0o600)
    assert load_class(ref, str(tmp_path), trust=False).__name__ == "Net"


def test_class_ref_of_an_importable_class_names_no_script() -> None:
    from sentineld.contracts.recipe import Recipe

    assert class_ref(Recipe) == {"module": "sentineld.contracts.recipe", "qualname": "Recipe", "script": None}
    assert load_class(class_ref(Recipe), ".", trust=False) is Recipe
