"""What the policy talks to in multi-turn rollouts: environments and the agents of the agent endpoint.

- `base`: the `Environment` interface (`reset`, `step`), its registry (`env.name`), the trajectory record and
  the measured cost of episode batches (`EpisodeTiming`);
- `tools`: the built-in tool environment (`env.name: tools`), and `tool_calls`: tool calls parsed out of a
  model's text in its template family's format;
- `pool`: environments in worker processes (`env.workers`);
- `episodes`: a batch of environment episodes played by the multi-turn engine (`env.name`);
- the agent endpoint (`env.name: openai_agent`): `records` (what an episode's requests recorded), `chat`
  (OpenAI's request and error), `service` (episodes by id, limits, one request's dispatch), `backends`
  (what generates: the run's generate placement, a model, or the multi-turn engine's cache, which a request
  after an observation extends), `agents` (agents on the official client, their episodes as the trainer's
  rows) and `server` (the HTTP transport).

Importing the package imports no JAX; it registers the built-in environments (`tools`), so a worker process
that builds one by name finds it.
"""

from jaxrlhf.environments import tools  # noqa: F401  (registers env.name=tools)
from jaxrlhf.environments.base import (
    ACTION_MASK,
    ENVIRONMENTS,
    Environment,
    EnvironmentContext,
    EpisodeTiming,
    Observation,
    StepResult,
    Trajectory,
    make_environment,
    register_environment,
)
from jaxrlhf.environments.tools import TOOLS, ToolEnvironment, answer_reward, calculator, register_tool

__all__ = ["ACTION_MASK", "ENVIRONMENTS", "TOOLS", "Environment", "EnvironmentContext", "EpisodeTiming", "Observation",
           "StepResult", "ToolEnvironment", "Trajectory", "answer_reward", "calculator", "make_environment",
           "register_environment", "register_tool"]
