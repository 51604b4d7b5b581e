"""The CLI's verbs exist and ``--help`` stays light: no torch, vLLM or transformers import."""

import subprocess
import sys

import pytest

from rlfleet.cli import VERBS

HEAVY = ("torch", "vllm", "transformers")

PROBE = """
import sys
from rlfleet.cli import main
try:
    main([{verb!r}, "--help"])
except SystemExit:
    pass
print("HEAVY:" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_verb_help_imports_nothing_heavy(verb):
    code = PROBE.format(verb=verb, heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "usage: rlfleet" in result.stdout, result.stdout + result.stderr
    assert result.stdout.strip().endswith("HEAVY:"), result.stdout[-300:]


def test_top_level_help_lists_every_verb(capsys):
    from rlfleet.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in VERBS:
        assert f"  {verb}" in out


def test_unknown_verb_is_an_error(capsys):
    from rlfleet.cli import main

    assert main(["nonsense"]) == 2
    assert "unknown verb" in capsys.readouterr().err


def test_help_config_lists_nested_fields(capsys):
    from rlfleet.cli import main

    with pytest.raises(SystemExit) as done:
        main(["reward", "--help-config"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "reward.custom.reward_kwargs = {}:" in out and "\nlog_level = 'INFO':" in out


def test_misspelt_log_level_stops_the_role_before_it_starts(capsys):
    from rlfleet.cli import main

    with pytest.raises(SystemExit) as done:
        main(["reward", "log_level=LOUD"])
    assert done.value.code == 2
    assert "bad config" in capsys.readouterr().err
