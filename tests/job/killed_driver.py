"""A job driver that starts its own local Ray and a worker, prints every process it started, then
waits to be killed (for test_faults' SIGKILL test)."""

import json
import time

import psutil

from value_assets.core.backbone import BackboneConfig
from value_assets.core.job_configs import PLACEMENT_STRATEGY, TIMEOUT_S
from value_assets.core.memory import Layout
from value_assets.core.objective import Objective
from value_assets.core.worker_spec import WorkerSpec
from value_assets.gpu.workers.cluster import start_workers

spec = WorkerSpec(backbone=BackboneConfig.tiny(), objective=Objective(), layout=Layout(), seed=0)
with start_workers(spec, timeout_s=TIMEOUT_S, placement_strategy=PLACEMENT_STRATEGY, log=lambda _m: None):
    started = {}
    for proc in psutil.Process().children(recursive=True):
        try:  # Ray's short-lived helpers may end between the listing and the read
            started[proc.pid] = proc.name()
        except psutil.NoSuchProcess:
            pass
    print(json.dumps(started), flush=True)
    time.sleep(600)
