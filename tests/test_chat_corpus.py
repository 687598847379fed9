"""Chat text for draft heads (`train/chat_corpus.py`): instruction files read with their inputs,
questions rendered through the chat template, and `eejax train-draft` on chat data alone (questions
from a file and questions the model writes itself, greedy and sampled answers, going on from a
trained head)."""

import gzip
import json
import shutil

import jax
import numpy as np
import pytest
from transformers import AutoTokenizer

import eejax
from eejax.errors import EejaxError
from eejax.models import draft_head
from eejax.train import chat_corpus

CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_instructions_are_read_with_their_inputs_and_bad_rows_named(tmp_path):
    good = tmp_path / "good.jsonl"
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3"},
        {"question": "Why?"},
        {"prompt": " Hi ", "context": ""},
    ]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert chat_corpus.read_instructions(good) == ["Add the numbers.\n\n2 and 3", "Why?", "Hi"]
    packed = tmp_path / "good.jsonl.gz"
    packed.write_bytes(gzip.compress(good.read_bytes()))
    assert chat_corpus.read_instructions(packed) == ["Add the numbers.\n\n2 and 3", "Why?", "Hi"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "ok"}\n{"answer": "no question"}\n')
    with pytest.raises(EejaxError, match="line 2 has no instruction"):
        chat_corpus.read_instructions(bad)
    bad.write_text("not json\n")
    with pytest.raises(EejaxError, match="line 1 is not JSON"):
        chat_corpus.read_instructions(bad)
    with pytest.raises(EejaxError, match="not found"):
        chat_corpus.read_instructions(tmp_path / "missing.jsonl")


def test_chat_prompts_follow_the_template(tiny_tokenizer):
    with pytest.raises(EejaxError, match="no chat template"):
        chat_corpus.chat_prompt(tiny_tokenizer, "Hello")
    tok = AutoTokenizer.from_pretrained(_with_template(tiny_tokenizer))
    ids = chat_corpus.chat_prompt(tok, "Name a fruit.")
    assert tok.decode(ids) == "<s>user\nName a fruit.</s>\n<s>assistant\n"
    prefix = chat_corpus.user_turn_prefix(tok)
    assert tok.decode(prefix) == "<s>user\n" and ids[: len(prefix)] == prefix


def _with_template(tokenizer, where=None):
    import tempfile

    where = where or tempfile.mkdtemp()
    tokenizer.chat_template = CHATML
    try:
        tokenizer.save_pretrained(where)
    finally:
        tokenizer.chat_template = None
    return where


def test_train_draft_on_chat_alone_goes_on_from_a_trained_head(tiny_checkpoints, tmp_path, capsys):
    from eejax.cli import main
    from eejax.loading.deltas import apply_draft
    from eejax.train.draft_run import save_draft

    path = tmp_path / "chat-model"
    shutil.copytree(tiny_checkpoints["gqa-untied"][2], path)
    base = eejax.load(path)
    _with_template(base.tokenizer, path / "tokenizer")
    start = base.with_params({**base.params, "draft": draft_head.init_draft(base.config, jax.random.PRNGKey(3))})
    init = save_draft(tmp_path / "init.safetensors", start, np.arange(64), {})
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"instruction": "Say hello."}\n{"instruction": "Count to three.", "input": "1, 2"}\n')
    out = tmp_path / "run"
    argv = ["train-draft", "--model", str(path), "--instructions-file", str(questions), "--self-questions", "6"]
    argv += ["--answer-tokens", "6", "--init", str(init), "--output", str(out), "--steps", "2", "--batch-size", "2"]
    argv += ["--learning-rate", "1e-12", "--window", "64", "--vocab-size", "64", "--no-plot", "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    answers = json.loads((out / "answers.json").read_text())
    tok = eejax.load(path).tokenizer
    assert tok.decode(answers["prompts"][1]) == "<s>user\nCount to three.\n\n1, 2</s>\n<s>assistant\n"
    own = json.loads((out / "self_questions.json").read_text())["questions"]
    assert len(answers["prompts"]) == 2 + len(own)
    sampled = json.loads((out / "answers_sampled.json").read_text())["prompts"]
    assert sampled == answers["prompts"]  # one sampled answer each besides the greedy one
    trained = eejax.load(out / "model").params["draft"]
    first = apply_draft(base, init).params["draft"]
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(first)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)  # the init's head: lr ~ 0
    assert main(["train-draft", "--model", str(path), "--output", str(tmp_path / "none"), "--quiet"]) == 2
    assert "nothing to train on" in capsys.readouterr().err


def test_train_draft_on_sequences_made_beforehand(tiny_checkpoints, tmp_path, capsys):
    """`--sequences-file`: token sequences written beforehand (`token_sequences`) are the whole
    training text, with no generation; ids past the vocabulary and missing files are refused
    before anything is written."""
    from eejax.cli import main
    from eejax.train.token_sequences import load_sequences, save_sequences

    path = tiny_checkpoints["gqa-untied"][2]
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, 60, size=n).tolist() for n in (20, 33, 9)]
    made = tmp_path / "answers.npz"
    save_sequences(made, sequences, [["test answers", 0.0, 0, 3]])
    assert load_sequences(made) == (sequences, [["test answers", 0.0, 0, 3]])
    out = tmp_path / "run"
    argv = ["train-draft", "--model", str(path), "--output", str(out), "--steps", "1", "--batch-size", "2"]
    argv += ["--window", "64", "--vocab-size", "64", "--no-plot", "--quiet"]
    assert main([*argv, "--sequences-file", str(made)]) == 0, capsys.readouterr().err
    meta = json.loads((out / "features" / "meta.json").read_text())
    assert meta["tokens"] == 62 and "3 sequences made beforehand" in meta["source"]
    assert not (out / "answers.json").exists()
    bad = tmp_path / "bad.npz"
    save_sequences(bad, [[1, 2, 10**4]], [])
    with pytest.raises(EejaxError, match="uint16"):
        save_sequences(tmp_path / "wide.npz", [[1, 70_000]], [])  # a larger vocabulary is refused, not wrapped
    assert not (tmp_path / "wide.npz").exists()
    assert main([*argv[:4], str(tmp_path / "bad-run"), *argv[5:], "--sequences-file", str(bad)]) == 2
    assert "token id 10000, past" in capsys.readouterr().err and not (tmp_path / "bad-run").exists()
    assert main([*argv[:4], str(tmp_path / "bad-run"), *argv[5:], "--sequences-file", str(tmp_path / "no.npz")]) == 2
    assert "token sequences file not found" in capsys.readouterr().err


def test_continuations_are_saved_each_batch_and_reused_per_prompt(tmp_path, monkeypatch):
    """A rerun with more prompts continues only the new ones; a run cut short keeps its batches."""
    from eejax.train import data, draft_corpus

    asked = []

    def fake(model, prompts, new_tokens, *, batch_size, progress):
        asked.append([list(p) for p in prompts])
        if prompts[0] == [9]:
            raise KeyboardInterrupt  # the run is cut short in its second batch
        return [list(p) + [7] * new_tokens for p in prompts]

    monkeypatch.setattr(data, "continued_sequences", fake)
    path = tmp_path / "c.json"
    with pytest.raises(KeyboardInterrupt):
        draft_corpus.continuations(None, [[1], [2], [9]], path, new_tokens=2, batch_size=2, progress=False)
    assert asked == [[[1], [2]], [[9]]]
    asked.clear()
    out = draft_corpus.continuations(None, [[3], [1], [1], [2]], path, new_tokens=2, batch_size=2, progress=False)
    assert out == [[3, 7, 7], [1, 7, 7], [1, 7, 7], [2, 7, 7]] and asked == [[[3]]]
    asked.clear()
    draft_corpus.continuations(None, [[1]], path, new_tokens=3, batch_size=2, progress=False)
    assert asked == [[[1]]]  # another length: continued again


def test_sampled_continuations_go_in_saved_batches_and_sample_as_one_call(tiny_checkpoints, tmp_path, monkeypatch):
    """Prompt i draws with (seed, i) whatever batch it runs in (`generate`'s row_offset), so a run
    cut short goes on after its last saved batch and ends with what an uncut run gives."""
    import sys

    from eejax.train import draft_corpus

    model = eejax.load(tiny_checkpoints["gqa-untied"][2])
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [10, 11, 12, 13], [14]]  # a prompt twice: two samples
    one_call = eejax.generate(model, prompts, max_new_tokens=4, temperature=0.7, seed=1, batch_size=2).tokens
    later = eejax.generate(model, prompts[2:4], max_new_tokens=4, temperature=0.7, seed=1, row_offset=2)
    assert later.tokens == one_call[2:4]
    uncut = draft_corpus.sampled_continuations(model, prompts, tmp_path / "uncut.json", new_tokens=4, batch_size=2)
    assert uncut == [p + t for p, t in zip(prompts, one_call)]

    module = sys.modules["eejax.engine.generate"]
    real, offsets = module.generate, []

    def cut_in_the_second_batch(*args, row_offset, **kwargs):
        offsets.append(row_offset)
        if len(offsets) == 2:
            raise KeyboardInterrupt
        return real(*args, row_offset=row_offset, **kwargs)

    monkeypatch.setattr(module, "generate", cut_in_the_second_batch)
    path = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        draft_corpus.sampled_continuations(model, prompts, path, new_tokens=4, batch_size=2, progress=False)
    assert json.loads(path.read_text())["sequences"] == uncut[:2]
    offsets.clear()
    monkeypatch.setattr(module, "generate", real)
    assert draft_corpus.sampled_continuations(model, prompts, path, new_tokens=4, batch_size=2) == uncut
    with pytest.raises(EejaxError, match="row_offset must be an integer >= 0"):
        eejax.generate(model, prompts, max_new_tokens=2, row_offset=-1)


def test_self_questions_in_whole_batches_are_the_samples_of_one_call_and_a_cut_short_set_goes_on(
    tiny_checkpoints, tmp_path, monkeypatch
):
    import sys
    import time

    module = sys.modules["eejax.engine.generate"]

    path = tmp_path / "chat-model"
    shutil.copytree(tiny_checkpoints["gqa-untied"][2], path)
    _with_template(eejax.load(path).tokenizer, path / "tokenizer")
    model = eejax.load(path)
    # every sample kept as its tokens (a tiny random model seldom ends a turn), so samples are compared
    monkeypatch.setattr(
        chat_corpus, "_whole_questions", lambda m, samples, w, seen, **kw: [str(list(t)) for t in samples]
    )
    prefix = chat_corpus.user_turn_prefix(model.tokenizer)
    one_call = eejax.generate(model, [prefix] * 5, max_new_tokens=8, temperature=0.9, seed=7, batch_size=8).tokens
    got = chat_corpus.self_questions(model, 5, tmp_path / "q.json", max_tokens=8, batch_size=2)
    assert got == [str(list(t)) for t in one_call] and len(set(got)) > 1
    cut = tmp_path / "cut.json"
    past = time.monotonic() - 1
    assert chat_corpus.self_questions(model, 5, cut, max_tokens=8, batch_size=2, until=past) == []
    assert json.loads(cut.read_text())["complete"] is False
    real, asked = module.generate, []

    def stop_at_the_second_batch(m, prompts, **kw):
        asked.append((prompts, kw["row_offset"]))
        if len(asked) == 2:
            raise KeyboardInterrupt
        return real(m, prompts, **kw)

    monkeypatch.setattr(module, "generate", stop_at_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        chat_corpus.self_questions(model, 5, cut, max_tokens=8, batch_size=2)
    assert json.loads(cut.read_text())["questions"] == got[:2]
    asked.clear()
    monkeypatch.setattr(
        module, "generate", lambda m, prompts, **kw: asked.append(kw["row_offset"]) or real(m, prompts, **kw)
    )
    assert chat_corpus.self_questions(model, 5, cut, max_tokens=8, batch_size=2) == got  # the uncut run's
    assert asked == [2, 4]  # it went on after the saved batch
    asked.clear()
    assert chat_corpus.self_questions(model, 5, cut, max_tokens=8, batch_size=2) == got and asked == []  # read back

    # openings: row i's question begins with starts[i % 2]; another setting is sampled anew
    def prompts_of(m, prompts, **kw):
        asked.append(prompts)
        return real(m, prompts, **kw)

    monkeypatch.setattr(module, "generate", prompts_of)
    chat_corpus.self_questions(model, 3, cut, max_tokens=8, batch_size=2, starts=("", "Write"))
    write = model.tokenizer("Write", add_special_tokens=False)["input_ids"]
    assert asked == [[prefix, prefix + write], [prefix]]
    assert json.loads(cut.read_text())["settings"]["starts"] == ["", "Write"]


def test_whole_questions_begin_with_their_opening_and_leave_out_the_excluded(tiny_checkpoints):
    model = eejax.load(tiny_checkpoints["gqa-untied"][2])
    tok, eos = model.tokenizer, model.eos_token_ids[0]
    ids = tok("a poem about the sea", add_special_tokens=False)["input_ids"]
    write = tok("Write", add_special_tokens=False)["input_ids"]
    cut_off = ids  # no EOS: the model did not end the turn
    got = chat_corpus._whole_questions(
        model, [ids + [eos], ids + [eos], cut_off], 3, seen=[], starts=[write, [], write]
    )
    assert got == [tok.decode(write + ids).strip(), tok.decode(ids).strip()]
    assert got[0].startswith("Write")
    assert chat_corpus._whole_questions(model, [ids + [eos]], 3, seen=[got[1]]) == []  # excluded
    assert chat_corpus._whole_questions(model, [ids + [eos]], 30, seen=[]) == []  # too few words
