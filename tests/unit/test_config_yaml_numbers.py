"""Config YAML reads numbers by YAML 1.2's rules: verl's ``lower_upper`` bounds stay text."""

from rlfleet.common.config import load_config
from rlfleet.common.config.loading import parse_value, read_yaml


def test_an_unquoted_lower_upper_bound_stays_text_and_reaches_the_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
        "    rollout_is_threshold: 0.5_5\ntrainer:\n  lr: 1e-5\n"
    )
    config = load_config(path, env={})
    assert config.algorithm.rollout_correction.rollout_is_threshold == "0.5_5"  # not 0.55
    assert config.trainer.lr == 1e-5


def test_numbers_follow_yaml_1_2():
    tree = read_yaml("a: 1e-5\nb: 1.0e-5\nc: 400\nd: 010\ne: 0x1f\nf: -2.5\ng: 1:30\nh: 1_000")
    assert tree == {
        "a": 1e-5,
        "b": 1e-5,
        "c": 400,
        "d": 10,
        "e": 31,
        "f": -2.5,
        "g": "1:30",
        "h": "1_000",
    }
    assert parse_value("0.999_1.001") == "0.999_1.001"
    assert parse_value("3") == 3 and parse_value("true") is True and parse_value("null") is None
