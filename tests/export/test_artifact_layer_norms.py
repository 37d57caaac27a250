"""Whatever opens an export to serve it runs ``ldlm verify-onnx``'s check first: each graph against the LayerNorm
specs its manifest records, and those specs against config.json's ``layer_norm_eps``. A manifest with one eps
edited from 1e-05 to 1e-06 is refused at start-up, by ``ldlm serve`` and by the Python service alike, with the
verifier's own message (the one ``ldlm verify-onnx`` prints), while the untouched copy serves. Engines are
opened only when the LayerNorms their build checked have the config's eps. Expected messages are written out
by hand, or taken from ``ldlm verify-onnx`` itself."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from ldlm.cli import main
from ldlm.export.artifact import ArtifactError, check_engine_dir, verified_by_caller
from ldlm.export.layernorm.verify import VerificationError
from ldlm.serve.api.service import LDLMService, ServerSettings
from ldlm.serve.runtime.backends import open_graphs
from scripts.harness.loopback import serve_command
from tests.artifacts import ENCODER_LN, edited_export, set_eps
from tests.servers import RunningServer, free_port, wait_ready

pytest.importorskip("onnxruntime", reason="an export is served on ONNX Runtime (pip install -e .[cpu])")

REFUSED_EPS = f"module {ENCODER_LN}: recorded eps 1e-06 != config.json's layer_norm_eps 1e-05 (compared as float32)"


def edit_spec_eps(directory: Path, module: str, eps: float) -> None:
    """Set the eps ``directory``'s manifest records for ``module``, as an edit by hand would."""
    manifest = json.loads((directory / "manifest.json").read_text())
    for entry in manifest["graphs"].values():
        for spec in entry["layer_norms"]:
            if spec["name"] == module:
                spec["eps"] = eps
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


@pytest.fixture
def tampered(export_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny export whose manifest says one encoder LayerNorm has eps 1e-06 (the graph has 1e-05)."""
    copy = tmp_path / "tampered"
    shutil.copytree(export_dir, copy)
    assert '"eps": 1e-05' in (copy / "manifest.json").read_text()
    edit_spec_eps(copy, ENCODER_LN, 1e-6)
    return copy


def verify_onnx_says(directory: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The lines ``ldlm verify-onnx`` prints for ``directory``'s failing encoder (it exits 1 on a failure)."""
    with pytest.raises(SystemExit) as failed:
        main(["verify-onnx", str(directory)])
    assert failed.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("FAILED encoder"))
    return [lines[start], *(line for line in lines[start + 1 :] if line.startswith("  - "))]


def test_the_service_refuses_a_manifest_eps_edit_with_the_verifiers_message(
    export_dir: Path, tampered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    untouched = tmp_path / "untouched"
    shutil.copytree(export_dir, untouched)
    running = RunningServer(LDLMService(str(untouched), ServerSettings(port=free_port())))
    try:
        assert httpx.get(f"{running.url}/v2/health/ready", timeout=30).status_code == 200
    finally:
        running.stop()
    said = verify_onnx_says(tampered, capsys)
    assert said[0] == "FAILED encoder: 6 LayerNormalization node(s), 6 expected"
    assert f"  - {REFUSED_EPS}" in said
    assert any(f"(module {ENCODER_LN}): epsilon 1e-05 != module eps 1e-06 (compared as float32)" in line for line in said)
    with pytest.raises(VerificationError) as refused:
        LDLMService(str(tampered), ServerSettings(port=free_port()))
    assert "\n".join(said) in str(refused.value)
    assert str(refused.value).startswith(f"{tampered / 'encoder.onnx'}: FAILED encoder")


def test_ldlm_serve_refuses_it_at_start_up(tampered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = verify_onnx_says(tampered, capsys)
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(serve_command(tampered, port), stdout=output, stderr=subprocess.STDOUT)
        try:
            with pytest.raises(RuntimeError, match="ldlm serve exited with 2 before it was ready"):
                wait_ready(process, f"http://127.0.0.1:{port}", timeout_s=120)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(30)
    text = log.read_text()
    assert f"ldlm serve: error: {tampered / 'encoder.onnx'}: FAILED encoder" in text, text
    assert "\n".join(said) in text


def test_specs_edited_to_match_an_edited_graph_fail_against_the_config(export_dir: Path, tmp_path: Path) -> None:
    """Graph and manifest agree on 1e-06 (sha256 rewritten too): only the config's eps can tell, and does."""
    edited = edited_export(export_dir, tmp_path / "edited", "encoder", set_eps(ENCODER_LN, 1e-6))
    edit_spec_eps(edited, ENCODER_LN, 1e-6)
    with pytest.raises(VerificationError) as refused:
        open_graphs("ort", edited)
    assert str(refused.value) == f"{edited / 'encoder.onnx'}: FAILED encoder: 6 LayerNormalization node(s), 6 expected\n  - {REFUSED_EPS}"


def test_a_verified_export_is_verified_again_once_its_manifest_changes(
    export_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export verified once in a process is not verified twice, but an edit made since is still found."""
    import ldlm.export.artifact as artifact

    copy = tmp_path / "onnx"
    shutil.copytree(export_dir, copy)
    monkeypatch.setattr(artifact, "_VERIFIED", set())  # what other tests verified in this process is forgotten
    verified: list[str] = []
    real = artifact.verify_onnx
    monkeypatch.setattr(artifact, "verify_onnx", lambda path, *args: verified.append(Path(path).name) or real(path, *args))
    open_graphs("ort", copy)
    open_graphs("ort", copy)
    assert sorted(verified) == ["decoder.onnx", "denoiser.onnx", "encoder.onnx"]
    edit_spec_eps(copy, ENCODER_LN, 1e-6)
    with pytest.raises(VerificationError, match=REFUSED_EPS.replace("(", r"\(").replace(")", r"\)")):
        open_graphs("ort", copy)


def test_a_diagnosing_caller_opens_it_and_verifies_it_itself(tampered: Path, tmp_path: Path) -> None:
    """``ldlm parity`` runs the verifier itself, against the checkpoint, and reports: inside ``verified_by_caller``
    the export opens with its files checked alone (an edited file is still refused), and only there."""
    with verified_by_caller():
        graphs, _, _ = open_graphs("ort", tampered)
        assert sorted(graphs) == ["decoder", "denoiser", "encoder"]
        edited = tmp_path / "edited"
        shutil.copytree(tampered, edited)
        (edited / "config.json").write_text((edited / "config.json").read_text().replace("1e-05", "1e-06", 1))
        with pytest.raises(ArtifactError, match=r"config\.json does not match the config_sha256"):
            open_graphs("ort", edited)
    with pytest.raises(VerificationError, match="FAILED encoder"):
        open_graphs("ort", tampered)


@pytest.fixture(scope="module")
def engines(export_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tensorrt_rtx", reason="engines are built with TensorRT-RTX (pip install -e .[rtx])")
    from ldlm.export.engine_builder import BuildOptions, build_engines
    from ldlm.export.profiles import EngineProfile, ShapeRange

    profiles = (EngineProfile(ShapeRange(1, 2, 4), ShapeRange(1, 16, 64)),)
    return build_engines(
        export_dir, tmp_path_factory.mktemp("engines") / "plans", BuildOptions(profiles=profiles), flavor="tensorrt_rtx"
    ).out


def test_engines_are_refused_when_their_builds_layer_norm_record_is_not_the_configs(engines: Path, tmp_path: Path) -> None:
    """Refused from the plan manifests before any plan is read, so this runs without a GPU."""
    record = json.loads((engines / "encoder.plan.json").read_text())
    assert record["layer_norms"] == 6 and {spec["eps"] for spec in record["layer_norm_specs"]} == {1e-05}
    copy = tmp_path / "plans"
    shutil.copytree(engines, copy)
    edited = {**record, "layer_norm_specs": [{**s, "eps": 1e-6} if s["name"] == ENCODER_LN else s for s in record["layer_norm_specs"]]}
    (copy / "encoder.plan.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError) as refused:
        open_graphs("trt", copy)
    assert str(refused.value) == f"{copy / 'encoder.plan.json'}: FAILED encoder:\n  - {REFUSED_EPS}\nrebuild with `ldlm build-engine`"
    with verified_by_caller():  # parity, which verifies the ONNX each plan was built from itself
        assert sorted(check_engine_dir(copy, ["encoder", "denoiser", "decoder"])) == ["decoder", "denoiser", "encoder"]
    del edited["layer_norm_specs"]  # a plan built before the record was kept
    (copy / "encoder.plan.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError, match=r"encoder\.plan\.json does not record the LayerNorms its build checked"):
        open_graphs("trt", copy)
