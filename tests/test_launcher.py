"""The local launcher's worker start: fork-server reuse only with the same import-time environment,
and each worker running in the launcher's environment plus its own per-rank variables."""

import os

import agoq.train.forkserver as forkserver


def test_a_fork_server_is_reused_only_with_the_environment_it_imported_under(monkeypatch):
    monkeypatch.setattr(forkserver, "_forkserver_env", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert forkserver.start_method() == "forkserver"  # the first launch starts it
    monkeypatch.setenv("SOMETHING_READ_AT_RUN_TIME", "x")
    assert forkserver.start_method() == "forkserver"  # workers adopt such variables themselves
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read when torch is imported: the server has the old one
    assert forkserver.start_method() == "spawn"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert forkserver.start_method() == "forkserver"


def test_a_worker_adopts_the_launcher_environment_and_keeps_its_rank_variables(monkeypatch):
    server = {"PATH": os.environ.get("PATH", ""), "STALE": "from the first launch", "AGOQ_QUANT_BACKEND": "torch"}
    monkeypatch.setattr(forkserver, "_ENV_AT_IMPORT", dict(server))
    worker = {**server, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}  # the elastic agent's per-rank set
    launcher = {"PATH": server["PATH"], "AGOQ_QUANT_BACKEND": "compiled", "NEW": "this launch"}
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(worker)
        forkserver.adopt_launcher_env(launcher)
        assert dict(os.environ) == {**launcher, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_the_fork_server_started_early_serves_the_launch_that_follows(monkeypatch):
    # agoq train starts it before importing torch, held to AVX2 here (the case whose cache folder
    # agoq train sets first, agoq.cli.main): the launch must then find the same import-time
    # variables and fork from it.
    import multiprocessing.forkserver

    from agoq.inductor_cache import use_capability_cache

    started = []
    monkeypatch.setattr(forkserver, "_forkserver_env", None)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: started.append(dict(os.environ)))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    for name in ("TORCHELASTIC_RUN_ID", "RANK", *forkserver.local_worker_env()):
        monkeypatch.delenv(name, raising=False)
    use_capability_cache()
    forkserver.start_early()
    assert len(started) == 1
    server_env = started[0]
    assert server_env[forkserver.LOOPBACK_ENV] == "1"  # the workers' variables were in the server's environment
    assert forkserver.LOOPBACK_ENV not in os.environ  # and only there
    assert server_env["TORCHINDUCTOR_CACHE_DIR"].endswith(os.sep + "aten-cpu-capability-avx2")
    # The launch (agoq.train.run._launch_local) sets the workers' variables and asks how to start them.
    with forkserver.workers_environment():
        assert forkserver.start_method() == "forkserver"
    forkserver.start_early()  # a second launch in this process starts nothing more
    assert len(started) == 1


def test_no_fork_server_is_started_under_torchrun(monkeypatch):
    import multiprocessing.forkserver

    started = []
    monkeypatch.setattr(forkserver, "_forkserver_env", None)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: started.append(True))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    forkserver.start_early()
    assert started == [] and forkserver._forkserver_env is None
