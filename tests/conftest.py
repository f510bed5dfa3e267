"""Test harness: 8 simulated CPU devices, set before any JAX backend starts, and one persistent
compilation cache for the whole test run."""

import gc
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Tests run tiny models, so their time is XLA's compile time. Optimisation level 0 skips most of LLVM's
# passes (a tiny PPO run: 45 s -> 25 s of CPU); the CPU backend's older fusion emitters compile in about
# 60 % of the time of its MLIR fusion emitters (the same run, nothing cached: 32 -> 18-22 s of CPU, the
# slow tier 2,020 -> 1,190 s). Neither changes the HLO, only how fast the code runs and how floats are
# contracted; and code without FMA instructions (`max_isa=AVX`, no slower here) rounds every product
# as written, so two programs of the same arithmetic agree to the bit whatever their fusions (tests
# assert such equalities; the older emitters contract products into FMAs where the newer did not). Set
# for this process and every process a test starts (they inherit the environment), so runs compared
# with each other are compiled alike.
_FLAGS_ENV = "JAXRLHF_TEST_XLA_FLAGS"
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_max_isa=AVX")


def _test_xla_flags() -> str:
    """The flags above that this jaxlib knows (XLA aborts on an unknown flag, and the emitter flag is
    recent), probed once in a subprocess and handed to xdist workers through the environment."""
    if _FLAGS_ENV not in os.environ:
        flags = [_FAST_COMPILE[0]]
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                               env=dict(os.environ, XLA_FLAGS=" ".join(_FAST_COMPILE)), capture_output=True)
        if probe.returncode == 0:
            flags = list(_FAST_COMPILE)
        os.environ[_FLAGS_ENV] = " ".join(flags)
    return os.environ[_FLAGS_ENV]


os.environ["XLA_FLAGS"] = _test_xla_flags()

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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_file():
    """XLA:CPU maps each compiled kernel into memory (three mappings per object), and JAX's in-memory
    caches keep alive every program a worker compiled: over the slow tier a worker passed 31,000
    mappings, and workers died inside XLA's compile or serialize (segfault, abort), most likely at the
    kernel's vm.max_map_count (65,530 by default). Dropping JAX's caches after each file frees them; the
    persistent cache above reloads what a later file compiles again."""
    yield
    jax.clear_caches()
    gc.collect()


# The slow tier's heaviest files, by worker-seconds measured on the 2-core machine (180 s down to 40 s),
# handed out first, the two largest multi-process files apart (their processes then rarely share the
# cores with each other's): pytest-xdist gives each worker whole files in collection order (pyproject's
# addopts: --no-loadscope-reorder; its default order is by test count, which put the 2-test
# multi-process file, 90 s, near the end), and a long file handed out last keeps the other worker idle
# until it ends.
HEAVIEST_FIRST = (
    "tests/multihost/test_multihost.py", "tests/algorithms/test_end_to_end.py", "tests/multihost/test_faults.py",
    "tests/test_train.py", "tests/test_partial_rollouts.py", "tests/algorithms/test_learning.py",
    "tests/test_reliability.py", "tests/multihost/test_multihost_stream.py", "tests/algorithms/test_environments.py",
    "tests/algorithms/test_evaluation.py", "tests/models/test_families.py", "tests/models/test_continuous.py",
    "tests/test_profile_cli.py", "tests/test_replan.py", "tests/algorithms/test_moe_training.py",
    "tests/test_pipeline.py", "tests/test_bench_scripts.py", "tests/models/test_context_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files keep their order


def pytest_unconfigure(config):
    if _made_cache:
        shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
    return devs
