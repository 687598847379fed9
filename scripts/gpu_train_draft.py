"""The draft head of smollm2-135m-eagle at GPU scale, inside a fixed time budget (a device-tool
call runs 10 minutes at most, and a session has 15 minutes of device time).

The chat head's next lease (the questions and their answers made beforehand, so the device only
caches features and trains):

    # here, in the background (hours on a 2-core CPU; resumable: a rerun goes on after the last
    # saved batch): the default load's greedy answers to the questions SmolLM2 wrote itself
    python scripts/gpu_train_draft.py answer data/smollm2_self_questions.jsonl.gz data/smollm2_chat_answers.npz
    # more questions, each begun with one of QUESTION_STARTS' openings, none of the old ones (~70
    # min for 16,384 samples on a 2-core CPU; resumable), then their answers the same way
    python scripts/gpu_train_draft.py questions data/smollm2_steered_questions.jsonl.gz --seed 8 --steered \
        --exclude data/smollm2_self_questions.jsonl.gz
    python scripts/gpu_train_draft.py answer data/smollm2_steered_questions.jsonl.gz \
        data/smollm2_steered_answers.npz --answer-tokens 96
    # here: the evaluation prompts and the texts as token ids (5 MB)
    python scripts/gpu_train_draft.py prepare .gpu/jobs.json.gz
    # there: features of the answers and the texts, training from the shipped chat head, its reduced
    # head's tokens taken anew from these answers
    python scripts/gpu_train_draft.py run .gpu/jobs.json.gz RUN_DIR --seconds 540 --out $OUT \
        --continuations data/smollm2_chat_answers.npz --continuations data/smollm2_steered_answers.npz \
        --init eejax/assets/smollm2-135m-eagle-chat.safetensors --fresh-vocab --steps 4000 --learning-rate 6e-4

Generating on the device as well:

    # here, where the model's tokenizer is: the training and evaluation prompts as token ids
    # (--questions: more chat questions, a self_questions.json or JSON lines)
    python scripts/gpu_train_draft.py prepare .gpu/jobs.json.gz [--questions data/smollm2_self_questions.jsonl.gz]

    # on the GPU machine: continuations, features, training and evaluation in SECONDS
    # (--self-questions N: first sample N more questions there, in whole batches, for 15% of SECONDS at most)
    python scripts/gpu_train_draft.py run .gpu/jobs.json.gz RUN_DIR --seconds 540 [--out DIR]
    # a dry run of the same shapes on random weights (--random-like: a checkpoint's eejax.json
    # and tokenizer/, no weights), to find errors and fill the compile cache first
    python scripts/gpu_train_draft.py run .gpu/jobs.json.gz RUN_DIR --seconds 90 --random-like DIR
    # more training with the time a generation would take: an earlier run's sequences, its head
    python scripts/gpu_train_draft.py run .gpu/jobs.json.gz RUN_DIR --seconds 540 \
        --continuations data/smollm2_continuations.npz --init eejax/assets/smollm2-135m-eagle.safetensors --steps 6000

The text (provenance: data/SOURCES.md): chat questions (data/self_instruct_instructions.jsonl, and
the questions of --questions) through the chat template, answered first (greedy, then sampled),
then windows of Python's standard-library docs and code (data/python_stdlib_text.txt.gz);
CNN/DM rows 20..99 of data/cnndm_test_dev100.jsonl and the
1,240 other CNN/DM articles of data/cnndm_more.jsonl.gz (rows 0..19 of the first are the evaluation
rows, never trained on), and WikiText-2. `run` continues prompts made from them with the frozen
model in a fixed order of priority (`JOBS`: chat answers, the standard library, then greedy
continuations of 256-token summary prompts, sampled ones, other prompt lengths, later article
windows, document windows, more samples) until its generation time is up, caches the features of
those sequences and of the texts themselves (shuffled, so that a pass cut short keeps a fair
sample), trains the draft head (`draft_training.train_draft`, --steps, stopped early if its time
runs out), and measures its held-out agreement on rows 0..19 (256-token summary prompts, the
model's 64 greedy tokens, teacher-forced). It writes RUN_DIR/draft.safetensors, and copies it
with the continuations, the losses and a result.json (each job's sequences and seconds, the
programs compiled) to --out.

The shipped head (docs/models.md: the model card of smollm2-135m-eagle) was made on one H100 on 2026-11-26
in two calls: this script's continuations (217 s: 15,277 sequences) and features (74 s: 6.3M
tokens), then `train_draft` for 3000 steps of 32 windows (180 s) on that feature cache, as `run`
now does; those continuations are data/smollm2_continuations.npz. (The script's first version
sized the training by timing 12 steps, which timed compilations: the step compiles once per
window width, up to 8 of them, and it ran 12 steps.)

On an H200 on 2026-11-30 (`run --self-questions 16384 --generate-batch 1024 --init ...chat...`)
the evaluation's 20 continuations and the questions took the whole run (569 s after a 24 s
load). The questions were one `generate` over 16,384 prompts, which admits rows as others end
and prefills groups of many sizes, each its own program (a tiny model's such call compiled 12
programs at 4,096 prompts, 5 at 1,024), and compiling is slow on a GPU; how the time went there
is not known (the log, held back by a `grep` in the pipe, did not come back). The call was
stopped at its 600 s with 13,389 questions (data/smollm2_self_questions.jsonl.gz) and no head.
`run` now samples them in whole batches until a deadline, and the answers can be made
beforehand (`answer`: the default load's answers at batch 16, ~2 questions a second on a 2-core
CPU; batch 64 answered ~1.3).

How it runs through the device tool (one call carries 64 MiB, the GGUF is 98 MB): the tracked
assets (eejax/assets/*.safetensors, data/smollm2_continuations.npz, data/cnndm_more.jsonl.gz,
data/t5_spiece.model) go aside for both calls, leaving ~5.5 MB; call 1 carries the first 58 MB of
the GGUF and the `gguf` wheel (transformers' GGUF reader needs it) and copies them to /tmp and
installs the wheel there; call 2, at once on the same warm machine, carries .gpu/ (jobs.json.gz)
and the rest of the GGUF with its sha256 and the --init head, joins and checks the GGUF into
$EEJAX_CACHE/downloads, and runs `run` with PYTHONPATH set to the checkout and
PYTHONUNBUFFERED=1, its output through `tee $OUT/log.txt` alone (a `grep` in the pipe holds the
log back until the end, and a call stopped at its limit then returns none of it).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 96  # per training continuation ...
ANSWER_TOKENS = 160  # ... and per answer to a chat question (it may end sooner)
EVAL_TOKENS = 64  # per evaluation continuation, as in benchmarks/draft_head.py
# (prompt set, temperature, seed): the order in which continuations are made until time is up;
# the chat head's data first (chat answers, then Python's standard-library docs and code)
JOBS = (
    ("chat", 0.0, 0),
    ("chat", 0.7, 1),
    ("stdlib", 0.0, 0),
    ("chat", 0.7, 2),
    ("stdlib", 0.7, 1),
    ("summary256", 0.0, 0),
    ("summary256", 0.7, 1),
    ("summary128_384", 0.0, 0),
    ("windows", 0.0, 0),
    ("summary256", 0.7, 2),
    ("documents", 0.0, 0),
    ("summary128_384", 0.7, 3),
    ("windows", 0.7, 4),
    ("documents", 0.7, 5),
    *(("summary256", 0.7, s) for s in range(6, 12)),
)


def read_questions(path: Path) -> list[str]:
    """The questions of a self_questions.json (`eejax train-draft --self-questions`, or `run`'s), or
    of JSON lines (.jsonl or .jsonl.gz) with an `instruction` or `question` each."""
    from eejax.train.chat_corpus import read_instructions

    return json.loads(path.read_text())["questions"] if path.suffix == ".json" else read_instructions(path)


def prepare(out: Path, questions=()) -> None:
    """The prompts as token ids in OUT: the texts, the evaluation rows, and the chat questions
    (self-instruct's and those of each file in `questions`) through the chat template."""
    import eejax
    from eejax.cli.draft import read_text_file
    from eejax.train import draft_corpus as dc
    from eejax.train.chat_corpus import chat_prompt, read_instructions

    tok = eejax.load("smollm2-135m", quantization=None).tokenizer
    news = dc.articles(ROOT / "data/cnndm_test_dev100.jsonl") + dc.articles(
        ROOT / "data/cnndm_more.jsonl.gz", skip_rows=0
    )
    documents = read_text_file(str(ROOT / "data/wikitext2_valid_test.txt.gz"))
    stdlib = read_text_file(str(ROOT / "data/python_stdlib_text.txt.gz"))
    evaluation = dc.articles(ROOT / "data/cnndm_test_dev100.jsonl", skip_rows=0)[: dc.EVAL_ROWS]
    chat = read_instructions(ROOT / "data/self_instruct_instructions.jsonl")
    chat += [q for path in questions for q in read_questions(path)]
    sets = {
        "chat": [chat_prompt(tok, q) for q in chat],
        "summary256": dc.summary_prompts(tok, news, (256,)),
        "summary128_384": dc.summary_prompts(tok, news, (128, 384)),
        "windows": dc.window_summary_prompts(tok, news),
        "documents": dc.text_prompts(tok, documents),
        "stdlib": dc.text_prompts(tok, stdlib, offsets=tuple(range(0, 4096, 256))),
    }
    jobs = {
        "sets": sets,
        "jobs": JOBS,
        "texts": [tok(t)["input_ids"] for t in news + documents + stdlib],
        "evaluation": dc.summary_prompts(tok, evaluation, (256,)),
        "source": f"{len(chat)} chat questions, {len(news)} CNN/DM articles, {len(documents)} WikiText-2 documents, "
        f"{len(stdlib)} standard-library documents",
    }
    with gzip.open(out, "wt") as f:
        json.dump(jobs, f)
    print({k: len(v) for k, v in sets.items()}, "texts", len(jobs["texts"]), "->", out)


def load_model(args):
    import jax

    import eejax
    from eejax.checkpoint import read_config, read_metadata
    from eejax.loading.model import Model

    if args.random_like is None:
        return eejax.load(args.model, quantization=None)  # trains on float32 weights
    from transformers import AutoTokenizer

    from eejax.models.llama import init_params

    config = read_config(args.random_like, read_metadata(args.random_like))
    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.random_like) / "tokenizer"))
    return Model(config, init_params(config, jax.random.PRNGKey(0)), tokenizer)


def continue_prompts(model, prompts, *, new_tokens, temperature, seed, batch_size, until=None):
    """Prompts (sorted by length, in batches) followed by the model's continuations, until the
    `until` time passes (then fewer)."""
    from eejax.engine.generate import generate
    from eejax.train.data import cache_budget_for

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = []
    for start in range(0, len(order), batch_size):
        if until is not None and time.monotonic() > until:
            break
        chunk = [prompts[i] for i in order[start : start + batch_size]]
        res = generate(
            model,
            chunk,
            max_new_tokens=new_tokens,
            temperature=temperature,
            seed=seed * 100_003 + start,
            batch_size=batch_size,
            cache_budget=cache_budget_for(model, chunk, new_tokens, batch_size),
            spec=None,  # full depth's samples, as on the CPU
        )
        out += [list(p) + list(t) for p, t in zip(chunk, res.tokens)]
    return out


def init_head(model, path: Path, result: dict):
    """`model` with the draft head of `path`; where its probe does not reproduce (random weights in a
    dry run, or a device that rounds otherwise) the run goes on and result.json says so."""
    from eejax.errors import EejaxError
    from eejax.loading.deltas import apply_draft

    try:
        return apply_draft(model, path)
    except EejaxError as e:
        result["init_probe"] = str(e)
        print(f"  --init: {e}; going on", flush=True)
        return apply_draft(model, path, check=False)


def vocab_coverage(data: dict, ids) -> float:
    """The share of the model's top-1 next tokens over the cached windows that lie in `ids`."""
    valid = np.arange(data["tokens"].shape[1])[None, :] < data["lengths"][:, None]
    top = data["top_ids"][..., 0][valid]
    return round(float(np.isin(top, np.asarray(ids)).mean()), 4)


def run(args) -> None:
    from eejax.train.chat_corpus import chat_prompt, self_questions
    from eejax.train.draft_features import build_feature_cache, load_feature_cache
    from eejax.train.draft_run import draft_vocabulary, save_draft
    from eejax.train.draft_training import heldout_agreement, train_draft
    from eejax.train.exit_vocab import add_exit_vocab
    from eejax.train.token_sequences import load_sequences, save_sequences

    began = time.monotonic()
    end = began + args.seconds
    run_dir, out = Path(args.run_dir), Path(args.out or args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    result = {"seconds": args.seconds, "random_weights": args.random_like is not None, "phases": {}}

    def phase(name, t):
        result["phases"][name] = round(time.monotonic() - t, 1)
        print(f"[{time.monotonic() - began:6.1f} s] {name}: {result['phases'][name]} s", flush=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))

    with gzip.open(args.jobs, "rt") as f:
        jobs = json.load(f)
    t = time.monotonic()
    model = load_model(args)
    initial = None if args.init is None else init_head(model, args.init, result)  # a bad --init fails here, early
    phase("load", t)
    left = end - time.monotonic() - args.reserve
    gen_until, features_until = time.monotonic() + 0.45 * left, time.monotonic() + 0.6 * left

    t = time.monotonic()
    evaluation = continue_prompts(
        model, jobs["evaluation"], new_tokens=EVAL_TOKENS, temperature=0.0, seed=0, batch_size=args.generate_batch
    )
    if args.self_questions:  # Magpie: questions the model writes itself, answered below with the others
        t_q = time.monotonic()
        own = self_questions(
            model,
            args.self_questions,
            out / "self_questions.json",
            batch_size=args.generate_batch,
            until=began + 0.15 * args.seconds,
        )
        jobs["sets"]["chat"] = jobs["sets"]["chat"] + [chat_prompt(model.tokenizer, q) for q in own]
        result["self_questions"] = {
            "sampled": args.self_questions,
            "kept": len(own),
            "seconds": round(time.monotonic() - t_q, 1),
        }
        print(f"  self questions: {result['self_questions']}", flush=True)
    generated, made = [], []
    for path in args.continuations:  # earlier runs' (or `answer`'s): no generation, more time to train
        seqs, how = load_sequences(path)
        generated, made = generated + seqs, made + how
    if args.continuations:
        features_until = time.monotonic() + 0.3 * left
    for name, temperature, seed in [] if args.continuations else jobs["jobs"]:
        t_job = time.monotonic()
        seqs = continue_prompts(
            model,
            jobs["sets"][name],
            new_tokens=ANSWER_TOKENS if name == "chat" else NEW_TOKENS,
            temperature=temperature,
            seed=seed,
            batch_size=args.generate_batch,
            until=gen_until,
        )
        generated += seqs
        made.append([name, temperature, seed, len(seqs), round(time.monotonic() - t_job, 1)])
        print(
            f"  {name} T={temperature} seed {seed}: {len(seqs)} of {len(jobs['sets'][name])} {made[-1][-1]} s",
            flush=True,
        )
        save_sequences(out / "continuations.npz", generated, made)  # after each job: kept if a later phase fails
        if time.monotonic() > gen_until:
            break
    result["continuations"] = made  # [set, temperature, seed, sequences, seconds]
    result["programs_compiled"] = model.programs.num_programs
    phase("continuations", t)

    t = time.monotonic()
    sequences = generated + jobs["texts"]
    shuffled = [sequences[i] for i in np.random.default_rng(0).permutation(len(sequences))]
    source = f"{jobs['source']}; continuations {made}"
    cache = build_feature_cache(
        model,
        shuffled,
        run_dir / "features",
        batch_size=args.feature_batch,
        shard_rows=4 * args.feature_batch,
        source=source,
        progress=False,
        deadline=features_until,
    )
    data = load_feature_cache(cache)
    held = load_feature_cache(
        build_feature_cache(model, evaluation, run_dir / "evaluation", batch_size=args.feature_batch, progress=False)
    )
    result["training_tokens"], result["training_windows"] = int(data["lengths"].sum()), len(data["lengths"])
    phase("features", t)

    t = time.monotonic()
    if args.init is not None:  # go on from a trained head (and its reduced head's tokens)
        trainee = initial
        ids = np.asarray(trainee.params["exits"]["vocab_ids"])
        if args.fresh_vocab:  # the head's layers go on; its reduced head becomes this data's most frequent tokens
            fresh = draft_vocabulary(data, len(ids), model.config.vocab_size, always=model.eos_token_ids)
            result["vocab_coverage"] = {"init": vocab_coverage(data, ids), "fresh": vocab_coverage(data, fresh)}
            ids, trainee = fresh, add_exit_vocab(trainee, fresh)
    else:
        ids = draft_vocabulary(data, 8192, model.config.vocab_size, always=model.eos_token_ids)
        trainee = add_exit_vocab(model, ids)
    settings = dict(batch_size=args.batch_size, learning_rate=args.learning_rate, unroll=args.unroll)
    budget = end - args.reserve - time.monotonic()  # a run out of time stops early (its schedule unfinished)
    draft, losses, agree = train_draft(
        trainee, data, steps=args.steps, progress=False, hours=max(budget, 1) / 3600, **settings
    )
    result["steps"], result["steps_run"] = args.steps, len(losses)
    np.savez(out / "training.npz", losses=losses, agree=agree)
    phase("training", t)

    t = time.monotonic()
    trained = trainee.with_params({**trainee.params, "draft": draft})
    first = [len(p) for p in jobs["evaluation"]]
    result["heldout_agreement"] = [round(float(a), 4) for a in heldout_agreement(trained, held, first=first)]
    result["train_agreement_last_100"] = [round(float(a), 4) for a in np.mean(agree[-100:], axis=0)]
    delta = save_draft(
        run_dir / "draft.safetensors",
        trained,
        ids,
        {
            "base": "smollm2-135m",
            "made_by": "scripts/gpu_train_draft.py",
            "init": None if args.init is None else str(args.init),
            "settings": {
                **settings,
                "steps": args.steps,
                "fresh_vocab": args.fresh_vocab,
                "self_questions": args.self_questions,
                "new_tokens": NEW_TOKENS,
                "answer_tokens": ANSWER_TOKENS,
                "noise": 0.1,
                "feature_weight": 0.1,
            },
            "training_tokens": result["training_tokens"],
            "data": source,
            "heldout_agreement": result["heldout_agreement"],
        },
    )
    if out != run_dir:
        shutil.copy(delta, out / "draft.safetensors")
    phase("evaluation and save", t)
    print(json.dumps(result), flush=True)


# Openings a question may begin with (`questions --steered`): row i's begins with the i-th modulo
# their count, "" for the model's own first word; they steer a small chat model to kinds of requests
# it seldom writes unprompted (writing, role play, reasoning, math, code, extraction, editing).
QUESTION_STARTS = (
    "", "Write", "Explain", "How", "What", "Why", "Can you", "Describe", "Imagine", "Compose", "Solve",
    "Write a Python", "Given", "Suppose", "Create", "Summarize", "Compare", "Rewrite", "Help me", "List", "I",
    "Please", "Act as", "Calculate", "Identify", "Draft", "Edit", "Design", "Tell me", "Give me", "Which", "Is it",
)  # fmt: skip


def questions(args) -> None:
    """Questions the model writes itself (Magpie), sampled with the default load, saved to OUT as JSON
    lines (`{"question"}` a line) when all are sampled; a rerun goes on after the last saved batch
    (the state: OUT's name + `.state.json`)."""
    import eejax
    from eejax.train.chat_corpus import self_questions

    if args.out.exists():
        raise SystemExit(f"{args.out} exists: give another OUT")
    exclude = [q for path in args.exclude for q in read_questions(path)]
    model = eejax.load(args.model)
    state = args.out.with_name(args.out.name + ".state.json")
    own = self_questions(
        model,
        args.count,
        state,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        batch_size=args.batch,
        starts=QUESTION_STARTS if args.steered else (),
        exclude=exclude,
        progress=True,
    )
    tmp = args.out.with_name(args.out.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"question": q}) + "\n" for q in own)
    tmp.replace(args.out)
    state.unlink()
    print(f"{len(own)} distinct questions of {args.count} samples -> {args.out}", flush=True)


def answer(args) -> None:
    """The model's greedy answers to chat questions (a self_questions.json, or JSON lines with an
    `instruction`), `--batch` at once with the model's default load (on a CPU its own blocks with
    int16 activations), saved to OUT (continuations.npz's format, for `run --continuations`) after
    every batch; a rerun with the same questions, model, order seed and --answer-tokens goes on
    after the last saved answer (with more --limit, on with the same order), any other is refused."""
    from tqdm.auto import tqdm

    import eejax
    from eejax.train.chat_corpus import chat_prompt
    from eejax.train.token_sequences import load_sequences, save_sequences

    path = Path(args.questions)
    questions = read_questions(path)
    order = np.random.default_rng(args.seed).permutation(len(questions))[: args.limit]  # a cut-short run: a fair sample
    model = eejax.load(args.model)
    prompts = [chat_prompt(model.tokenizer, questions[i]) for i in order]
    digest = hashlib.sha256(json.dumps(questions).encode()).hexdigest()[:16]  # which questions, whatever the file
    made_by = f"greedy answers of {args.model}'s default load to {len(questions)} questions {digest}"
    made_by += f", order seed {args.seed}, up to {args.answer_tokens} tokens each"
    done, made = load_sequences(args.out) if args.out.exists() else ([], [])
    if made and made[0][0] != made_by:
        raise SystemExit(f"{args.out} holds other answers ({made[0][0]}): give another OUT")
    bar = tqdm(total=len(prompts), initial=len(done), desc="answering", unit="question")
    for start in range(len(done), len(prompts), args.batch):
        chunk = prompts[start : start + args.batch]
        done += continue_prompts(
            model, chunk, new_tokens=args.answer_tokens, temperature=0.0, seed=0, batch_size=args.batch
        )
        save_sequences(args.out, done, [[made_by, 0.0, 0, len(done)]])
        bar.update(len(chunk))
    bar.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize the training and evaluation prompts (here)")
    p.add_argument("jobs", type=Path, help="where to write them (.json.gz)")
    p.add_argument(
        "--questions",
        type=Path,
        action="append",
        default=[],
        help="more chat questions: a self_questions.json, or JSON lines (.jsonl[.gz]); repeatable",
    )
    p = sub.add_parser("questions", help="sample questions the model writes itself (here, in the background)")
    p.add_argument("out", type=Path, help="where the questions go (.jsonl.gz; must not exist)")
    p.add_argument("--count", type=int, default=16384, help="samples drawn (default 16384)")
    p.add_argument("--seed", type=int, default=7, help="row i is drawn with (seed, i) (default 7)")
    p.add_argument("--temperature", type=float, default=0.9, help="sampling temperature (default 0.9)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per question at most (default 64)")
    p.add_argument("--batch", type=int, default=64, help="samples drawn at once (default 64)")
    p.add_argument("--model", default="smollm2-135m", help="the model (default smollm2-135m)")
    p.add_argument(
        "--steered", action="store_true", help="begin row i's question with QUESTION_STARTS[i % their count]"
    )
    p.add_argument(
        "--exclude", type=Path, action="append", default=[], help="questions not to keep (a file of them; repeatable)"
    )
    p = sub.add_parser("answer", help="answer chat questions with the model's default load (here, in the background)")
    p.add_argument("questions", type=Path, help="a self_questions.json, or JSON lines with an instruction each")
    p.add_argument("out", type=Path, help="where the answers go (.npz; resumed when it exists)")
    p.add_argument("--model", default="smollm2-135m", help="the model (default smollm2-135m)")
    p.add_argument("--limit", type=int, help="answer this many questions (a random sample; default all)")
    p.add_argument("--seed", type=int, default=0, help="the order of the questions (default 0)")
    p.add_argument("--batch", type=int, default=16, help="questions answered at once (default 16)")
    p.add_argument("--answer-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    p = sub.add_parser("run", help="continue, cache features, train and evaluate within --seconds (on a GPU)")
    p.add_argument("jobs", type=Path, help="the prepared prompts (.json.gz)")
    p.add_argument("run_dir", type=Path, help="where the feature cache and the head go")
    p.add_argument("--seconds", type=float, required=True, help="the whole run's time")
    p.add_argument("--reserve", type=float, default=30.0, help="seconds kept for the evaluation and saving")
    p.add_argument("--out", type=Path, help="where to copy the results (default RUN_DIR)")
    p.add_argument("--model", default="smollm2-135m", help="the frozen model (default smollm2-135m)")
    p.add_argument("--random-like", type=Path, help="a dry run on random weights of this checkpoint's config")
    p.add_argument(
        "--continuations",
        type=Path,
        action="append",
        default=[],
        help="an earlier run's continuations.npz (or `answer`'s): train on them instead of generating; repeatable",
    )
    p.add_argument("--init", type=Path, help="a draft head (.safetensors delta) to go on training from")
    p.add_argument(
        "--fresh-vocab",
        action="store_true",
        help="with --init: the reduced head's tokens from this run's data rather than the init's",
    )
    p.add_argument(
        "--self-questions",
        type=int,
        default=0,
        help="sample this many user questions from the model's chat template (Magpie) and answer them too",
    )
    p.add_argument("--generate-batch", type=int, default=512, help="prompts continued at once (default 512)")
    p.add_argument("--feature-batch", type=int, default=32, help="windows per feature pass (default 32)")
    p.add_argument("--batch-size", type=int, default=32, help="windows per training step (default 32)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--unroll", type=int, default=3, choices=(1, 2, 3), help="training-time test passes (default 3)")
    p.add_argument("--steps", type=int, default=3000, help="training steps (default 3000: ~3 min on an H100)")
    args = parser.parse_args(argv)
    if args.command == "run" and args.fresh_vocab and args.init is None:
        parser.error("--fresh-vocab needs --init (without it the vocabulary is this run's data's anyway)")
    if args.command == "questions" and min(args.count, args.max_tokens, args.batch) < 1:
        parser.error(
            f"--count, --max-tokens and --batch must be >= 1, got {args.count}, {args.max_tokens}, {args.batch}"
        )
    if args.command == "questions" and not args.temperature > 0:
        parser.error(f"--temperature must be > 0 (questions are sampled), got {args.temperature}")
    if args.command == "answer" and min(args.batch, args.answer_tokens, 1 if args.limit is None else args.limit) < 1:
        parser.error(
            f"--batch, --answer-tokens and --limit must be >= 1, got {args.batch}, {args.answer_tokens}, {args.limit}"
        )
    if args.command == "run" and args.self_questions < 0:
        parser.error(f"--self-questions must be >= 0, got {args.self_questions}")
    if args.command == "prepare":
        prepare(args.jobs, args.questions)
    elif args.command == "questions":
        questions(args)
    elif args.command == "answer":
        answer(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
