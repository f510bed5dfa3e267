"""jaxrlhf: RLHF training in JAX where placement of every model call is a plan."""

__version__ = "0.1.0"
