"""Benchmark scripts count the same thing on both sides (no timings here: benchmarks live in scripts/)."""

import importlib.util
import json
import pathlib
import sys

import pytest

from jaxrlhf.testing import compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tunix_completions_count_their_eos_like_jaxrlhf_response_mask():
    """tunix cuts a completion before its first EOS; jaxrlhf's response mask includes the EOS. Limit 8:
    EOS at index 3 -> 4 tokens, no EOS -> 8, EOS first -> 1, EOS in the last slot -> 8 (cut length 7)."""
    bench = _load("bench_grpo_tunix")
    assert bench.generated_tokens([3, 8, 0, 7], max_new=8) == 4 + 8 + 1 + 8
    assert bench.generated_tokens([], max_new=8) == 0


def test_validate_planner_never_replaces_a_results_file(tmp_path, capsys):
    """--out naming an existing file stops before anything runs, and the file keeps its content."""
    out = tmp_path / "earlier.json"
    out.write_text("{}")
    with pytest.raises(SystemExit):
        _load("validate_planner").main(["--quick", "--out", str(out)])
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == "{}"


@pytest.mark.slow
def test_validate_planner_quick_runs_plans_and_reports_their_ranking(tmp_path):
    """The smoke mode runs every plan through the real executor and writes the summary the issue asks
    for; Spearman is checked against the no-ties formula 1 - 6 sum d^2 / (n (n^2 - 1)) on its own rows,
    and pick_vs_best against the rows' measured times."""
    from jaxrlhf.planner.hardware import get_profile

    out = tmp_path / "v.json"
    # the stock CPU profile instead of a calibration (what --profile is for; the rows' predictions are
    # only checked for being positive), a 1 s search and no warm-up step (each plan's one measured step
    # is then its first): every plan still runs through train.run and the summary is still computed
    hw = str(tmp_path / "cpu.yaml")
    get_profile("cpu").save(hw)
    _load("validate_planner").main(["--quick", "--profile", hw, "--search-budget", "1", "--warmup", "0",
                                    "--workdir", str(tmp_path / "w"), "--out", str(out), compile_cache.override(),
                                    "run.save_checkpoints=false"])
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert len(rows) >= 2 and all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
    assert any(r["name"].split("=")[0] == "colocated" for r in rows)  # "colocated=planner-pick" when they agree
    assert sum(r["name"].endswith("planner-pick") for r in rows) == 1
    assert all(set(r["measured_calls_s"]) >= {"actor.generate", "actor.train", "critic.train"} for r in rows)
    pred, meas = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    if len(set(pred)) == len(pred) and len(set(meas)) == len(meas):
        rank = lambda xs: {x: i for i, x in enumerate(sorted(xs))}  # noqa: E731
        rp, rm = rank(pred), rank(meas)
        n = len(rows)
        d2 = sum((rp[p] - rm[m]) ** 2 for p, m in zip(pred, meas))
        assert res["spearman"] == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
    pick = next(r for r in rows if r["name"].endswith("planner-pick"))
    assert res["pick_vs_best"] == pytest.approx(pick["measured_s"] / min(meas))
    assert res["median_abs_error"] == pytest.approx(
        sorted(abs(p / m - 1) for p, m in zip(pred, meas))[len(rows) // 2] if len(rows) % 2 else
        sum(sorted(abs(p / m - 1) for p, m in zip(pred, meas))[len(rows) // 2 - 1:len(rows) // 2 + 1]) / 2)


def test_rl_response_lengths_are_long_tailed_clipped_and_seeded():
    """bench_generate --workload rl: log-normal lengths, median 64, clipped to [1, 512], same per seed."""
    import numpy as np

    bench = _load("bench_generate")
    lengths = bench.rl_lengths(4096, 64, 1.0, 512)
    assert lengths.min() >= 1 and lengths.max() == 512  # P(> 512) = P(z > ln 8) ~ 2%: the cap is reached
    assert 60 <= np.median(lengths) <= 68 and lengths.mean() > np.median(lengths) * 1.4  # mean e^0.5 x median
    np.testing.assert_array_equal(lengths, bench.rl_lengths(4096, 64, 1.0, 512))


@pytest.mark.slow
def test_rl_workload_reports_the_pool_and_the_pages_in_use(tmp_path):
    """bench_generate --workload rl (tiny): both engines return the same tokens; the JSON holds the ratios,
    both engines' peak KV bytes, and the continuous engine's pool and the part of it in use at peak."""
    out = tmp_path / "rl.json"
    assert _load("bench_generate").main([
        "--workload", "rl", "--preset", "tiny", "--prompt-len", "16", "--new-tokens", "40", "--groups", "2",
        "--group-size", "2", "--median-len", "8", "--kv-pages", "6", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["same_tokens"] == 1.0 and res["tokens_per_s_ratio"] > 0 and res["prefill_ratio"] > 0
    cont = res["continuous"]
    # the seed's lengths are 9, 7, 15 and 9 tokens: each row stores at most 14 tokens, one page of 16, and
    # all four decode at once (4 slots); hand count in cache columns: static 4 rows x (16 + 40) plus the
    # 2 prefilled rows they are copied from; continuous pool 2 prompts x 16 + 6 pages x 16, in use
    # 2 x 16 + 4 x 16, plus the prefill's 2 x 16
    assert cont["kv_pages"] == 6 and cont["kv_pages_used_peak"] == 4
    column = res["static"]["peak_kv_bytes"] // ((4 + 2) * 56)
    assert res["static"]["peak_kv_bytes"] == (4 + 2) * 56 * column
    assert (cont["kv_pool_bytes"], cont["kv_used_peak_bytes"], cont["peak_kv_bytes"]) == (
        128 * column, 96 * column, 160 * column)


def test_bench_replan_never_replaces_a_results_file(tmp_path, capsys):
    out = tmp_path / "earlier.json"
    out.write_text("{}")
    assert _load("bench_replan").main(["--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == "{}"


def test_step_breakdown_sets_each_call_against_its_flops(tmp_path, capsys):
    """Means over the steps after --skip; with --config each call gets the planner's FLOPs and bytes and
    its MFU = FLOPs / run time / the profile's matmul rate (a hand-made two-call step here)."""
    from jaxrlhf.planner.hardware import get_profile

    breakdown = _load("step_breakdown")
    step = {"time/step_s": 1.0, "time/step/compute_s": 0.75, "time/step/move_s": 0.0, "time/step/host_s": 0.0,
            "time/step/other_s": 0.25, "time/actor.generate_s": 0.25, "time/actor.generate/wait_s": 0.0,
            "time/actor.generate/move_s": 0.0, "time/actor.train_s": 0.5, "time/actor.train/wait_s": 0.0,
            "time/actor.train/move_s": 0.0}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(dict(step, step=i)) for i in (1, 2, 3)) + "\n")
    out = tmp_path / "b.json"
    args = [str(metrics), "--skip", "1", "--out", str(out), "--config", str(REPO / "configs" / "quickstart-grpo.yaml"),
            "--devices", "1", "--profile", "cpu"]
    assert breakdown.main(args) == 0
    b = json.loads(out.read_text())
    assert b["steps"] == 2 and sum(b["split"].values()) == pytest.approx(b["step_s"]) == 1.0
    train = b["calls"]["actor.train"]
    rate = get_profile("cpu").matmul_flops("float32")
    assert train["flops"] > 0 and train["mfu"] == pytest.approx(train["flops"] / 0.5 / rate)
    assert "ref.inference" not in b["calls"]  # only the calls the metrics time
    assert "MFU" in capsys.readouterr().out
    # every override applies, given after one --set or each after its own (argparse's default keeps the last)
    for sets in (["--set", "data.batch_size=32", "algorithm.group_size=16"],  # 16 x 8 rows -> 32 x 16
                 ["--set", "data.batch_size=32", "--set", "algorithm.group_size=16"]):
        assert breakdown.main(args + sets) == 0
        bigger = json.loads(out.read_text())["calls"]["actor.train"]["flops"]
        assert bigger == pytest.approx(4 * train["flops"], rel=0.05), sets
    capsys.readouterr()

    # a run folder's plan.yaml and hardware.yaml (what `train` writes) are what the run ran: no re-planning
    from jaxrlhf import config as cfglib
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.run import planning

    config = args[args.index("--config") + 1]
    cfg = cfglib.load_config(config, [])
    algorithm = build_algorithm(cfg)
    models = planning.role_configs(cfg, algorithm.graph().roles)
    build_plan("colocated", 2, models, algorithm.graph(), batch_size=algorithm.batch_rows).save(
        str(tmp_path / "plan.yaml"))
    get_profile("h200").save(str(tmp_path / "hardware.yaml"))
    assert breakdown.main([str(metrics), "--out", str(out), "--config", config]) == 0
    ran = json.loads(out.read_text())["calls"]["actor.train"]
    assert ran["flops"] == pytest.approx(train["flops"] / 2, rel=0.05)  # the batch split over 2 devices
    assert ran["mfu"] == pytest.approx(ran["flops"] / 0.5 / get_profile("h200").matmul_flops("float32"))
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert breakdown.main([str(tmp_path / "bad.jsonl")]) == 2
    assert "is not a metrics.jsonl" in capsys.readouterr().err


def test_trace_summary_sums_device_ops_per_kind_and_per_call(tmp_path, capsys):
    """A hand-made trace: a GPU's kernel stream and XLA:CPU's device thread both count, the python
    thread does not; `--call` keeps the ops that start between that call's launch and the next launch."""
    import gzip

    summary = _load("trace_summary")
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "python3"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 2, "args": {"name": "tf_XLAEigen/3"}},
    ]
    span = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = meta + [
        span(2, 1, "actor.generate", 0, 10), span(2, 1, "actor.train", 100, 10),  # launches (python thread)
        span(1, 7, "loop_add_fusion_3", 5, 20e3), span(1, 7, "gemm_fusion_dot.12", 30, 40e3),  # generate's
        span(1, 7, "gemm_fusion_dot_7", 120, 60e3), span(2, 2, "dot.4", 130, 30e3),  # train's, GPU and CPU
        span(2, 2, "ThunkExecutor::Execute", 130, 90e3),  # a runtime wrapper: not an op
    ]
    folder = tmp_path / "step_1"
    folder.mkdir()
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    seconds, counts = summary.op_times(summary.find_trace(str(folder)))
    assert seconds == pytest.approx({"loop_add_fusion": 0.02, "gemm_fusion_dot": 0.1, "dot": 0.03})
    assert counts == {"loop_add_fusion": 1, "gemm_fusion_dot": 2, "dot": 1}
    seconds, _ = summary.op_times(summary.find_trace(str(folder)), "actor.train")
    assert seconds == pytest.approx({"gemm_fusion_dot": 0.06, "dot": 0.03})
    assert summary.main([str(folder), "--call", "critic.train"]) == 2
    assert "no launch of 'critic.train'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bench_packing", "bench_rewards", "bench_one_row"])
def test_long_sequence_and_reward_benchmarks_never_replace_a_results_file(name, tmp_path, capsys):
    out = tmp_path / "earlier.json"
    out.write_text("{}")
    assert _load(name).main(["--quick", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "{}"


def test_the_one_row_benchmark_measures_both_layouts_and_prices_them(tmp_path):
    """`bench_one_row --quick`: each call timed in rows as wide as the batch and in one row, the one row
    holding fewer tokens, the planner pricing both (its one-row shape about a single row)."""
    out = tmp_path / "one_row.json"
    assert _load("bench_one_row").main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for call in ("inference", "train"):
        r = result["calls"][call]
        assert r["tokens"]["one_row"] < r["tokens"]["wide"]
        assert all(r["seconds"][side] > 0 and r["predicted_s"][side] > 0 for side in ("wide", "one_row"))
        # one row a draw: the mean shape's rows are its mean tokens over its token-weighted width, at most 1
        assert 0.5 < r["priced_shape"]["one_row"]["rows"] <= 1 < r["priced_shape"]["wide"]["rows"]
        assert r["measured_ratio"] == pytest.approx(r["seconds"]["wide"] / r["seconds"]["one_row"])
