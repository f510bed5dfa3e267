"""The run's models: every role built on its home placement, with its optimizer, and exported at the end.

A role's weights come from a preset (initialised on device, already sharded
as they will live), a checkpoint folder (each parameter placed as it is read)
or another role (`init_from`: copied after that role was built, and after the
actor's SFT warm-up when there is one, so a reference is the warmed-up actor).
Where each role lives is the plan's home placement of it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

from jaxrlhf import config as cfglib


@dataclasses.dataclass
class Built:
    """A role's model as built: structure, parameters (on device) and output head."""

    graphdef: Any
    params: Any
    head: str


class RoleBuilder:
    """Builds every role's parameters directly on its home placement.

    Roles with a preset are initialised on device (sharded as they will live);
    roles with a checkpoint path are loaded; roles with `init_from` copy the
    source role's current parameters: the whole model when the heads agree,
    the trunk under a fresh head otherwise (a critic or reward model from an
    actor); a source's LoRA adapters are merged into a copy whose role has
    other adapters or none (`lora.merge_adapters`), and the role's own start
    fresh. A source the algorithm does not use itself (the actor of a
    reward-model stage) is built where the role that copies it lives.
    """

    def __init__(self, cfg: cfglib.Config, specs: Mapping[str, Any], model_configs: Mapping[str, Any], cache, plan):
        self.cfg, self.specs, self.model_configs, self.cache, self.plan = cfg, specs, model_configs, cache, plan
        self.seed = cfg.run.seed

    def shardings(self, at: str, state: Any) -> Any:
        """Shardings of `state` on the home placement of role `at`."""
        return self.cache.placed(self.plan.home_call(at)).param_shardings(state)

    def head(self, role: str) -> str:
        return self.specs[role].head if role in self.specs else "lm"

    def direct(self, role: str, at: str) -> Built:
        """A role whose weights come from its own preset or checkpoint, on `at`'s home."""
        from flax import nnx

        from jaxrlhf.models.hf_io import load_hf_checkpoint

        rc, mc, head = getattr(self.cfg.model, role), self.model_configs[role], self.head(role)
        if rc.path:
            # each parameter placed as it is read: no process holds the whole model
            model, _ = load_hf_checkpoint(rc.path, head, param_dtype=mc.param_dtype, dtype=mc.dtype, seed=self.seed,
                                          remat=self.plan.execution.remat_of(role),
                                          config_overrides={**rc.overrides, "lora": mc.lora},
                                          shardings=lambda state: self.shardings(at, state))
            graphdef, state = nnx.split(model)
            return Built(graphdef, state, head)
        return self.fresh(role, head, self.seed + list(cfglib.ROLES).index(role), at)

    def fresh(self, role: str, head: str, seed: int, at: str) -> Built:
        """A randomly initialised model, created on device already sharded as on `at`'s home."""
        import jax
        from flax import nnx

        from jaxrlhf.models.transformer import build_model

        mc, remat = self.model_configs[role], self.plan.execution.remat_of(role)
        make = lambda: build_model(mc, head, seed=seed, remat=remat)  # noqa: E731
        graphdef, abstract = nnx.split(nnx.eval_shape(make))
        params = jax.jit(lambda: nnx.split(make())[1], out_shardings=self.shardings(at, abstract))()
        return Built(graphdef, params, head)

    def structure(self, role: str):
        """The role's model structure (graphdef) without building its weights."""
        from flax import nnx

        from jaxrlhf.models.transformer import build_model

        mc, remat = self.model_configs[role], self.plan.execution.remat_of(role)
        return nnx.split(nnx.eval_shape(lambda: build_model(mc, self.head(role), remat=remat)))[0]

    def derived(self, role: str, source: Built) -> Built:
        """A copy of `source` laid out for `role`'s home: whole, or its trunk under a fresh head."""
        from jaxrlhf.models import lora
        from jaxrlhf.transfer.realloc import reallocate

        head = self.head(role)
        source_lora = self.model_configs[getattr(self.cfg.model, role).init_from].lora
        mine = self.model_configs[role].lora
        if head == source.head and mine == source_lora:
            copy, _ = reallocate(source.params, self.shardings(role, source.params))  # always new buffers
            return Built(source.graphdef, copy, head)
        fresh = self.fresh(role, head, self.seed + 1, role)
        params = source.params
        if source_lora != mine:  # the source's adapters folded in; the role's own adapters start fresh
            params = lora.with_base(fresh.params, lora.merge_adapters(params, source_lora) if source_lora else params)
        if head == source.head:
            copy, _ = reallocate(params, self.shardings(role, fresh.params))
            return Built(fresh.graphdef, copy, head)
        trunk, _ = reallocate(params["model"], self.shardings(role, fresh.params)["model"])
        out = dict(fresh.params)
        out["model"] = trunk
        return Built(fresh.graphdef, type(fresh.params)(out), head)


def build_optimizer_for(cfg: cfglib.Config, role: str, total_updates: int, model_config):
    """The role's AdamW; fp32 master weights only where its parameters are low precision."""
    from jaxrlhf.algorithms.optim import build_optimizer
    from jaxrlhf.models import lora

    o = getattr(cfg.optimizer, role)
    trained_dtype = model_config.lora.dtype if model_config.lora else model_config.param_dtype
    return build_optimizer(
        lr=o.lr, total_updates=total_updates, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
        warmup_steps=o.warmup_steps, schedule=o.schedule, max_grad_norm=o.max_grad_norm,
        master_weights=o.master_weights and trained_dtype in ("bfloat16", "float16"),
        trainable=lora.trainable if model_config.lora else None,
    )


def init_opt_state(role, placed):
    """Optimizer state laid out like the params, counters replicated: checkpoints restore onto this."""
    import jax

    return jax.jit(role.optimizer.init, out_shardings=placed.opt_state_shardings(role.optimizer, role.params))(
        role.params
    )


def build_roles(cfg: cfglib.Config, specs: Mapping[str, Any], model_configs: Mapping[str, Any], cache, plan, *,
                total_updates: int, warm_up: Callable[[Any], None] | None = None,
                base_views: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every role of `specs` as an executor `Role` on its home placement, trained roles with their
    optimizer (`total_updates` long) and its state. Sources are built before the roles that copy them;
    `warm_up(actor)` runs on the actor once it is built and before any role copies it. A role in
    `base_views` (role -> LoRA source, `Algorithm.base_views`) gets no weights of its own: it runs on
    the source's frozen base."""
    from jaxrlhf.placement.executor import Role, delete_tree

    builder = RoleBuilder(cfg, specs, model_configs, cache, plan)
    views = dict(base_views or {})
    built: dict[str, Built] = {}
    for name in sorted(specs, key=lambda r: len(cfg.model.init_chain(r))):  # sources before their copies
        source = getattr(cfg.model, name).init_from
        if name in views:  # the LoRA actor's frozen base: structure only, its weights are the actor's
            built[name] = Built(builder.structure(name), None, builder.head(name))
        elif source is None:
            built[name] = builder.direct(name, at=name)
        else:
            if source not in built:  # a weight source the algorithm does not otherwise use
                built[source] = builder.direct(source, at=name)
            built[name] = builder.derived(name, built[source])
        if name == "actor" and warm_up is not None:
            actor = Role("actor", built["actor"].graphdef, built["actor"].params)
            warm_up(actor)
            built["actor"].params = actor.params
    roles: dict[str, Role] = {}
    for name, spec in specs.items():
        role = Role(name, built[name].graphdef, built[name].params, base_of=views.get(name))
        if spec.trained:
            role.optimizer = build_optimizer_for(cfg, name, total_updates, model_configs[name])
            role.opt_state = init_opt_state(role, cache.placed(plan.home_call(name)))
        roles[name] = role
    for name in [r for r in built if r not in specs]:
        delete_tree(built[name].params)
    return roles


def export_role(cfg: cfglib.Config, role, model_config, out: str) -> None:
    """Write a role as an HF checkpoint (with the tokenizer, when it is a file); every process gathers
    each tensor, process 0 writes. A LoRA actor is also written as its adapters alone in PEFT's layout
    (`<name>_lora/`, beside the merged `<name>_hf/`). The run's closing summary says where
    (`run_dir.RunFiles`)."""
    import shutil

    from flax import nnx

    from jaxrlhf.models.hf_io import save_hf_checkpoint
    from jaxrlhf.models.lora import save_peft_adapter
    from jaxrlhf.models.transformer import CausalLM
    from jaxrlhf.transfer.processes import is_main

    model = nnx.merge(role.graphdef, role.params)
    save_hf_checkpoint(model, model_config, out)
    if model_config.lora and isinstance(model, CausalLM):  # the adapters alone, in PEFT's layout
        save_peft_adapter(role.params, model_config.lora, out.removesuffix("_hf") + "_lora")
    if not is_main():
        return
    tok_path = cfg.model.tokenizer
    if tok_path != "byte" and os.path.exists(tok_path):
        src = tok_path if os.path.isfile(tok_path) else os.path.join(tok_path, "tokenizer.json")
        shutil.copy(src, os.path.join(out, "tokenizer.json"))
