"""The pytest fixture for the DaskRunner tests: a loopback cluster (bench/dask_cluster.py,
shared with the scale benchmark's Dask drills).

    from tests.dask_cluster import dask_cluster  # noqa: F401  (the fixture)

    def test_x(dask_cluster):
        opts = dask_cluster.options()  # ["--dask_client_address=tcp://127.0.0.1:PORT"]
"""

from __future__ import annotations

import pytest

from bench.dask_cluster import DaskCluster, free_port, start_cluster, stop_process  # noqa: F401  (re-exported)


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """A scheduler and two one-thread worker processes (each under a nanny) on loopback,
    shared by a test module (the workers' imports and engines are paid for once)."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("dask-logs"))
    except RuntimeError as err:
        pytest.fail(str(err))
    yield cluster
    cluster.stop()
