"""`python -m jaxrlhf.train --config FILE [key=value ...]`: the main job.

Orchestration only: resolve the config, set up devices, build the models on
their home placements, pick or load the execution plan, optionally warm the
actor up with SFT, then run PPO steps with metrics and checkpoints, and
export the final actor as an HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Any, Sequence

from jaxrlhf import config as cfglib


def setup_devices(run: cfglib.RunConfig) -> None:
    """Must run before any JAX backend starts (DESIGN §3 facts 1 and 5)."""
    import jax

    if run.platform == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_platforms", "cpu")
        if run.devices:
            jax.config.update("jax_num_cpu_devices", run.devices)
    elif run.platform in ("gpu", "tpu"):
        jax.config.update("jax_platforms", "cuda" if run.platform == "gpu" else "tpu")
    if run.distributed:
        jax.distributed.initialize()


# --------------------------------------------------------------------------- models


def _role_configs(cfg: cfglib.Config, roles: Sequence[str]):
    """ModelConfig of every role, following init_from chains; no weights touched."""
    from jaxrlhf.models.config import preset
    from jaxrlhf.models.hf_io import config_from_hf, read_hf_config

    out = {}

    def resolve(role: str):
        if role in out:
            return out[role]
        rc = getattr(cfg.model, role)
        if rc.init_from:
            base = resolve(rc.init_from)
        elif rc.path:
            base = config_from_hf(read_hf_config(rc.path), source=os.path.join(rc.path, "config.json"))
        elif rc.preset:
            base = preset(rc.preset)
        else:
            raise cfglib.ConfigError(f"model.{role}: set one of preset, path or init_from")
        changes = dict(rc.overrides)
        if rc.dtype:
            changes["dtype"] = rc.dtype
        if rc.param_dtype:
            changes["param_dtype"] = rc.param_dtype
        out[role] = base.replace(**changes) if changes else base
        return out[role]

    for r in roles:
        resolve(r)
    return {r: out[r] for r in roles}


HEAD_OF_ROLE = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "reward"}


def _source_of(cfg: cfglib.Config, role: str) -> tuple[str | None, str | None]:
    """(checkpoint path, preset) a role's weights come from, following init_from."""
    rc = getattr(cfg.model, role)
    seen = set()
    while rc.init_from and rc.init_from not in seen:
        seen.add(rc.init_from)
        rc = getattr(cfg.model, rc.init_from)
    return rc.path, rc.preset


def build_role_model(cfg: cfglib.Config, role: str, model_config, seed: int):
    """A host-side NNX model for `role` (random init from a preset, or an HF checkpoint)."""
    from jaxrlhf.models.hf_io import load_hf_checkpoint
    from jaxrlhf.models.transformer import build_model

    rc = getattr(cfg.model, role)
    path, _ = _source_of(cfg, role)
    head = HEAD_OF_ROLE[role]
    if path:
        model, _ = load_hf_checkpoint(
            path, head, param_dtype=model_config.param_dtype, dtype=model_config.dtype, seed=seed,
            remat=rc.remat,
        )
        return model
    return build_model(model_config, head, seed=seed, remat=rc.remat)


def copy_trunk(src_params, dst_params):
    """Copy the shared transformer trunk ("model" subtree) from one role's params into another's."""
    import jax

    out = dict(dst_params)
    out["model"] = jax.tree_util.tree_map(lambda x: x, src_params["model"])
    return type(dst_params)(out)


# --------------------------------------------------------------------------- graph and plan


def graph_for(cfg: cfglib.Config):
    """The algorithm's dataflow graph: critic-free estimators drop the critic's calls,
    rule-only rewards drop the reward model's."""
    from jaxrlhf.mesh.graph import CallGraph
    from jaxrlhf.ppo.graph import PPO_GRAPH

    drop = set()
    if cfg.algorithm.advantage != "gae":
        drop |= {"critic.inference", "critic.train"}
    if not cfg.rewards.model:
        drop |= {"reward.inference"}
    return CallGraph(
        tuple(
            dataclasses.replace(c, deps=tuple(d for d in c.deps if d not in drop))
            for c in PPO_GRAPH.calls
            if c.name not in drop
        )
    )


def plan_for(cfg: cfglib.Config, graph, model_configs, num_devices: int, devices_per_host: int | None = None):
    """The execution plan of a run: a plan file, a preset, or the planner's search (`auto`).

    Needs only model dimensions, so realistic configs can be planned without weights or devices.
    """
    from jaxrlhf.mesh.plan import ExecutionPlan, validate as validate_plan
    from jaxrlhf.mesh.presets import build_plan

    batch = cfg.data.batch_size * cfg.algorithm.group_size
    if cfg.plan.file:
        plan = ExecutionPlan.load(cfg.plan.file)
        validate_plan(plan, graph, model_configs, devices=num_devices, batch_size=batch,
                      devices_per_host=devices_per_host)
        return plan
    if cfg.plan.strategy == "auto":
        return search_plan(cfg, graph, model_configs, num_devices, batch, devices_per_host)
    return build_plan(
        cfg.plan.strategy, num_devices, model_configs, graph, batch_size=batch,
        devices_per_host=devices_per_host, offpolicy=cfg.plan.offpolicy,
    )


DEFAULT_HARDWARE = {"cpu": "cpu", "gpu": "h100", "cuda": "h100", "tpu": "tpu-v5e"}


def search_plan(cfg: cfglib.Config, graph, model_configs, num_devices: int, batch_size: int,
                devices_per_host: int | None = None):
    """`plan.strategy=auto`: the planner's best plan for these devices, models and workload."""
    import dataclasses as dc

    from jaxrlhf.mesh.cost import Workload
    from jaxrlhf.mesh.hardware import get_profile
    from jaxrlhf.mesh.search import search

    if cfg.plan.hardware:
        hw = get_profile(cfg.plan.hardware)
    else:
        import jax

        hw = get_profile(DEFAULT_HARDWARE.get(jax.devices()[0].platform, "cpu"))
    if devices_per_host:
        hw = dc.replace(hw, devices_per_host=devices_per_host)
    wl = Workload(
        batch_size=batch_size, prompt_len=cfg.data.max_prompt_len, gen_len=cfg.generation.max_new_tokens,
        minibatches=cfg.algorithm.minibatches, ppo_epochs=cfg.algorithm.epochs,
    )
    result = search(
        model_configs, wl, hw, num_devices, graph, seed=cfg.run.seed, time_budget_s=30.0,
        allow_offpolicy=cfg.plan.offpolicy,
    )
    plan = result.best.plan
    print(f"plan.strategy=auto: searched {result.evaluations} plans in {result.seconds:.1f} s "
          f"(estimated step {result.best.step_s:.3g} s on {hw.name})", flush=True)
    return plan


# --------------------------------------------------------------------------- main


def run(cfg: cfglib.Config) -> dict[str, Any]:
    """Train according to `cfg`; returns the last step's metrics."""
    import jax
    from flax import nnx

    from jaxrlhf.checkpoint import CheckpointManager
    from jaxrlhf.data import PromptDataset, SFTDataset
    from jaxrlhf.mesh.calls import CallCache
    from jaxrlhf.mesh.layout import AxisRules
    from jaxrlhf.mesh.realloc import reallocate
    from jaxrlhf.metrics import MetricsWriter
    from jaxrlhf.models.hf_io import save_hf_checkpoint
    from jaxrlhf.models.sampling import SamplingParams
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.ppo import calls
    from jaxrlhf.ppo.engine import PPOEngine, RewardSettings, Role
    from jaxrlhf.ppo.kl import build_kl_controller, kl_controller_from_state
    from jaxrlhf.ppo.optim import build_optimizer
    from jaxrlhf.ppo.rewards import REWARD_FUNCTIONS, CombinedReward

    cfglib.validate(cfg, reward_rules=REWARD_FUNCTIONS)
    alg = cfg.algorithm
    tokenizer = load_tokenizer(cfg.model.tokenizer)

    graph = graph_for(cfg)
    roles_needed = graph.roles
    model_configs = _role_configs(cfg, roles_needed)
    for role, mc in model_configs.items():
        if mc.vocab_size < tokenizer.vocab_size:
            raise cfglib.ConfigError(
                f"model.{role}: vocab_size {mc.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )
    plan = plan_for(cfg, graph, model_configs, jax.device_count())
    print(plan.table(), flush=True)
    rules = AxisRules.from_config(cfg.plan.axis_rules)
    cache = CallCache(plan, rules=rules)

    # Models on their home placements.
    steps = cfg.run.steps
    updates_per_step = alg.minibatches * alg.epochs

    def place(role: str, model) -> tuple[Any, Any]:
        graphdef, state = nnx.split(model)
        placed = cache.placed(plan.home_call(role))
        return graphdef, jax.device_put(state, placed.param_shardings(state))

    def optimizer_for(role: str, total: int, lr: float | None = None):
        o = getattr(cfg.optimizer, role)
        return build_optimizer(
            lr=lr or o.lr, total_updates=total, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
            warmup_steps=o.warmup_steps, schedule=o.schedule, max_grad_norm=o.max_grad_norm,
        )

    seed = cfg.run.seed
    actor_graphdef, actor_params = place("actor", build_role_model(cfg, "actor", model_configs["actor"], seed))
    roles: dict[str, Role] = {}
    actor_opt = optimizer_for("actor", steps * updates_per_step)
    roles["actor"] = Role("actor", actor_graphdef, actor_params, actor_opt)

    ckpt = CheckpointManager(os.path.join(cfg.run.output_dir, "checkpoints"), max_to_keep=cfg.run.keep_checkpoints)
    resume_step = ckpt.latest_step() if cfg.run.resume else None

    # SFT warm-up (skipped on resume: the checkpoint holds the warmed-up actor and reference).
    sft_metrics: dict[str, float] = {}
    if cfg.sft.steps and resume_step is None:
        sft_data = SFTDataset.from_config(cfg, tokenizer)
        sft_opt = build_optimizer(lr=cfg.sft.lr, total_updates=cfg.sft.steps, warmup_steps=min(10, cfg.sft.steps))
        placed = cache.placed("actor.train")
        sft_state, _ = reallocate(actor_params, placed.param_shardings(actor_params))
        sft_opt_state = jax.jit(sft_opt.init)(sft_state)
        sft_fn = cache.function(
            "actor.train", functools.partial(calls.sft_train, actor_graphdef, sft_opt),
            in_shardings=None, out_shardings=None, donate_argnums=(0, 1),
        )
        t0 = time.perf_counter()
        for i in range(cfg.sft.steps):
            b = sft_data.next_batch()
            args = [jax.device_put(a, placed.batch_sharding(2)) for a in (b.input_ids, b.attention_mask, b.loss_mask)]
            sft_state, sft_opt_state, loss = sft_fn(sft_state, sft_opt_state, *args)
            if (i + 1) % max(cfg.sft.steps // 5, 1) == 0 or i + 1 == cfg.sft.steps:
                print(f"sft step {i + 1}/{cfg.sft.steps}: loss={float(loss):.4f}", flush=True)
        sft_metrics = {"sft/final_loss": float(loss), "sft/seconds": time.perf_counter() - t0}
        roles["actor"].params = sft_state
        del sft_opt_state

    # Other roles: the reference is a frozen copy of the (warmed-up) actor, the critic shares its trunk.
    actor_host_params = roles["actor"].params
    for role in roles_needed:
        if role == "actor":
            continue
        rc = getattr(cfg.model, role)
        model = build_role_model(cfg, role, model_configs[role], seed + 1)
        graphdef, state = nnx.split(model)
        if rc.init_from == "actor" and not _source_of(cfg, role)[0]:
            if role == "ref":
                state = jax.tree_util.tree_map(lambda x: x, actor_host_params)
            else:
                state = copy_trunk(actor_host_params, state)
        placed = cache.placed(plan.home_call(role))
        if rc.init_from == "actor" and role == "ref" and not _source_of(cfg, role)[0]:
            state, _ = reallocate(state, placed.param_shardings(state))  # device to device, no host copy
        else:
            state = jax.device_put(state, placed.param_shardings(state))
        opt = None
        if graph.train_call(role) is not None:
            opt = optimizer_for(role, steps * updates_per_step)
        roles[role] = Role(role, graphdef, state, opt)
    for role in roles.values():
        if role.trainable:  # laid out like the params, counters replicated: checkpoints restore onto this
            placed = cache.placed(plan.home_call(role.name))
            role.opt_state = jax.jit(
                role.optimizer.init, out_shardings=placed.opt_state_shardings(role.optimizer, role.params)
            )(role.params)

    gen = cfg.generation
    sampling = SamplingParams(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=gen.greedy)
    hp = calls.PPOHParams(
        loss=alg.name, advantage=alg.advantage, gamma=alg.gamma, lam=alg.lam, group_size=alg.group_size,
        clip_eps=alg.clip_eps, value_clip_eps=alg.value_clip_eps, kl_estimator=alg.kl_estimator,
        kl_in_reward=alg.name == "ppo", minibatches=alg.minibatches, epochs=alg.epochs,
        ratio_early_stop=alg.ratio_early_stop, whiten_advantages=alg.whiten_advantages,
        normalize_values=alg.normalize_values, entropy_coef=alg.entropy_coef, sampling=sampling,
    )
    rules_spec = [(r.name, r.weight, dict(r.args)) for r in cfg.rewards.rules]
    reward_settings = RewardSettings(
        rules=CombinedReward(rules_spec) if rules_spec else None, use_model=cfg.rewards.model,
        scale=cfg.rewards.scale, bias=cfg.rewards.bias, clip=cfg.rewards.clip, eos_only=cfg.rewards.eos_only,
    )
    kl = build_kl_controller(
        "adaptive" if alg.kl_target else "fixed", alg.kl_coef, alg.kl_target or 6.0, alg.kl_horizon
    )
    engine = PPOEngine(
        plan, roles, tokenizer=tokenizer, hparams=hp, rewards=reward_settings, kl=kl,
        max_new_tokens=gen.max_new_tokens, cache=cache,
    )
    data = PromptDataset.from_config(cfg, tokenizer)

    # Resume.
    start = 0
    if resume_step is not None:
        arrays = engine.array_state()
        if "ref" in roles:
            arrays["ref"] = {"params": roles["ref"].params}
        restored, meta = ckpt.restore(resume_step, arrays)
        if "ref" in roles:
            roles["ref"].params = restored.pop("ref")["params"]
        engine.load_array_state(restored)
        data.load_state_dict(meta["data"])
        engine.kl = kl_controller_from_state(meta["kl"])
        start = int(meta["step"])
        print(f"resumed from step {start} ({ckpt.directory})", flush=True)

    def save(step: int, data_state: dict) -> None:
        arrays = engine.array_state()
        if "ref" in roles:
            arrays["ref"] = {"params": roles["ref"].params}
        ckpt.save(step, arrays, {"step": step, "data": data_state, "kl": engine.kl.state_dict()})

    writer = MetricsWriter(cfg.run.output_dir, steps, resume_step=start, tensorboard=cfg.run.tensorboard)
    base_rng = jax.random.key(seed)
    metrics: dict[str, Any] = {}
    offpolicy = plan.offpolicy
    batch = None
    try:
        for step in range(start + 1, steps + 1):
            batch = batch if (offpolicy and batch is not None) else _draw(data, alg.group_size)
            data_state = data.state_dict()
            nxt = _draw(data, alg.group_size) if offpolicy and step < steps else None
            metrics = engine.step(
                batch, jax.random.fold_in(base_rng, step), nxt, jax.random.fold_in(base_rng, step + 1)
            )
            batch = nxt
            metrics.update(data.metrics())
            if step == 1:
                metrics.update(sft_metrics)
            _check_finite(metrics, step)
            if step % cfg.run.log_every == 0 or step == steps:
                writer.write(step, metrics)
            if (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0) or step == steps:
                save(step, data_state)
    finally:
        writer.close()
        ckpt.close()

    if cfg.run.export_hf and jax.process_index() == 0:
        out = os.path.join(cfg.run.output_dir, "actor_hf")
        actor = nnx.merge(roles["actor"].graphdef, jax.device_get(roles["actor"].params))
        save_hf_checkpoint(actor, model_configs["actor"], out)
        tok_path = cfg.model.tokenizer
        if tok_path != "byte" and os.path.exists(tok_path):
            import shutil

            src = tok_path if os.path.isfile(tok_path) else os.path.join(tok_path, "tokenizer.json")
            shutil.copy(src, os.path.join(out, "tokenizer.json"))
        print(f"final actor exported to {out}", flush=True)
    return metrics


def _draw(data, group_size: int):
    """The next prompt batch, each prompt repeated `group_size` times."""
    batch = data.next_batch()
    return _repeat_prompts(batch, group_size) if group_size > 1 else batch


def _repeat_prompts(batch, g: int):
    """G samples per prompt (GRPO / RLOO): every prompt row repeated G times, adjacent."""
    import numpy as np

    rep = lambda xs: tuple(x for x in xs for _ in range(g))  # noqa: E731
    return dataclasses.replace(
        batch,
        input_ids=np.repeat(batch.input_ids, g, axis=0),
        attention_mask=np.repeat(batch.attention_mask, g, axis=0),
        prompt_lens=np.repeat(batch.prompt_lens, g, axis=0),
        prompts=rep(batch.prompts),
        answers=rep(batch.answers),
        meta=rep(batch.meta),
        row_ids=np.repeat(batch.row_ids, g, axis=0),
        global_batch_size=batch.global_batch_size * g,
    )


def _check_finite(metrics: dict[str, Any], step: int) -> None:
    """Non-finite steps were skipped on device; say so on the console, keep going."""
    skipped = metrics.get("skipped_nonfinite", 0.0) + metrics.get("critic/skipped_nonfinite", 0.0)
    if skipped:
        print(
            f"step {step}: {int(skipped)} update(s) had a non-finite loss or gradient and were skipped "
            "(parameters unchanged)",
            file=sys.stderr,
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    from jaxrlhf.data.sources import DataError
    from jaxrlhf.mesh.plan import PlanError
    from jaxrlhf.models.hf_io import CheckpointError
    from jaxrlhf.models.tokenizer import TokenizerError

    try:
        args = cfglib.parse_cli(argv)
        if args.print_config:
            print(cfglib.format_config(args.config), end="")
            return 0
        setup_devices(args.config.run)
        run(args.config)
    except (cfglib.ConfigError, PlanError, DataError, CheckpointError, TokenizerError) as e:
        kind = type(e).__name__.replace("Error", " error").lower()
        print(f"jaxrlhf.train: {kind}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
