"""The code location test_dg_postgres.py serves: the real graph, jobs, sensor and `local` resources
of value_assets.definitions, with the in-process executor. A run is then one process instead of one
per step; on a 2-core CI machine the step processes cost more than the steps. Pools apply alike."""

from dagster import in_process_executor

from value_assets.definitions import deployment_name, make_definitions, resources_by_deployment_name

defs = make_definitions(resources_by_deployment_name()[deployment_name()], executor=in_process_executor)
