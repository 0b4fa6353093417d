"""The local launcher's worker start: fork-server reuse only with the same import-time environment,
and each worker running in the launcher's environment plus its own per-rank variables."""

import os

import agoq.train.run as run


def test_a_fork_server_is_reused_only_with_the_environment_it_imported_under(monkeypatch):
    monkeypatch.setattr(run, "_forkserver_env", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run._start_method() == "forkserver"  # the first launch starts it
    monkeypatch.setenv("SOMETHING_READ_AT_RUN_TIME", "x")
    assert run._start_method() == "forkserver"  # workers adopt such variables themselves
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read when torch is imported: the server has the old one
    assert run._start_method() == "spawn"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run._start_method() == "forkserver"


def test_a_worker_adopts_the_launcher_environment_and_keeps_its_rank_variables(monkeypatch):
    server = {"PATH": os.environ.get("PATH", ""), "STALE": "from the first launch", "AGOQ_QUANT_BACKEND": "torch"}
    monkeypatch.setattr(run, "_ENV_AT_IMPORT", dict(server))
    worker = {**server, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}  # the elastic agent's per-rank set
    launcher = {"PATH": server["PATH"], "AGOQ_QUANT_BACKEND": "compiled", "NEW": "this launch"}
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(worker)
        run._adopt_launcher_env(launcher)
        assert dict(os.environ) == {**launcher, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
