"""Conversion: every HF weight format, dtypes, atomicity and clear errors."""

import json
import os

import jax
import numpy as np
import pytest

import eejax
from conversion import convert
from eejax.errors import EejaxError, UnsupportedModelError
from tests.helpers import make_hf_llama


def params_of(path):
    return jax.tree.map(np.asarray, eejax.load(path).params)


def assert_same_params(a, b, **tol):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **tol), a, b
    )


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_llama("gqa-untied", seed=5)


def test_stacked_layout_and_values(tiny_checkpoints):
    hf, _, path = tiny_checkpoints["gqa-untied"]
    p = params_of(path)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert p["layers"]["wq"].shape == (3, 64, 64) and p["layers"]["wk"].shape == (3, 64, 32)
    np.testing.assert_array_equal(p["layers"]["wk"][2], sd["model.layers.2.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(p["layers"]["mlp_norm"][1], sd["model.layers.1.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(p["lm_head"], sd["lm_head.weight"].T)
    tied = params_of(tiny_checkpoints["gqa-tied"][2])
    assert "lm_head" not in tied


@pytest.mark.parametrize("fmt", ["sharded-safetensors", "bin", "sharded-bin"])
def test_weight_formats_give_the_same_params(tmp_path, hf_model, fmt):
    ref = tmp_path / "ref"
    hf_model.save_pretrained(ref)
    src = tmp_path / fmt
    hf_model.save_pretrained(
        src, safe_serialization=not fmt.endswith("bin"), max_shard_size="100KB" if fmt.startswith("sharded") else "10GB"
    )
    names = os.listdir(src)
    assert any(n.endswith(".index.json") for n in names) == fmt.startswith("sharded")
    assert_same_params(
        params_of(convert(ref, tmp_path / "a", progress=False)),
        params_of(convert(src, tmp_path / "b", progress=False)),
        rtol=0,
        atol=0,
    )


def test_bfloat16(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path / "hf")
    p32 = params_of(convert(tmp_path / "hf", tmp_path / "f32", progress=False))
    model = eejax.load(convert(tmp_path / "hf", tmp_path / "bf16", dtype="bfloat16", progress=False))
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(model.params))
    assert_same_params(p32, jax.tree.map(np.asarray, model.params), rtol=1e-2, atol=1e-3)
    out = eejax.generate(model, [[5, 6, 7]], max_new_tokens=4, ignore_eos=True)
    assert len(out.tokens[0]) == 4


def test_missing_tensor_leaves_nothing_behind(tmp_path, hf_model):
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "hf"
    hf_model.save_pretrained(src)
    state = load_file(src / "model.safetensors")
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    dst = tmp_path / "out"
    with pytest.raises(EejaxError, match="up_proj"):
        convert(src, dst, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"], "a failed conversion left files behind"


def test_failure_while_writing_leaves_nothing(tmp_path, hf_model, monkeypatch):
    import eejax.checkpoint as ckpt  # where the atomic write calls save_checkpoint

    hf_model.save_pretrained(tmp_path / "hf")

    def broken_save(directory, *args, **kwargs):
        (directory / "params").mkdir(parents=True)
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_checkpoint", broken_save)
    with pytest.raises(OSError):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_unsupported_architecture_names_what_is_supported(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (src / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*converts: llama, qwen2, qwen3, mistral, t5"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gguf_files_are_read_as_gguf_py_reads_them(tmp_path):
    """conversion.gguf_file against gguf-py's GGUFReader: every kind of metadata value, plain and
    block tensors, GGUF v3; a file cut short is refused, not read past its end."""
    gguf = pytest.importorskip("gguf")
    from conversion.gguf_file import read_gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_int64("x.signed", -3)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "Ġb", "東"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1])
    writer.add_array("x.flags", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("norm", rng.standard_normal(8).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 4)).astype(np.float16))
    for kind in ("Q8_0", "Q4_1", "Q4_0"):
        qtype = gguf.GGMLQuantizationType[kind]
        raw = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        writer.add_tensor(kind, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    metadata, tensors = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    assert metadata == {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert metadata["x.signed"] == -3 and metadata["x.flags"] == [True, False]
    assert list(tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        ours = tensors[t.name]
        assert (ours.tensor_type, list(ours.shape), ours.data.dtype) == (t.tensor_type, list(t.shape), t.data.dtype)
        np.testing.assert_array_equal(ours.data, t.data)
    path.write_bytes(path.read_bytes()[:-100])  # the last tensor cut short
    with pytest.raises(EejaxError, match="cannot read .*ends inside tensor Q4_0"):
        convert(path, tmp_path / "out", progress=False)


def test_a_gguf_file_eejax_cannot_read_is_refused_by_name(tmp_path):
    from conversion.gguf_source import gguf_config

    (tmp_path / "bad.gguf").write_bytes(b"not a GGUF file, only its suffix" * 4)
    with pytest.raises(EejaxError, match="cannot read .*bad.gguf: GGUF magic invalid"):
        convert(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    llama = {"general.architecture": "llama", "llama.block_count": 2, "tokenizer.ggml.eos_token_id": 2}
    config, generation = gguf_config(llama, {"token_embd.weight"})
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] and generation == {"eos_token_id": 2}
    with pytest.raises(UnsupportedModelError, match="'gemma2' GGUF file; eejax reads llama, qwen2, qwen3 GGUF"):
        gguf_config({**llama, "general.architecture": "gemma2"}, set())
    with pytest.raises(UnsupportedModelError, match="scales its rotary embedding \\(yarn\\)"):
        gguf_config({**llama, "llama.rope.scaling.type": "yarn"}, set())  # transformers would drop it


def test_bad_sources_and_destinations(tmp_path, hf_model):
    with pytest.raises(EejaxError, match="no such file"):
        convert(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EejaxError, match="not an HF model directory"):
        convert(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(EejaxError, match="not a .gguf"):
        convert(tmp_path / "weights.txt", tmp_path / "out")
    hf_model.save_pretrained(tmp_path / "hf")
    with pytest.raises(EejaxError, match="dtype"):
        convert(tmp_path / "hf", tmp_path / "out", dtype="float16")
    first = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    with pytest.raises(EejaxError, match="already exists"):
        convert(tmp_path / "hf", first, progress=False)
    convert(tmp_path / "hf", first, overwrite=True, progress=False)
    assert (first / "eejax.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["empty", "hf", "out", "weights.txt"]


def test_loading_maps_big_allocations_until_the_last_load_ends(monkeypatch):
    """Big host copies are mappings while any load runs (freed, they leave the process at once);
    the outermost load's end, error or not, sets glibc's thresholds back and trims the heap."""
    from eejax import checkpoint

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append(("mallopt", param, value))

        def malloc_trim(self, pad):
            calls.append(("trim", pad))

    monkeypatch.setattr(checkpoint, "_glibc", Libc)
    start = ("mallopt", checkpoint.M_MMAP_THRESHOLD, checkpoint.MMAP_THRESHOLD_START)
    with pytest.raises(RuntimeError):
        with checkpoint.mapped_while_loading():
            with checkpoint.mapped_while_loading():
                pass  # a nested load that ends first: the mapping stays
            assert calls == [start, start]
            raise RuntimeError("a load failed")
    assert calls[2:] == [
        ("mallopt", checkpoint.M_MMAP_THRESHOLD, checkpoint.MMAP_THRESHOLD_MAX),
        ("mallopt", checkpoint.M_TRIM_THRESHOLD, 2 * checkpoint.MMAP_THRESHOLD_MAX),
        ("trim", 0),
    ]
    assert checkpoint._depth == 0
