"""The PPO step as a dataflow graph of six model calls (DESIGN.md §1)."""

from jaxrlhf.mesh.graph import CallGraph, CallSpec

ROLES = ("actor", "critic", "ref", "reward")

PPO_GRAPH = CallGraph(
    calls=(
        CallSpec("actor.generate", "actor", "generate"),
        CallSpec("reward.inference", "reward", "inference", deps=("actor.generate",)),
        CallSpec("ref.inference", "ref", "inference", deps=("actor.generate",)),
        CallSpec("critic.inference", "critic", "inference", deps=("actor.generate",)),
        CallSpec(
            "actor.train", "actor", "train",
            deps=("actor.generate", "reward.inference", "ref.inference", "critic.inference"),
        ),
        CallSpec(
            "critic.train", "critic", "train",
            deps=("actor.generate", "reward.inference", "ref.inference", "critic.inference"),
        ),
    )
)
