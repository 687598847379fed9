"""`StepOptions`, the one frozen value that keys compiled programs: its checks, the views each
program reads, and that options a program ignores never compile it twice (torch-free)."""

import dataclasses

import jax
import pytest

import eejax
from eejax.config import LlamaConfig
from eejax.errors import EejaxError
from eejax.models.registry import model_module
from eejax.options import (
    DEFAULT_SPEC,
    METHODS,
    DraftChainSpec,
    DraftLookupSpec,
    ExitConfig,
    LayerSkipSpec,
    SpecConfig,
    StepOptions,
    auto_spec,
    check_exit_or_spec,
    default_spec,
)

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    max_position_embeddings=64,
)


def test_early_exit_or_speculation_is_one_rule():
    """`check_exit_or_spec`, which generate, the engine's requests, the CLI and StepOptions call:
    words that mean off ask for nothing; "auto" and any config ask."""
    for exit, spec in [
        ("none", "1:2"),
        ("softmax:0.9", "off"),
        (None, "auto"),
        ("", None),
        (ExitConfig("none"), " None"),
    ]:
        check_exit_or_spec(exit, spec)
    for exit, spec in [("softmax:0.9", "auto"), (ExitConfig("none"), "1:2"), ("static:1", LayerSkipSpec(1, 2))]:
        with pytest.raises(EejaxError, match="choose --exit or --spec, not both"):
            check_exit_or_spec(exit, spec, ("--exit", "--spec"))


def test_a_spec_not_given_is_auto_unless_an_exit_is_asked():
    """`default_spec`: generate's, an engine's and the CLI's `spec` when not given. An exit that
    asks (any config, a measure) keeps it off; words that mean off do not; a given spec, None
    (full depth) included, stays as given."""
    for exit in (None, "none", "off", ""):
        assert default_spec(exit, DEFAULT_SPEC) == "auto"
    for exit in ("softmax:0.9", ExitConfig("none"), ExitConfig("static", exit_layer=1)):
        assert default_spec(exit, DEFAULT_SPEC) is None
    for spec in (None, "none", "auto", "draft:2", LayerSkipSpec(1, 2)):
        assert default_spec(None, spec) is spec and default_spec("softmax:0.9", spec) is spec
    assert repr(DEFAULT_SPEC) == "DEFAULT_SPEC"


def test_checks_and_hashing():
    with pytest.raises(EejaxError, match="not both"):
        StepOptions(8, exit=ExitConfig("static", exit_layer=1), spec=LayerSkipSpec(1, 2))
    for bad in (0, 1.5, True):
        with pytest.raises(EejaxError, match="num_steps"):
            StepOptions(8, num_steps=bad)
    a, b = StepOptions(8, eos_ids=[2, 3]), StepOptions(8, eos_ids=(2, 3))
    assert a == b and hash(a) == hash(b) and a.eos_ids == (2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sampler = "temperature"


def test_views_keep_what_each_program_reads():
    exit_config = ExitConfig("softmax", threshold=0.9)
    base = StepOptions(16, (2,), "temperature", attention="reference", logprobs=True)
    assert base.prefilling() == base
    assert dataclasses.replace(base, exit=exit_config, num_steps=4).prefilling() == base
    assert dataclasses.replace(base, exit=exit_config).decoding(4) == dataclasses.replace(
        base, exit=exit_config, num_steps=4
    )
    spec = LayerSkipSpec(2, 3, adaptive=True, max_speculations=6, head="full", bonus=None)
    round_ = dataclasses.replace(base, spec=spec).round(5, bonus=True)
    assert round_.spec == LayerSkipSpec(2, 5, head="full") and round_.bonus
    # The same round under another adaptive policy is the same program.
    other = dataclasses.replace(base, spec=LayerSkipSpec(2, 1, adaptive=True, max_speculations=8, head="full"))
    assert other.round(5, bonus=True) == round_
    # A draft reads neither the limits, EOS nor log-probs; a verify not the bonus flag.
    assert round_.drafting() == StepOptions(
        0, sampler="temperature", spec=round_.spec, bonus=True, attention="reference"
    )
    assert dataclasses.replace(round_, max_new_tokens=99, eos_ids=(7,)).drafting() == round_.drafting()
    assert round_.verifying() == dataclasses.replace(round_, bonus=False)
    assert dataclasses.replace(round_, spec=None).decoding() == base


def test_a_prefill_compiles_once_for_every_decoding_option():
    model = eejax.Model(CONFIG, model_module(CONFIG).init_params(CONFIG, jax.random.PRNGKey(0)))
    prompts = [[5, 6, 7], [8, 9]]
    for kw in (dict(), dict(exit="static:1"), dict(exit="state:0.5"), dict(spec="1:2")):
        eejax.generate(model, prompts, max_new_tokens=4, ignore_eos=True, **kw)
    names = [name for name, _ in model.programs.compiled()]
    assert names.count("prefill_slots") == 1, names
    assert names.count("decode_slots") == 3
    options = [opts for name, opts, _ in model.programs.entries() if name == "decode_slots"]
    assert {o.exit.spec if o.exit else "none" for o in options} == {"none", "static:1", "state:0.5"}


def test_the_grammar_reads_plain_fields_and_spells_each_option_back():
    """`options.grammar` turns strings into a method and its fields (plain values, no config) and the
    configs spell themselves back through it: every spelling reads back to itself."""
    from eejax.options import grammar

    assert grammar.read_spec("draft:4:lookup") == {
        "method": "lookup",
        "num_speculations": 4,
        "adaptive": False,
        "lookup": 4,
    }
    assert grammar.read_exit("static:12") == {"measure": "static", "exit_layer": 12}
    for text in ("12:4", "12:4:adaptive", "draft:2", "draft:4:tree", "draft:tree=0,00,1", "draft:4:stop=0.3",
                 "draft:4:lookup", "draft:2:lookup=8", "draft:2:adaptive:lookup=4"):  # fmt: skip
        assert SpecConfig.parse(text).spec == text
    for text in ("none", "static:12", "softmax:0.9", "state:-0.5", "classifier:inf"):
        assert ExitConfig.parse(text).spec == text
    assert [grammar.is_off(t) for t in ("none", " OFF ", "", "auto", None)] == [True, True, True, False, False]
    with pytest.raises(EejaxError, match="cannot read speculation 'draft:4:lookup:lookup'"):
        SpecConfig.parse("draft:4:lookup:lookup")


def test_each_speculation_method_is_its_own_record_and_a_round_keeps_what_it_runs():
    spelled = ("2:3:adaptive", "draft:3:adaptive", "draft:3:adaptive:lookup=5", "draft:3:stop=0.4", "draft:tree=0,00,1")
    specs = [SpecConfig.parse(text) for text in spelled]
    assert [type(spec).method for spec in specs] == list(METHODS) and [s.spec for s in specs] == list(spelled)
    base = StepOptions(16)
    auto = dataclasses.replace(base, spec=auto_spec())
    assert auto.round(3).spec == DraftLookupSpec(3, lookup=4)  # not adaptive, nor its largest d
    assert auto.plain(2).spec == DraftChainSpec(1) and auto.plain(2).num_steps == 2  # the draft's catch-up
    assert auto.plain(2, catch_up=False) == base.decoding(2)
    for spec in specs[3:]:  # a fixed method's round is itself
        assert dataclasses.replace(base, spec=spec).round(spec.num_speculations).spec == spec
