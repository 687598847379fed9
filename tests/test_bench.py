"""`eejax bench`: settings as typed, paired timing, and the command's rows and JSON on a tiny model."""

import json

import pytest

from eejax.bench.paired import paired_runs, runs_count
from eejax.bench.peers import llamacpp_failure
from eejax.bench.run import agreement
from eejax.bench.settings import parse_setting
from eejax.errors import EejaxError
from tests.test_cli import run_cli


def test_settings_read_as_typed_and_refuse_typos():
    assert parse_setting("full").is_full and parse_setting("none").is_full and parse_setting("spec=off").is_full
    s = parse_setting("draft:4:lookup")
    assert (s.spec, s.exit, s.lossless) == ("draft:4:lookup", None, True)
    s = parse_setting("exit=softmax:0.9")
    assert (s.spec, s.exit, s.lossless) == (None, "softmax:0.9", False)
    assert parse_setting("exit=none").exit == "none"  # the exit loop at full depth, not the peer
    assert parse_setting("spec=auto").spec == "auto"
    for bad, needle in [("exit=bogus:1", "unknown exit measure"), ("draft:x", "cannot read"), ("x=1", "expected full")]:
        with pytest.raises(EejaxError, match=needle):
            parse_setting(bad)


def test_paired_runs_time_each_config_between_two_peer_runs():
    calls = []
    speeds = iter([1, 9, 2, 4, 6, 10, 5])  # warm-ups: peer 1, a 9, b 2; then peer 4, a 6, peer 10, b 5, peer ...

    def run(config):
        calls.append(config)
        return next(speeds, 6)

    timed = paired_runs(run, ["a", "b"], repeats=1)
    assert calls == [None, "a", "b", None, "a", None, "b", None] and len(calls) == runs_count(2, 1)
    assert timed.ratio(0, float) == 6 / 7 and timed.ratio(1, float) == 5 / 8
    assert timed.speed(None, float) == 6 and timed.last(1) == 5


def test_agreement_counts_positions_and_length_differences():
    assert agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert agreement([[1, 9, 3], [4]], [[1, 2, 3], [4, 5]]) == 3 / 5


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints["gqa-untied"][2]


def test_a_failed_llamacpp_run_says_how_it_failed_and_on_amx_how_to_build_one_that_runs():
    assert llamacpp_failure(1, "load\nerror: no such file\n", "") == (
        "llama.cpp's run failed (exit status 1): error: no such file"
    )
    assert llamacpp_failure(-11, "", "flags: avx512f") == "llama.cpp's run was killed by SIGSEGV"
    amx = llamacpp_failure(-11, "", "flags: avx512f amx_tile amx_int8")
    assert "#20824" in amx and "-DGGML_NATIVE=OFF" in amx and "llama-cpp-python==0.3.36" in amx
    assert llamacpp_failure(-9, "", "amx_int8") == "llama.cpp's run was killed by SIGKILL"


def test_bench_command_rows_and_json(capsys, ckpt, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "The river rose"}\n"Officials said"\n')
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", ckpt, "--settings", "1:2", "exit=static:1", "--batches", 1, 2]
    argv += ["--prompts", 2, "--new-tokens", 4, "--data", data, "--json", out_json]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    rows = {(r["setting"], r["batch"]): r for r in doc["rows"]}
    assert list(rows) == [(s, b) for b in (1, 2) for s in ("full", "1:2", "exit=static:1")]
    for b in (1, 2):
        assert rows["full", b]["decode_ratio"] == 1.0 and rows["full", b]["tokens_equal_full"]
        assert rows["1:2", b]["tokens_equal_full"] and rows["1:2", b]["lossless"] and rows["1:2", b]["tokens_per_round"]
        exited = rows["exit=static:1", b]
        assert exited["layers_per_token"] < rows["full", b]["layers_per_token"] and not exited["lossless"]
        assert all(r["decode_tokens_per_s"] > 0 and r["end_to_end_ratio"] > 0 for r in doc["rows"])
    assert doc["run"]["settings"] == ["full", "1:2", "exit=static:1"] and doc["environment"]["device"]["platform"]
    assert out.splitlines()[0].split()[:2] == ["setting", "batch"] and len(out.splitlines()) == 7


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--settings", "draft:x"], "bench setting 'draft:x'"),
        (["--json", "/no/such/folder/b.json"], "does not exist"),
        (["--data", "/no/such/prompts.jsonl"], "neither a file nor one of the sets"),
        (["--data", "chat", "--reference-field", "summary"], "--reference-field needs --data FILE"),
        (["--peer", "llamacpp"], "--peer needs a known model"),
        (["--batches", 0], "positive integer"),
    ],
)
def test_bench_refuses_bad_input_in_one_line(capsys, ckpt, extra, needle):
    code, out, err = run_cli(capsys, "bench", "--model", ckpt, "--new-tokens", 2, *extra)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and out == "", err
