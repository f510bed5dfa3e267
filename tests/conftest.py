"""Test harness: 8 simulated CPU devices, set before any JAX backend starts, and one persistent
compilation cache for the whole test run."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny models, so their time is XLA's compile time, most of it LLVM's optimisation passes:
# level 0 halves it (a tiny PPO run: 45 s -> 25 s of CPU) and changes no HLO, only how fast the code
# runs and how floats are contracted. Set for this process and every process a test starts (they
# inherit the environment), so runs compared with each other are compiled alike.
os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402

from jaxrlhf.testing.compile_cache import ENV as _CACHE_ENV  # noqa: E402

# Tests compile the same tiny programs again and again (every run of a config, every resume, every
# xdist worker): one cache folder per test run, shared through the environment by the xdist workers
# and by the subprocesses tests start (jaxrlhf.testing.compile_cache.override), and removed at the
# end by the process that made it. Never the user's ~/.cache.
_made_cache = _CACHE_ENV not in os.environ
if _made_cache:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxrlhf-test-xla-")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="session")
def _plan_searches_in_the_test_cache():
    """In-process runs keep their plan searches (`run.planning.plan_cache_dir`) in the test run's cache
    folder too, as the CLI runs tests start do through `compile_cache.override()`, never in ~/.cache."""
    from jaxrlhf.run import planning

    kept = planning.plan_cache_dir
    planning.plan_cache_dir = lambda cfg: None if cfg.run.compile_cache is None else \
        os.path.join(os.environ[_CACHE_ENV], "plans")
    yield
    planning.plan_cache_dir = kept


def pytest_unconfigure(config):
    if _made_cache:
        shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
    return devs
