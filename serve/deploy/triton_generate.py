"""Triton Python-backend model ``ldlm_generate``: /v1/generate's generation, calling the ``encoder``,
``denoiser`` and ``decoder`` models of the same repository through BLS.

``ldlm triton-repo`` copies this file to ``ldlm_generate/1/model.py``. Nothing of the generation is
copied: the model is an ``LDLMPipeline`` whose three graphs are BLS calls (``BLSGraphs``), so a request
is resolved by ``ldlm.sampling.resolve`` (limits: config.pbtxt's ``max_n`` and ``max_steps``), a prompt
is checked and encoded as /v1/generate does it (``ldlm.serve.api.prompted.prompt_prefix``), and the
sampling runs the one sampling engine with our runner's per-sample noise streams: a seed gives the
runner's tokens. The ``ldlm`` package must be importable in Triton's Python environment (see docs/scale-out.md).

Inputs and outputs: ``ldlm.serve.api.kserve_models.GENERATE_INPUTS`` and ``GENERATE_OUTPUTS``, each input
/v1/generate's field of the same name (N, LENGTH, STEPS, SEED, SAMPLER, T_MIN, PRIOR_TEMPERATURE, GRID,
PROMPT, PROMPT_STRENGTH; one value each, only N and LENGTH required), the outputs its answer (TEXTS [N],
TOKEN_IDS [N, LENGTH], PLAN: the plan that ran, as JSON). A refused request is answered with Triton's
INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT) and the message /v1/generate's checks give, under the input's name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend
from torch import Tensor

from ldlm.limits import MAX_N, MAX_STEPS
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline, TextResult, keep_prompt
from ldlm.sampling import GenerateRequest, RequestLimits, resolve
from ldlm.sampling.tuned_grids import load_schedules
from ldlm.serve.api.errors import error_status
from ldlm.serve.api.kserve_models import GENERATE_INPUTS, GENERATE_NAMES
from ldlm.serve.api.prompted import prompt_prefix


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        version_dir = Path(args["model_repository"]) / args["model_version"]
        parameters = json.loads(args["model_config"]).get("parameters", {})
        limits = {key: parameters.get(key, {}).get("string_value") for key in ("max_n", "max_steps", "bls_max_batch")}
        self.limits = RequestLimits(int(limits["max_n"] or MAX_N), int(limits["max_steps"] or MAX_STEPS))
        # The graphs' max_batch_size: larger N runs in BLS calls of this many samples (without the parameter: one call per step).
        self.bls_max_batch = int(limits["bls_max_batch"]) if limits["bls_max_batch"] else None
        config = LDLMConfig.load(version_dir / "config.json")
        tokenizer = version_dir / "tokenizer.json"
        if tokenizer.is_file():
            # `ldlm triton-repo` wrote its sha256 into config.pbtxt: an edited tokenizer would change every text
            expected = parameters.get("tokenizer_sha256", {}).get("string_value")
            found = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
            if found != expected:
                raise RuntimeError(
                    f"{tokenizer} has sha256 {found}, but config.pbtxt's tokenizer_sha256 is {expected}; "
                    "rewrite the repository with `ldlm triton-repo`"
                )
        texts = TextTokenizer.from_directory(version_dir) if tokenizer.is_file() else TextTokenizer.gpt2()
        # the export's tuned grids, copied by `ldlm triton-repo`: the defaults where tuned, as in ldlm serve
        self.pipeline = LDLMPipeline(BLSGraphs(self.bls_max_batch), texts, config=config, schedules=load_schedules(version_dir))

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                result = self.generate(request)
                plan = json.dumps(None if result.plan is None else result.plan.summary())
                outputs = {
                    "TEXTS": np.array([t.encode() for t in result.texts], dtype=np.object_),
                    "TOKEN_IDS": result.token_ids.numpy().astype(np.int64),
                    "PLAN": np.array([plan.encode()], dtype=np.object_),
                }
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()]))
            except Exception as error:  # one bad request never takes the others down
                responses.append(pb_utils.InferenceResponse(error=triton_error(error)))
        return responses

    def generate(self, request: Any) -> TextResult:
        """One request's result, as /v1/generate answers it: the plan resolved and checked first (nothing runs for a
        refused one), then the prompt, then the samples, which start with the prompt's own tokens."""
        fields = request_fields(request)
        prompt = fields.pop("prompt", None) or ""
        plan = resolve(GenerateRequest(**fields), self.pipeline.config, self.limits, GENERATE_NAMES, self.pipeline.schedules)
        prefix, ids = prompt_prefix(self.pipeline, prompt, plan.length)  # /v1/generate's checks and encoding
        result = self.pipeline.decode(self.pipeline.run_plan(plan, prefix=prefix))
        result.plan = plan
        return keep_prompt(result, ids, self.pipeline.tokenizer) if ids else result


def request_fields(request: Any) -> dict[str, Any]:
    """The GenerateRequest fields (and "prompt") of the inputs a request gives, each its one value as a Python
    number or text; a required input left out is refused (Triton refuses it first, as config.pbtxt says)."""
    fields: dict[str, Any] = {}
    for spec in GENERATE_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is None:
            if spec.required:
                raise ValueError(f"input {spec.name} is required")
            continue  # not given: resolve fills it in (a prompt: none)
        value = tensor.as_numpy().reshape(-1)[0]
        if isinstance(value, bytes):
            try:
                fields[spec.field] = value.decode()
            except UnicodeDecodeError:
                raise ValueError(f"{spec.name} is not UTF-8 text; allowed: UTF-8 text") from None
        else:
            fields[spec.field] = value.item()
    return fields


def triton_error(error: Exception) -> Any:
    """``error`` as Triton's: what /v1/generate answers 400 (a refused value) is INVALID_ARG, which Triton
    answers with HTTP 400 and gRPC INVALID_ARGUMENT; anything else INTERNAL (500)."""
    status, message, _ = error_status(error)
    code = pb_utils.TritonError.INVALID_ARG if status == 400 else pb_utils.TritonError.INTERNAL
    return pb_utils.TritonError(message, code)


class BLSGraphs:
    """The repository's encoder, denoiser and decoder as ``LDLMPipeline``'s graphs (``ldlm.pipeline.InferenceGraphs``):
    each call a synchronous BLS request of at most ``max_batch`` samples (None: all at once)."""

    def __init__(self, max_batch: int | None) -> None:
        self.max_batch = max_batch

    def encode_latents(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        feed = {"input_ids": input_ids.long().numpy(), "attention_mask": attention_mask.long().numpy()}
        return torch.from_numpy(self.call("encoder", feed, "latents"))

    def denoise(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor | None) -> Tensor:
        # t is a per-sample scalar: config.pbtxt declares dims [1] (reshaped to [] for the model)
        feed = {"x_t": x_t.float().numpy(), "t": t.float().numpy().reshape(-1, 1), "x0_prev": x0_prev.float().numpy()}
        feed["attention_mask"] = np.ones(x_t.shape[:2], np.int64) if mask is None else mask.long().numpy()
        return torch.from_numpy(self.call("denoiser", feed, "x0_hat"))

    def decode_tokens(self, latents: Tensor, mask: Tensor) -> Tensor:
        return torch.from_numpy(
            self.call("decoder", {"latents": latents.float().numpy(), "attention_mask": mask.long().numpy()}, "token_ids")
        )

    def call(self, model: str, inputs: dict[str, np.ndarray], output: str) -> np.ndarray:
        return bls(model, inputs, [output], self.max_batch or len(next(iter(inputs.values()))))[output]


def bls(model: str, inputs: dict[str, np.ndarray], outputs: list[str], max_batch: int) -> dict[str, np.ndarray]:
    """Synchronous BLS calls to another model of the repository, ``max_batch`` samples at a time
    (its max_batch_size: Triton refuses a larger batch); the outputs concatenated."""
    n = len(next(iter(inputs.values())))
    parts = [_bls_call(model, {name: value[i : i + max_batch] for name, value in inputs.items()}, outputs) for i in range(0, n, max_batch)]
    return {name: np.concatenate([part[name] for part in parts]) for name in outputs}


def _bls_call(model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    request = pb_utils.InferenceRequest(
        model_name=model,
        inputs=[pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in inputs.items()],
        requested_output_names=outputs,
    )
    response = request.exec()
    if response.has_error():
        raise RuntimeError(f"BLS call to {model} failed: {response.error().message()}")
    return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}
