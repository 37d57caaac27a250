"""Triton Python-backend model for one graph (encoder, denoiser or decoder): ONNX Runtime on the
exported ONNX beside it.

``ldlm triton-repo EXPORT OUT --graph-backend python`` copies this file to ``<graph>/1/model.py``
next to ``<graph>/1/model.onnx/`` (``model.onnx`` + its external data: the same folder Triton's
onnxruntime_onnx backend would load). The config is the native one with ``backend: "python"`` in
place of ``platform: "onnxruntime_onnx"``. It serves where Triton has no ONNX Runtime backend, as in
the ``nvidia-pytriton`` wheel's server (ldlm.serve.deploy.triton_local).

Batching: Triton's dynamic batcher hands ``execute`` several requests at once, but the Python
backend does not merge them; requests whose non-batch shapes agree are concatenated here into one
ONNX Runtime run and its outputs split back by each request's batch size (Triton's own batcher
only puts requests of equal shapes in one batch; this keeps that promise when it does not).
Inputs arrive in the model's shapes: Triton applies the config's ``reshape`` (``t``: [B, 1] -> [B]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        onnx = Path(args["model_repository"]) / args["model_version"] / "model.onnx" / "model.onnx"
        options = ort.SessionOptions()
        # the onnxruntime backend's parameter of the same name; 0 (default): ONNX Runtime's choice
        threads = config.get("parameters", {}).get("intra_op_thread_count", {}).get("string_value", "0")
        options.intra_op_num_threads = int(threads)
        kind = args.get("model_instance_kind", "CPU")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if kind == "GPU" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(onnx), options, providers=providers)
        if kind == "GPU" and "CUDAExecutionProvider" not in self.session.get_providers():
            # onnxruntime (CPU build) or no CUDA: ONNX Runtime would quietly run on CPU
            raise RuntimeError(
                f"instance_group kind GPU, but ONNX Runtime runs {self.session.get_providers()} here; "
                "write the repository with `ldlm triton-repo --cpu`, or install onnxruntime-gpu"
            )
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]
        missing = set(self.input_names) - {i.name for i in self.session.get_inputs()}
        if missing:
            raise RuntimeError(f"{onnx} has no input(s) {sorted(missing)} that config.pbtxt declares")

    def execute(self, requests: list[Any]) -> list[Any]:
        feeds = [{name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.input_names} for r in requests]
        groups: dict[tuple, list[int]] = {}
        for index, feed in enumerate(feeds):  # same non-batch shapes -> one run
            groups.setdefault(tuple(feed[name].shape[1:] for name in self.input_names), []).append(index)
        responses: list[Any] = [None] * len(requests)
        for members in groups.values():
            try:
                merged = {name: np.concatenate([feeds[i][name] for i in members]) for name in self.input_names}
                outputs = dict(zip(self.output_names, self.session.run(self.output_names, merged)))
                start = 0
                for i in members:
                    rows = len(feeds[i][self.input_names[0]])
                    responses[i] = pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor(name, np.ascontiguousarray(value[start : start + rows])) for name, value in outputs.items()
                        ]
                    )
                    start += rows
            except Exception as error:  # one bad group never takes the others down
                for i in members:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(error).__name__}: {error}"))
        return responses
