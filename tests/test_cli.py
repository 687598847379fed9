"""The `eejax` CLI: the --json contract scripts rely on, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from eejax.cli import main


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints["gqa-untied"][2]


def test_generate_json_contract(capsys, ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"article": "The river rose"}\n"A plain string prompt"\n\n{"article": "Officials said"}\n')
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpt,
        "--prompts-file",
        prompts,
        "--max-new-tokens",
        6,
        "--ignore-eos",
        "--json",
        "--batch-size",
        2,
    )
    assert code == 0
    doc = json.loads(out)  # stdout is exactly one JSON object
    assert [o["prompt"] for o in doc["outputs"]] == ["The river rose", "A plain string prompt", "Officials said"]
    for o in doc["outputs"]:
        assert set(o) == {"prompt", "text", "tokens", "exit_layers", "confident_layers"}
        assert len(o["tokens"]) == 6 and o["exit_layers"] == [3] * 6
    s = doc["stats"]
    assert {"tokens_per_s", "generated_tokens", "mean_layers_per_token", "num_layers", "compile_s"} <= set(s)
    assert s["generated_tokens"] == 18 and s["num_layers"] == 3 and s["mean_layers_per_token"] == 3
    # The same prompts given with --prompt give the same tokens, with either layout of the weights.
    for layout in ("stacked", "split"):
        code, out2, _ = run_cli(
            capsys,
            "generate",
            "--model",
            ckpt,
            "--prompt",
            "The river rose",
            "--max-new-tokens",
            6,
            "--ignore-eos",
            "--json",
            "--layer-buffers",
            layout,
        )
        assert json.loads(out2)["outputs"][0]["tokens"] == doc["outputs"][0]["tokens"]


def test_a_mesh_that_does_not_fit_is_one_line_with_status_2(capsys, ckpt):
    """(Sharded generation itself is tested on 8 virtual devices in test_sharding.py.)"""
    code, _, err = run_cli(
        capsys, "generate", "--model", ckpt, "--prompt", "x", "--tensor-parallel", 2, "--data-parallel", 2
    )
    assert code == 2 and err.strip().splitlines() == [
        "eejax: error: a mesh of tensor 2 x data 2 needs 4 devices; this process has 1 (cpu)"
    ]
    code, _, err = run_cli(capsys, "serve", "--model", ckpt, "--tensor-parallel", 0)
    assert code == 2 and "--tensor-parallel" in err
    code, _, err = run_cli(capsys, "generate", "--model", ckpt, "--prompt", "x", "--num-processes", 2)
    assert code == 2 and err.strip() == "eejax: error: --num-processes needs --coordinator HOST:PORT and --process-id"
    code, _, err = run_cli(capsys, "generate", "--model", ckpt, "--prompt", "x", "--process-id", 1)
    assert code == 2 and err.strip() == "eejax: error: --process-id needs --coordinator and --num-processes"


def test_generate_with_exit_json(capsys, ckpt):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpt,
        "--prompt",
        "The river rose",
        "Officials said",
        "--max-new-tokens",
        5,
        "--ignore-eos",
        "--json",
        "--exit",
        "static:2",
    )
    assert code == 0
    doc = json.loads(out)
    for o in doc["outputs"]:
        assert o["exit_layers"] == [3, 2, 2, 2, 2] and o["confident_layers"] == [3, 2, 2, 2, 2]
    assert doc["stats"]["exit"] == "static:2" and doc["stats"]["kv_fill_layers_per_token"] == pytest.approx(0.8)
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpt,
        "--prompt",
        "The river rose",
        "--max-new-tokens",
        5,
        "--ignore-eos",
        "--json",
        "--exit",
        "softmax:-inf",
        "--min-exit-layer",
        2,
        "--exit-decay",
        "off",
    )
    assert code == 0 and json.loads(out)["outputs"][0]["exit_layers"] == [3, 2, 2, 2, 2]


def test_generate_with_spec_json(capsys, ckpt):
    argv = [
        "generate",
        "--model",
        ckpt,
        "--prompt",
        "The river rose",
        "Officials said",
        "--max-new-tokens",
        7,
        "--ignore-eos",
        "--json",
    ]
    _, full, _ = run_cli(capsys, *argv)
    for spec in ("1:3", "2:2:adaptive"):
        code, out, _ = run_cli(capsys, *argv, "--spec", spec)
        assert code == 0
        doc = json.loads(out)
        assert [o["tokens"] for o in doc["outputs"]] == [o["tokens"] for o in json.loads(full)["outputs"]]
        s = doc["stats"]
        assert s["spec"] == spec and 0 <= s["acceptance_rate"] <= 1 and s["tokens_per_round"] >= 1
        assert s["rounds"] >= 2 and s["drafted_tokens"] >= s["accepted_tokens"] and s["mean_layers_per_token"] > 0
    code, out, _ = run_cli(
        capsys, "generate", "--model", ckpt, "--prompt", "Hello", "--max-new-tokens", 4, "--spec", "2:2"
    )
    assert code == 0 and "self-speculation 2:2: acceptance" in out


def test_generate_text_output(capsys, ckpt):
    code, out, _ = run_cli(capsys, "generate", "--model", ckpt, "--prompt", "Hello there", "--max-new-tokens", 4)
    assert code == 0 and "=== prompt 0 ===" in out and "tokens/s" in out


def test_convert_command(capsys, tiny_checkpoints, tmp_path):
    code, out, _ = run_cli(capsys, "convert", tiny_checkpoints["mha-tied"][1], tmp_path / "c", "--quiet")
    assert code == 0 and (tmp_path / "c" / "eejax.json").is_file()


def bad_inputs(tmp_path, ckpt):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    base = ["generate", "--model", ckpt, "--max-new-tokens", 4]
    train = ["train-exits", "--model", ckpt, "--prompt", "hi", "--steps", 1, "--quiet"]
    return {
        "missing path": (["generate", "--model", tmp_path / "nope", "--prompt", "hi"], "no such file"),
        "not a model": (["generate", "--model", tmp_path / "empty_dir", "--prompt", "hi"], "not an eejax model"),
        "unsupported architecture": (["convert", tmp_path / "gpt2", tmp_path / "out"], "converts: llama"),
        "prompt too long": (base + ["--prompt", "word " * 400], "context"),
        "empty prompt list": (base + ["--prompts-file", tmp_path / "empty.jsonl"], "no prompts"),
        "empty prompt": (base + ["--prompt", ""], "prompt 0 is empty"),
        "non-positive max-new-tokens": (
            ["generate", "--model", ckpt, "--prompt", "hi", "--max-new-tokens", 0],
            "positive",
        ),
        "cache budget too small": (base + ["--prompt", "hi", "--cache-budget", "1KiB"], "KV cache budget"),
        "bad prompts file": (base + ["--prompts-file", tmp_path / "missing.jsonl"], "not found"),
        "unknown exit measure": (base + ["--prompt", "hi", "--exit", "entropy:0.5"], "unknown exit measure"),
        "exit threshold missing": (base + ["--prompt", "hi", "--exit", "softmax"], "needs a value"),
        "exit threshold out of range": (base + ["--prompt", "hi", "--exit", "softmax:1.5"], "[0, 1]"),
        "static exit too deep": (base + ["--prompt", "hi", "--exit", "static:9"], "deeper than the model"),
        "classifier without exits": (base + ["--prompt", "hi", "--exit", "classifier:0.5"], "init_exits"),
        "exit options without --exit": (base + ["--prompt", "hi", "--min-exit-layer", 2], "need --exit"),
        "bad exit decay": (base + ["--prompt", "hi", "--exit", "state:0.9", "--exit-decay", "x"], "--exit-decay"),
        "bad spec": (base + ["--prompt", "hi", "--spec", "3"], "expected E:d"),
        "spec as deep as the model": (base + ["--prompt", "hi", "--spec", "3:2"], "must be below"),
        "spec with exit": (base + ["--prompt", "hi", "--spec", "1:2", "--exit", "static:2"], "not both"),
        "spec max without adaptive": (base + ["--prompt", "hi", "--spec", "1:2", "--spec-max-d", 4], "adaptive"),
        "train-exits output exists": (train + ["--output", ckpt], "already exists"),
        "train-exits exit layers": (train + ["--output", tmp_path / "out", "--exit-layers", "0,2"], "exit layers must"),
        "train-exits no room": (
            train + ["--output", tmp_path / "out", "--max-len", 8, "--continuation-tokens", 8],
            "no room",
        ),
        "top-k above the vocabulary": (
            base + ["--prompt", "hi", "--temperature", 0.7, "--top-k", 100000],
            "vocabulary size 320",
        ),
        "too many drafts": (base + ["--prompt", "hi", "--spec", "1:100000"], "[1, 64]"),
        "infinite temperature": (base + ["--prompt", "hi", "--temperature", "inf"], "finite"),
        "zero repetition penalty": (base + ["--prompt", "hi", "--repetition-penalty", 0], "repetition_penalty"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing path",
        "not a model",
        "unsupported architecture",
        "prompt too long",
        "empty prompt list",
        "empty prompt",
        "non-positive max-new-tokens",
        "cache budget too small",
        "bad prompts file",
        "unknown exit measure",
        "exit threshold missing",
        "exit threshold out of range",
        "static exit too deep",
        "classifier without exits",
        "exit options without --exit",
        "bad exit decay",
        "bad spec",
        "spec as deep as the model",
        "spec with exit",
        "spec max without adaptive",
        "train-exits output exists",
        "train-exits exit layers",
        "train-exits no room",
        "top-k above the vocabulary",
        "too many drafts",
        "infinite temperature",
        "zero repetition penalty",
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, ckpt, tmp_path, case):
    argv, needle = bad_inputs(tmp_path, ckpt)[case]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert out == ""
    assert not (tmp_path / "out").exists()


def test_train_exits_command(capsys, ckpt, tmp_path):
    import numpy as np

    import eejax

    out_dir, png = tmp_path / "trained", tmp_path / "loss.png"
    argv = [
        "train-exits",
        "--model",
        ckpt,
        "--prompt",
        "The river rose",
        "Officials said that the",
        "--output",
        out_dir,
        "--suffix",
        " Summary:",
        "--steps",
        3,
        "--exit-layers",
        "1",
        "--adapter-rank",
        8,
        "--continuation-tokens",
        4,
        "--max-len",
        16,
        "--batch-size",
        2,
        "--positions-per-row",
        4,
        "--learning-rate",
        1e-2,
        "--loss-plot",
        png,
        "--checkpoint-dir",
        tmp_path / "ck",
        "--quiet",
    ]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "trained exit adapters for 3 steps on 2 prompts" in out and str(out_dir) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    base, trained = eejax.load(ckpt), eejax.load(out_dir)
    up = np.asarray(trained.params["exits"]["adapter_up"])
    assert up.shape == (3, 8, trained.config.hidden_size)
    assert np.abs(up[0]).max() > 0 and np.abs(up[1:]).max() == 0  # only the exit after 1 layer trained
    np.testing.assert_array_equal(np.asarray(trained.params["embed"]), np.asarray(base.params["embed"]))
    # The trained model decodes with its exits; the rerun without --overwrite is refused.
    res = eejax.generate(trained, ["The river rose"], max_new_tokens=3, exit="static:1")
    assert res.exit_layers[0][1:] == [1, 1]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "already exists" in err


def test_train_layerskip_command(capsys, ckpt, tmp_path):
    """A whole LayerSkip run on the tiny model: interrupted by its time budget, resumed by the
    same command, then the trained checkpoint and delta; other settings on the same run refused."""
    import numpy as np

    import eejax

    out_dir = tmp_path / "run"
    argv = [
        "train-layerskip",
        "--model",
        ckpt,
        "--prompt",
        "The river rose",
        "Officials said that the",
        "Rain fell",
        "--skip",
        1,
        "--output",
        out_dir,
        "--steps",
        4,
        "--batch-size",
        2,
        "--window",
        6,
        "--continuation-tokens",
        4,
        "--exit-layers",
        "1,2",
        "--lora-rank",
        2,
        "--exit-vocab-size",
        100,
        "--save-every",
        2,
        "--quiet",
    ]
    code, out, err = run_cli(capsys, *argv, "--hours", 1e-9)  # out of time after the first step
    assert code == 0, err
    assert "stopped after" in out and "at step 1 of 4" in out and "run the same command again" in out
    code, out, err = run_cli(capsys, *argv)  # the same command, without the budget, finishes the run
    assert code == 0, err
    assert "trained 4 steps" in out and (out_dir / "delta.safetensors").exists()
    for png in ("loss.png", "kl.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = json.loads((out_dir / "run.json").read_text())
    assert run["data"]["skip"] == 1 and run["settings"]["layerskip"]["exit_layers"] == [1, 2]
    trained = eejax.load(out_dir / "model")
    assert np.asarray(trained.params["exits"]["exit_layers"]).tolist() == [1, 2]
    from eejax.loading.deltas import probe_logits
    from eejax.train.layerskip_run import load_run

    at_end, step = load_run(out_dir)  # the latest checkpoint is the trained model
    assert step == 4
    np.testing.assert_array_equal(probe_logits(at_end)[1], probe_logits(trained)[1])
    code, _, err = run_cli(capsys, *argv[:-1], "--p-max", 0.2, "--quiet")
    assert code == 2 and "other settings (settings.layerskip.p_max)" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exit-layers", "1,3"], "layer counts in [1, 2]"),
        (["--p-max", "1.5"], "p_max and e_scale must lie in [0, 1]"),
        (["--hours", "0"], "--hours must be a positive number"),
        (["--lora-rank", "-1"], "lora_rank and exit_positions >= 0"),
        (["--exit-vocab-size", "1000"], "--exit-vocab-size must lie in [0, 320]"),
        (["--skip", "5"], "no prompts left after --skip 5"),
    ],
)
def test_train_layerskip_refuses_bad_settings_before_any_work(capsys, ckpt, tmp_path, extra, message):
    code, out, err = run_cli(
        capsys, "train-layerskip", "--model", ckpt, "--prompt", "a b c", "--output", tmp_path / "run", *extra
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "data.npz").exists()


def test_entry_point_subprocess(ckpt, tmp_path):
    """The installed `eejax` command itself: --help works, and bad input gives status 2 and no traceback."""
    exe = [sys.executable, "-m", "eejax.cli"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    help_out = subprocess.run(exe + ["generate", "--help"], capture_output=True, text=True, env=env)
    assert help_out.returncode == 0 and "--max-new-tokens" in help_out.stdout
    bad = subprocess.run(
        exe + ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("eejax: error: no such file")
    conv = subprocess.run(exe + ["convert", "--help"], capture_output=True, text=True, env=env)
    assert conv.returncode == 0 and "atomic" in conv.stdout


def test_repeated_prompts_accumulate(capsys, ckpt):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        ckpt,
        "--prompt",
        "The river rose",
        "--prompt",
        "Officials said",
        "Hello",
        "--max-new-tokens",
        3,
        "--json",
    )
    assert code == 0
    assert [o["prompt"] for o in json.loads(out)["outputs"]] == ["The river rose", "Officials said", "Hello"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--model", "a", "--model", "b", "--prompt", "x"], "--model given twice"),
        (
            ["generate", "--model", "a", "--prompt", "x", "--max-new-tokens", "3", "--max-new-tokens", "4"],
            "--max-new-tokens given twice",
        ),
        (["convert", "src", "dst", "--dtype", "float32", "--dtype", "bfloat16"], "--dtype given twice"),
    ],
)
def test_repeated_single_valued_options_are_refused(capsys, argv, needle):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_repeated_list_options_accumulate_and_keep_their_default_when_absent():
    from eejax.cli import build_parser

    args = build_parser().parse_args(
        [
            "calibrate",
            "--model",
            "m",
            "--prompt",
            "x",
            "--measure",
            "softmax",
            "--thresholds",
            "0.5",
            "--thresholds",
            "0.7",
            "0.9",
        ]
    )
    assert args.thresholds == [0.5, 0.7, 0.9]
    from eejax.cli.parsing import OneLineErrorParser

    parser = OneLineErrorParser()
    parser.add_argument("--batches", type=int, nargs="*", action="extend", default=[1, 8])
    assert parser.parse_args([]).batches == [1, 8]
    assert parser.parse_args(["--batches", "2", "--batches", "4"]).batches == [2, 4]
    assert parser.parse_args(["--batches"]).batches == []  # given empty: off


# --- damaged checkpoints and conversions: one line naming the file, status 2 ------------------


def _edit_config(path, **changes):
    meta = json.loads((path / "eejax.json").read_text())
    meta["config"].update(changes)
    (path / "eejax.json").write_text(json.dumps(meta))


def _largest_weights_file(path):
    return max((f for f in (path / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _truncate_largest_weights(path):
    largest = _largest_weights_file(path)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 3])


def _scramble_largest_weights(path):
    largest = _largest_weights_file(path)
    largest.write_bytes(bytes(largest.stat().st_size))


DAMAGE = {
    "eejax.json not JSON": (lambda p: (p / "eejax.json").write_text('{"config": '), "eejax.json is not valid JSON"),
    "eejax.json without config": (
        lambda p: (p / "eejax.json").write_text('{"architecture": "llama"}'),
        "no config object",
    ),
    "unknown config field": (lambda p: _edit_config(p, wings=2), "not a valid llama config"),
    "weights missing": (lambda p: __import__("shutil").rmtree(p / "params"), "params: no such directory"),
    "weights truncated": (_truncate_largest_weights, "bytes where the checkpoint wrote"),
    "num_layers over the weights": (lambda p: _edit_config(p, num_layers=4), "have shape (3,"),
    "hidden size over the weights": (lambda p: _edit_config(p, hidden_size=96), "the config asks for"),
    "tokenizer damaged": (
        lambda p: (p / "tokenizer" / "tokenizer.json").write_text("{garbage"),
        "cannot read the tokenizer",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # nothing printed after the line
def test_a_damaged_checkpoint_is_one_line_naming_the_file(capsys, ckpt, tmp_path, damage):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(ckpt, copy)
    hurt, needle = DAMAGE[damage]
    hurt(copy)
    code, out, err = run_cli(capsys, "generate", "--model", copy, "--prompt", "hi", "--max-new-tokens", 2)
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert code == 2 and out == "", err
    assert len(lines) == 1 and needle in lines[0] and str(copy) in lines[0] and "Traceback" not in err, err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_weights_orbax_cannot_read_are_one_line_naming_them(capsys, ckpt, tmp_path):
    """A weights file of the size eejax.json recorded but unreadable: orbax's error, in one line.
    Orbax's reads still in flight then report late, on its threads (on a terminal, under the line):
    the size check keeps that from truncated files, not from these; they are waited for here."""
    import gc
    import shutil
    import time

    copy = tmp_path / "model"
    shutil.copytree(ckpt, copy)
    _scramble_largest_weights(copy)
    code, out, err = run_cli(capsys, "generate", "--model", copy, "--prompt", "hi", "--max-new-tokens", 2)
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert code == 2 and out == "" and len(lines) == 1 and "cannot read the weights" in lines[0], err
    time.sleep(0.2)
    gc.collect()


def test_convert_checks_its_inputs_before_working_and_cleans_dead_partials(capsys, tiny_checkpoints, tmp_path):
    import shutil

    hf_dir = tiny_checkpoints["mha-tied"][1]
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(capsys, "convert", hf_dir, tmp_path / "file" / "dst", "--quiet")
    assert code == 2 and "is a file, not a directory" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad-hf"
    shutil.copytree(hf_dir, bad)
    (bad / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    code, _, err = run_cli(capsys, "convert", bad, tmp_path / "dst", "--quiet")
    assert code == 2 and "config.json is not valid JSON" in err and len(err.strip().splitlines()) == 1
    (bad / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run_cli(capsys, "convert", bad, tmp_path / "dst", "--quiet")
    assert code == 2 and "not a valid llama config" in err and len(err.strip().splitlines()) == 1
    # A writer killed mid-conversion left its partial directory: the next conversion removes it
    # (the process is dead), and leaves a living process's alone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, alive = tmp_path / f".dst.partial-{int(dead.stdout)}", tmp_path / f".dst.partial-{os.getppid()}"
    stale.mkdir()
    alive.mkdir()
    code, _, _ = run_cli(capsys, "convert", hf_dir, tmp_path / "dst", "--quiet")
    assert code == 0 and not stale.exists() and alive.exists() and (tmp_path / "dst" / "eejax.json").is_file()


def test_the_compile_cache_directory_and_off():
    """`eejax` commands keep compiled programs in $EEJAX_COMPILE_CACHE (default
    ~/.cache/eejax/jax-compile); "off" and its kin turn it off; an explicit JAX directory wins."""
    from pathlib import Path

    from eejax.compile_cache import compile_cache_dir, enable_compile_cache

    assert compile_cache_dir({}) == Path.home() / ".cache" / "eejax" / "jax-compile"
    assert compile_cache_dir({"EEJAX_COMPILE_CACHE": "~/cc"}) == Path.home() / "cc"
    for off in ("off", "OFF", "none", "0", "false"):
        assert compile_cache_dir({"EEJAX_COMPILE_CACHE": off}) is None
    current = os.environ.get("JAX_COMPILATION_CACHE_DIR")  # (the session's own: enabling it changes nothing)
    if current:
        explicit = {"JAX_COMPILATION_CACHE_DIR": current, "EEJAX_COMPILE_CACHE": "off"}
        assert enable_compile_cache(explicit) == Path(current)


@pytest.mark.parametrize(
    "extra, needle",
    [(["--exit", "static:1", "--spec", "1:2"], "choose --exit or --spec"), (["--spec", "1:x"], "cannot read")],
)
def test_serve_reads_its_default_decoding_before_loading(capsys, ckpt, extra, needle):
    code, out, err = run_cli(capsys, "serve", "--model", ckpt, *extra)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and out == "", err
