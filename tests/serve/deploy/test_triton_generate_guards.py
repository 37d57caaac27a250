"""The deployment entry points' guards, each bound at its edge: Triton's ``ldlm_generate`` (its
inputs, limits and BLS chunking, with a stand-in for Triton's Python-backend module whose models
return zeros, so only the guards and the plumbing run) and Ray Serve's ``RayOptions``."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from ldlm.model.config import preset
from tests import REPO

ROOT = REPO


class PbUtils(types.ModuleType):
    """The slice of triton_python_backend_utils that ldlm_generate uses. BLS calls are recorded
    (model, batch) and answered with zeros: latents = 0, x0_hat = 0, token_ids = 383 (" The")."""

    def __init__(self) -> None:
        super().__init__("triton_python_backend_utils")
        self.calls: list[tuple[str, int]] = []
        utils = self

        class Tensor:
            def __init__(self, name, array):
                self._name, self._array = name, array

            def name(self):
                return self._name

            def as_numpy(self):
                return self._array

        class TritonError:
            INTERNAL, INVALID_ARG = "INTERNAL", "INVALID_ARG"  # the Python backend's codes (strings here)

            def __init__(self, message, code=INTERNAL):
                self._message, self._code = message, code

            def message(self):
                return self._message

            def code(self):
                return self._code

        class InferenceResponse:
            def __init__(self, output_tensors=None, error=None):
                self.output_tensors, self._error = output_tensors or [], error

            def has_error(self):
                return self._error is not None

            def error(self):
                return self._error

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names):
                self.model_name, self.inputs = model_name, {t.name(): t.as_numpy() for t in inputs}

            def exec(self):
                first = next(iter(self.inputs.values()))
                utils.calls.append((self.model_name, len(first)))
                if self.model_name == "denoiser":
                    return InferenceResponse([Tensor("x0_hat", np.zeros_like(self.inputs["x_t"]))])
                if self.model_name == "encoder":
                    ids = self.inputs["input_ids"]
                    return InferenceResponse([Tensor("latents", np.zeros((*ids.shape, preset("tiny").d_model), np.float32))])
                n, length = self.inputs["attention_mask"].shape
                return InferenceResponse([Tensor("token_ids", np.full((n, length), 383, np.int64))])

        self.Tensor, self.TritonError, self.InferenceResponse, self.InferenceRequest = (
            Tensor,
            TritonError,
            InferenceResponse,
            InferenceRequest,
        )

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.get(name)

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return next(t for t in response.output_tensors if t.name() == name)


@pytest.fixture
def generate_model(tmp_path: Path, monkeypatch):
    """ldlm_generate's model.py, initialized on the tiny config with the given parameters."""
    pb = PbUtils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("ldlm_generate_under_test", ROOT / "serve" / "deploy" / "triton_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "1").mkdir()
    preset("tiny").save(tmp_path / "1" / "config.json")

    def make(**parameters: str):
        model = module.TritonPythonModel()
        config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
        model.initialize({"model_repository": str(tmp_path), "model_version": "1", "model_config": json.dumps(config)})
        return model

    return make, pb


def inputs(pb: PbUtils, **values) -> dict:
    tensors = {}
    for name, value in values.items():
        array = (
            np.array([value.encode()], dtype=np.object_)
            if isinstance(value, str)
            else np.array([value], dtype=np.float32 if isinstance(value, float) else np.int64)
        )
        tensors[name] = pb.Tensor(name, array)
    return tensors


def test_generate_refuses_each_input_outside_its_range(generate_model) -> None:
    make, pb = generate_model
    model = make(max_n="4", max_steps="5")
    good = {"N": 1, "LENGTH": 4, "STEPS": 1, "SEED": 0, "SAMPLER": "ddim"}
    for changes, message in (
        ({"N": 0}, "N=0 is out of range; allowed: 1..4"),
        ({"N": 5}, "N=5 is out of range; allowed: 1..4"),
        ({"LENGTH": 0}, "LENGTH=0 is out of range; allowed: 1..128"),
        ({"LENGTH": 129}, "LENGTH=129 is out of range; allowed: 1..128"),
        ({"STEPS": 0}, "STEPS=0 is out of range; allowed: 1..5"),
        ({"STEPS": 6}, "STEPS=6 is out of range; allowed: 1..5"),
        ({"SAMPLER": "euler"}, "SAMPLER='euler' is unknown; allowed: sde, ddim, dpm2m, dpm3m, dpm3m-psc, dpm3m-psc-unic"),
        ({"T_MIN": 1.0}, "T_MIN=1.0 is out of range; allowed: a number in (0, 1), both ends excluded"),
        ({"PRIOR_TEMPERATURE": 1.5}, "PRIOR_TEMPERATURE=1.5 is out of range; allowed: a number in (0, 1]"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            model.generate(inputs(pb, **{**good, **changes}))
    for name in ("N", "LENGTH"):
        with pytest.raises(ValueError, match=f"input {name} is required"):
            model.generate(inputs(pb, **{k: v for k, v in good.items() if k != name}))
    # STEPS left out is resolve's default (the config's 21 for ddim here), refused above this model's max_steps, not cut
    with pytest.raises(
        ValueError,
        match=re.escape("STEPS was not given, and the default for sampler ddim is 21 steps, which is out of range; allowed: 1..5"),
    ):
        model.generate(inputs(pb, **{k: v for k, v in good.items() if k != "STEPS"}))
    assert pb.calls == []  # nothing reached the graphs


def test_generate_takes_each_limit_itself_and_chunks_bls_calls(generate_model) -> None:
    make, pb = generate_model
    model = make(max_n="7", max_steps="3", bls_max_batch="3")
    result = model.generate(inputs(pb, N=7, LENGTH=128, STEPS=3, SEED=1, SAMPLER="dpm2m"))
    assert result.texts == [" The" * 128] * 7 and result.token_ids.shape == (7, 128)
    assert pb.calls == [("denoiser", 3), ("denoiser", 3), ("denoiser", 1)] * 3 + [("decoder", 3), ("decoder", 3), ("decoder", 1)]


def test_generate_defaults_without_parameters(generate_model) -> None:
    """A repository without the parameters: 64 samples, 1000 steps, one BLS call per step; SEED,
    SAMPLER and T_MIN optional (the config's defaults)."""
    make, pb = generate_model
    model = make()
    assert (model.limits.max_n, model.limits.max_steps, model.bls_max_batch) == (64, 1000, None)
    result = model.generate(inputs(pb, N=64, LENGTH=1, STEPS=2))
    assert len(result.texts) == 64 and pb.calls == [("denoiser", 64)] * 2 + [("decoder", 64)]
    with pytest.raises(ValueError, match=re.escape("N=65 is out of range; allowed: 1..64")):
        model.generate(inputs(pb, N=65, LENGTH=1, STEPS=2))


def test_one_bad_request_gets_its_error_and_the_others_their_answers(generate_model) -> None:
    make, pb = generate_model
    model = make(max_n="2", max_steps="2")
    bad, good = inputs(pb, N=3, LENGTH=2, STEPS=1), inputs(pb, N=2, LENGTH=2, STEPS=1)
    responses = model.execute([bad, good, bad])
    assert [r.has_error() for r in responses] == [True, False, True]
    assert responses[0].error().message() == "N=3 is out of range; allowed: 1..2"
    assert responses[0].error().code() == pb.TritonError.INVALID_ARG  # Triton answers it 400, not 500
    texts, ids, plan = (t.as_numpy() for t in responses[1].output_tensors)
    assert texts.tolist() == [b" The The"] * 2 and ids.dtype == np.int64 and ids.shape == (2, 2)
    assert json.loads(plan[0])["steps"] == 1


def test_prompt_and_grid_refusals_are_invalid_arguments_before_any_graph_runs(generate_model) -> None:
    """/v1/generate's words for a prompt that leaves no room and for a blank one (serve/api/prompted.py), resolve's
    for an unknown grid; each INVALID_ARG (Triton's 400). A prompt that fits is encoded once and comes back first."""
    make, pb = generate_model
    model = make(max_n="2", max_steps="2")
    good = {"N": 1, "LENGTH": 3, "STEPS": 1}
    for changes, message in (
        ({"PROMPT": " The The The"}, "the prompt is 3 tokens long; allowed: 1..2 tokens (fewer than length=3)"),
        ({"PROMPT": "  "}, "prompt='  ' is blank; allowed: text with a non-space character, or \"\" for none"),
        ({"GRID": "zigzag"}, "grid='zigzag' is unknown; allowed: "),
        ({"PROMPT_STRENGTH": 5.0}, "PROMPT_STRENGTH=5.0 is out of range; allowed: a number in [0, 4]"),
    ):
        (response,) = model.execute([inputs(pb, **good, **changes)])
        assert message in response.error().message() and response.error().code() == pb.TritonError.INVALID_ARG, changes
    assert pb.calls == []
    (response,) = model.execute([inputs(pb, **good, PROMPT=" Hello")])
    texts, ids, _ = (t.as_numpy() for t in response.output_tensors)
    assert ids[0, 0] == 18435 and texts[0] == b" Hello The The"  # " Hello" verbatim, then the stand-in's tokens
    assert pb.calls == [("encoder", 1), ("denoiser", 1), ("decoder", 1)]


def test_the_model_loads_where_ssl_cannot(tmp_path: Path) -> None:
    """The Python embedded in Triton's backend stub (nvidia-pytriton's) cannot load ``ssl``; a module the model
    imports that needs it unguarded (prometheus_client, through the service) fails the model's load there. In a
    child Python with ssl unloadable, the model file imports."""
    import subprocess

    (tmp_path / "triton_python_backend_utils.py").write_text("")
    script = (
        "import sys, importlib.util\n"
        "class NoSsl:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in ('ssl', '_ssl'):\n"
        "            raise ImportError('ssl is unloadable here, as in the stub')\n"
        "sys.meta_path.insert(0, NoSsl())\n"
        f"spec = importlib.util.spec_from_file_location('model', {str(ROOT / 'serve' / 'deploy' / 'triton_generate.py')!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_an_edited_tokenizer_in_the_repository_is_refused(generate_model, tmp_path: Path) -> None:
    import hashlib

    make, _ = generate_model
    tokenizer = tmp_path / "1" / "tokenizer.json"
    from ldlm.model.tokenizer import TextTokenizer

    TextTokenizer.gpt2().save(tokenizer.parent)
    found = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    assert make(tokenizer_sha256=found).pipeline.tokenizer.encode([" The"]) == [[383]]  # the recorded file loads
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            f"{tokenizer} has sha256 {found}, but config.pbtxt's tokenizer_sha256 is {'1' * 64}; "
            "rewrite the repository with `ldlm triton-repo`"
        ),
    ):
        make(tokenizer_sha256="1" * 64)
    with pytest.raises(RuntimeError, match=re.escape("but config.pbtxt's tokenizer_sha256 is None")):
        make()  # a tokenizer.json that config.pbtxt has no record of


def test_a_failed_bls_call_names_the_model(generate_model, monkeypatch) -> None:
    make, pb = generate_model
    model = make()
    monkeypatch.setattr(pb.InferenceRequest, "exec", lambda self: pb.InferenceResponse(error=pb.TritonError("out of memory")))
    with pytest.raises(RuntimeError, match="BLS call to denoiser failed: out of memory"):
        model.generate(inputs(pb, N=1, LENGTH=2, STEPS=1))


# --- Ray Serve options ------------------------------------------------------------------------------


def test_ray_options_at_their_edges() -> None:
    ray_app = pytest.importorskip("ldlm.serve.deploy.ray_app", reason="Ray Serve is the optional extra (pip install -e .[ray])")
    RayOptions = ray_app.RayOptions
    for name, low, high in (("replicas", 1, 4096), ("max_ongoing_requests", 1, 1 << 16), ("max_queued_requests", 1, 1 << 20)):
        assert getattr(RayOptions(**{name: low}), name) == low and getattr(RayOptions(**{name: high}), name) == high
        for bad in (low - 1, high + 1):
            with pytest.raises(ValueError, match=re.escape(f"{name}={bad} is out of range; allowed: {low}..{high}")):
                RayOptions(**{name: bad})
    assert RayOptions(replicas=1, min_replicas=0, max_replicas=1).autoscaling  # scale to zero is allowed
    assert RayOptions(replicas=4, min_replicas=4, max_replicas=4).deployment_options()["autoscaling_config"]["initial_replicas"] == 4
    for low, replicas, high in ((2, 1, 4), (1, 5, 4), (-1, 1, 4)):
        with pytest.raises(
            ValueError, match=re.escape(f"autoscaling needs 0 <= min_replicas ({low}) <= replicas ({replicas}) <= max_replicas ({high})")
        ):
            RayOptions(replicas=replicas, min_replicas=low, max_replicas=high)
    with pytest.raises(ValueError, match="min_replicas and max_replicas go together"):
        RayOptions(max_replicas=3)
    with pytest.raises(ValueError, match=re.escape("target_ongoing_requests=0 is out of range; allowed: > 0")):
        RayOptions(target_ongoing_requests=0)
    with pytest.raises(ValueError, match=re.escape("num_cpus=1.0 and num_gpus=-0.5 must be >= 0")):
        RayOptions(num_gpus=-0.5)
    assert RayOptions(num_cpus=0, num_gpus=0.25).deployment_options() == {
        "max_ongoing_requests": 64,
        "max_queued_requests": 1024,
        "ray_actor_options": {"num_cpus": 0, "num_gpus": 0.25},
        "num_replicas": 1,
    }
    assert RayOptions(replicas=3, min_replicas=1, max_replicas=5, target_ongoing_requests=2.5).deployment_options() == {
        "max_ongoing_requests": 64,
        "max_queued_requests": 1024,
        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0},
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 5, "initial_replicas": 3, "target_ongoing_requests": 2.5},
    }
    assert ray_app._typed(RayOptions, {"replicas": "2", "num_gpus": "0"}) == {"replicas": 2, "num_gpus": 0.0}
    assert [ray_app._parse("flag", word, bool) for word in ("true", "FALSE", " 1 ", "0")] == [True, False, True, False]
    assert ray_app.parse_autoscale(" 2 : 8 ") == (2, 8)
    with pytest.raises(ValueError, match=re.escape("autoscale '2:' is not MIN:MAX replicas")):
        ray_app.parse_autoscale("2:")
