"""Triton Python-backend model ``ldlm_generate``: the sampling loop, calling the ``denoiser`` and
``decoder`` models of the same repository through BLS.

``ldlm triton-repo`` copies this file to ``ldlm_generate/1/model.py``. The sampler is not copied:
the loop is ``ldlm.solvers.run_sampler`` with the same per-sample noise streams as our runner,
so a seed gives the runner's tokens. The ``ldlm`` package must be importable in Triton's Python
environment (see docs/scale-out.md).

Inputs (one request each): N (1..max_n), LENGTH, STEPS (1..max_steps), SEED (INT64 [1]), SAMPLER (BYTES [1], a name of ldlm.solvers.SOLVERS; default: the config's default_sampler),
optional T_MIN (FP32 [1]). Outputs: TEXTS (BYTES [N]), TOKEN_IDS (INT64 [N, LENGTH]).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from ldlm.config import LDLMConfig
from ldlm.sampler import NoiseStream, TangentSchedule, sample_seeds
from ldlm.solvers import SOLVERS, get_solver, run_sampler
from ldlm.tokenizer import TextTokenizer


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        version_dir = Path(args["model_repository"]) / args["model_version"]
        parameters = json.loads(args["model_config"]).get("parameters", {})
        limits = {key: parameters.get(key, {}).get("string_value") for key in ("max_n", "max_steps", "bls_max_batch")}
        self.max_n, self.max_steps = int(limits["max_n"] or 64), int(limits["max_steps"] or 1000)
        # The denoiser's and decoder's max_batch_size: larger N runs in BLS calls of this many samples.
        # (A repository written before this parameter: one call per step, as before.)
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
        self.schedule = TangentSchedule(self.config.schedule_d, self.config.beta_clip_t)

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
        def scalar(name: str, default: Any = None) -> Any:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                if default is None:
                    raise ValueError(f"input {name} is required")
                return default
            value = tensor.as_numpy().reshape(-1)[0]
            return value.decode() if isinstance(value, bytes) else value.item()

        cfg = self.config
        n, length, steps, seed = int(scalar("N")), int(scalar("LENGTH")), int(scalar("STEPS")), int(scalar("SEED", 0))
        sampler, t_min = scalar("SAMPLER", cfg.default_sampler), float(scalar("T_MIN", cfg.t_min))
        if not 1 <= n <= self.max_n:
            raise ValueError(f"N={n} is out of range; allowed: 1..{self.max_n}")
        if not 1 <= length <= cfg.max_seq_len:
            raise ValueError(f"LENGTH={length} is out of range; allowed: 1..{cfg.max_seq_len}")
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"STEPS={steps} is out of range; allowed: 1..{self.max_steps}")
        if sampler not in SOLVERS:
            raise ValueError(f"SAMPLER={sampler!r} is unknown; allowed: {', '.join(SOLVERS)}")
        grid = get_solver(sampler).time_grid(steps, t_min, self.schedule)
        streams = [NoiseStream(s, (length, cfg.d_model)) for s in sample_seeds(seed, n)]
        mask = np.ones((n, length), dtype=np.int64)
        chunk = self.bls_max_batch or n

        def draw_noise() -> torch.Tensor:
            return torch.stack([stream.draw() for stream in streams])

        def denoise(x_t: torch.Tensor, t: torch.Tensor, x0_prev: torch.Tensor) -> torch.Tensor:
            # t is a per-sample scalar: config.pbtxt declares dims [1] (reshaped to [] for the model)
            outputs = bls(
                "denoiser",
                {
                    "x_t": x_t.float().numpy(),
                    "t": t.float().numpy().reshape(-1, 1),
                    "x0_prev": x0_prev.float().numpy(),
                    "attention_mask": mask,
                },
                ["x0_hat"],
                chunk,
            )
            return torch.from_numpy(outputs["x0_hat"])

        latents = run_sampler(denoise, draw_noise(), draw_noise, grid, self.schedule, sampler, cfg.decode_final)
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
