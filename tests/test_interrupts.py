"""Ctrl-C is not lost where Python drops it (ldlm.interrupts).

CI once saw `ldlm serve CHECKPOINT` take SIGINT inside an import lock's weakref callback: Python printed
"Exception ignored", the export went on, and the server started. These tests drop a KeyboardInterrupt
the same way, inside a weakref callback, and check that the long jobs stop at their next stage.
"""

from __future__ import annotations

import signal
import sys
import weakref
from pathlib import Path

import pytest

from ldlm import interrupts


class Droppable:
    """An object whose weakref callback raises SIGINT in this process: the KeyboardInterrupt is raised
    inside the callback, where Python reports it as unraisable and carries on."""


def drop_a_ctrl_c() -> None:
    thing = Droppable()

    def callback(_: object) -> None:
        signal.raise_signal(signal.SIGINT)
        sum(range(100))  # bytecode after the signal, so its handler runs inside this callback

    ref = weakref.ref(thing, callback)
    del thing  # the callback runs here, and the KeyboardInterrupt does not come out of it
    assert ref() is None


def test_a_ctrl_c_python_drops_is_raised_at_the_next_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    printed: list[BaseException | None] = []  # what Python's hook would print as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: printed.append(unraisable.exc_value))
    with interrupts.remembered_interrupts():
        assert not interrupts.interrupted()
        drop_a_ctrl_c()  # Python drops it: the case in question
        assert interrupts.interrupted()
        assert printed == []  # not printed: `ldlm serve` says "interrupted" in one line
        weakref.finalize(Droppable(), lambda: 1 / 0)  # anything else unraisable is still printed
        assert [type(e) for e in printed] == [ZeroDivisionError]
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_interrupted()
    assert not interrupts.interrupted()  # forgotten with the block, and the previous handler is back
    assert signal.getsignal(signal.SIGINT) is not interrupts._on_sigint


def test_the_export_stops_at_its_next_stage_and_leaves_nothing(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ldlm.export import onnx_export

    exported: list[str] = []
    real_export_graph = onnx_export.export_graph

    def export_graph_then_drop_a_ctrl_c(io, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_export_graph(io, path, *args, **kwargs)
        exported.append(path.name)
        drop_a_ctrl_c()

    monkeypatch.setattr(onnx_export, "export_graph", export_graph_then_drop_a_ctrl_c)
    out = tmp_path / "onnx"
    with interrupts.remembered_interrupts(), pytest.raises(KeyboardInterrupt):
        onnx_export.export_graphs(tiny_checkpoint, out)
    assert exported == ["encoder.onnx"]  # stopped before verifying it, and before the next graph
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory


@pytest.mark.parametrize("where", ["raised into TensorRT", "dropped by Python"])
def test_an_engine_build_stops_at_a_ctrl_c_in_its_progress_callback(
    where: str, export_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorRT calls the progress monitor from C++. A KeyboardInterrupt raised into it fails the build
    (it returns no plan), and one Python dropped leaves TensorRT building: the monitor's next step then
    returns False, which cancels the build. Either way build_engines reports the Ctrl-C, not a failed
    build, and leaves nothing."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX builds engines without a GPU; it is not installed")
    from ldlm.export import engine

    steps: list[str] = []
    real_progress = engine.BuildProgress

    def interrupting_progress(trt, label):  # type: ignore[no-untyped-def]
        monitor = real_progress(trt, label)
        real_step = monitor.step_complete

        def step_complete(phase_name: str, step: int) -> bool:
            steps.append(phase_name)
            if len(steps) == 1 and where == "raised into TensorRT":
                signal.raise_signal(signal.SIGINT)  # handled inside this callback, called from TensorRT
            elif len(steps) == 1:
                drop_a_ctrl_c()
            return real_step(phase_name, step)

        monitor.step_complete = step_complete
        return monitor

    monkeypatch.setattr(engine, "BuildProgress", interrupting_progress)
    out = tmp_path / "engines"
    with interrupts.remembered_interrupts(), pytest.raises(KeyboardInterrupt):
        engine.build_engines(export_dir, out, graphs=["encoder"], flavor="tensorrt_rtx", progress=True)
    assert len(steps) <= 2  # TensorRT called the monitor, and stopped at the step that saw the Ctrl-C
    assert list(tmp_path.iterdir()) == []


def test_serve_does_not_start_after_a_ctrl_c_dropped_while_preparing(
    export_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The case CI saw: Ctrl-C while `ldlm serve` prepared the service, dropped by Python. Preparing
    ends, and the server must not then start."""
    from ldlm.serve.api import server
    from ldlm.serve.api.service import LDLMService, ServerSettings

    started: list[str] = []

    def prepare_and_drop_a_ctrl_c(*args, **kwargs):  # type: ignore[no-untyped-def]
        service = LDLMService(*args, **kwargs)
        drop_a_ctrl_c()
        return service

    monkeypatch.setattr(server, "LDLMService", prepare_and_drop_a_ctrl_c)
    monkeypatch.setattr(server.GracefulServer, "run", lambda self, sockets: started.append("serving"))
    with interrupts.remembered_interrupts(), pytest.raises(KeyboardInterrupt):
        server.serve(str(export_dir), ServerSettings(port=0), log_level="warning")
    assert started == []
    assert "ldlm serving" not in capsys.readouterr().out
