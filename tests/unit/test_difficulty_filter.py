"""The difficulty filter without a fleet: the band, pass rates, the histogram, the empty-band
error, the scorer check, held-out problems, the written file, and the CLI's argument checks."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfleet.tasks import difficulty_filter as df


def row(question: str, source: str = "arith", **extra) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"split": "train", "index": 0, **extra},
    }


def test_band_keeps_both_ends_and_refuses_bad_bands():
    band = df.Band(0.2, 0.8)
    assert [band.contains(p) for p in (0.0, 0.19, 0.2, 2 / 10, 0.5, 0.8, 4 / 5, 0.81, 1.0)] == [
        False,
        False,
        True,
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert df.Band.parse("0,1") == df.Band(0.0, 1.0)
    assert df.Band.parse(" 0.5 , 0.5 ").contains(4 / 8)
    for bad in ("0.8,0.2", "-0.1,0.5", "0.5,1.5"):
        with pytest.raises(ValueError, match="0 <= low <= high <= 1"):
            df.Band.parse(bad)
    with pytest.raises(ValueError, match="two numbers"):
        df.Band.parse("0.2")


def test_pass_rates_count_full_credit_only_by_default():
    groups = [[1.0, 0.0, 1.0, 1.0], [0.1, 0.1, 0.0, 0.0], [1.0] * 4]
    assert df.pass_rates(groups) == [0.75, 0.0, 1.0]
    assert df.pass_rates(groups, correct_at=0.1) == [0.75, 0.5, 1.0]
    with pytest.raises(ValueError, match="no sampled answers"):
        df.pass_rates([[]])


def test_histogram_counts_rows_per_bucket():
    counts = df.histogram([0.0, 0.25, 0.25, 1.0, 0.75, 0.0, 0.0], k=4)
    assert counts == [3, 2, 0, 1, 1]
    assert df.format_histogram(counts) == "0/4: 3  1/4: 2  2/4: 0  3/4: 1  4/4: 1"


def test_keep_in_band_keeps_the_edges():
    rows = [row(str(i)) for i in range(5)]
    assert df.keep_in_band(rows, [0.0, 0.2, 0.6, 0.8, 1.0], df.Band(0.2, 0.8), 5) == [1, 2, 3]
    assert df.keep_in_band(rows, [0.0, 0.2, 0.6, 0.8, 1.0], df.Band(1.0, 1.0), 5) == [4]


def test_an_empty_band_names_the_band_and_the_histogram():
    rows = [row(str(i)) for i in range(4)]
    with pytest.raises(ValueError) as raised:
        df.keep_in_band(rows, [0.0, 0.0, 1.0, 0.0], df.Band(0.2, 0.8), 2)
    message = str(raised.value)
    assert isinstance(raised.value, df.EmptyBand)
    assert "[0.2, 0.8]" in message and "0/2: 3  1/2: 0  2/2: 1" in message


def test_an_unscored_data_source_is_refused_with_its_name():
    rows = [row("1+1="), row("q", source="mystery"), row("r", source="mystery")]
    assert df.unscored_sources(rows, {"arith"}) == {"mystery": 2}
    with pytest.raises(ValueError, match=r"no scorer for data_source 'mystery' \(2 rows\)"):
        df.check_scored(rows, {"arith", "gsm8k"})
    df.check_scored(rows, {"arith"}, takes_any=True)  # a default scorer takes every source


def test_rows_of_held_out_problems_are_dropped():
    train = [row("1+1="), row("2+2="), row("3+3=")]
    assert df.without_problems(train, [row("2+2=", index=9)]) == [0, 2]
    assert df.problem_key({"prompt": "plain text"}) == "plain text"


def test_measure_batches_rows_and_reports_progress():
    calls, seen = [], []

    async def judge(batch):  # row i passes i of 4 answers
        calls.append(len(batch))
        return [[1.0] * r["n"] + [0.0] * (4 - r["n"]) for r in batch]

    class Bar(df.Progress):
        def update(self, n: int) -> None:
            seen.append(n)

    items = [{"n": i % 5} for i in range(7)]
    rates = asyncio.run(df.measure(items, judge, batch_size=3, progress=Bar()))
    assert rates == [0.0, 0.25, 0.5, 0.75, 1.0, 0.0, 0.25]
    assert calls == [3, 3, 1] and seen == [3, 3, 1]


def test_measure_refuses_a_judge_that_loses_rows():
    async def judge(batch):
        return [[1.0]]

    with pytest.raises(ValueError, match="answered 1 rows of 2"):
        asyncio.run(df.measure([{}, {}], judge, batch_size=2))


def test_written_rows_keep_the_schema_and_gain_pass_rate(tmp_path):
    rows = [row("a", index=0), row("b", index=1), row("c", index=2)]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    table = df.read_table(source)
    out = tmp_path / "out" / "kept.parquet"
    df.write_kept(table, [0, 2], [0.25, 0.75], 4, out)
    written = pq.read_table(out)
    assert written.column_names == table.column_names
    for name in ("prompt", "reward_model", "data_source"):
        assert written.schema.field(name).type == table.schema.field(name).type
    kept = written.to_pylist()
    assert [r["prompt"][0]["content"] for r in kept] == ["a", "c"]
    assert kept[1]["extra_info"] == {"split": "train", "index": 2, "pass_rate": 0.75, "pass_k": 4}
    assert not list(out.parent.glob(".*tmp"))


def test_rows_without_extra_info_get_one(tmp_path):
    table = pa.Table.from_pylist([{"data_source": "arith", "prompt": "1+1="}])
    df.write_kept(table, [0], [0.5], 2, tmp_path / "out.parquet")
    assert pq.read_table(tmp_path / "out.parquet").to_pylist()[0]["extra_info"] == {
        "pass_rate": 0.5,
        "pass_k": 2,
    }


def test_missing_input_is_an_error():
    with pytest.raises(ValueError, match="input file not found"):
        df.read_table("/nonexistent/in.parquet")


def test_cli_refuses_bad_arguments_before_any_work(tmp_path, capsys):
    from rlfleet.launch.data_filter import parse

    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([row("a")]), source)
    base = ["filter", "--input", str(source), "--output", str(tmp_path / "out.parquet")]
    for extra, said in (
        (["--band", "0.9,0.1"], "0 <= low <= high <= 1"),
        (["--k", "0"], "--k, --batch-size"),
        (["--router", "a:1", "--run-dir", "d"], "not allowed with"),
    ):
        with pytest.raises(SystemExit) as done:
            parse(base + extra)
        assert done.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["filter", "--input", str(tmp_path / "none.parquet"), "--output", "x.parquet"])
    assert "no such file" in capsys.readouterr().err
    args = parse([*base, "--temperature", "0.5", "model.path=m"])
    assert args.overrides == ["model.path=m", "rollout.temperature=0.5"]
    assert args.band == df.Band(0.2, 0.8) and args.k == 8
