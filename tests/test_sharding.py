"""Models on a device mesh (8 virtual CPU devices, in a fresh process): greedy tokens, early exit,
self-speculation and a draft head's chain and tree identical to one device (tiny Llamas with 4 and
1 KV heads, a T5, SmolLM2 at tensor 3, the engine); params and cache placed by the logical axes,
rows split over data."""

import json
import os
import subprocess
import sys
import warnings

import jax
import pytest

from eejax.config import LlamaConfig
from eejax.decode.collectives import collectives
from eejax.errors import EejaxError
from eejax.sharding import check_fits, make_mesh
from tests.helpers import ROOT

SCRIPT = r"""
import json, jax, eejax
from eejax.config import LlamaConfig, T5Config
from eejax.models.registry import model_module
from eejax import ExitConfig, LayerSkipSpec, SpecConfig
from eejax.decode.collectives import collectives
from eejax.models.exits import set_exit_vocab
from eejax.models import draft_head
from eejax.engine.engine import Engine
from eejax.sharding import make_mesh
from eejax.loading import shard
from jax.sharding import PartitionSpec as P

prompts = [[3, 9, 27, 5, 8], [11, 4], [7, 7, 7, 2, 40, 41, 42], [5, 6]]
results = []

def check(name, base, mesh, **kw):
    want = eejax.generate(base, prompts, max_new_tokens=6, ignore_eos=True, **kw)
    model = shard(base, mesh)
    got = eejax.generate(model, prompts, max_new_tokens=6, ignore_eos=True, **kw)
    results.append(dict(name=name, mesh=dict(mesh.shape), options=str(kw), same=got.tokens == want.tokens,
                        same_layers=got.exit_layers == want.exit_layers, exited=min(map(min, got.exit_layers))))
    return model, want

for kv in (4, 1):
    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=kv,
                    head_dim=8, max_position_embeddings=64)
    base = eejax.Model(c, model_module(c).init_params(c, jax.random.PRNGKey(1), scale=0.3))
    every = (dict(), dict(exit="softmax:0.05"), dict(exit="state:0.7"), dict(exit="static:2"), dict(spec="2:2"))
    some = (dict(), dict(exit="softmax:0.05"), dict(spec="2:2"))
    # Every option at tensor 2 x data 2 (both axes at once); fewer on the other meshes. With one
    # KV head (replicated over tensor), tensor meshes only: splitting rows over data is the same.
    meshes = {(2, 2): every, (2, 1): some, (4, 1): (dict(spec="2:2"),), (1, 2): ({},)} if kv == 4 else \
        {(2, 1): some[:2], (4, 1): ({},)}
    for (t, d), options in meshes.items():
        for kw in options:
            model, want = check(f"llama-kv{kv}", base, make_mesh(t, d), **kw)
        layers = model.params["layers"]
        if (t, d, kv) == (2, 1, 4):  # what a full-depth decode program communicates
            fresh = shard(base, make_mesh(2, 1))
            eejax.generate(fresh, prompts, max_new_tokens=6, ignore_eos=True)
            text = [p for n, p in fresh.programs.compiled() if n == "decode_slots"][0].as_text()
            moved = collectives(text)
            results.append(dict(name="decode-collectives", unknown_loops=moved.unknown_loops, **moved.bytes))
            fresh = shard(base, make_mesh(2, 1))  # softmax checks over the vocabulary-sharded head
            eejax.generate(fresh, prompts, max_new_tokens=6, ignore_eos=True, exit="softmax:0.05")
            text = [p for n, p in fresh.programs.compiled() if n == "decode_slots"][0].as_text()
            results.append(dict(name="softmax-largest-collective", bytes=collectives(text).largest))
        results.append(dict(name=f"llama-kv{kv}-placement", mesh=dict(model.mesh.shape),
                            wq=list(layers["wq"].sharding.spec), wk=list(layers["wk"].sharding.spec),
                            embed=list(model.params["embed"].sharding.spec),
                            cache=list(model.new_cache(4, 8).k.sharding.spec)))
    if kv == 4:  # a GPU's loops: KV fill as one batched projection and one write of each device's heads
        from eejax.decode import early_exit
        cpu_loops, early_exit.static_loops = early_exit.static_loops, lambda: True
        check("llama-gpu-loops", eejax.Model(c, base.params, layer_buffers="stacked"), make_mesh(2, 2),
              exit="softmax:0.05")
        early_exit.static_loops = cpu_loops
    if kv == 4:  # rows split over data: each device's decode step runs half of the 4 rows
        model = shard(base, make_mesh(1, 2))
        eejax.generate(model, prompts, max_new_tokens=6, ignore_eos=True)
        text = [p for n, p in model.programs.compiled() if n == "decode_slots"][0].as_text()
        results.append(dict(name="rows-over-data", half="f32[2,1,32]" in text, whole="f32[4,1,32]" in text))
    want = eejax.generate(base, prompts, max_new_tokens=6, ignore_eos=True).tokens
    for t, d in ((2, 1), (2, 2)):
        engine = Engine(shard(base, make_mesh(t, d)), max_slots=4, max_new_tokens=8, cache_budget="1MiB", page_size=8)
        seqs = [engine.submit(p, max_new_tokens=6) for p in prompts]
        engine.run()
        results.append(dict(name=f"engine-kv{kv}-{t}x{d}", same=[s.tokens for s in seqs] == want))
    if kv == 4:  # the reduced exit head (vocabulary-sharded) in checks and drafts
        reduced = base.with_params(set_exit_vocab(base.params, range(0, 64, 2), tied=False))
        reduced_spec = LayerSkipSpec(2, 2, head="reduced")
        for kw in (dict(exit=ExitConfig("softmax", 0.05, head="reduced")), dict(spec=reduced_spec)):
            check("llama-reduced-head", reduced, make_mesh(2, 2), **kw)
        drafting = reduced.with_params({**reduced.params, "draft": draft_head.init_draft(c, jax.random.PRNGKey(1),
                                                                                         params=base.params)})
        model = shard(drafting, make_mesh(2, 1))
        specs = jax.tree.leaves(model.logical_axes(), is_leaf=lambda x: isinstance(x, P))
        arrays = jax.tree.leaves(model.params)
        counts = dict(heads=4, kv_heads=kv)
        unsplit = [str(spec) for spec, x in zip(specs, arrays)
                   if any(name in ("vocab", "heads", "kv_heads", "mlp") and counts.get(name, dim) % 2 == 0
                          for name, dim in zip(spec, x.shape)) and "tensor" not in tuple(x.sharding.spec)]
        results.append(dict(name="silently-replicated", arrays=unsplit))
        # A draft head over the reduced head: the chain and a tree (its mask goes with each
        # device's heads and rows), against one device and against full depth, and the engine.
        for kw in (dict(spec="draft:2"), dict(spec="draft:3:tree")):
            check("llama-draft-head", drafting, make_mesh(2, 2), **kw)
        model = shard(drafting, make_mesh(2, 2))
        got = eejax.generate(model, prompts, max_new_tokens=6, ignore_eos=True, spec="draft:2")
        engine = Engine(model, max_slots=4, max_new_tokens=8, cache_budget="1MiB", page_size=8)
        seqs = [engine.submit(p, max_new_tokens=6, spec="draft:2") for p in prompts]
        engine.run()
        results.append(dict(name="draft-head-2x2", full_depth=got.tokens == want,
                            engine=[s.tokens for s in seqs] == want, accepted=got.stats["acceptance_rate"],
                            wq=list(model.params["draft"]["layer"]["wq"].sharding.spec)))

tc = T5Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_encoder_layers=2, num_heads=4,
              head_dim=8, gated=True, activation="gelu_new", tie_embeddings=False)
t5 = eejax.Model(tc, model_module(tc).init_params(tc, jax.random.PRNGKey(2), scale=0.3))
for kw in (dict(), dict(exit="softmax:0.05")):
    check("t5", t5, make_mesh(2, 1), **kw)
# float32 (a mesh shards float weights); 9 heads, 3 KV heads: tensor 3 splits both
smol = eejax.load("smollm2-135m", quantization=None)
smol_prompts = [smol.tokenizer(t)["input_ids"] for t in ("The capital of France is", "def fibonacci(n):")]
want = eejax.generate(smol, smol_prompts, max_new_tokens=8, ignore_eos=True)
got = eejax.generate(shard(smol, make_mesh(3, 1)), smol_prompts, max_new_tokens=8, ignore_eos=True)
results.append(dict(name="smollm2-tensor3", same=got.tokens == want.tokens))
print("RESULTS" + json.dumps(results))
"""


RENDEZVOUS_ABORT = "Termination timeout for"  # what XLA:CPU prints when it aborts a stuck collective


@pytest.fixture(scope="module")
def mesh_results():
    # XLA:CPU's in-process collectives have twice deadlocked in CI runs (2 cores, another test
    # worker beside): one device's participant never arrived, with a 40 s and with a 300 s limit.
    # It is a runtime hang, not slowness, and the same script passes alone and pinned to one core.
    # So the wait is 2 min, and a run XLA aborts for it is run once more, with a warning.
    flags = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=120"
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=str(ROOT))
    for attempt in range(2):
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        if out.returncode == 0 or RENDEZVOUS_ABORT not in out.stderr or attempt:
            break
        warnings.warn("XLA:CPU aborted the mesh script on a stuck collective; running it once more", stacklevel=1)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULTS", 1)[1])


def test_sharded_decoding_gives_one_devices_tokens_and_exit_layers(mesh_results):
    runs = [r for r in mesh_results if "options" in r]
    assert len(runs) == 20
    assert [r for r in runs if not (r["same"] and r["same_layers"])] == []
    assert any(r["exited"] < 4 for r in runs if "exit" in r["options"])  # early exits ran on the mesh
    assert [r["same"] for r in mesh_results if r["name"].startswith(("engine", "smollm2"))] == [True] * 5


def test_a_draft_head_decodes_on_a_mesh_as_full_depth(mesh_results):
    """Tensor 2 x data 2: the draft's layer split by heads like the model's, its rounds accepting
    some drafts and rejecting others, the tokens full depth's, in `generate` and the engine."""
    run = next(r for r in mesh_results if r["name"] == "draft-head-2x2")
    assert run["full_depth"] and run["engine"]
    assert 0 < run["accepted"] < 1
    assert run["wq"] == [None, "tensor"]


def test_params_and_cache_are_placed_by_the_logical_axes(mesh_results):
    placed = {
        (r["name"], r["mesh"]["tensor"], r["mesh"]["data"]): r for r in mesh_results if r["name"].endswith("placement")
    }
    gqa = placed[("llama-kv4-placement", 2, 1)]
    assert gqa["wq"] == gqa["wk"] == [None, None, "tensor"]
    assert gqa["embed"] == ["tensor", None] and gqa["cache"] == [None, "tensor"]
    mqa = placed[("llama-kv1-placement", 4, 1)]  # one KV head: replicated, never cut inside a head
    assert mqa["wq"] == [None, None, "tensor"]
    assert mqa["wk"] == [None, None, None] and mqa["cache"] == [None, None]


def test_no_array_the_rules_split_is_silently_replicated(mesh_results):
    """At tensor 2 every param with a vocab, heads, KV heads or MLP axis that 2 divides is split
    (the reduced exit head and the draft head's layer included)."""
    assert next(r for r in mesh_results if r["name"] == "silently-replicated")["arrays"] == []


def test_tensor_parallel_decoding_moves_only_the_hidden_states(mesh_results):
    """Per decode step at tensor 2: Megatron's two all-reduces of the rows' hidden states per
    layer plus the embedding's, and the head's per-shard (max, index) pairs; nothing that grows
    with the context (the cache write and the attention run on each device's own KV heads)."""
    moved = next(r for r in mesh_results if r["name"] == "decode-collectives")
    # The first decode program runs steps_per_dispatch steps in a loop that, on a CPU, ends once
    # every row is done (`steps.repeat`): its trip count unknown, its body (one step) counts once.
    assert moved.pop("unknown_loops") == 1
    layers, rows, hidden = 4, 4, 32
    assert moved["all-reduce"] == (2 * layers + 1) * rows * hidden * 4
    assert moved["all-gather"] == 2 * rows * 2 * 4  # float and int32 [rows, 2 shards]
    assert set(moved) == {"name", "all-reduce", "all-gather"}
    # The softmax margin over a head split by vocabulary gathers per-shard values, never the
    # logits [rows, 64]: nothing larger than a row's hidden state moves.
    assert next(r for r in mesh_results if r["name"] == "softmax-largest-collective")["bytes"] == rows * hidden * 4


def test_collectives_count_each_loop_trip():
    text = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, to_apply=%add
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"30"}}
  %ag = f32[2,4]{1,0} all-gather(%y), channel_id=2, dimensions={0}
}
"""
    moved = collectives(text)
    assert moved.bytes == {"all-reduce": 30 * 8 * 4, "all-gather": 8 * 4} and moved.ops == 2 and moved.largest == 32
    assert moved.unknown_loops == 0


def test_rows_split_over_the_data_axis(mesh_results):
    rows = next(r for r in mesh_results if r["name"] == "rows-over-data")
    assert rows["half"] and not rows["whole"]


def test_two_processes_give_one_processes_tokens(tiny_checkpoints):
    """`eejax generate` in two processes on 127.0.0.1 (jax.distributed, gloo collectives), two CPU
    devices each, one tensor 2 x data 2 mesh over both: the tokens and exit layers of one process."""
    from tests.helpers import free_port

    ckpt = tiny_checkpoints["gqa-untied"][2]
    argv = [
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "The river rose",
        "Officials said",
        "A storm",
        "x",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--exit",
        "softmax:0.05",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=2")
    one = subprocess.run(
        [sys.executable, "-m", "eejax.cli", *argv],
        env=dict(env, XLA_FLAGS=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    address = f"127.0.0.1:{free_port()}"
    mesh = ["--tensor-parallel", "2", "--data-parallel", "2", "--coordinator", address, "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "eejax.cli", *argv, *mesh, "--process-id", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[1][0] == ""  # process 0 prints the result
    want, got = json.loads(one.stdout)["outputs"], json.loads(outs[0][0])["outputs"]
    assert [(o["tokens"], o["exit_layers"]) for o in got] == [(o["tokens"], o["exit_layers"]) for o in want]


def test_a_server_over_two_processes_answers_like_one_process(tiny_checkpoints, tmp_path):
    """`eejax serve` in two processes (tensor 2 x data 2 over both): process 0 serves HTTP and
    schedules, process 1 follows its steps; concurrent greedy completions equal one process's
    `generate`, and both processes exit cleanly when process 0 is stopped."""
    import concurrent.futures

    import httpx

    from tests.helpers import free_port, wait_until_healthy

    ckpt = str(tiny_checkpoints["gqa-untied"][2])
    prompts = ["The river rose", "Officials said", "A storm", "x"]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "eejax.cli",
            "generate",
            "--model",
            ckpt,
            "--prompt",
            *prompts,
            "--max-new-tokens",
            "6",
            "--json",
        ],
        env=dict(env, XLA_FLAGS=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    want = [o["text"] for o in json.loads(one.stdout)["outputs"]]
    port, address = free_port(), f"127.0.0.1:{free_port()}"
    argv = [
        "serve",
        "--model",
        ckpt,
        "--port",
        str(port),
        "--tensor-parallel",
        "2",
        "--data-parallel",
        "2",
        "--coordinator",
        address,
        "--num-processes",
        "2",
        "--max-slots",
        "4",
        "--cache-budget",
        "1MiB",
    ]
    # (logs to a file: a pipe nobody reads could fill and block a server)
    logs = [open(tmp_path / f"serve-{i}.log", "w") for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "eejax.cli", *argv, "--process-id", str(i)],
            env=env,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_healthy(url, procs, 180), "the servers did not start: " + "".join(
            (tmp_path / f"serve-{i}.log").read_text()[-2000:] for i in range(2)
        )

        def complete(prompt):
            body = dict(model=ckpt, prompt=prompt, max_tokens=6, temperature=0)
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts)) == want
        procs[0].terminate()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p, log in zip(procs, logs):
            if p.poll() is None:
                p.kill()
            log.close()


def test_a_mesh_that_does_not_fit_is_one_clear_error():
    with pytest.raises(EejaxError, match="needs 16 devices; this process has"):
        make_mesh(tensor=8, data=2, devices=jax.devices() * 8)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    with pytest.raises(EejaxError, match="tensor parallelism 3 does not divide the model's 4 attention heads"):
        check_fits(config, make_mesh(tensor=3, devices=jax.devices() * 3))
