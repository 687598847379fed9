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

    questions.write_text(json.dumps({"question": "Something else."}) + "\n")
    with pytest.raises(SystemExit, match="holds other answers"):
        script.main(argv)
    assert load_sequences(out)[0] == done  # left as it was


def test_run_refuses_a_fresh_vocabulary_without_a_head_to_go_on_from(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["run", str(tmp_path / "jobs.json.gz"), str(tmp_path / "run"), "--seconds", "60", "--fresh-vocab"])
    assert e.value.code == 2 and "--fresh-vocab needs --init" in capsys.readouterr().err
