"""The H200 latent benchmarks (``bench.head_gpu``, ``bench.recurrent_gpu``) run end to end
with ``--tiny`` (tiny models, CPU, float32) and write their JSON; no timing assertions. In
fp32 on the CPU the engine and the eager references agree token for token."""

import json


def test_head_gpu_tiny(tmp_path):
    from benchmarks.head_gpu import main

    out = tmp_path / "head.json"
    assert main([str(out), "--tiny", "--step-rounds", "2"]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["max_latent"] == 4 and res["config"]["use_stop"] is False
    assert res["config"]["step_rounds"] == 2
    shape = res["models"]["tiny"]
    for c in ("1", "4"):
        row = shape["concurrency"][c]
        assert row["tokens"] == int(c) * 4  # answer tokens only
        assert row["steps"]["latent"] >= 1
        assert row["speedup"] > 0
    cost = shape["step_cost"]
    assert cost["latent_steps"] == 4
    for k in ("latent_step_s", "plain_step_s", "bare_backbone_step_s"):
        assert cost[k] > 0
    assert cost["latent_step_over_floor"] == cost["latent_step_s"] / \
        cost["bandwidth_floor"]["floor_s"]
    # Two rounds of each phase; the reported step is their median (here: their mean).
    for k, name in (("latent", "latent_step_s"), ("plain", "plain_step_s"),
                    ("bare", "bare_backbone_step_s")):
        assert len(cost["rounds"][k]) == 2
        assert abs(cost[name] - sum(cost["rounds"][k]) / 2) < 1e-12
    assert shape["reference"]["agree_with_engine"] == 1.0


def test_recurrent_gpu_tiny(tmp_path):
    from benchmarks.recurrent_gpu import main

    out = tmp_path / "rec.json"
    assert main([str(out), "--tiny"]) == 0
    res = json.loads(out.read_text())
    assert set(res["models"]) == {"huginn-tiny", "ouro-tiny"}
    for m in res["models"].values():
        for run in m["depths"].values():
            for c, row in run["concurrency"].items():
                assert row["tokens"] == int(c) * 4
                assert row["decode_step_s"] > 0 and row["speedup"] > 0
                assert row["bandwidth_floor"]["floor_s"] > 0
            assert run["reference"]["agree_with_engine"] == 1.0
    huginn = res["models"]["huginn-tiny"]["depths"]
    # banks read per decode step: prelude 1 + depth x 2 core + coda 1
    assert huginn["2"]["concurrency"]["1"]["bandwidth_floor"]["kv_banks_read"] == 6
    assert huginn["4"]["concurrency"]["1"]["bandwidth_floor"]["kv_banks_read"] == 10


def test_host_bench_times_latent_and_plain_steps():
    """``bench.host --latent``: every timed step of the latent run is a latent step of the
    whole batch (it raises otherwise), the plain run decodes the same batch."""
    import torch

    from benchmarks.host import run_host_bench

    threads = torch.get_num_threads()  # the bench runs torch on one thread
    try:
        for kind in ("feedback", "head"):
            res = run_host_bench(batch=4, steps=6, prompt_len=8, latent=kind)
            assert res["latent_kind"] == kind and res["batch"] == 4
            for part in ("latent", "plain"):
                assert res[part]["steps"] == 5 and res[part]["step_us"] > 0
                assert res[part]["run_us"] > 0 and res[part]["latent_inputs_us"] > 0
        plain = run_host_bench(batch=4, steps=6, prompt_len=8)
        assert plain["steps"] == 5 and plain["postprocess_us"] > 0
    finally:
        torch.set_num_threads(threads)


def test_time_replays_warms_up_then_times_the_replays_between_two_events(monkeypatch):
    """``device_common.time_replays`` on the CPU with the CUDA events stood in: the warm-up
    replays run before the first event, the timed ones between the two, and the result is
    the events' elapsed time per timed replay in microseconds."""
    import torch

    from latentserve.bench.device_common import time_replays

    log = []

    class Event:
        def __init__(self, timing):
            assert timing is True

        def record(self):
            log.append("event")

        def elapsed_time(self, other):  # milliseconds, as CUDA events give them
            return 6.0

    class Graph:
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    assert time_replays(Graph(), replays=3, warmup=2) == 6.0 * 1e3 / 3
    assert log == ["replay"] * 2 + ["sync", "event"] + ["replay"] * 3 + ["event", "sync"]


def test_probe_times_each_replay_and_overlap_wait_under_its_step_kind(monkeypatch):
    """``drive.Probe`` on the CPU with CUDA events and graphs stood in: each replay's event
    time goes to the kind set when it ran, a decode step's quick wait for its launched step
    counts as host-bound, and on exit the graphs' methods and ``overlap.finish`` are the
    originals again."""
    import torch

    from latentserve.bench.drive import Probe
    from latentserve.engine import overlap

    now = [0.0]  # milliseconds on the stand-in device clock

    class Event:
        def __init__(self, timing):
            self.t = None

        def record(self):
            self.t = now[0]

        def elapsed_time(self, other):
            return other.t - self.t

    class Graphs:
        def replay(self, ms):
            now[0] += ms

        def replay_packed(self, ms):
            now[0] += ms

    class Launched:
        class event:  # noqa: N801 - stands in for a torch.cuda.Event instance
            @staticmethod
            def synchronize():
                pass

    engine = type("Engine", (), {})()
    engine.runner = type("Runner", (), {"graphs": Graphs()})()
    finished = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(overlap, "finish", lambda e, launched: finished.append(launched))
    real_finish = overlap.finish
    with Probe(engine) as probe:
        probe.kind = "latent"
        engine.runner.graphs.replay(5.0)
        probe.kind = "decode"
        engine.runner.graphs.replay(2.0)
        engine.runner.graphs.replay_packed(4.0)
        overlap.finish(engine, Launched)
    assert probe.summary()["replay_s"] == {"latent": 5e-3, "decode": 3e-3}
    assert probe.summary()["host_bound_frac"] == 1.0 and finished == [Launched]
    assert overlap.finish is real_finish
    assert "replay" not in engine.runner.graphs.__dict__
