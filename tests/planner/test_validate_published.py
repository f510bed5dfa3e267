"""scripts/validate_published.py: peers' published step times re-priced by the cost model. The shipped case file
reads, a case maps onto a jaxrlhf question and plan as the script says, and a bad case is one line naming it
and the field."""

import importlib.util
import math
import pathlib
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = ROOT / "docs" / "results" / "published_cases.yaml"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("validate_published", ROOT / "scripts" / "validate_published.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["validate_published"] = module
    spec.loader.exec_module(module)
    return module


def test_the_shipped_cases_read_and_come_from_at_least_three_sources(script):
    cases = script.load_cases(str(CASES))
    sources = {c["source"]["ref"].split(" ")[0] for c in cases}
    assert len(cases) >= 10 and len(sources) >= 3
    published = [c for c in cases if c["response_len"].get("mean") is not None]
    # a mean length is the source's own or derived from its published numbers (the derivation cited), never fitted
    assert published and all(c["response_len"]["from"].startswith(("published", "derived from published"))
                             for c in published)
    for c in cases:  # a case without published lengths has a colocated row in its pair to fit them on
        if c["response_len"].get("mean") is None:
            key = c["pair"].split(":")[0]
            assert any(o["pair"] == f"{key}:colocated" for o in cases)


def test_a_mean_under_the_cap_gives_the_median_of_its_lognormal(script):
    median, sigma = script.length_distribution(1000, 4096, 0.8)
    assert sigma == 0.8
    assert median < 1000  # a log-normal's mean lies above its median
    mu, s, cap = math.log(median), 0.8, 4096
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / s
    capped = median * math.exp(s * s / 2) * phi(z - s) + cap * (1 - phi(z))
    assert capped == pytest.approx(1000, rel=2e-3)
    assert script.length_distribution(5000, 4096, 0.8) == (4096, 0.0)


def test_a_mean_near_the_cap_narrows_the_spread_with_the_median_at_the_cap(script):
    """NeMo-RL's Qwen3 runs average 3,200 of 3,968 tokens: at sigma 0.8 even a median at the cap averages less
    (cut at the cap, 0.79 of it), so the lengths keep the median at the cap and a narrower spread that gives
    the published mean (checked here by drawing, not by the script's closed form), not every response at
    the cap (24 % more tokens than published)."""
    import numpy as np

    median, sigma = script.length_distribution(3200, 3968, 0.8)
    assert median == 3968 and 0.5 < sigma < 0.8
    drawn = np.minimum(3968 * np.exp(sigma * np.random.default_rng(0).standard_normal(400_000)), 3968)
    assert drawn.mean() == pytest.approx(3200, rel=5e-3)


def _case(**changes) -> dict:
    case = yaml.safe_load("""
name: toy
source: {ref: "toy source", version: "1", quote: "-"}
models: {actor: llama3-8b, critic: null, ref: llama3-8b, reward: null}
hardware: h100
devices: 16
algorithm: grpo
prompts_per_step: 32
samples_per_prompt: 8
optimizer_steps_per_step: 2
prompt_len: {mean: 128}
response_len: {mean: 500, max: 2048}
placement:
  kind: split
  generation: {devices: 8, tp: 2}
  training: {devices: 8, backend: megatron, tp: 2, pp: 2}
staleness: {max_trajectory_age_steps: 1}
published: {step_s: 60.0}
""")
    for dotted, value in changes.items():
        node = case
        *path, last = dotted.split(".")
        for key in path:
            node = node[key]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return case


@pytest.mark.parametrize("changes, words", [
    ({"published": None}, "case 'toy': missing field 'published'"),
    ({"models.actor": "llama9-8b"}, "case 'toy': field 'models.actor': unknown model preset 'llama9-8b'"),
    ({"hardware": "b300"}, "case 'toy': field 'hardware': unknown hardware 'b300'"),
    ({"placement.training.devices": 7}, "must add up to devices=16"),
    ({"placement.generation.tp": 3}, "tp x pp x cp x ep = 3 does not divide its 8 devices"),
    ({"response_len.mean": None}, "field 'response_len.mean' is missing and the case has no pair"),
    ({"placement.generation.cuda_graphs": "no"}, "field 'placement.generation.cuda_graphs' must be true or false"),
    ({"models.actor": None}, "case 'toy': missing field 'models.actor'"),
    ({"published.step_s": "fast"}, "field 'published.step_s' must be a number > 0, got 'fast'"),
    ({"prompt_len.mean": -1}, "field 'prompt_len.mean' must be a number > 0"),
    ({"placement.training.tp": "two"}, "field 'placement.training.tp' must be a whole number > 0, got 'two'"),
    ({"placement.generation.devices": "8"}, "field 'placement.generation.devices' must be a whole number > 0"),
    ({"response_len.max": 10_000}, "field 'response_len.max': prompt_len.mean + response_len.max = 10128 tokens is "
                                   "past llama3-8b's 8192 positions"),
])
def test_a_bad_case_is_one_line_naming_the_case_and_the_field(script, tmp_path, capsys, changes, words):
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump({"cases": [_case(**changes)]}))
    assert script.main(["--cases", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_a_case_is_priced_on_its_own_placement(script):
    """The toy split case: generation on 8 devices (4 replicas of tensor 2), Megatron training on the other 8
    (tensor 2 x pipeline 2 x data 2), a shadow actor one step ahead, each call priced, and the time between
    the published one's tenth and tenfold (a sanity bound; the shipped cases are the check)."""
    from jaxrlhf.run.assembly import Machine, setup

    case = _case()
    cfg = script.run_config(case)
    run = setup(cfg, machine=Machine.described(cfg, 16), runtime=False)
    plan = script.peer_plan(case, run.graph, 16)
    assert plan.groups["gen"].size == plan.groups["train"].size == 8 and plan.groups["train"].start == 8
    assert str(plan.calls["actor.generate"].layout) == "d4f1t2" and str(plan.calls["actor.train"].layout) == "d2f1t2p2"
    assert plan.shadow_roles == ("actor",) and plan.offpolicy and plan.staleness == 1
    result = script.price(case, 0, search=False)
    assert result.predicted_s and 6 < result.predicted_s < 600 and set(result.calls) == set(run.graph.names)


def test_an_engine_without_cuda_graphs_is_said_beside_its_row_and_priced_alike(script, capsys):
    """A case whose engine decoded eagerly (`placement.generation.cuda_graphs: false`, vLLM's enforce_eager) is
    priced as any other, and its printed row says the steps' host launches are not priced; a case that does not
    say is not marked."""
    graphs, eager = (script.price(_case(**{"placement.generation.cuda_graphs": g}), 0, search=False)
                     for g in (True, False))
    assert eager.predicted_s == graphs.predicted_s and (graphs.cuda_graphs, eager.cuda_graphs) == (True, False)
    assert script.price(_case(), 0, search=False).cuda_graphs is None
    script._print_row(eager)
    script._print_row(graphs)
    eager_line, graphs_line = capsys.readouterr().out.splitlines()
    assert "decoded without CUDA graphs" in eager_line and "CUDA graphs" not in graphs_line


def test_a_peers_paged_engine_is_priced_reading_each_rows_own_tokens(script):
    """vLLM and SGLang (paged attention) read only the tokens a row holds (`Workload.live_kv`); DeepSpeed-Chat's
    hybrid engine and a case that names no engine are priced as jaxrlhf's engines decode."""
    for engine, paged in (("vllm", True), ("vllm (async engine)", True), ("sglang 0.4.6", True),
                          ("deepspeed-hybrid-engine", False), (None, False)):
        case = _case()
        if engine:
            case["placement"]["generation"]["engine"] = engine
        assert script.paged_engine(case) is paged, engine


def test_a_peer_that_recomputes_the_old_log_probs_runs_the_actors_forward_first(script):
    """verl's synchronous trainer recomputes the rollout's log-probs (its breakdown's `old_log_prob` stage) where
    its fully-async trainer takes the rollout's: the peer's config gets the actor's forward before the update
    (a rollout correction's `actor.inference`) only where the case says so or its breakdown shows that stage."""
    case = _case()
    assert not script.recomputes_logprobs(case)
    assert script.recomputes_logprobs(_case(**{"published.breakdown_s": {"old_log_prob": 107.7}}))
    assert not script.recomputes_logprobs(_case(**{"published.breakdown_s": {"old_log_prob": None}}))
    stated = _case(**{"placement.training.recompute_logprobs": True})
    assert script.recomputes_logprobs(stated)
    assert script.run_config(stated).algorithm.rollout_correction == "decoupled"
    assert script.run_config(stated, peer_knobs=False).algorithm.rollout_correction == "none"  # the pick's own run


def test_a_pairs_length_is_fitted_on_the_colocated_rows_trainer_stages_and_its_step_is_left_to_check(script):
    """A pair without published lengths: where the colocated row's breakdown prints its trainer's stages (verl's
    old_log_prob and update_actor), the mean length is the one at which the trainer's calls are priced at them,
    and that row's step, generation included, is then a check too (counted apart from the unfitted rows); a
    breakdown without them leaves the fit on the whole step, which then matches by construction."""
    pair = {"placement": {"kind": "colocated", "generation": {"tp": 2},
                          "training": {"backend": "megatron", "tp": 2, "pp": 2, "packed": True}},
            "staleness": 0, "name": "toy-sync", "pair": "toy:colocated", "response_len.mean": None}
    colocated = _case(**pair, **{"published.breakdown_s": {"gen": 30.0, "old_log_prob": 1.0, "update_actor": 1.0}})
    at_500 = script.price(colocated, 0, mean=500, search=False)
    assert set(at_500.generate) == {"actor.generate"} and at_500.trainer_s > 0
    colocated["published"]["breakdown_s"]["update_actor"] = at_500.trainer_s - 1.0
    mean, fitted_to, note = script.fitted_mean(colocated)
    assert fitted_to == "trainer stages" and note is None and mean == pytest.approx(500, rel=0.01)

    split = _case(**{"name": "toy-async", "pair": "toy:split", "response_len.mean": None,
                     "placement.training.packed": True})
    results = script.price_all([colocated, split], evaluations=0)
    assert [r.fitted for r in results] == ["trainer stages", None]
    assert results[0].mean == results[1].mean == pytest.approx(mean)
    summary = script.summarize(results)
    assert summary["priced"] == 1  # the split row; the colocated row's trainer stages were fitted
    staged = summary["trainer_fitted"]["steps"]["toy-sync"]
    assert staged["generation_published"] == 30.0 and staged["generation_predicted"] == results[0].generate_s > 0
    assert staged["ratio"] == pytest.approx(results[0].predicted_s / 60.0)

    whole = _case(**pair)  # no breakdown; a padding trainer's stages would not say the length either
    whole["published"]["step_s"] = script.price(whole, 0, mean=500, search=False).predicted_s
    padded = _case(**{**pair, "placement": {**pair["placement"], "training": {"backend": "megatron", "tp": 2}}},
                   **{"published.breakdown_s": colocated["published"]["breakdown_s"]})
    assert script.fitted_mean(padded)[1] == "step"
    mean, fitted_to, _ = script.fitted_mean(whole)
    assert fitted_to == "step"
    assert mean == pytest.approx(500, rel=0.01)
