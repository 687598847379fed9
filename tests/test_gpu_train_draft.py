"""scripts/gpu_train_draft.py's CPU side: `answer` (the model's greedy answers to chat questions,
saved after each batch, resumed, refused for another question set) and the run's argument checks."""

import importlib.util
import json
import shutil

import pytest

import eejax
from eejax.train.token_sequences import load_sequences
from tests.helpers import ROOT
from tests.test_chat_corpus import _with_template

SCRIPT = ROOT / "scripts" / "gpu_train_draft.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_train_draft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answers_resume_after_the_last_saved_batch_and_are_the_models_greedy_answers(
    script, tiny_checkpoints, tmp_path, monkeypatch
):
    from eejax.train.chat_corpus import chat_prompt

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_checkpoints["gqa-untied"][2], model_dir)
    _with_template(eejax.load(model_dir).tokenizer, model_dir / "tokenizer")
    questions = tmp_path / "q.jsonl"
    asked = ["Say hello.", "Count to three.", "Name a fruit.", "Why is the sky blue?", "Add 2 and 3."]
    questions.write_text("".join(json.dumps({"question": q}) + "\n" for q in asked))
    out = tmp_path / "answers.npz"
    argv = ["answer", str(questions), str(out), "--model", str(model_dir), "--batch", "2", "--answer-tokens", "4"]

    assert script.main([*argv, "--limit", "3"]) == 0
    first, _ = load_sequences(out)
    real = script.continue_prompts
    assert len(first) == 3
    answered = []
    monkeypatch.setattr(script, "continue_prompts", lambda m, c, **kw: answered.append(len(c)) or real(m, c, **kw))
    assert script.main(argv) == 0  # all five: the first three are kept, two more answered
    assert answered == [2]
    done, made = load_sequences(out)
    assert done[:3] == first and len(done) == 5 and made[0][3] == 5

    model = eejax.load(model_dir)
    order = script.np.random.default_rng(0).permutation(len(asked))
    prompts = [chat_prompt(model.tokenizer, asked[i]) for i in order]
    greedy = eejax.generate(model, prompts, max_new_tokens=4).tokens
    assert sorted(done) == sorted(p + list(t) for p, t in zip(prompts, greedy))

    with pytest.raises(SystemExit, match="up to 4 tokens each"):  # longer answers would not match these
        script.main([*argv[:-1], "8"])
    questions.write_text(json.dumps({"question": "Something else."}) + "\n")
    with pytest.raises(SystemExit, match="holds other answers"):
        script.main(argv)
    assert load_sequences(out)[0] == done  # left as it was


def test_answer_refuses_counts_below_one_by_name(script, tmp_path, capsys):
    for flag in ("--batch", "--answer-tokens", "--limit"):
        with pytest.raises(SystemExit) as e:
            script.main(["answer", str(tmp_path / "q.jsonl"), str(tmp_path / "a.npz"), flag, "0"])
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_run_refuses_a_fresh_vocabulary_without_a_head_to_go_on_from(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["run", str(tmp_path / "jobs.json.gz"), str(tmp_path / "run"), "--seconds", "60", "--fresh-vocab"])
    assert e.value.code == 2 and "--fresh-vocab needs --init" in capsys.readouterr().err


def test_questions_are_written_as_json_lines_once_all_are_sampled(script, tiny_checkpoints, tmp_path, monkeypatch):
    import gzip

    from eejax.train import chat_corpus

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_checkpoints["gqa-untied"][2], model_dir)
    _with_template(eejax.load(model_dir).tokenizer, model_dir / "tokenizer")
    excluded = tmp_path / "old.jsonl"
    excluded.write_text(json.dumps({"question": "An old question?"}) + "\n")
    asked = []

    def as_tokens(m, samples, w, seen, starts=None):  # a tiny random model seldom ends a turn
        asked.append(list(seen))
        return [f"{list(s)} {list(t)}" for s, t in zip(starts, samples)]

    monkeypatch.setattr(chat_corpus, "_whole_questions", as_tokens)
    out = tmp_path / "q.jsonl.gz"
    argv = ["questions", str(out), "--model", str(model_dir), "--count", "3", "--batch", "2", "--max-tokens", "4"]
    assert script.main([*argv, "--steered", "--exclude", str(excluded)]) == 0
    with gzip.open(out, "rt") as f:
        got = [json.loads(line)["question"] for line in f]
    write = eejax.load(model_dir).tokenizer("Write", add_special_tokens=False)["input_ids"]
    assert len(got) == 3 and got[1].startswith(f"{write} ") and got[0].startswith("[] ")  # QUESTION_STARTS[:2]
    assert asked[0] == ["An old question?"] and asked[1] == ["An old question?", *got[:2]]
    assert not (tmp_path / "q.jsonl.gz.state.json").exists()
    with pytest.raises(SystemExit, match="exists"):
        script.main(argv)


@pytest.mark.parametrize("bad", [["--count", "0"], ["--batch", "0"], ["--temperature", "0"]])
def test_questions_refuse_bad_settings_by_name(script, tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        script.main(["questions", str(tmp_path / "q.jsonl.gz"), *bad])
    assert e.value.code == 2 and bad[0] in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
