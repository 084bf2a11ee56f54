import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Under pytest-xdist (`make test`), torch's OpenMP threads sleep when idle instead of spinning (GNU
# OpenMP spins by default). Several test processes then share few cores, and spinning threads take
# CPU from the others (measured on 2 cores, test_dg_engine + test_job + test_memory_features under
# two workers: 92 s and 160 s of CPU spinning, 74-78 s and 128-137 s passive). One process alone
# (`TEST_WORKERS=0`) is faster spinning: the unit tier took 59 s against 62 s. Set here, before anything imports
# torch, so every process the tests start (Ray workers, rank processes, jobs) inherits it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class _SessionRay:
    """The local Ray cluster the tests that run the GPU job in this process share (`ray_cluster`):
    started before the first test that needs it, stopped when this process moves on to a module
    with no such test (an idle Ray, its agents and the pool's workers, costs 5-10% of a core for as
    long as it runs), started again if a later module needs it."""

    def __init__(self):
        self.running = False
        self.previous_pool: str | None = None

    def start(self) -> None:
        if self.running:
            return
        import ray

        from value_assets.core.warm_folder import POOL_ENV

        # Jobs in this process share one worker pool (gpu/workers/cluster.py `WorkerPool`): after the
        # first job of a shape, no worker process starts and nothing imports torch or megatron again.
        # Logical slots beyond the cores, so that a job with fresh workers (pool unset) fits beside the pool.
        self.previous_pool = os.environ.get(POOL_ENV)
        os.environ[POOL_ENV] = "tests"
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        self.running = True

    def stop(self) -> None:
        if not self.running:
            return
        import ray

        from value_assets.core.warm_folder import POOL_ENV

        self.running = False
        ray.shutdown()
        if self.previous_pool is None:
            os.environ.pop(POOL_ENV, None)
        else:
            os.environ[POOL_ENV] = self.previous_pool


SESSION_RAY = _SessionRay()
# Modules with a test that uses `ray_cluster` (filled at collection).
RAY_MODULES: set[str] = set()


def _module(item) -> str:
    """The test's module as its node id names it (tests/job/test_job.py)."""
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that runs the GPU job in this process; `start_workers`
    joins it instead of starting its own (it starts Ray only where none is initialized), and takes
    its workers from the session's worker pool.

    Running while this process is on a module that uses it (`_SessionRay`). (tests/dagster/
    test_dg_ray_multinode.py starts a cluster of its own with `ray start`, on free ports, so the two
    never meet.)"""
    SESSION_RAY.start()
    try:
        yield
    finally:
        SESSION_RAY.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of a module that uses the session's Ray (module fixtures train on it)."""
    if _module(item) in RAY_MODULES:
        SESSION_RAY.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a module that used the session's Ray, if the next module does not."""
    yield
    if SESSION_RAY.running and (nextitem is None or _module(nextitem) not in RAY_MODULES):
        SESSION_RAY.stop()


# The slowest modules, in the order they are handed out (measured with `--durations`; keep roughly
# in order). Under `make test` (pytest-xdist, a module per worker at a time) they go first, so the
# run does not end with one worker alone on a long module while the other idles. Those on the
# session's Ray (RAY_MODULES) come first and together: each worker then stops its Ray once, early
# (`_SessionRay`), instead of keeping it idle to the end or starting it again.
SLOW_MODULES = (
    "tests/job/test_faults.py",
    "tests/dagster/test_dg_ray_multinode.py",
    "tests/job/test_job.py",
    "tests/job/test_worker_pool.py",
    "tests/job/test_memory_job.py",
    "tests/dagster/test_dg_engine.py",
    "tests/dagster/test_dg_ui.py",
    "tests/dagster/test_dg_walkthrough.py",
    "tests/engine/test_distributed.py",
    "tests/job/test_warm_cluster.py",
    "tests/job/test_driver_ray.py",
    "tests/dagster/test_dg_pipeline.py",
    "tests/dagster/test_dg_promotion.py",
    "tests/dagster/test_dg_handoff.py",
    "tests/engine/test_memory_features.py",
    "tests/dagster/test_dg_champion.py",
    "tests/dagster/test_dg_cli.py",
    "tests/dagster/test_dg_executor.py",
    "tests/hf/test_miles_export.py",
    "tests/core/test_stats.py",
    "tests/hf/test_miles_megatron_load.py",
    "tests/engine/test_compat.py",
    "tests/core/test_rollouts_hf.py",
    "tests/hf/test_hf_parallel.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Slow modules first, each module's tests in their own order (a stable sort on the module)."""
    rank = {path: i for i, path in enumerate(SLOW_MODULES)}
    root = str(config.rootpath)

    def key(item):
        path = os.path.relpath(str(item.path), root)
        return rank.get(path, len(SLOW_MODULES))

    items.sort(key=key)
    RAY_MODULES.update(_module(item) for item in items if "ray_cluster" in item.fixturenames)


def pytest_sessionstart(session):
    """`make test-mcore-next` runs the GPU code paths against another megatron-core, put first on
    PYTHONPATH: refuse to run (rather than pass) when that is not the release imported."""
    expected = os.environ.get("VALUE_ASSETS_EXPECT_MEGATRON")
    if expected:
        import megatron.core

        if megatron.core.__version__.split("+")[0] != expected:  # 0.19.2+5f09eb5: a build tag
            raise pytest.UsageError(
                f"VALUE_ASSETS_EXPECT_MEGATRON={expected}, but megatron-core {megatron.core.__version__} "
                f"is imported from {megatron.core.__file__}"
            )
