"""What `rlfleet up` prints at each loudness: `-v` (DEBUG in every role), the default (start-up,
validation, checkpoints, the summary) and `-q` (warnings and the summary only)."""

import logging

import pytest

from rlfleet.common import entry
from rlfleet.common.config import load_config
from rlfleet.launch.session import say
from rlfleet.launch.up import parse_args
from rlfleet.trainer.loggers import ConsoleBackend


@pytest.mark.parametrize(("flag", "level"), [("-v", "DEBUG"), ("-q", "WARNING")])
def test_up_flags_set_every_roles_log_level_over_an_override(flag, level):
    args = parse_args([flag, "log_level=ERROR", "trainer.total_steps=3"])
    assert args.overrides[-1] == f"log_level={level}"
    assert load_config(None, args.overrides, env={}).log_level == level


def test_up_is_not_both_verbose_and_quiet(capsys):
    with pytest.raises(SystemExit):
        parse_args(["-v", "-q"])
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(("level", "shown"), [("INFO", True), ("DEBUG", True), ("WARNING", False)])
def test_launcher_lines_are_kept_back_when_quiet(capsys, level, shown):
    say(load_config(None, [f"log_level={level}"], env={}), "rlfleet up: reward: grpc=x")
    assert ("reward: grpc=x" in capsys.readouterr().out) is shown


def test_validation_samples_are_one_line(caplog):
    rows = [["1+1=", "2", "2", 1.0], ["2+2=", "5", "4", 0.0]]
    with caplog.at_level(logging.INFO, logger="rlfleet.trainer.loggers"):
        ConsoleBackend().log_table(50, ["prompt", "response", "ground_truth", "score"], rows)
    [line] = caplog.messages
    assert line.startswith("step 50 validation samples (prompt | response | ground_truth")
    assert "'1+1=' | '2' | '2' | 1.0 || '2+2=' | '5' | '4' | 0.0" in line


def test_library_progress_bars_and_vllm_info_are_off_unless_debug(monkeypatch):
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "")  # recorded, so what the test sets is undone after it
        monkeypatch.delenv(name)
    entry.quiet_libraries("INFO")
    assert entry.os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert entry.os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # the user's choice stays
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    entry.quiet_libraries("DEBUG")
    assert entry.os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in entry.os.environ


def test_the_steps_bar_is_off_when_info_is(monkeypatch):
    from rlfleet.trainer import run

    monkeypatch.setattr(run.log, "isEnabledFor", lambda level: level > logging.INFO)
    assert run.progress(3).disable
    monkeypatch.setattr(run.log, "isEnabledFor", lambda level: True)
    bar = run.progress(3)
    assert not bar.disable
    bar.close()
