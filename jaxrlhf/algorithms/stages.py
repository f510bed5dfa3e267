"""The training stages of the InstructGPT pipeline and its offline alternative, declared without JAX.

`sft` (supervised fine-tuning on demonstrations; also the actor's warm-up before RL), `rm`
(a reward model from preference pairs) and `dpo` (DPO/IPO on preference pairs). Each
declaration says which roles a run needs and what its step graph is; the losses, calls and
metrics are the runtimes in `jaxrlhf.algorithms.sft`, `.rm` and `.dpo`.
"""

from __future__ import annotations

from typing import Any

from jaxrlhf.algorithms.base import Algorithm, RoleSpec, register_algorithm
from jaxrlhf.graph import CallGraph, CallSpec, HostStep

# a batch row is one (chosen, rejected) pair, both left-padded to one length (see jaxrlhf.algorithms.pairs)
PAIR = ("chosen_tokens", "chosen_mask", "chosen_loss_mask", "rejected_tokens", "rejected_mask", "rejected_loss_mask")
REF = ("ref_chosen_logp", "ref_rejected_logp")  # DPO: the reference's summed log-probs of both responses


@register_algorithm
class SFT(Algorithm):
    name = "sft"
    data = "demonstrations"
    runtime = "jaxrlhf.algorithms.sft:SFTRuntime"

    def __init__(self, cfg: Any, *, warmup: bool = False):
        super().__init__(cfg)
        self.warmup = warmup  # the actor's warm-up before RL: reads the `sft` section

    @property
    def packing(self) -> bool:
        return self.cfg.sft.packing if self.warmup else self.cfg.data.packing

    @property
    def batch_rows(self) -> int:
        return self.cfg.sft.batch_size if self.warmup else self.cfg.data.batch_size

    def roles(self) -> dict[str, RoleSpec]:
        return {"actor": RoleSpec("lm", True, "it is trained")}

    def graph(self) -> CallGraph:
        inputs = ("tokens", "mask", "loss_mask", "positions") + (("segment_ids",) if self.packing else ())
        return CallGraph(
            (CallSpec("actor.train", "actor", "train", inputs=inputs + ("rng_actor",), outputs=("actor_stats",),
                      logit_positions="all"),),
            feed=inputs + ("rng_actor",),
        )


@register_algorithm
class RewardModelling(Algorithm):
    name = "rm"
    data = "pairs"
    runtime = "jaxrlhf.algorithms.rm:RewardModellingRuntime"

    def roles(self) -> dict[str, RoleSpec]:
        return {"reward": RoleSpec("reward", True, "it is trained")}

    def graph(self) -> CallGraph:
        call = CallSpec("reward.train", "reward", "train", "reward", inputs=(*PAIR, "rng_reward"),
                        outputs=("reward_stats",), seqs_per_row=2)
        return CallGraph((call,), feed=(*PAIR, "rng_reward"))


@register_algorithm
class DPO(Algorithm):
    name = "dpo"
    data = "pairs"
    runtime = "jaxrlhf.algorithms.dpo:DPORuntime"

    def roles(self) -> dict[str, RoleSpec]:
        return {
            "actor": RoleSpec("lm", True, "it is trained"),
            "ref": RoleSpec("lm", False, "DPO measures the policy against the reference"),
        }

    @property
    def packs(self) -> bool:
        """Both calls run packed rows (`algorithm.pack_sequences`; `jaxrlhf.algorithms.dpo`)."""
        return self.cfg.algorithm.pack_sequences

    def graph(self) -> CallGraph:
        packed = ("packed_pairs",) if self.packs else ()
        calls = (
            CallSpec("ref.inference", "ref", "inference", inputs=(*PAIR, *packed), outputs=REF, seqs_per_row=2,
                     logit_positions="all"),
            CallSpec("actor.train", "actor", "train", inputs=(*PAIR, *REF, "rng_actor", *packed),
                     outputs=("actor_stats",), seqs_per_row=2, logit_positions="all"),
        )
        host = (HostStep("pack_pairs", ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask"),
                         ("packed_pairs", "packing_stats"), shards_of=("ref.inference", "actor.train")),) \
            if self.packs else ()
        return CallGraph(calls, host, feed=(*PAIR, "rng_actor"))
