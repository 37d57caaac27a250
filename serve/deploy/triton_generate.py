"""Triton Python-backend model ``ldlm_generate``: the sampling loop, calling the ``denoiser`` and
``decoder`` models of the same repository through BLS.

``ldlm triton-repo`` copies this file to ``ldlm_generate/1/model.py``. The sampling is not copied:
the request is resolved and run by ``ldlm.sampling`` (the lockstep driver of the one sampling
engine, with the same per-sample noise streams as our runner), so a seed gives the runner's tokens.
The ``ldlm`` package must be importable in Triton's Python environment (see docs/scale-out.md).

Inputs (one request each): N (1..max_n), LENGTH, STEPS (1..max_steps), SEED (INT64 [1]), SAMPLER
(BYTES [1], a name of ldlm.model.config.SAMPLERS; default: the config's default_sampler), optional T_MIN
(FP32 [1]) and PRIOR_TEMPERATURE (FP32 [1]). Outputs: TEXTS (BYTES [N]), TOKEN_IDS (INT64 [N, LENGTH]).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from ldlm.limits import MAX_N, MAX_STEPS
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.sampling import GenerateRequest, RequestLimits, SamplingEngine, resolve, run_lockstep
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.tuned_grids import load_schedules

TRITON_NAMES = {
    "n": "N",
    "length": "LENGTH",
    "steps": "STEPS",
    "sampler": "SAMPLER",
    "seed": "SEED",
    "t_min": "T_MIN",
    "prior_temperature": "PRIOR_TEMPERATURE",
}  # its inputs' names


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        version_dir = Path(args["model_repository"]) / args["model_version"]
        parameters = json.loads(args["model_config"]).get("parameters", {})
        limits = {key: parameters.get(key, {}).get("string_value") for key in ("max_n", "max_steps", "bls_max_batch")}
        self.max_n, self.max_steps = int(limits["max_n"] or MAX_N), int(limits["max_steps"] or MAX_STEPS)
        # The denoiser's and decoder's max_batch_size: larger N runs in BLS calls of this many samples
        # (without the parameter: one call per step).
        self.bls_max_batch = int(limits["bls_max_batch"]) if limits["bls_max_batch"] else None
        self.config = LDLMConfig.load(version_dir / "config.json")
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
        self.tokenizer = TextTokenizer.from_directory(version_dir) if tokenizer.is_file() else TextTokenizer.gpt2()
        # the export's tuned grids, copied by `ldlm triton-repo`: the defaults where tuned, as in ldlm serve
        self.schedules = load_schedules(version_dir)
        self.engine = SamplingEngine(TangentSchedule(self.config.schedule_d, self.config.beta_clip_t), self.config.decode_final)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                texts, token_ids = self.generate(request)
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("TEXTS", np.array([t.encode() for t in texts], dtype=np.object_)),
                            pb_utils.Tensor("TOKEN_IDS", token_ids.astype(np.int64)),
                        ]
                    )
                )
            except Exception as error:  # one bad request never takes the others down
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses

    def generate(self, request: Any) -> tuple[list[str], np.ndarray]:
        def scalar(name: str, required: bool = True) -> Any:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                if required:
                    raise ValueError(f"input {name} is required")
                return None  # not given: resolve fills it in
            value = tensor.as_numpy().reshape(-1)[0]
            return value.decode() if isinstance(value, bytes) else value.item()

        steps, seed = scalar("STEPS", False), scalar("SEED", False)
        request = GenerateRequest(
            int(scalar("N")),
            int(scalar("LENGTH")),
            None if steps is None else int(steps),
            None if seed is None else int(seed),
            scalar("SAMPLER", False),
            scalar("T_MIN", False),
            prior_temperature=scalar("PRIOR_TEMPERATURE", False),
        )
        plan = resolve(request, self.config, RequestLimits(self.max_n, self.max_steps), TRITON_NAMES, self.schedules)
        mask = np.ones((plan.n, plan.length), dtype=np.int64)
        chunk = self.bls_max_batch or plan.n

        def denoise(x_t: torch.Tensor, t: torch.Tensor, x0_prev: torch.Tensor, _: torch.Tensor | None) -> torch.Tensor:
            # t is a per-sample scalar: config.pbtxt declares dims [1] (reshaped to [] for the model)
            feed = {
                "x_t": x_t.float().numpy(),
                "t": t.float().numpy().reshape(-1, 1),
                "x0_prev": x0_prev.float().numpy(),
                "attention_mask": mask,
            }
            return torch.from_numpy(bls("denoiser", feed, ["x0_hat"], chunk)["x0_hat"])

        latents = run_lockstep(self.engine, self.engine.start(plan, self.config.d_model), denoise)
        token_ids = bls("decoder", {"latents": latents.float().numpy(), "attention_mask": mask}, ["token_ids"], chunk)["token_ids"]
        return [self.tokenizer.decode(row.tolist()) for row in token_ids], token_ids


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
